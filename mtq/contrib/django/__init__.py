"""Django: an installable app (``INSTALLED_APPS = [..., "mtq.contrib.django"]``).

* Settings: ``MTQ = {"REDIS_URL": ..., "QUEUE": ..., "WORKERS": "pkg.mod:Model", ...}``
  (:mod:`mtq.contrib.django.conf`, every key optional, unknown keys refused).
* :func:`queue`, :func:`submit`, :func:`asubmit`: the project's queues, and submitting
  from a view into the requesting user's own stream (FIFO per user,
  :func:`user_stream`), as the user's tenant (:func:`user_tenant`), at the request's
  priority (:func:`request_priority`: ``interactive`` unless ``X-Mtq-Priority`` says
  otherwise), sync or async.
* :func:`submit_on_commit`: submit when the database transaction commits (a task never
  runs before the row it needs is visible; a rollback submits nothing).
* :func:`event_stream` (sync views, WSGI) and :func:`aevent_stream` (async views,
  ASGI): a task's tokens as server-sent events, resuming from ``Last-Event-ID``,
  cancelling the task when the client goes away if asked.
* ``MtqErrorMiddleware`` (:mod:`mtq.contrib.django.middleware`) and
  :func:`error_response`: mtq's errors as JSON (a full queue: 503 + Retry-After; a
  tenant over its rate limit: 429 + Retry-After).
* ``manage.py mtq_status`` / ``manage.py mtq_workers``: ``mtq status`` and ``mtq
  workers start`` with the project's settings as defaults.
* System checks: ``mtq.E001`` Redis unreachable, ``mtq.E002`` worker target missing,
  ``mtq.E003`` bad ``MTQ`` setting, ``mtq.W001`` (``--deploy``) no Redis URL.

Nothing here imports torch. docs/web.md, "Django in ten lines", shows it whole.
"""

from __future__ import annotations

from mtq.contrib.django.conf import MtqSettings, MtqSettingsError, get_settings
from mtq.contrib.django.queues import (
    asubmit,
    priority_of,
    queue,
    request_priority,
    stream_of,
    submit,
    submit_on_commit,
    tenant_of,
    user_stream,
    user_tenant,
)
from mtq.contrib.django.responses import (
    aevent_stream,
    error_response,
    event_stream,
    json_response,
)

__all__ = [
    "MtqSettings",
    "MtqSettingsError",
    "aevent_stream",
    "asubmit",
    "error_response",
    "event_stream",
    "get_settings",
    "json_response",
    "priority_of",
    "queue",
    "request_priority",
    "stream_of",
    "submit",
    "submit_on_commit",
    "tenant_of",
    "user_stream",
    "user_tenant",
]
