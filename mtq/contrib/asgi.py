"""ASGI: Starlette, FastAPI (built on Starlette), and any ASGI server (uvicorn).

* :class:`EventStreamResponse`: a task's events as server-sent events (see
  :mod:`mtq.contrib.sse` for the format), resuming from ``Last-Event-ID``, with
  keep-alives and, if asked, the task cancelled when the client goes away. Return it
  from a Starlette or FastAPI endpoint.
* :func:`submit` / :func:`submitter`: submit from a request into the user's own
  stream (FIFO per user), as the user's tenant (:func:`user_tenant`), at the request's
  priority (:func:`request_priority`: ``interactive`` unless ``X-Mtq-Priority`` says
  otherwise), without blocking the event loop; :func:`submitter` is a FastAPI
  dependency.
* :class:`TaskRoutes`: submit, result, events and cancel endpoints for one queue,
  as Starlette routes or a sub-application to mount.
* :func:`add_error_handlers`: mtq's errors as JSON answers (404, 400, 413, 429 with
  Retry-After for a tenant over its rate limit, and 503 with Retry-After for a full
  queue, a deadline that would be missed or an unreachable Redis).

Every stream of the process shares the process's one reply subscription (the
:class:`~mtq.replies.Hub` of the queue's Redis client): a stream is an in-memory
feed, not a Redis connection. The Redis reads a stream makes (its first read of the
stored state, re-reads after a reconnect) run in asyncio's default executor, so the
connections the process holds are bounded by that executor's threads, not by the
number of streams. asyncio only (mtq's async API is asyncio's).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import AsyncIterable, Awaitable, Callable, Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from mtq.client import Queue, Task
from mtq.contrib.sse import (
    KEEPALIVE_S,
    RETRY_AFTER_S,
    RETRY_MS,
    BadLastEventId,
    Encoder,
    EventStream,
    HttpError,
    headers,
    http_error,
    parse_last_event_id,
    stream_name,
    to_json,
)
from mtq.contrib.web import (
    DEADLINE_HEADER,
    PRIORITY_HEADER,
    PriorityOf,
    TenantOf,
    fill_options,
    priority_from,
    tenant_name,
)
from mtq.errors import (
    InvalidName,
    MtqError,
    ResultTimeout,
    TaskFailed,
)
from mtq.validation import check_task_id

log = logging.getLogger(__name__)

__all__ = [
    "EventStreamResponse",
    "TaskRoutes",
    "add_error_handlers",
    "error_response",
    "request_priority",
    "serve_event_stream",
    "submit",
    "submitter",
    "user_stream",
    "user_tenant",
]

#: the session key that holds an anonymous user's stream id (SessionMiddleware)
SESSION_KEY = "mtq_stream"


# -- answers -----------------------------------------------------------------------------
def json_response(body: Any, status: int = 200,
                  extra: list[tuple[str, str]] | None = None) -> Response:
    """A JSON response encoded as the event stream encodes data (bytes as base64)."""
    return Response(to_json(body), status, dict(extra or ()), media_type="application/json")


def error_response(err: HttpError) -> Response:
    """The JSON answer of an :class:`~mtq.contrib.sse.HttpError`."""
    return Response(err.body(), err.status, dict(err.headers), media_type="application/json")


async def _send_error(err: HttpError, send: Send) -> None:
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(k.lower().encode("latin-1"), v.encode("latin-1"))
                            for k, v in err.all_headers()]})
    await send({"type": "http.response.body", "body": err.body()})


def add_error_handlers(app: Any, retry_after_s: int = RETRY_AFTER_S) -> None:
    """Answer mtq's errors raised in ``app``'s endpoints as JSON (see
    :func:`mtq.contrib.sse.http_error`): a full queue is a 503 with Retry-After, not
    a 500 or a hung request; a tenant over its rate limit a 429 with Retry-After.
    ``app``: a Starlette or FastAPI application."""

    async def handle(request: Request, exc: Exception) -> Response:
        err = http_error(exc, retry_after_s)
        if err is None:
            log.error("unexpected mtq error in %s", request.url.path, exc_info=exc)
            err = HttpError(500, "internal", f"{type(exc).__name__}: {exc}")
        return error_response(err)

    app.add_exception_handler(MtqError, handle)


# -- the event stream ----------------------------------------------------------------------
async def serve_event_stream(stream: EventStream, scope: Scope, receive: Receive,
                             send: Send, extra_headers: Sequence[tuple[bytes, bytes]] = (),
                             retry_after_s: int = RETRY_AFTER_S) -> None:
    """Answer one ASGI request with ``stream``: a JSON error if the task does not
    exist, else the event stream. It listens for ``http.disconnect`` while it
    streams (whatever the ASGI spec version), so a client that goes away stops the
    stream at once and, with ``cancel_on_disconnect``, cancels the task."""
    try:
        await stream.aopen()
    except MtqError as exc:
        err = http_error(exc, retry_after_s)
        if err is None:
            raise
        await _send_error(err, send)
        return
    gone, failure = await send_event_stream(stream, scope, receive, send, extra_headers)
    if gone and not stream.finished:
        await stream.adisconnected()
    if failure is not None:
        raise failure


async def send_event_stream(chunks: AsyncIterable[bytes], scope: Scope, receive: Receive,
                            send: Send, extra_headers: Sequence[tuple[bytes, bytes]] = ()
                            ) -> tuple[bool, BaseException | None]:
    """Answer one ASGI request with ``chunks`` (an event stream's bytes, 200) until
    they end or the client goes away, which it notices at once (it listens for
    ``http.disconnect``, whatever the ASGI spec version); whether the client went
    away, and what ``chunks`` raised (None: nothing), for the caller to raise once it
    has done what a client leaving asks. A cancelled request stops both at once."""
    hop = str(scope.get("http_version", "1.1")).startswith("1")
    raw = [(k.lower().encode("latin-1"), v.encode("latin-1"))
           for k, v in headers(hop_by_hop=hop)]
    await send({"type": "http.response.start", "status": 200,
                "headers": raw + list(extra_headers)})

    async def pump() -> None:
        async for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def listen() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    pumping = asyncio.ensure_future(pump())
    listening = asyncio.ensure_future(listen())
    try:
        await asyncio.wait({pumping, listening}, return_when=asyncio.FIRST_COMPLETED)
        gone = listening.done()  # the client went away (before or as the stream ended)
    finally:  # also when this request itself is cancelled (server shutdown)
        for t in (pumping, listening):
            t.cancel()
        for t in (pumping, listening):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t  # its exception, if any, is read below
    failure = None if pumping.cancelled() else pumping.exception()
    if isinstance(failure, OSError):  # a server that reports a closed client this way
        gone, failure = True, None
    return gone, failure


class EventStreamResponse(Response):
    """A task's events as ``text/event-stream`` (format: :mod:`mtq.contrib.sse`).

    Return it from a Starlette or FastAPI endpoint. When it is sent it reads the
    request's ``Last-Event-ID`` (or ``?last_event_id=``) and starts at the next token
    (a malformed one: 400), checks the task exists (404 with a JSON body if not),
    then streams until the task ends. ``cancel_on_disconnect``: cancel the task when
    the client goes away before the end (``cancel_grace_s`` later, unless another
    stream of the task opened meanwhile: a page reloaded). ``keepalive_s``,
    ``retry_ms``, ``timeout`` and ``encode``: see :class:`~mtq.contrib.sse.EventStream`.
    """

    media_type = "text/event-stream"

    def __init__(self, task: Task, *, cancel_on_disconnect: bool = False,
                 cancel_grace_s: float = 0.0,
                 keepalive_s: float = KEEPALIVE_S, retry_ms: int = RETRY_MS,
                 timeout: float | None = None, encode: Encoder = to_json,
                 retry_after_s: int = RETRY_AFTER_S) -> None:
        # no super().__init__(): there is no body; headers set here (cookies a
        # dependency or middleware adds) are sent with the stream's own
        self.status_code = 200
        self.background = None
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.task = task
        self.options: dict[str, Any] = {
            "cancel_on_disconnect": cancel_on_disconnect, "cancel_grace_s": cancel_grace_s,
            "keepalive_s": keepalive_s,
            "retry_ms": retry_ms, "timeout": timeout, "encode": encode}
        self.retry_after_s = retry_after_s
        #: the stream, once the response is being sent (for tests and metrics)
        self.stream: EventStream | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope)
        try:
            start = parse_last_event_id(request.headers.get("last-event-id"),
                                        request.query_params.get("last_event_id"))
        except BadLastEventId as exc:
            err = http_error(exc)
            assert err is not None
            await _send_error(err, send)
            return
        self.stream = EventStream(self.task, start=start, **self.options)
        await serve_event_stream(self.stream, scope, receive, send, self.raw_headers,
                                 self.retry_after_s)


# -- submitting into the user's stream -----------------------------------------------------
def user_stream(request: Request) -> str | None:
    """The default stream of a request: its authenticated user (``user:<identity>``,
    Starlette's AuthenticationMiddleware), else its session (``session:<id>``, an id
    kept in the session under ``mtq_stream``; SessionMiddleware), else None (no
    ordering). Each user's tasks then run one at a time in the order they were sent,
    and users share the workers fairly."""
    user = request.scope.get("user")
    if user is not None and getattr(user, "is_authenticated", False):
        ident = getattr(user, "identity", None) or getattr(user, "display_name", None)
        if ident:
            return stream_name("user", ident)
    session = request.scope.get("session")
    if session is not None:
        from mtq.client import new_task_id

        sid = session.get(SESSION_KEY)
        if not isinstance(sid, str) or not sid:
            sid = session[SESSION_KEY] = new_task_id()
        return stream_name("session", sid)
    return None


def user_tenant(request: Request) -> str | None:
    """The default tenant of a request: its user authenticated by Starlette's
    AuthenticationMiddleware (its ``identity``, else its ``display_name``), as a tenant
    name (:func:`mtq.contrib.web.tenant_name`: a name that is not a valid tenant name
    becomes ``sha1-<hex>``), else None (no tenant). Each user then gets a fair share of
    the workers' cost; pass ``tenant_of=`` to share per organisation or API key."""
    user = request.scope.get("user")
    if user is not None and getattr(user, "is_authenticated", False):
        return tenant_name(getattr(user, "identity", None)
                           or getattr(user, "display_name", None))
    return None


def request_priority(request: Request) -> str | None:
    """The default priority of a request's submits: its ``X-Mtq-Priority`` header
    (``interactive``, ``standard`` or ``batch``; another value raises BadHeader, a
    400), else ``interactive``."""
    return priority_from(request.headers.get(PRIORITY_HEADER))


StreamOf = Callable[[Request], "str | None"]


async def submit(queue: Queue, payload: Any, *, request: Request | None = None,
                 stream: str | None = None, stream_of: StreamOf = user_stream,
                 tenant_of: TenantOf[Request] = user_tenant,
                 priority_of: PriorityOf[Request] = request_priority,
                 **options: Any) -> Task:
    """Submit ``payload`` without blocking the event loop (the submit runs in a
    thread) into ``stream``, or else the stream ``stream_of(request)`` gives (the
    user's, by default). With a ``request``, a ``tenant`` or ``priority`` not given
    is ``tenant_of(request)`` / ``priority_of(request)``, and a ``deadline`` not given
    is the ``X-Mtq-Deadline`` header's (seconds; see
    :func:`mtq.contrib.web.fill_options`). ``options``: ``key``, ``ttl``, ``retries``,
    ``id``, ``priority``, ``tenant``, ``cost``, ``deadline`` of
    :meth:`mtq.Queue.submit`. Raises what it raises (QueueFull, RateLimited,
    WouldMissDeadline: see :func:`add_error_handlers`) and BadHeader."""
    if request is not None:
        if stream is None:
            stream = stream_of(request)
        options = fill_options(options, request, tenant_of, priority_of,
                               request.headers.get(DEADLINE_HEADER))
    return await asyncio.to_thread(functools.partial(queue.submit, payload, stream=stream,
                                                     **options))


Submit = Callable[..., Awaitable[Task]]


def submitter(queue: Queue, stream_of: StreamOf = user_stream, *,
              tenant_of: TenantOf[Request] = user_tenant,
              priority_of: PriorityOf[Request] = request_priority
              ) -> Callable[[Request], Submit]:
    """A FastAPI dependency: ``submit = Depends(submitter(q))`` gives the endpoint an
    ``await submit(payload, **options)`` that submits into the requesting user's
    stream (see :func:`user_stream`), as its tenant, at its priority (see
    :func:`submit`; an option given wins)."""

    def dependency(request: Request) -> Submit:
        stream = stream_of(request)

        async def bound(payload: Any, **options: Any) -> Task:
            options.setdefault("stream", stream)
            options = fill_options(options, request, tenant_of, priority_of,
                                   request.headers.get(DEADLINE_HEADER))
            return await submit(queue, payload, **options)

        return bound

    return dependency


# -- ready-made endpoints -------------------------------------------------------------------
class TaskRoutes:
    """Endpoints for one queue, under ``prefix`` (``/tasks``):

    * ``POST /tasks``: the JSON body is the payload, submitted into the user's
      stream (``stream_of``), as the user's tenant (``tenant_of``), at the request's
      priority (``priority_of``: ``interactive`` unless ``X-Mtq-Priority`` says
      otherwise), with the ``X-Mtq-Deadline`` header's deadline if any; 202 with
      ``{"id", "stream", "events", "result"}``. Full queue, or a deadline that would
      be missed: 503 with Retry-After. Tenant over its rate limit: 429 with
      Retry-After. Body not JSON, bad ``X-Mtq-Priority`` or ``X-Mtq-Deadline``: 400.
    * ``GET /tasks/{id}``: ``{"id", "status"}`` plus ``result`` or ``error`` once it
      ended; ``?wait=S`` waits up to S seconds (at most ``max_wait_s``) for the end.
    * ``GET /tasks/{id}/events``: the event stream (:class:`EventStreamResponse`).
    * ``DELETE /tasks/{id}``: cancel; ``{"cancelled": true}`` if it had not started,
      false if its worker was told to stop it (or it had ended).

    ``routes()`` for your own Starlette app, ``app()`` to mount
    (``app.mount("/chat", TaskRoutes(q).app())``, FastAPI too). Task ids are random
    (96 bits): whoever knows one can read its task, as with a capability URL; put
    the routes behind your authentication if that is not enough.
    """

    def __init__(self, queue: Queue, *, prefix: str = "/tasks",
                 stream_of: StreamOf = user_stream,
                 tenant_of: TenantOf[Request] = user_tenant,
                 priority_of: PriorityOf[Request] = request_priority,
                 cancel_on_disconnect: bool = False,
                 keepalive_s: float = KEEPALIVE_S, retry_ms: int = RETRY_MS,
                 stream_timeout: float | None = None, retry_after_s: int = RETRY_AFTER_S,
                 max_wait_s: float = 60.0, ttl: float | None = None,
                 encode: Encoder = to_json) -> None:
        self.queue = queue
        self.prefix = prefix.rstrip("/")
        self.stream_of = stream_of
        self.tenant_of = tenant_of
        self.priority_of = priority_of
        self.cancel_on_disconnect = cancel_on_disconnect
        self.keepalive_s = keepalive_s
        self.retry_ms = retry_ms
        self.stream_timeout = stream_timeout
        self.retry_after_s = retry_after_s
        self.max_wait_s = max_wait_s
        self.ttl = ttl
        self.encode = encode

    def _task(self, task_id: str) -> Task:
        check_task_id(task_id)  # InvalidName: 404
        return self.queue.task(task_id)

    def events(self, task_id: str) -> Response:
        """The event stream of a task (404 for an id mtq never makes)."""
        try:
            task = self._task(task_id)
        except InvalidName as exc:
            err = http_error(exc)
            assert err is not None
            return error_response(err)
        return EventStreamResponse(task, cancel_on_disconnect=self.cancel_on_disconnect,
                                   keepalive_s=self.keepalive_s, retry_ms=self.retry_ms,
                                   timeout=self.stream_timeout, encode=self.encode,
                                   retry_after_s=self.retry_after_s)

    async def result(self, task_id: str, wait: float = 0.0) -> dict[str, Any]:
        """``{"id", "status"}``, plus ``result`` (succeeded) or ``error`` (another end),
        after waiting up to ``wait`` seconds for the task to end. Raises TaskNotFound."""
        task = self._task(task_id)
        body: dict[str, Any] = {"id": task.id}
        try:
            body["result"] = await task.aresult(timeout=wait)
            body["status"] = "succeeded"
        except TaskFailed as exc:  # TaskCancelled too
            body.update(status=exc.status, error=exc.error)
        except ResultTimeout as exc:
            body["status"] = exc.status
        return body

    # -- the endpoints ---------------------------------------------------------------
    async def _post(self, request: Request) -> Response:
        try:
            payload = json.loads(await request.body())
        except ValueError as exc:
            return error_response(HttpError(400, "bad_json", f"the body must be JSON: {exc}"))
        stream = self.stream_of(request)
        task = await submit(self.queue, payload, request=request, stream=stream,
                            tenant_of=self.tenant_of, priority_of=self.priority_of,
                            ttl=self.ttl)
        base = f"{request.scope.get('root_path', '')}{self.prefix}/{task.id}"
        info = {"id": task.id, "stream": stream, "status": "queued",
                "result": base, "events": f"{base}/events"}
        return json_response(info, 202)

    async def _get(self, request: Request) -> Response:
        raw = request.query_params.get("wait", "0")
        try:
            wait = float(raw)
            if not 0 <= wait <= self.max_wait_s:
                raise ValueError
        except ValueError:
            return error_response(HttpError(
                400, "bad_wait", f"wait must be seconds between 0 and {self.max_wait_s:g}, "
                f"got {raw[:40]!r}"))
        return json_response(await self.result(request.path_params["task_id"], wait))

    async def _events(self, request: Request) -> Response:
        return self.events(request.path_params["task_id"])

    async def _delete(self, request: Request) -> Response:
        task = self._task(request.path_params["task_id"])
        return json_response({"id": task.id,
                              "cancelled": await asyncio.to_thread(task.cancel)})

    def routes(self) -> list[Route]:
        """The Starlette routes (mtq errors they raise need :func:`add_error_handlers`)."""
        p = self.prefix
        return [
            Route(p, self._post, methods=["POST"]),
            Route(p + "/{task_id}", self._get, methods=["GET"]),
            Route(p + "/{task_id}", self._delete, methods=["DELETE"]),
            Route(p + "/{task_id}/events", self._events, methods=["GET"]),
        ]

    def app(self) -> Starlette:
        """A Starlette application with these routes and mtq's error answers, to
        mount in a Starlette or FastAPI application."""
        app = Starlette(routes=self.routes())
        add_error_handlers(app, self.retry_after_s)
        return app
