"""A task's events as server-sent events (``text/event-stream``), for any web server.

No framework is imported here: :class:`EventStream` gives the bytes of the stream
to a WSGI server (iterate it) or an ASGI one (``async for`` over it), and
:func:`http_error` turns mtq's errors into a status, headers and a JSON body that
each framework wraps in its own response (:mod:`mtq.contrib.asgi` does for ASGI).

The stream (docs/web.md has the same, for browsers)::

    retry: 1000                                   the client's reconnect delay (ms)

    event: started                                a worker took the task
    data: {"delivery": 1}

    id: 0                                         the token's index
    event: token
    data: "Once"                                  the token, as JSON

    : keep-alive                                  every keepalive_s without an event

    event: progress
    data: 0.5

    event: restarted                              it runs again from the start (its
    data: {"delivery": 1, "reason": "..."}        worker died); tokens go on gapless

    event: done                                   the last event: the task ended
    data: {"status": "succeeded", "result": ...}  (or "status": "failed" | "dead" |
                                                  "expired" | "cancelled", "error": "...")

    event: error                                  the stream broke before the task
    data: {"error": "unavailable", "detail": "...", "retry": true}   ended; it closes

Only tokens carry an ``id:``, so an ``EventSource`` that reconnects sends the index
of the last token it got as ``Last-Event-ID``, and the stream starts again at the
next one, read from the task's stored token log: no gap, no repeat. After ``done``
a client should close its EventSource (else it reconnects and gets the end again).
After ``error``, it reconnects (``retry`` ms later) and resumes; ``retry: false``
means reconnecting cannot help (the task no longer exists).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import redis

from mtq.client import Task
from mtq.contrib.web import BadHeader, retry_after
from mtq.errors import (
    BrokerError,
    ConfigError,
    EncodeError,
    InvalidName,
    MtqError,
    PayloadTooLarge,
    QueueFull,
    RateLimited,
    ResultTimeout,
    TaskNotFound,
    WouldMissDeadline,
)
from mtq.replies import Event
from mtq.validation import check_stream_name

log = logging.getLogger(__name__)

#: seconds without an event after which a ``: keep-alive`` comment is sent (proxies
#: and load balancers close connections idle for 30 to 60 s by default)
KEEPALIVE_S = 15.0
#: the reconnect delay the stream asks of the client (``retry:``), in ms
RETRY_MS = 1000
#: the Retry-After (s) of a 503 answered for a full queue or an unreachable Redis
RETRY_AFTER_S = 2
#: the longest Last-Event-ID accepted (digits)
MAX_ID_DIGITS = 18

MEDIA_TYPE = "text/event-stream"

#: the events a stream sends (``event:`` names)
EVENT_NAMES = ("started", "token", "progress", "restarted", "done", "error")


#: how long a task's count of opened streams is kept (``cancel_grace_s``), renewed at
#: each open: past it, a stream still open no longer cancels its task when it ends
VIEWERS_TTL_S = 24 * 3600


def stream_name(kind: str, value: object) -> str:
    """The stream of a user or a session, ``kind:value`` (``user:ann``,
    ``session:<id>``): FIFO per user. A name that is not a valid stream name (spaces,
    over 256 bytes, not UTF-8) is replaced by a stable digest, ``kind:sha256:...``."""
    name = f"{kind}:{value}"
    try:
        return check_stream_name(name)
    except InvalidName:
        digest = hashlib.sha256(repr(value).encode("utf-8", "backslashreplace")).hexdigest()
        return f"{kind}:sha256:{digest[:40]}"


class BadLastEventId(MtqError, ValueError):
    """A Last-Event-ID (or ``last_event_id`` query parameter) that is not a token
    index: answered 400."""


def headers(*, hop_by_hop: bool = True) -> list[tuple[str, str]]:
    """The response headers of an event stream. ``Cache-Control: no-cache`` and
    ``X-Accel-Buffering: no`` keep proxies (nginx) from caching or buffering it;
    ``Connection: keep-alive`` only where the server lets an application set a
    hop-by-hop header (``hop_by_hop``: not under WSGI, PEP 3333, nor HTTP/2)."""
    out = [("Content-Type", f"{MEDIA_TYPE}; charset=utf-8"),
           ("Cache-Control", "no-cache"),
           ("X-Accel-Buffering", "no")]
    if hop_by_hop:
        out.append(("Connection", "keep-alive"))
    return out


def parse_last_event_id(header: str | None, query: str | None = None) -> int:
    """The first token index to send, from the ``Last-Event-ID`` header (an EventSource
    reconnecting sends it) or else the ``last_event_id`` query parameter (a page that
    reloads and remembered where it was: an EventSource cannot set headers). Absent
    or empty: 0. Raises BadLastEventId for anything but a decimal index."""
    value = header if header not in (None, "") else query
    if value is None or value == "":
        return 0
    value = value.strip()
    if not (value.isascii() and value.isdigit()) or len(value) > MAX_ID_DIGITS:
        raise BadLastEventId(
            f"Last-Event-ID must be the index of the last token received (a number "
            f"0-{'9' * MAX_ID_DIGITS}), got {value[:40]!r}; leave it out to start at "
            "the first token")
    return int(value) + 1


def json_default(value: Any) -> Any:
    """JSON for what ``json`` cannot encode: bytes as base64 text, arrays and tensors
    (anything with ``tolist()``) as lists. Raises EncodeError (a TypeError) otherwise."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return tolist()
    raise EncodeError(f"{type(value).__name__} is not JSON-encodable; pass encode= to "
                      "turn it into something that is")


