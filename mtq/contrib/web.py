"""What the web helpers take from a request besides its stream: its tenant, its
priority and its deadline (docs/web.md, "Tenants, priorities and deadlines"). No
framework is imported here: each integration reads its own request object and calls
these.

* :func:`tenant_name`: a user's id or name as a tenant name (valid as it is, else a
  digest of it, ``sha1-<40 hex digits>``).
* :func:`header_priority`: the ``X-Mtq-Priority`` header (``interactive``,
  ``standard`` or ``batch``); :func:`priority_from`: it, else ``interactive``.
* :func:`header_deadline`: the ``X-Mtq-Deadline`` header, seconds from now.
* :func:`fill_options`: the options of :meth:`mtq.Queue.submit` with the request's
  tenant, priority and deadline where the caller gave none.
* :func:`retry_after`: the ``Retry-After`` value of a refusal that says when to retry.

A header mtq reads with a value it does not take raises :class:`BadHeader`, which
:func:`mtq.contrib.sse.http_error` answers 400.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from typing import Any, TypeVar

from mtq.client.submit import MAX_TTL_S
from mtq.errors import InvalidName, MtqError
from mtq.validation import BANDS, check_tenant

#: the request header that picks the priority of the request's submits
PRIORITY_HEADER = "X-Mtq-Priority"
#: the request header that gives the request's submits a deadline (seconds from now)
DEADLINE_HEADER = "X-Mtq-Deadline"
#: the priority of a request's submits when neither the caller nor the header says
DEFAULT_PRIORITY = "interactive"

R = TypeVar("R")
#: a request -> its tenant (a valid tenant name, or None: no tenant)
TenantOf = Callable[[R], "str | None"]
#: a request -> its priority (a priority name, or None: the queue's standard band)
PriorityOf = Callable[[R], "str | None"]


class BadHeader(MtqError, ValueError):
    """A request header mtq reads (``X-Mtq-Priority``, ``X-Mtq-Deadline``) holds a
    value it does not take: answered 400, ``{"error": code, "detail": message}``."""

    def __init__(self, code: str, detail: str) -> None:
        self.code = code
        super().__init__(detail)


def tenant_name(value: object) -> str | None:
    """``value`` (a user's id or name) as a tenant name: as it is when it is a valid
    one (1-64 letters, digits, ``_ . @ + -``, starting with a letter or digit), else
    ``sha1-`` and the first 40 hex digits of the SHA-1 of its text (a stable name: the
    same user is always the same tenant). None or empty text: None (no tenant)."""
    if value is None:
        return None
    text = str(value)
    if not text:
        return None
    try:
        return check_tenant(text)
    except InvalidName:
        raw = text.encode("utf-8", "backslashreplace")
        return "sha1-" + hashlib.sha1(raw, usedforsecurity=False).hexdigest()


def header_priority(value: str | None) -> str | None:
    """The priority an ``X-Mtq-Priority`` header names (any case, spaces around it
    ignored); absent or empty: None. Raises BadHeader (``bad_priority``) for another
    value, naming the ones accepted."""
    if value is None or not value.strip():
        return None
    name = value.strip().lower()
    if name not in BANDS:
        raise BadHeader("bad_priority",
                        f"{PRIORITY_HEADER} must be one of {', '.join(BANDS)}, got "
                        f"{value[:40]!r}")
    return name


def priority_from(header: str | None) -> str:
    """The default priority of a request's submits: the ``X-Mtq-Priority`` header's,
    else ``interactive`` (someone is waiting for the answer). A client can only lower
    its priority this way: interactive is the highest. Raises BadHeader."""
    return header_priority(header) or DEFAULT_PRIORITY


def header_deadline(value: str | None) -> float | None:
    """The deadline an ``X-Mtq-Deadline`` header gives, seconds from now (a number
    above 0, fractions allowed); absent or empty: None. Raises BadHeader
    (``bad_deadline``) for another value."""
    if value is None or not value.strip():
        return None
    try:
        seconds = float(value.strip())
        if not (math.isfinite(seconds) and 0 < seconds <= MAX_TTL_S):
            raise ValueError
    except ValueError:
        raise BadHeader("bad_deadline",
                        f"{DEADLINE_HEADER} must be seconds from now, a number above 0 "
                        f"(e.g. 30 or 2.5), got {value[:40]!r}") from None
    return seconds


def fill_options(options: dict[str, Any], request: R, tenant_of: TenantOf[R],
                 priority_of: PriorityOf[R], deadline_header: str | None) -> dict[str, Any]:
    """``options`` (keyword arguments of :meth:`mtq.Queue.submit`) with, where the
    caller did not give them, the request's ``tenant`` (``tenant_of(request)``), its
    ``priority`` (``priority_of(request)``) and its ``deadline`` (the
    ``X-Mtq-Deadline`` header's value, ``deadline_header``). A given ``tenant`` or
    ``priority``, None included, wins over the request's. A header deadline with a
    ``ttl`` becomes the deadline ``min(deadline, ttl)`` (a task cannot have both).
    Raises BadHeader."""
    out = dict(options)
    if "tenant" not in out:
        out["tenant"] = tenant_of(request)
    if "priority" not in out:
        out["priority"] = priority_of(request)
    if out.get("deadline") is None:
        deadline = header_deadline(deadline_header)
        if deadline is not None:
            ttl = out.get("ttl")
            if ttl is None or (isinstance(ttl, (int, float)) and not isinstance(ttl, bool)):
                out.pop("ttl", None)
                out["deadline"] = deadline if ttl is None else min(deadline, ttl)
    return out


def retry_after(seconds: float) -> str:
    """The ``Retry-After`` value for a wait of ``seconds``: whole seconds, rounded up,
    at least 1 (HTTP has no fractions, and 0 would invite an immediate retry)."""
    return str(max(1, math.ceil(seconds)))
