"""The producer side's records: a task id, a submit item with options of its own, a
snapshot of a task's stored state, one step of its trace."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any


def new_task_id() -> str:
    """A random id of 16 URL-safe characters (about 96 bits) that does not start with
    ``-``: on a command line, ``mtq cancel -Mx...`` would read as an option."""
    while True:
        task_id = secrets.token_urlsafe(12)
        if task_id[0] != "-":  # 1 in 64 draws
            return task_id


@dataclass(frozen=True, slots=True)
class TraceEntry:
    """One step of a task's life (:meth:`Task.trace`)."""

    ts: float    # Redis server time, seconds since the epoch
    kind: str    # queued, started, retry, restarted, released, cancel requested, <status>
    detail: str  # delivery and worker, the error, the reason


@dataclass(frozen=True)
class Request:
    """One item for :meth:`Queue.submit_many` with options of its own."""

    payload: Any
    stream: str | None = None
    key: str | None = None
    ttl: float | None = None
    retries: int | None = None
    id: str | None = None
    #: False: never answered from the result cache, nor attached to an identical task
    cache: bool = True
    #: scheduling (docs/scheduling.md): ``interactive``, ``standard`` or ``batch``; the
    #: tenant whose fair share it counts against; its cost (tokens, say)
    priority: str | None = None
    tenant: str | None = None
    cost: float | None = None
    #: seconds from now, or an aware datetime, by which it must start (see
    #: Queue.submit): refused at once if the work ahead would make it late
    deadline: Any = None
    #: seconds a run may take once started (see Queue.submit): past it, TaskTimeout
    timeout: float | None = None
    #: seconds to wait, or an aware datetime, before it is queued (see Queue.submit);
    #: either replaces both of submit_many's defaults
    delay: float | None = None
    at: Any = None
    #: the steps of a chain that follow it (see Queue.submit's ``then``)
    then: Any = None


@dataclass(frozen=True)
class TaskInfo:
    """A snapshot of a task's stored state. Times are Redis server ms since the epoch."""

    id: str
    status: str
    stream: str | None
    attempts: int
    deliveries: int
    created: int | None
    started: int | None
    finished: int | None
    deadline: int | None
    worker: str | None
    error: str | None
    cancel_requested: bool
    #: the traceback of the last exception the task's handler raised (bounded)
    traceback: str | None = None
    #: while it waits for its submit's delay: when it is due (None once queued)
    due: int | None = None
    #: its run timeout in seconds when its submit gave one (None: the queue's
    #: ``task_timeout_s`` applies)
    timeout: float | None = None
