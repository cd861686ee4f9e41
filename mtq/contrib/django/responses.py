"""A task's events as server-sent events from Django views, and mtq's errors as JSON.

* :func:`event_stream`: for sync views under WSGI (gunicorn): a
  ``StreamingHttpResponse`` whose body is the :class:`~mtq.contrib.sse.EventStream`
  itself, so the server's ``close()`` (a client that went away, seen when a write
  fails) reaches it and, with ``cancel_on_disconnect``, cancels the task.
* :func:`aevent_stream`: for async views under ASGI (uvicorn): the body is an async
  iterator; Django's ASGI handler cancels it when the client disconnects, which
  cancels the task (``cancel_on_disconnect``).
* :func:`error_response` / :func:`json_response`: JSON answers, the way
  :func:`mtq.contrib.sse.http_error` maps mtq's errors (404, 400, 413, 429 and 503
  with Retry-After). :class:`~mtq.contrib.django.middleware.MtqErrorMiddleware` applies
  it to errors a view raises.

Both streams resume after the request's ``Last-Event-ID`` (or ``?last_event_id=``;
the header wins), answer 400 for a malformed one and 404 for an unknown task (JSON),
then stream until the task ends; the format is :mod:`mtq.contrib.sse`'s.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from django.http import HttpRequest, HttpResponse, StreamingHttpResponse

from mtq.client import Task
from mtq.contrib.django.conf import get_settings
from mtq.contrib.django.queues import queue as get_queue
from mtq.contrib.sse import (
    MEDIA_TYPE,
    RETRY_MS,
    BadLastEventId,
    Encoder,
    EventStream,
    HttpError,
    headers,
    http_error,
    parse_last_event_id,
    to_json,
)
from mtq.errors import MtqError
from mtq.validation import check_task_id

log = logging.getLogger(__name__)


def json_response(body: Any, status: int = 200,
                  extra: list[tuple[str, str]] | None = None) -> HttpResponse:
    """A JSON response encoded as the event stream encodes data (bytes as base64)."""
    resp = HttpResponse(to_json(body), status=status, content_type="application/json")
    for k, v in extra or ():
        resp[k] = v
    return resp


def error_response(exc: BaseException | HttpError,
                   retry_after_s: int | None = None) -> HttpResponse:
    """The JSON answer of an mtq error (or of an :class:`~mtq.contrib.sse.HttpError`):
    ``{"error": code, "detail": message}`` with its status (TaskNotFound 404,
    BadLastEventId, BadHeader and a bad stream name 400, PayloadTooLarge 413, QueueFull
    and an unreachable Redis 503 with ``Retry-After``: ``MTQ["RETRY_AFTER_S"]``;
    RateLimited 429 and WouldMissDeadline 503 with the ``Retry-After`` they give). An
    error :func:`~mtq.contrib.sse.http_error` does not know is a 500 ``internal``."""
    if isinstance(exc, HttpError):
        err = exc
    else:
        if retry_after_s is None:
            retry_after_s = get_settings().retry_after_s
        err = http_error(exc, retry_after_s) or HttpError(
            500, "internal", f"{type(exc).__name__}: {exc}")
    resp = HttpResponse(err.body(), status=err.status, content_type="application/json")
    for k, v in err.headers:
        resp[k] = v
    return resp


def _prepare(request: HttpRequest, task: Task | str, queue: str | None,
             options: dict[str, Any]) -> EventStream:
    """The EventStream for ``request`` (not opened). Raises BadLastEventId,
    InvalidName (an id mtq never makes: a 404)."""
    if isinstance(task, str):
        task = get_queue(queue).task(check_task_id(task))
    start = parse_last_event_id(request.headers.get("Last-Event-ID"),
                                request.GET.get("last_event_id"))
    if options.get("keepalive_s") is None:
        options["keepalive_s"] = get_settings().keepalive_s
    return EventStream(task, start=start, **options)


def _streaming(body: Any) -> StreamingHttpResponse:
    resp = StreamingHttpResponse(body, content_type=f"{MEDIA_TYPE}; charset=utf-8")
    for k, v in headers(hop_by_hop=False):  # no Connection: WSGI (PEP 3333), Django
        if k != "Content-Type":
            resp[k] = v
    return resp


def event_stream(request: HttpRequest, task: Task | str, *, queue: str | None = None,
                 cancel_on_disconnect: bool = False, cancel_grace_s: float = 0.0,
                 keepalive_s: float | None = None,
                 retry_ms: int = RETRY_MS, timeout: float | None = None,
                 encode: Encoder = to_json) -> HttpResponse:
    """The events of ``task`` (a :class:`~mtq.Task`, or a task id of ``queue``,
    default ``MTQ["QUEUE"]``) as ``text/event-stream``, for a sync view (WSGI).

    400 (JSON) for a malformed Last-Event-ID, 404 (JSON) for an unknown task; an
    unreachable Redis is a 200 holding one ``error`` event (the browser reconnects and
    resumes). ``cancel_on_disconnect``: cancel the task when the client goes away
    before the end (a WSGI server learns it when a write fails, at the next token or
    keep-alive, then closes the response), ``cancel_grace_s`` later unless another
    stream of the task opened meanwhile, in any process (a page reloaded). ``keepalive_s`` (default
    ``MTQ["KEEPALIVE_S"]``), ``retry_ms``, ``timeout``, ``encode``: see
    :class:`~mtq.contrib.sse.EventStream`. Under ASGI use :func:`aevent_stream`."""
    opts: dict[str, Any] = {"cancel_on_disconnect": cancel_on_disconnect,
                            "cancel_grace_s": cancel_grace_s,
                            "keepalive_s": keepalive_s, "retry_ms": retry_ms,
                            "timeout": timeout, "encode": encode}
    try:
        stream = _prepare(request, task, queue, opts)
        stream.open()  # TaskNotFound before the 200
    except (BadLastEventId, MtqError) as exc:
        return error_response(exc)
    # the EventStream is the body: StreamingHttpResponse keeps its close() among the
    # response's closers, and the WSGI server closes the response when it is over or
    # the client went away: EventStream.close() cancels (cancel_on_disconnect)
    return _streaming(stream)


async def _until_gone(stream: EventStream) -> AsyncIterator[bytes]:
    """The stream's chunks; if it is left before its end (Django's ASGI handler
    cancels the response when the client disconnects), the client went away."""
    ended = False
    try:
        async for chunk in stream:
            yield chunk
        ended = True
    finally:
        if not ended and not stream.finished:
            # shielded: a second cancel must not leave the task running unseen
            await asyncio.shield(stream.adisconnected())


async def aevent_stream(request: HttpRequest, task: Task | str, *,
                        queue: str | None = None, cancel_on_disconnect: bool = False,
                        cancel_grace_s: float = 0.0, keepalive_s: float | None = None, retry_ms: int = RETRY_MS,
                        timeout: float | None = None,
                        encode: Encoder = to_json) -> HttpResponse:
    """:func:`event_stream` for an async view (ASGI: uvicorn, daphne): the body is an
    async iterator, the Redis reads run in threads, and the streams of a process share
    its one reply subscription. Django (4.2+) cancels the response when the client
    disconnects; with ``cancel_on_disconnect`` that cancels the task."""
    opts: dict[str, Any] = {"cancel_on_disconnect": cancel_on_disconnect,
                            "cancel_grace_s": cancel_grace_s,
                            "keepalive_s": keepalive_s, "retry_ms": retry_ms,
                            "timeout": timeout, "encode": encode}
    try:
        stream = await asyncio.to_thread(_prepare, request, task, queue, opts)
        await stream.aopen()
    except (BadLastEventId, MtqError) as exc:
        return error_response(exc)
    return _streaming(_until_gone(stream))
