"""What operators read: the queues, one cheap snapshot of everything, a task found
by id alone. The CLI (``mtq status``, ``mtq task``) and the dashboard are thin
layers over these calls.

A :func:`snapshot` costs two round trips (the queue names, then one pipeline,
which reads the model records and the scheduling counts per tenant too) plus the worker registry's two, whatever the number of tasks or streams: per
queue it reads O(1) counters, the last 1000 latencies and the last 10 failures
(both capped lists the scripts keep), and the two scheduling hashes (one field set per
lane, tenant and band, that ever had work: :mod:`mtq.broker.tenants`); no KEYS, no SCAN.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from mtq.broker.cluster import shared
from mtq.broker.connection import redis_errors
from mtq.broker.keys import QUEUES
from mtq.broker.protocol import Broker
from mtq.broker.tenants import TenantRow, parse_rows, read_into
from mtq.client.queue import Queue
from mtq.client.task import Task
from mtq.errors import TaskNotFound
from mtq.settings import QueueSettings
from mtq.validation import check_queue_name, check_task_id


def queue_names(client: redis.Redis) -> list[str]:
    """Every queue that was ever submitted to (sorted)."""
    with redis_errors("while listing queues"):
        raw = shared(client).smembers(QUEUES)
    return sorted(v.decode() if isinstance(v, bytes) else str(v) for v in raw)


def _pct(values: list[int], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return float(values[0])
    return float(statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1])


@dataclass
class QueueView:
    """One queue in a :class:`Snapshot`."""

    name: str
    waiting: int = 0
    streams: int = 0           # streams with waiting work
    running: int = 0
    delayed: int = 0
    dead: int = 0
    submitted: int = 0
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0
    expired: int = 0
    retried: int = 0
    redelivered: int = 0
    #: submit-to-finish of the last (up to 1000) finished tasks
    p50_ms: float | None = None
    p99_ms: float | None = None
    #: the last failures: {id, status, ts (ms), error}, newest first
    failures: list[dict[str, Any]] = field(default_factory=list)
    dead_total: int = 0
    workers: int = 0
    #: scheduling per tenant and band (:func:`tenants`; [] without scheduling)
    tenants: list[TenantRow] = field(default_factory=list)


@dataclass
class Snapshot:
    """Queues and workers at one instant (``ts``: this host's time.time())."""

    ts: float
    queues: list[QueueView]
    workers: list[dict[str, Any]]
    #: one row per (queue, model, version) served (:func:`mtq.broker.catalogue.served`)
    models: list[dict[str, Any]] = field(default_factory=list)

    def queue(self, name: str) -> QueueView | None:
        return next((q for q in self.queues if q.name == name), None)


def snapshot(client: redis.Redis, queues: list[str] | None = None) -> Snapshot:
    """Read every queue's counters, recent latencies and failures, and the live
    workers, in four round trips (see the module docstring)."""
    from mtq.broker import catalogue
    from mtq.broker.registry import list_workers

    names = queue_names(client) if queues is None else [check_queue_name(q) for q in queues]
    settings = QueueSettings()
    brokers = [Broker(client, n, settings) for n in names]
    with redis_errors("while reading the queues"):
        # on a cluster, one pipeline per node, sent together (redis-py's cluster pipeline)
        pipe = shared(client).pipeline(transaction=False)
        sizes = [b.snapshot_into(pipe) + read_into(pipe, b.keys) for b in brokers]
        for b in brokers:  # the model records, in the same round trip
            pipe.hgetall(b.keys.model)
        replies = pipe.execute() if brokers else []
    records = catalogue.decode_records(names, replies[sum(sizes):])
    views = []
    k = 0
    for b, size in zip(brokers, sizes):
        raw = Broker.parse_snapshot(replies[k:k + size - 2])
        lat = raw.pop("latency_ms")
        v = QueueView(name=b.queue, failures=raw.pop("failures"),
                      p50_ms=_pct(lat, 50), p99_ms=_pct(lat, 99),
                      tenants=parse_rows(*replies[k + size - 2:k + size]))
        k += size
        for key, value in raw.items():
            if hasattr(v, key):
                setattr(v, key, value)
        views.append(v)
    workers = list_workers(client)
    for v in views:
        v.workers = sum(1 for w in workers if w.get("queue") == v.name)
    return Snapshot(time.time(), views, workers, catalogue.served(workers, records))


def tenants(client_or_queue: redis.Redis | Queue, queue: str | None = None
            ) -> list[TenantRow]:
    """Scheduling per tenant and band of ``queue`` (or of the :class:`Queue` given):
    one row per lane that ever had work, sorted by tenant then band; [] for a queue
    without scheduling. One round trip of two HGETALLs, whose size grows with the
    number of lanes, not of tasks. Top N and "other": :func:`mtq.broker.tenants.top_rows`."""
    if isinstance(client_or_queue, Queue):
        client, name = client_or_queue.redis, client_or_queue.name
    elif queue is None:
        raise TypeError("tenants(client, queue): name the queue")
    else:
        client, name = client_or_queue, check_queue_name(queue)
    with redis_errors("while reading the tenants"):
        pipe = shared(client).pipeline(transaction=False)
        read_into(pipe, Broker(client, name, QueueSettings()).keys)
        count, served = pipe.execute()
    return parse_rows(count, served)


def find_task(client: redis.Redis, task_id: str, queue: str | None = None) -> Task:
    """The task with this id, in ``queue`` or else in whichever known queue holds
    it (one round trip over the queues). Raises TaskNotFound."""
    task_id = check_task_id(task_id)
    names = [check_queue_name(queue)] if queue else queue_names(client)
    with redis_errors("while looking for the task"):
        pipe = shared(client).pipeline(transaction=False)
        for n in names:
            pipe.exists(Broker(client, n, QueueSettings()).keys.task(task_id))
        found = [n for n, hit in zip(names, pipe.execute() if names else []) if hit]
    if not found:
        where = f"queue {queue!r}" if queue else f"any of the {len(names)} known queue(s)"
        raise TaskNotFound(f"no task {task_id!r} in {where}; finished tasks are kept for "
                           "their retention (1 h by default), then deleted")
    return Queue(found[0], client=client).task(task_id)
