"""Validation of names that end up inside Redis keys and channels."""

from __future__ import annotations

import re

from mtq.errors import InvalidName

_QUEUE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,99}")
_ID = re.compile(r"[A-Za-z0-9_\-]{1,64}")
MAX_STREAM_BYTES = 256


def check_queue_name(name: object) -> str:
    """Return ``name`` if it is a valid queue name, else raise InvalidName.

    Queue names go inside the Redis Cluster hash tag, so they are restricted to
    letters, digits, ``_ . -`` (no braces, colons or spaces), 1 to 100 characters.
    """
    if not isinstance(name, str) or not _QUEUE.fullmatch(name):
        raise InvalidName(
            f"invalid queue name {name!r}: use 1-100 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit (e.g. 'embed', 'chat-v2')"
        )
    return name


def check_stream_name(name: object, what: str = "stream") -> str:
    """Return ``name`` if it is a valid stream name (or idempotency key), else raise.

    Any printable text without whitespace, 1 to 256 bytes in UTF-8: user ids,
    e-mail addresses and session ids all fit.
    """
    if not isinstance(name, str) or not name:
        raise InvalidName(f"invalid {what} {name!r}: it must be a non-empty string")
    try:
        size = len(name.encode())
    except UnicodeEncodeError:  # lone surrogates: bytes that were not UTF-8 (argv, files)
        raise InvalidName(
            f"invalid {what} {name!r}: it is not valid UTF-8 text; give it as UTF-8"
        ) from None
    if size > MAX_STREAM_BYTES:
        raise InvalidName(
            f"invalid {what} {name[:40]!r}...: {size} bytes, at most "
            f"{MAX_STREAM_BYTES}; hash long names (e.g. sha1) before using them"
        )
    if not name.isprintable() or any(c.isspace() for c in name):
        raise InvalidName(
            f"invalid {what} {name!r}: whitespace and control characters are not allowed"
        )
    return name


def check_task_id(task_id: object) -> str:
    """Return ``task_id`` if it is a valid task id, else raise InvalidName."""
    if not isinstance(task_id, str) or not _ID.fullmatch(task_id):
        raise InvalidName(
            f"invalid task id {task_id!r}: use 1-64 letters, digits, '_' or '-'"
        )
    return task_id
