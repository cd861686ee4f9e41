"""A worker's record of the batches it ran: what ``mtq trace`` reads, and the
OpenTelemetry spans of traced tasks.

The model thread notes each batch (a :class:`~mtq.workers.generator.Generator`:
each admission group, the requests prefilled together) in memory; the heartbeat
thread writes what gathered since its last beat to the queue's batch list
(``mtq:{q}:batches``, newest first) in the same round trip as its registry report:
no Redis command per task or per batch. A beat that fails keeps the records for the
next one (at most :data:`BUFFER_MAX`, the oldest dropped first). A process killed
with SIGKILL loses the records of its last beat interval (up to a second).

The list is bounded by the queue's settings (:class:`~mtq.settings.QueueSettings`,
docs/operations.md "Diagnostics kept in Redis"): a beat that writes records trims the
list (LTRIM) to the fewest of ``batch_log_max`` records and of the records that fit
in ``batch_log_bytes`` at this writer's mean record size (with Redis's cost of a list
element: :func:`entry_bytes`), and sets the list's, the latency list's and the
failures list's expiry to ``diagnostics_ttl_s`` (PEXPIRE): an idle queue's diagnostics
go once no worker wrote for that long. A few commands (the push, the trim, the
expiries) in one round trip a beat that ran batches; none a task.

A record is a msgpack array ``[worker id, start ms, duration ms, [task ids]]`` (wall
clock), followed by its kind when it is not ``batch`` (``prefill``, ``load``), and by
host and pid when the worker id does not start with them (ids are ``host:pid:random``
by default). :func:`mtq.observe.perfetto.parse_record` reads it (and the JSON records
of older workers).

Tasks that carry a traceparent (see :mod:`mtq.tracing`) are also remembered
from the start of their batch to their outcome; the heartbeat thread turns them
into spans, off the model thread.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import msgpack

from mtq.broker.connection import redis_errors
from mtq.broker.consumer import Outcome
from mtq.broker.keys import QueueKeys
from mtq.broker.protocol import Claimed
from mtq.observe import otel as tracing
from mtq.settings import LATENCY_MAX, QueueSettings

#: what a record is of: a batch, or a generator's prefill of the requests it admitted
#: together
Kind = Literal["batch", "prefill", "load"]

#: records (and finished traced tasks) a process keeps while Redis cannot be reached
BUFFER_MAX = 10_000


def entry_bytes(size: float) -> float:
    """What a list element of ``size`` bytes costs Redis, counted against
    ``batch_log_bytes``: the element, its listpack entry's header and back-length, its
    share of the list's nodes and of their unfilled ends; a few bytes and a fiftieth
    (MEMORY USAGE of lists of 30 to 5,000-byte elements: 2 to 49 bytes more per
    element than the elements' sum)."""
    return size * 1.02 + 8


class BatchLog:
    """Batch records and traced tasks of one worker process (thread-safe)."""

    def __init__(self, key: str, worker_id: str, queue: str) -> None:
        self.key = key
        self.queue = queue
        self.keys = QueueKeys(queue)
        self.worker_id = worker_id
        host, pid = socket.gethostname(), os.getpid()
        #: host and pid, written in each record when the id does not tell them
        self._where: tuple[str, int] | None = None if \
            worker_id.startswith(f"{host}:{pid}:") else (host, pid)
        #: the queue's settings the bounds come from (the heartbeat keeps them current)
        self.settings = QueueSettings()
        #: mean bytes of a record (:func:`entry_bytes`) this process wrote; 0: none yet
        self.mean_bytes = 0.0
        #: one packer, reused (heartbeat thread: :meth:`write`; a Packer per record cost
        #: as much as the rest of a beat with batches of one task)
        self._pack = msgpack.Packer(use_bin_type=True).pack
        #: held by :meth:`write` (the heartbeat's, or a stop's flush if the heartbeat
        #: thread did not end in time): one packer, one _inflight
        self._writing = threading.Lock()
        self._lock = threading.Lock()
        #: (kind, start, end, task ids) of the batches not written yet (see end)
        self._pending: list[tuple[Kind, float, float, list[str]]] = []
        #: encoded records of a write whose pipeline has not run yet (or failed)
        self._inflight: list[bytes] = []
        self._t0 = 0.0
        self._tasks: Sequence[Claimed] = ()
        #: traced tasks running: id -> (task, start, batch size)
        self.open: dict[str, tuple[Claimed, float, int]] = {}
        self._spans: list[tracing.TaskSpan] = []

    # -- model thread -------------------------------------------------------------
    def start(self, tasks: Sequence[Claimed]) -> None:
        """A batch (or an admission group) starts now."""
        self._t0 = time.time()
        self._tasks = tasks
        traced = [t for t in tasks if t.traceparent]
        if traced:
            with self._lock:
                for t in traced:
                    self.open[t.id] = (t, self._t0, len(tasks))
                while len(self.open) > BUFFER_MAX:  # outcomes never seen (handed off, lost)
                    self.open.pop(next(iter(self.open)))

    def end(self, kind: Kind = "batch") -> None:
        """The batch begun by :meth:`start` ended (its predict or prefill returned). The
        record is kept as it is and encoded by the heartbeat thread (:meth:`write`): no
        JSON on the model thread."""
        if not self._tasks:
            return
        record = (kind, self._t0, time.time(), [t.id for t in self._tasks])
        self._tasks = ()
        with self._lock:
            self._pending.append(record)
            if len(self._pending) > BUFFER_MAX:
                del self._pending[:len(self._pending) - BUFFER_MAX]

    def record(self, kind: Kind, t0: float, t1: float, tasks: Sequence[Claimed]) -> None:
        """A record of ``kind`` for ``tasks`` from ``t0`` to ``t1`` (unix s) that is not
        a batch: the load an unloaded engine did for the tasks it took ("load")."""
        with self._lock:
            self._pending.append((kind, t0, t1, [t.id for t in tasks]))

    def _encode(self, record: tuple[Kind, float, float, list[str]]) -> bytes:
        """The record's msgpack (see the module's docstring)."""
        kind, t0, t1, ids = record
        start = int(t0 * 1000)
        fields: list[Any] = [self.worker_id, start, max(0, int(t1 * 1000) - start), ids]
        if kind != "batch" or self._where:
            fields.append(kind)
        if self._where:
            fields.extend(self._where)
        return self._pack(fields)

    def keep(self) -> int:
        """How many records the list keeps: the fewest of ``batch_log_max`` and of the
        records that fit in ``batch_log_bytes`` at :attr:`mean_bytes`."""
        s = self.settings
        if self.mean_bytes <= 0:
            return s.batch_log_max
        return min(s.batch_log_max, int(s.batch_log_bytes // self.mean_bytes))

    def ended(self, items: Iterable[Any]) -> None:
        """Outcomes left the model thread: close the traced tasks among them. Call it
        only when :attr:`open` is non-empty (the common case costs nothing)."""
        now = time.time()
        with self._lock:
            for o in items:
                if not isinstance(o, Outcome):
                    continue
                entry = self.open.pop(o.task.id, None)
                if entry is None:
                    continue
                t, started, size = entry
                status = "succeeded" if o.ok else "cancelled" if o.cancelled else \
                    "released" if o.released else "failed"
                self._spans.append(tracing.TaskSpan(
                    t.traceparent, self.queue, t.id, t.deliveries, size,
                    t.claimed_at - t.age_ms / 1000, t.claimed_at or started, started, now,
                    status))
            if len(self._spans) > BUFFER_MAX:
                del self._spans[:len(self._spans) - BUFFER_MAX]

    # -- heartbeat thread ---------------------------------------------------------
    def write(self, pipe: Any) -> None:
        """Queue the records gathered since the last beat on ``pipe`` (and those of a
        beat that failed); :meth:`written` once the pipeline ran."""
        with self._writing:
            self._write(pipe)

    def _write(self, pipe: Any) -> None:
        with self._lock:
            fresh, self._pending = self._pending, []
        # only what the list keeps is encoded: the newest records (the rest would be
        # trimmed at once; with batches of one task a beat gathers thousands)
        fresh = fresh[-min(BUFFER_MAX, max(1, self.keep())):]
        records = (self._inflight + [self._encode(r) for r in fresh])[-BUFFER_MAX:]
        self._inflight = records
        if not records:
            return
        size = entry_bytes(sum(map(len, records)) / len(records))
        # the mean over this process's records, weighted towards the recent ones
        self.mean_bytes = size if self.mean_bytes <= 0 else \
            0.8 * self.mean_bytes + 0.2 * size
        keep = self.keep()
        if keep > 0:
            pipe.lpush(self.key, *records[-keep:])
            pipe.ltrim(self.key, 0, keep - 1)
        else:
            pipe.delete(self.key)
        self.expire(pipe)

    def expire(self, pipe: Any) -> None:
        """Queue the expiry of the queue's batch list, latency list and failures list
        (``diagnostics_ttl_s``, from now) on ``pipe``, and the latency list's trim to
        ``latency_keep`` when it is below what the scripts keep."""
        s, k = self.settings, self.keys
        ttl_ms = s.diagnostics_ttl_s * 1000
        pipe.pexpire(self.key, ttl_ms)
        pipe.pexpire(k.latency, ttl_ms)
        pipe.pexpire(k.failures, ttl_ms)
        if s.latency_keep < LATENCY_MAX:
            pipe.ltrim(k.latency, 0, s.latency_keep - 1)

    def written(self) -> None:
        """The pipeline of the last :meth:`write` ran: its records are in Redis."""
        self._inflight = []

    def flush(self, client: Any) -> None:
        """Write what is buffered now (one round trip) and make the pending spans:
        a worker's last act as it stops. Raises BrokerError."""
        self.spans()
        with redis_errors("while writing the batch records"):
            pipe = client.pipeline(transaction=False)
            self.write(pipe)
            pipe.execute()
        self.written()

    def spans(self) -> None:
        """Make the OpenTelemetry spans of the traced tasks that finished."""
        if not self._spans:
            return
        with self._lock:
            spans, self._spans = self._spans, []
        tracing.emit(spans)
