"""Validation of names that end up inside Redis keys and channels, and of the
scheduling fields of a task (priority, tenant, cost)."""

from __future__ import annotations

import math
import re

from mtq.errors import InvalidArgument, InvalidName

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


#: the priority bands, most urgent first, and the letter a task's hash stores
BANDS = {"interactive": "i", "standard": "s", "batch": "b"}
BAND_NAMES = {v: k for k, v in BANDS.items()}
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@+\-]{0,63}")
#: the largest cost or weight a task or setting may give (exact sums in a double)
MAX_COST = 1e12


def check_priority(priority: object) -> str:
    """The band letter of a priority name (``interactive``, ``standard``, ``batch``);
    None is ``standard``. Raises InvalidArgument for anything else."""
    if priority is None:
        return "s"
    if isinstance(priority, str) and priority in BANDS:
        return BANDS[priority]
    raise InvalidArgument(f"unknown priority {priority!r}: use one of "
                          f"{', '.join(BANDS)} (the default is standard)")


def check_tenant(tenant: object) -> str:
    """Return ``tenant`` if it is a valid tenant name, else raise InvalidName. Tenant
    names go inside Redis keys: 1-64 letters, digits, ``_ . @ + -``, starting with a
    letter or digit (hash a longer or freer name, e.g. with sha1)."""
    if not isinstance(tenant, str) or not _TENANT.fullmatch(tenant):
        raise InvalidName(
            f"invalid tenant {tenant!r}: use 1-64 letters, digits, '_', '.', '@', '+' or "
            "'-', starting with a letter or digit (e.g. 'acme', 'team-7'); hash a longer "
            "name first")
    return tenant


def check_cost(cost: object, what: str = "cost", *, zero: bool = True) -> float:
    """Return ``cost`` as a float if it is a finite number in [0, MAX_COST] (``zero``
    False: above 0), else raise InvalidArgument."""
    if isinstance(cost, bool) or not isinstance(cost, (int, float)) \
            or not math.isfinite(cost) or not (0 <= cost if zero else 0 < cost) \
            or cost > MAX_COST:
        low = "0 or more" if zero else "above 0"
        raise InvalidArgument(f"{what} must be a finite number {low}, at most "
                              f"{MAX_COST:.0e}, got {cost!r}")
    return float(cost)
