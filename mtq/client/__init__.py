"""The producer side: what a web app or a script imports to submit tasks and wait
for them.

:mod:`~mtq.client.queue` (:class:`Queue`), :mod:`~mtq.client.submit` (the chunked,
retried, de-duplicated submit protocol), :mod:`~mtq.client.task` (:class:`Task`),
:mod:`~mtq.client.waiting` (one sans-IO waiter for ``result``, ``events`` and
``tokens``, sync and async), :mod:`~mtq.client.group` (:class:`Group`),
:mod:`~mtq.client.admin` (what operators read), :mod:`~mtq.client.records` and
:mod:`~mtq.client.replies` (one reply subscription per process).
"""

from mtq.client.group import Group
from mtq.client.queue import PURGE_CHUNK, Queue
from mtq.client.records import Request, TaskInfo, TraceEntry, new_task_id
from mtq.client.replies.events import Event
from mtq.client.submit import (
    MAX_TTL_S,
    SUBMIT_CHUNK,
    SUBMIT_RETRY_HA_S,
    SUBMIT_RETRY_S,
    cache_digest,
)
from mtq.client.task import Task
from mtq.client.waiting import READ_RETRY_S

__all__ = [
    "MAX_TTL_S",
    "PURGE_CHUNK",
    "READ_RETRY_S",
    "SUBMIT_CHUNK",
    "SUBMIT_RETRY_HA_S",
    "SUBMIT_RETRY_S",
    "Event",
    "Group",
    "Queue",
    "Request",
    "Task",
    "TaskInfo",
    "TraceEntry",
    "cache_digest",
    "new_task_id",
]
