"""Flask: an extension, a server-sent events response, and ``flask mtq`` commands.

* :class:`MTQ`: ``MTQ(app)`` or ``MTQ().init_app(app)`` reads ``MTQ_REDIS_URL`` and
  ``MTQ_QUEUE`` (the default queue) from ``app.config``; ``mtq_ext.queue(name)`` is
  the app's :class:`mtq.Queue` of that name (one per app and name, sharing the app's
  one Redis client); ``mtq_ext.submit(payload)`` in a view submits into the
  requesting user's own stream (FIFO per user, see :func:`user_stream`), as the
  user's tenant (:func:`user_tenant`), at the request's priority
  (:func:`request_priority`: ``interactive`` unless ``X-Mtq-Priority`` says
  otherwise). It answers mtq's errors as JSON (:func:`register_error_handlers`: a
  full queue is a 503 with Retry-After, a tenant over its rate limit a 429) and adds
  ``flask mtq status`` and ``flask mtq workers TARGET``.
* :func:`event_stream_response`: a task's events as ``text/event-stream``
  (:class:`mtq.contrib.sse.EventStream`, format there), resuming from
  ``Last-Event-ID``; its body is the EventStream itself, so the WSGI server's
  ``close()`` reaches it and, with ``cancel_on_disconnect``, cancels the task of a
  client that went away.

Flask is sync here (WSGI): each open stream holds one server thread for its length,
so serve it with threads (``gunicorn -k gthread --threads N``) or gevent, not one
sync worker per stream. The streams of a process share its one reply subscription
(mtq's reply hub), not a Redis connection each.

The commands are mtq's own click commands (``mtq status``, ``mtq workers start``)
with their ``--redis`` (and ``--queue``) defaults taken from the app's config; click
is Flask's CLI library, so this module is the one place outside :mod:`mtq.cli` that
builds click commands.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import click
from flask import Flask, Request, Response, current_app, g, request, session
from flask.cli import AppGroup

from mtq.broker.connection import connect
from mtq.client import Queue, Task, new_task_id
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
from mtq.errors import MtqError, UsageError
from mtq.validation import check_task_id

log = logging.getLogger(__name__)

#: the key of ``app.extensions`` (and of the session entry holding a stream id)
EXTENSION = "mtq"
SESSION_KEY = "mtq_stream"

StreamOf = Callable[[Request], "str | None"]


def user_stream(req: Request) -> str | None:
    """The default stream of a request: ``session:<id>``, with a random id kept in
    Flask's session under ``mtq_stream`` (created on first use: the session cookie
    makes a browser one user), else None (no ordering) when the app has no
    ``SECRET_KEY`` and so no session. Each user's tasks run one at a time in the
    order sent; users share the workers fairly. For a logged-in user or an API key,
    pass ``stream_of=lambda request: ...`` (e.g. ``stream_name("user", user.id)``)."""
    if not current_app.secret_key:
        return None
    sid = session.get(SESSION_KEY)
    if not isinstance(sid, str) or not sid:
        sid = session[SESSION_KEY] = new_task_id()
    return stream_name("session", sid)


def user_tenant(req: Request) -> str | None:
    """The default tenant of a request: its logged-in user, as a tenant name
    (:func:`mtq.contrib.web.tenant_name`: a name that is not a valid tenant name
    becomes ``sha1-<hex>``), else None (no tenant). The user is Flask-Login's
    ``current_user`` (its ``get_id()``) in an app that uses Flask-Login, else
    ``g.user`` (the Flask tutorial's convention: an object with an ``id``, a row or
    mapping with ``"id"``, or the id itself). Pass ``tenant_of=`` to share per
    organisation or API key."""
    if getattr(current_app, "login_manager", None) is not None:
        from flask_login import current_user  # an app with a login_manager has it

        if getattr(current_user, "is_authenticated", False):
            return tenant_name(current_user.get_id())
        return None
    user = g.get("user")
    if user is None or isinstance(user, (str, int)):
        return tenant_name(user)
    ident = getattr(user, "id", None)
    if ident is None:
        try:
            ident = user["id"]
        except (TypeError, KeyError, IndexError, ValueError):
            return None
    return tenant_name(ident)


def request_priority(req: Request) -> str | None:
    """The default priority of a request's submits: its ``X-Mtq-Priority`` header
    (``interactive``, ``standard`` or ``batch``; another value raises BadHeader, a
    400), else ``interactive``."""
    return priority_from(req.headers.get(PRIORITY_HEADER))


def json_response(body: Any, status: int = 200,
                  extra: list[tuple[str, str]] | None = None) -> Response:
    """A JSON response encoded as the event stream encodes data (bytes as base64)."""
    return Response(to_json(body), status, extra or [], mimetype="application/json")


def error_response(err: HttpError) -> Response:
    """The JSON answer of an :class:`~mtq.contrib.sse.HttpError`."""
    return Response(err.body(), err.status, err.all_headers())


def register_error_handlers(app: Flask, retry_after_s: int = RETRY_AFTER_S) -> None:
    """Answer mtq's errors raised in ``app``'s views as JSON (see
    :func:`mtq.contrib.sse.http_error`): a full queue is a 503 with Retry-After (not
    a 500 or a hung request), a tenant over its rate limit a 429 and a deadline that
    would be missed a 503 (both with Retry-After), an unknown task a 404, a bad name
    or header a 400, a payload over the limit a 413. ``MTQ(app)`` calls it."""

    def handle(exc: MtqError) -> Response:
        err = http_error(exc, retry_after_s)
        if err is None:
            log.error("unexpected mtq error in %s", request.path, exc_info=exc)
            err = HttpError(500, "internal", f"{type(exc).__name__}: {exc}")
        return error_response(err)

    app.register_error_handler(MtqError, handle)


def event_stream_response(task: Task, *, cancel_on_disconnect: bool = False,
                          cancel_grace_s: float = 0.0, keepalive_s: float = KEEPALIVE_S,
                          retry_ms: int = RETRY_MS,
                          timeout: float | None = None, encode: Encoder = to_json,
                          retry_after_s: int = RETRY_AFTER_S) -> Response:
    """A task's events as ``text/event-stream``, for the current request.

    It starts after the request's ``Last-Event-ID`` (or ``?last_event_id=``; the
    header wins), answers 400 (JSON) for a malformed one and 404 (JSON) for a task
    that does not exist, then streams until the task ends. An unreachable Redis is a
    200 holding one ``error`` event (the browser reconnects and resumes).
    ``cancel_on_disconnect``: cancel the task when the client goes away before the
    end (a WSGI server learns it when a write fails, at the next token or keep-alive,
    and then calls ``close()``), ``cancel_grace_s`` later unless another stream of
    the task opened meanwhile, in any process (a page reloaded). ``keepalive_s``,
    ``retry_ms``, ``timeout`` and ``encode``: see :class:`~mtq.contrib.sse.EventStream`."""
    try:
        start = parse_last_event_id(request.headers.get("Last-Event-ID"),
                                    request.args.get("last_event_id"))
        stream = EventStream(task, start=start, keepalive_s=keepalive_s, retry_ms=retry_ms,
                             timeout=timeout, cancel_on_disconnect=cancel_on_disconnect,
                             cancel_grace_s=cancel_grace_s, encode=encode)
        stream.open()  # TaskNotFound before the 200
    except (BadLastEventId, MtqError) as exc:
        err = http_error(exc, retry_after_s)
        if err is None:
            raise
        return error_response(err)
    # the EventStream itself is the body: Werkzeug's response closes its body when the
    # server closes the response, so the server's close() reaches EventStream.close()
    return Response(stream, 200, headers(hop_by_hop=False), direct_passthrough=True)


class _State:
    """What the extension keeps per app (``app.extensions["mtq"]``)."""

    def __init__(self, app: Flask) -> None:
        self.url: str | None = app.config["MTQ_REDIS_URL"]
        self.default_queue: str = app.config["MTQ_QUEUE"]
        self.client = connect(self.url)
        self.queues: dict[str, Queue] = {}


class MTQ:
    """The Flask extension: ``MTQ(app)``, or ``ext = MTQ()`` then ``ext.init_app(app)``
    (app factories; one extension may serve several apps).

    Config: ``MTQ_REDIS_URL`` (default: None, which is the ``MTQ_REDIS_URL``
    environment variable, else mtq's embedded server), ``MTQ_QUEUE`` (the default
    queue, ``"default"``), ``MTQ_RETRY_AFTER_S`` (the Retry-After of a 503, 2).
    ``stream_of``: the stream a request's submits go to (:func:`user_stream`);
    ``tenant_of``: their tenant (:func:`user_tenant`); ``priority_of``: their
    priority (:func:`request_priority`). ``error_handlers``: register :func:`register_error_handlers`. ``cli``: add the
    ``flask mtq`` commands.
    """

    def __init__(self, app: Flask | None = None, *, stream_of: StreamOf = user_stream,
                 tenant_of: TenantOf[Request] = user_tenant,
                 priority_of: PriorityOf[Request] = request_priority,
                 error_handlers: bool = True, cli: bool = True) -> None:
        self.stream_of = stream_of
        self.tenant_of = tenant_of
        self.priority_of = priority_of
        self.error_handlers = error_handlers
        self.cli = cli
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Flask) -> None:
        """Read the app's config, register the error answers and the commands."""
        app.config.setdefault("MTQ_REDIS_URL", None)
        app.config.setdefault("MTQ_QUEUE", "default")
        app.config.setdefault("MTQ_RETRY_AFTER_S", RETRY_AFTER_S)
        app.extensions[EXTENSION] = _State(app)
        if self.error_handlers:
            register_error_handlers(app, int(app.config["MTQ_RETRY_AFTER_S"]))
        if self.cli:
            app.cli.add_command(cli_group(app))

    @staticmethod
    def _state() -> _State:
        try:
            state: _State = current_app.extensions[EXTENSION]
            return state
        except KeyError:
            raise UsageError("mtq is not set up on this app: call MTQ(app) or "
                               "MTQ().init_app(app) first") from None

    def queue(self, name: str | None = None) -> Queue:
        """The current app's queue ``name`` (default ``MTQ_QUEUE``), made once per app
        and name. Raises InvalidName for a name mtq does not accept."""
        state = self._state()
        name = name or state.default_queue
        q = state.queues.get(name)
        if q is None:
            q = state.queues.setdefault(name, Queue(name, client=state.client))
        return q

    def task(self, task_id: str, queue: str | None = None) -> Task:
        """The task ``task_id`` of ``queue``; an id mtq never makes raises InvalidName
        (answered 404 by the error handlers). Reads nothing."""
        return self.queue(queue).task(check_task_id(task_id))

    def submit(self, payload: Any, *, queue: str | None = None, stream: str | None = None,
               **options: Any) -> Task:
        """Submit ``payload`` to ``queue`` (default ``MTQ_QUEUE``) from a view, into
        ``stream`` or else the requesting user's (``stream_of(request)``). A
        ``tenant`` or ``priority`` not given is ``tenant_of(request)`` /
        ``priority_of(request)``, a ``deadline`` not given the ``X-Mtq-Deadline``
        header's (seconds; see :func:`mtq.contrib.web.fill_options`). ``options``:
        ``key``, ``ttl``, ``retries``, ``id``, ``priority``, ``tenant``, ``cost``,
        ``deadline`` of :meth:`mtq.Queue.submit`. Raises what it raises (QueueFull,
        RateLimited, WouldMissDeadline: a 503, 429, 503 with the error handlers) and
        BadHeader (400)."""
        if stream is None:
            stream = self.stream_of(request)
        options = fill_options(options, request, self.tenant_of, self.priority_of,
                               request.headers.get(DEADLINE_HEADER))
        return self.queue(queue).submit(payload, stream=stream, **options)

    def event_stream(self, task_id: str, queue: str | None = None,
                     **options: Any) -> Response:
        """:func:`event_stream_response` of the task ``task_id`` of ``queue`` (an id
        mtq never makes: 404)."""
        try:
            task = self.task(task_id, queue)
        except MtqError as exc:
            err = http_error(exc)
            if err is None:
                raise
            return error_response(err)
        return event_stream_response(task, **options)


# -- flask mtq ... ----------------------------------------------------------------------
def cli_group(app: Flask) -> click.Group:
    """The ``flask mtq`` commands of ``app``: ``status`` (``mtq status``) and
    ``workers TARGET`` (``mtq workers start``), on the app's ``MTQ_REDIS_URL`` (else
    the ``MTQ_REDIS_URL`` environment variable, as for ``mtq``) and, for
    ``workers``, its ``MTQ_QUEUE``; every option of the mtq command is there."""
    from mtq.cli.common import with_defaults
    from mtq.cli.status import status
    from mtq.cli.workers import workers_start

    def url() -> str | None:
        return app.config.get("MTQ_REDIS_URL") or os.environ.get("MTQ_REDIS_URL")

    def queue() -> str:
        return str(app.config.get("MTQ_QUEUE") or "default")

    group = AppGroup(EXTENSION, help="The task queue of this app (mtq; see 'mtq --help').")
    group.add_command(with_defaults(status, "status", url=url))
    group.add_command(with_defaults(workers_start, "workers", url=url, queue=queue))
    return group
