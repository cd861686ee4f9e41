"""A worker's record of the batches it ran: what ``mtq trace`` reads, and the
OpenTelemetry spans of traced tasks.

The model thread notes each batch (a :class:`~mtq.workers.generator.Generator`:
each admission group, the requests prefilled together) in memory; the heartbeat
thread writes what gathered since its last beat to the queue's batch list
(``mtq:{q}:batches``, newest first, LPUSH then LTRIM to :data:`BATCHES_KEEP`) in
the same round trip as its registry report: no Redis command per task or per
batch. A beat that fails keeps the records for the next one (at most
:data:`BUFFER_MAX`, the oldest dropped first). A process killed with SIGKILL loses
the records of its last beat interval (up to a second).

A record is compact JSON: ``{"w": worker id, "h": host, "p": pid, "k": "batch" or
"prefill", "t0": start ms, "t1": end ms (wall clock), "ids": [task ids]}``.

Tasks that carry a traceparent (see :mod:`mtq.tracing`) are also remembered
from the start of their batch to their outcome; the heartbeat thread turns them
into spans, off the model thread.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from mtq.broker.connection import redis_errors
from mtq.broker.consumer import Outcome
from mtq.broker.protocol import Claimed
from mtq.observe import otel as tracing

#: compact JSON (one encoder, not one made per json.dumps call with separators)
_compact = json.JSONEncoder(separators=(",", ":")).encode

#: what a record is of: a batch, or a generator's prefill of the requests it admitted
#: together
Kind = Literal["batch", "prefill", "load"]

#: records kept in the queue's batch list (the newest)
BATCHES_KEEP = 10_000
#: records (and finished traced tasks) a process keeps while Redis cannot be reached
BUFFER_MAX = 10_000


class BatchLog:
    """Batch records and traced tasks of one worker process (thread-safe)."""

    def __init__(self, key: str, worker_id: str, queue: str) -> None:
        self.key = key
        self.queue = queue
        #: every record's opening, encoded once: ``{"w":...,"h":...,"p":...,"k":"``
        self._head = _compact({"w": worker_id, "h": socket.gethostname(),
                               "p": os.getpid()})[:-1] + ',"k":"'
        self._lock = threading.Lock()
        #: (kind, start, end, task ids) of the batches not written yet (see end)
        self._pending: list[tuple[Kind, float, float, list[str]]] = []
        #: encoded records of a write whose pipeline has not run yet (or failed)
        self._inflight: list[str] = []
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

    def _encode(self, record: tuple[Kind, float, float, list[str]]) -> str:
        """The record's JSON: the same text as encoding the whole dict, with less work
        (with batches of one task, a beat encodes a record per task: thousands).
        The head is encoded once, and ``kind`` is one of :data:`Kind` (no escaping)."""
        kind, t0, t1, ids = record
        return f'{self._head}{kind}","t0":{int(t0 * 1000)},"t1":{int(t1 * 1000)},' \
               f'"ids":{_compact(ids)}}}'

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
        with self._lock:
            fresh, self._pending = self._pending, []
        records = (self._inflight + [self._encode(r) for r in fresh])[-BUFFER_MAX:]
        self._inflight = records
        if records:
            pipe.lpush(self.key, *records)
            pipe.ltrim(self.key, 0, BATCHES_KEEP - 1)

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
