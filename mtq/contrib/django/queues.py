"""Queues of a Django project, and submitting from its views.

* :func:`queue`: the project's :class:`mtq.Queue` of a name (``MTQ["QUEUE"]`` by
  default), made once per process and name on ``MTQ["REDIS_URL"]``.
* :func:`submit` / :func:`asubmit`: submit from a view into the requesting user's own
  stream (FIFO per user: :func:`user_stream`), as the user's tenant
  (:func:`user_tenant`), at the request's priority (:func:`request_priority`:
  ``interactive`` unless ``X-Mtq-Priority`` says otherwise), sync or without blocking
  the event loop.
* :func:`submit_on_commit`: submit once the database transaction commits, so a task
  never runs before the row it needs is visible; nothing at all on a rollback.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from asgiref.sync import sync_to_async
from django.db import transaction
from django.http import HttpRequest

from mtq.client import Queue, Request, Task, new_task_id
from mtq.contrib.django.conf import get_settings
from mtq.contrib.sse import stream_name
from mtq.contrib.web import (
    DEADLINE_HEADER,
    PRIORITY_HEADER,
    fill_options,
    priority_from,
    tenant_name,
)

log = logging.getLogger(__name__)

#: the session key that holds a browser's stream id
SESSION_KEY = "mtq_stream"

_queues: dict[tuple[str | None, str], Queue] = {}
_lock = threading.Lock()


def queue(name: str | None = None) -> Queue:
    """The project's queue ``name`` (default ``MTQ["QUEUE"]``) on ``MTQ["REDIS_URL"]``
    (else the ``MTQ_REDIS_URL`` environment variable, else mtq's embedded server),
    made once per process and name; every queue shares the process's one Redis client
    and reply subscription. Raises InvalidName, MtqSettingsError, BrokerError (no
    embedded server can be started)."""
    conf = get_settings()
    name = name or conf.queue
    key = (conf.redis_url, name)
    q = _queues.get(key)
    if q is None:
        with _lock:
            q = _queues.get(key)
            if q is None:
                q = _queues[key] = Queue(name, conf.redis_url)
    return q


def clear_cache() -> None:
    """Forget the queues made so far (the app does it when ``MTQ`` changes, e.g. under
    ``override_settings``)."""
    with _lock:
        _queues.clear()
    get_settings.cache_clear()


def user_stream(request: HttpRequest) -> str | None:
    """The default stream of a request: its authenticated user, ``user:<pk>``, else
    its session, ``session:<id>`` (a random id kept in the session under
    ``mtq_stream``, made on first use), else None (no session middleware: no
    ordering). Each user's tasks then run one at a time in the order sent, and users
    share the workers fairly.

    Not ``session.session_key``: it changes when a user logs in (``cycle_key``) and,
    with signed-cookie sessions, with every change of the session; the id kept in the
    session survives both. Sync (it may read the session store): :func:`asubmit`
    calls it through ``sync_to_async``."""
    user = getattr(request, "user", None)
    if user is not None and getattr(user, "is_authenticated", False):
        ident = getattr(user, "pk", None)
        if ident is None:
            ident = user.get_username() if hasattr(user, "get_username") else None
        if ident is not None:
            return stream_name("user", ident)
    session = getattr(request, "session", None)
    if session is None:
        return None
    sid = session.get(SESSION_KEY)
    if not isinstance(sid, str) or not sid:
        sid = session[SESSION_KEY] = new_task_id()
    return stream_name("session", sid)


def stream_of(request: HttpRequest) -> str | None:
    """The stream of ``request``: ``MTQ["STREAM_OF"](request)`` if set, else
    :func:`user_stream`."""
    fn = get_settings().stream_of or user_stream
    return fn(request)


def user_tenant(request: HttpRequest) -> str | None:
    """The default tenant of a request: its authenticated user's ``pk`` (else its
    username) as a tenant name (:func:`mtq.contrib.web.tenant_name`: one that is not a
    valid tenant name becomes ``sha1-<hex>``), else None (no tenant). Sync (it may
    read the user from the database)."""
    user = getattr(request, "user", None)
    if user is None or not getattr(user, "is_authenticated", False):
        return None
    ident = getattr(user, "pk", None)
    if ident is None and hasattr(user, "get_username"):
        ident = user.get_username()
    return tenant_name(ident)


def request_priority(request: HttpRequest) -> str | None:
    """The default priority of a request's submits: its ``X-Mtq-Priority`` header
    (``interactive``, ``standard`` or ``batch``; another value raises BadHeader, a
    400), else ``interactive``."""
    return priority_from(request.headers.get(PRIORITY_HEADER))


def tenant_of(request: HttpRequest) -> str | None:
    """The tenant of ``request``: ``MTQ["TENANT_OF"](request)`` if set, else
    :func:`user_tenant`."""
    fn = get_settings().tenant_of or user_tenant
    return fn(request)


def priority_of(request: HttpRequest) -> str | None:
    """The priority of ``request``: ``MTQ["PRIORITY_OF"](request)`` if set, else
    :func:`request_priority`."""
    fn = get_settings().priority_of or request_priority
    return fn(request)


def _from_request(request: HttpRequest | None, stream: str | None,
                  options: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """The stream and the submit options of ``request`` (where the caller gave none).
    Sync: the user and the session may hit the database."""
    if request is None:
        return stream, options
    if stream is None:
        stream = stream_of(request)
    return stream, fill_options(options, request, tenant_of, priority_of,
                                request.headers.get(DEADLINE_HEADER))


def submit(request: HttpRequest | None, payload: Any, *, queue: str | None = None,
           stream: str | None = None, **options: Any) -> Task:
    """Submit ``payload`` to ``queue`` (default ``MTQ["QUEUE"]``) into ``stream``, else
    the stream of ``request`` (:func:`stream_of`; ``request=None`` and no ``stream``:
    no ordering). With a ``request``, a ``tenant`` or ``priority`` not given is
    :func:`tenant_of` / :func:`priority_of` of it, a ``deadline`` not given the
    ``X-Mtq-Deadline`` header's (seconds; see :func:`mtq.contrib.web.fill_options`).
    ``options``: ``key``, ``ttl``, ``retries``, ``id``, ``priority``, ``tenant``,
    ``cost``, ``deadline`` of :meth:`mtq.Queue.submit`. Raises what it raises
    (InvalidName, PayloadTooLarge, EncodeError, QueueFull, RateLimited,
    WouldMissDeadline, BrokerError) and BadHeader: answered as JSON by
    :class:`~mtq.contrib.django.middleware.MtqErrorMiddleware`."""
    stream, options = _from_request(request, stream, options)
    return _queue(queue).submit(payload, stream=stream, **options)


async def asubmit(request: HttpRequest | None, payload: Any, *, queue: str | None = None,
                  stream: str | None = None, **options: Any) -> Task:
    """:func:`submit` for async views: the request's stream, tenant and priority are
    read through ``sync_to_async`` (the user and the session may hit the database), the
    submit runs in a thread, so the event loop never waits on Redis."""
    if request is not None:
        stream, options = await sync_to_async(_from_request)(request, stream, options)

    def send() -> Task:  # the first queue() of a process may start the embedded server
        return _queue(queue).submit(payload, stream=stream, **options)

    return await asyncio.to_thread(send)


def submit_on_commit(payload: Any, *, request: HttpRequest | None = None,
                     queue: str | None = None, stream: str | None = None,
                     using: str | None = None, robust: bool = False,
                     key: str | None = None, ttl: float | None = None,
                     retries: int | None = None, id: str | None = None,
                     **options: Any) -> Task:
    """Submit ``payload`` when the current transaction of database ``using`` commits
    (``transaction.on_commit``): a worker never sees the task before the rows the
    view wrote are visible to it, and a rollback submits nothing. The stream, tenant,
    priority and deadline come from ``request`` as for :func:`submit`; ``options``:
    ``priority``, ``tenant``, ``cost``, ``deadline`` of :meth:`mtq.Queue.submit` (a
    deadline counts from now, and is checked at the commit: WouldMissDeadline).

    The payload is checked and encoded now (a bad payload or stream name raises here,
    inside the transaction, and nothing is registered), and the task's id is chosen
    now: the returned :class:`~mtq.Task` is a handle a view can answer with
    (``{"id": task.id}``) before the commit; its task exists in Redis only once the
    transaction committed (until then, and forever after a rollback, reading it
    raises TaskNotFound). Outside a transaction (autocommit) it submits at once, as
    ``on_commit`` runs the callback at once.

    At the commit, a QueueFull or BrokerError raises out of the ``atomic()`` block
    (after the commit: the rows are written, the task is not), unless ``robust``,
    which logs it instead and lets the other on-commit callbacks run. Pass ``key``
    (idempotency) to make a retry of the whole request safe. Sync only: in an async
    view, call it inside the ``sync_to_async`` function that holds the transaction."""
    stream, options = _from_request(request, stream, {"ttl": ttl, **options})
    q = _queue(queue)
    # prepare() checks and encodes, and chooses the id (when not given: then mtq knows
    # the id is its own, and a submit retried after a lost reply is not a duplicate)
    prepared = q.prepare([Request(payload, stream=stream, key=key, retries=retries, id=id,
                                  **options)])
    task = q.task(prepared[0].id)

    def send() -> None:
        q.send(prepared)
        log.debug("submitted task %s to %s after the commit", task.id, q.name)

    transaction.on_commit(send, using=using, robust=robust)
    return task


def _queue(name: str | None) -> Queue:
    return queue(name)