Encoder = Callable[[Any], str]


def to_json(value: Any) -> str:
    """The default encoder of event data: compact JSON on one line (json escapes every
    newline, so a ``data:`` line never breaks), non-ASCII text kept as is."""
    return json.dumps(value, default=json_default, ensure_ascii=False,
                      separators=(",", ":"))


def event_bytes(name: str, data: str, event_id: int | None = None) -> bytes:
    """One SSE event. ``data`` must be a single line (JSON is)."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {name}\ndata: {data}\n\n".encode()


def comment(text: str) -> bytes:
    """A comment line: ignored by clients, it keeps an idle connection alive."""
    return f": {text}\n\n".encode()


def format_event(ev: Event, encode: Encoder = to_json) -> bytes | None:
    """The SSE bytes of one mtq event, or None for those a stream leaves out
    (``queued``). Terminal events become ``done``."""
    if ev.kind == "token":
        return event_bytes("token", encode(ev.data), ev.index)
    if ev.kind == "idle":
        return comment("keep-alive")
    if ev.kind == "progress":
        return event_bytes("progress", encode(ev.data))
    if ev.kind == "started":
        return event_bytes("started", encode({"delivery": ev.delivery}))
    if ev.kind == "restarted":
        return event_bytes("restarted", encode({"delivery": ev.delivery, "reason": ev.data}))
    if ev.terminal:
        body: dict[str, Any] = {"status": ev.kind}
        if ev.kind == "succeeded":
            body["result"] = ev.data
        else:
            body["error"] = ev.data
        return event_bytes("done", encode(body))
    return None


def error_event(code: str, detail: str, retry: bool) -> bytes:
    """The ``error`` event that ends a stream broken before its task ended."""
    return event_bytes("error", to_json({"error": code, "detail": detail, "retry": retry}))


@dataclass(frozen=True)
class HttpError:
    """An error answered as JSON: ``{"error": code, "detail": message}``."""

    status: int
    code: str
    detail: str
    headers: list[tuple[str, str]] = field(default_factory=list)

    def body(self) -> bytes:
        return to_json({"error": self.code, "detail": self.detail}).encode()

    def all_headers(self) -> list[tuple[str, str]]:
        return [("Content-Type", "application/json"), *self.headers]


def http_error(exc: BaseException, retry_after_s: int = RETRY_AFTER_S) -> HttpError | None:
    """The HTTP answer for an mtq error, or None for an exception that is not one of
    these (a bug: let the framework answer 500).

    * TaskNotFound, and a task id mtq would never make (InvalidName): 404.
    * BadLastEventId, InvalidName of a stream: 400. PayloadTooLarge: 413.
    * QueueFull: 503 with Retry-After. Not 429: 429 tells one client that *it* sends
      too much, while a full queue is the service's capacity, shared by everyone, and
      every client should back off (RFC 9110: 503 for a temporary overload).
    * RedisUnavailable (and other broker errors): 503 with Retry-After.
    * BadHeader (``X-Mtq-Priority``, ``X-Mtq-Deadline``): 400. RateLimited: 429 (this
      tenant sends too much), WouldMissDeadline: 503; both with the Retry-After the
      refusal gives (whole seconds, rounded up, at least 1).
    """
    retry = [("Retry-After", str(retry_after_s))]
    if isinstance(exc, BadHeader):
        return HttpError(400, exc.code, str(exc))
    if isinstance(exc, (RateLimited, WouldMissDeadline)):
        status, code = ((429, "rate_limited") if isinstance(exc, RateLimited)
                        else (503, "would_miss_deadline"))
        return HttpError(status, code, str(exc), [("Retry-After", retry_after(exc.retry_after))])
    if isinstance(exc, TaskNotFound):
        return HttpError(404, "not_found", str(exc))
    if isinstance(exc, BadLastEventId):
        return HttpError(400, "bad_last_event_id", str(exc))
    if isinstance(exc, InvalidName):
        if "task id" in str(exc):
            return HttpError(404, "not_found", str(exc))
        return HttpError(400, "invalid_name", str(exc))
    if isinstance(exc, PayloadTooLarge):
        return HttpError(413, "payload_too_large", str(exc))
    if isinstance(exc, QueueFull):
        return HttpError(503, "queue_full", str(exc), retry)
    if isinstance(exc, BrokerError):
        return HttpError(503, "unavailable", str(exc), retry)
    return None


class EventStream:
    """The event stream of one task, from a token index on, as bytes.

    Check first (:meth:`open` / :meth:`aopen`: TaskNotFound, the HTTP 404, must be
    answered before the stream's 200), then iterate: ``for chunk in stream`` (WSGI)
    or ``async for chunk in stream`` (ASGI). It ends after ``done``, or after an
    ``error`` event when Redis cannot be reached (the client reconnects and resumes:
    a stream opened while Redis is away is also a 200 with that one event, since an
    EventSource that gets anything but a 200 never tries again).

    ``start``: the first token index (:func:`parse_last_event_id`). ``keepalive_s``:
    the comment sent after that long without an event. ``timeout``: the longest the
    response lasts (then an ``error`` event with ``"error": "timeout"``: the client
    reconnects and goes on); None: until the task ends. ``cancel_on_disconnect``: a
    client that goes away before the end cancels the task (:meth:`disconnected`;
    a generator stops at its next decode step). ``cancel_grace_s``: with
    ``cancel_on_disconnect``, wait that long first and cancel only if no other stream
    of the task opened meanwhile, in any server process (each stream of a task takes
    a number from a counter in Redis, ``mtq:{q}:viewers:<id>``): a page that reloads
    (or an EventSource that reconnects) and re-attaches within it keeps its task.
    0: at once.
    ``encode``: data to one line of text.
    """

    def __init__(self, task: Task, *, start: int = 0, keepalive_s: float = KEEPALIVE_S,
                 retry_ms: int = RETRY_MS, timeout: float | None = None,
                 cancel_on_disconnect: bool = False, cancel_grace_s: float = 0.0,
                 encode: Encoder = to_json) -> None:
        if cancel_grace_s < 0:
            raise ConfigError(f"cancel_grace_s must be >= 0, got {cancel_grace_s!r}")
        self.task = task
        self.start = start
        self.keepalive_s = keepalive_s
        self.retry_ms = retry_ms
        self.timeout = timeout
        self.cancel_on_disconnect = cancel_on_disconnect
        self.cancel_grace_s = cancel_grace_s
        self.encode = encode
        #: the task's terminal event was sent
        self.finished = False
        #: the task was cancelled because the client went away
        self.cancelled = False
        self._broken: BrokerError | None = None
        self._sync: Generator[bytes, None, None] | None = None
        self._number: int | None = None  # this stream's number among its task's
        self._gone = False               # the client went away (a cancel may follow)
        self._grace_over = False

    @property
    def _graced(self) -> bool:
        return self.cancel_on_disconnect and self.cancel_grace_s > 0

    def _attach(self) -> None:
        """Take this stream's number among its task's streams (``cancel_grace_s``): one
        round trip, only with a grace time. Without Redis there is no number, and the
        client's leaving cancels at once (if Redis is back by then)."""
        if self._number is not None or not self._graced:
            return
        q = self.task.queue
        key = q.broker.keys.viewers(self.task.id)
        try:
            with q.redis.pipeline(transaction=False) as pipe:
                pipe.incr(key)
                pipe.expire(key, VIEWERS_TTL_S)
                self._number = int(pipe.execute()[0])
        except redis.RedisError as exc:
            log.debug("task %s: no stream number (%s); no cancel grace", self.task.id, exc)

    def _detach(self) -> None:
        """The stream ended: if the client's leaving may cancel the task, decide after
        the grace time (the leaving is learnt just before or just after the stream
        ends, depending on the server)."""
        if self._number is None or self._grace_over:
            return
        if self.finished:
            self._grace_over = True
            return
        timer = threading.Timer(self.cancel_grace_s, self._after_grace)
        timer.daemon = True
        timer.name = f"mtq-cancel-grace-{self.task.id}"
        timer.start()

    def _after_grace(self) -> None:
        self._grace_over = True
        if self._gone:
            self._cancel_unless_reattached()

    def _cancel_unless_reattached(self) -> None:
        """Cancel the task unless a stream of it opened after this one (in any
        process)."""
        q = self.task.queue
        try:
            latest = q.redis.get(q.broker.keys.viewers(self.task.id))
        except redis.RedisError as exc:
            log.warning("could not cancel task %s after its client went away: %s",
                        self.task.id, exc)
            return
        if latest is not None and int(latest) != self._number:
            log.debug("task %s: another stream of it opened within %.1f s of its client "
                      "leaving; not cancelled", self.task.id, self.cancel_grace_s)
            return
        self._cancel()

    # -- before the response ---------------------------------------------------------
    def open(self) -> None:
        """Check that the task exists (one round trip). Raises TaskNotFound; an
        unreachable Redis is not raised but sent as the stream's ``error`` event."""
        try:
            self.task.status()
        except BrokerError as exc:
            self._broken = exc

    async def aopen(self) -> None:
        """:meth:`open` for asyncio."""
        await asyncio.to_thread(self.open)

    # -- the bytes ---------------------------------------------------------------------
    def _preamble(self) -> bytes:
        return f"retry: {self.retry_ms}\n\n".encode()

    def _chunk(self, ev: Event) -> bytes | None:
        out = format_event(ev, self.encode)
        if ev.terminal:
            self.finished = True
        return out

    @staticmethod
    def _failure(exc: MtqError) -> bytes:
        if isinstance(exc, ResultTimeout):
            return error_event("timeout", "this response's time limit passed; reconnect "
                               "to go on", True)
        if isinstance(exc, TaskNotFound):
            return error_event("not_found", str(exc), False)
        return error_event("unavailable", str(exc), True)

    def __iter__(self) -> Iterator[bytes]:
        self._sync = self._iter()
        return self._sync

    def close(self) -> None:
        """End the sync iteration: a WSGI server calls it when the response is over,
        also when the client went away (then, with ``cancel_on_disconnect``, the
        task is cancelled). PEP 3333 calls ``close()`` on the object the application
        returned, so return the EventStream itself."""
        if self._sync is not None:
            self._sync.close()

    def _iter(self) -> Generator[bytes, None, None]:
        events: Generator[Event, None, None] | None = None
        self._attach()
        try:
            yield self._preamble()
            if self._broken is not None:
                yield self._failure(self._broken)
                return
            events = cast(Generator[Event, None, None], self.task.events(
                self.timeout, start=self.start, idle=self.keepalive_s, fail_fast=True))
            for ev in events:
                chunk = self._chunk(ev)
                if chunk is not None:
                    yield chunk
        except (BrokerError, ResultTimeout, TaskNotFound) as exc:
            yield self._failure(exc)
        except GeneratorExit:  # the server closed us: the client went away
            self.disconnected()
            raise
        finally:
            if events is not None:
                events.close()
            self._detach()

    async def _aiter(self) -> AsyncIterator[bytes]:
        if self._graced:
            await asyncio.to_thread(self._attach)
        try:
            yield self._preamble()
            if self._broken is not None:
                yield self._failure(self._broken)
                return
            async for chunk in self._achunks():
                yield chunk
        finally:
            self._detach()

    async def _achunks(self) -> AsyncIterator[bytes]:
        events = cast(AsyncGenerator[Event, None], self.task.aevents(
            self.timeout, start=self.start, idle=self.keepalive_s, fail_fast=True))
        try:
            async for ev in events:
                chunk = self._chunk(ev)
                if chunk is not None:
                    yield chunk
        except (BrokerError, ResultTimeout, TaskNotFound) as exc:
            yield self._failure(exc)
        finally:
            await events.aclose()

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._aiter()

    # -- the client went away --------------------------------------------------------
    def disconnected(self) -> bool:
        """The client went away: cancel the task if ``cancel_on_disconnect`` and it has
        not ended; with ``cancel_grace_s``, only once that time passed with no other
        stream of the task opened (in any process). Returns True if a cancel was sent
        or may follow. Never raises (logs instead)."""
        if not self.cancel_on_disconnect or self.finished or self._gone:
            return False
        self._gone = True
        if self._number is None:
            self._cancel()
        elif self._grace_over:  # learnt after the grace time: the check is due now
            self._cancel_unless_reattached()
        # else: the grace timer, started when the stream ended, decides
        return True

    def _cancel(self) -> None:
        self.cancelled = True
        try:
            self.task.cancel()
        except MtqError as exc:
            log.warning("could not cancel task %s after its client went away: %s",
                        self.task.id, exc)

    async def adisconnected(self) -> bool:
        """:meth:`disconnected` for asyncio."""
        if not self.cancel_on_disconnect or self.finished or self._gone:
            return False
        return await asyncio.to_thread(self.disconnected)
