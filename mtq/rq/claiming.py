"""How a :class:`mtq.rq.worker.BatchWorker` takes its next batch: how many jobs to
claim, from which queues (RQ's dequeue strategies), waiting for work when every queue
is empty, reading the claimed jobs, filling a batched function's group for up to its
max_wait_ms, and isolating the jobs suspected of having killed a worker.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rq.job import Job
from rq.queue import Queue
from rq.serializers import JSONSerializer
from rq.utils import now
from rq.worker import DequeueStrategy, WorkerStatus

from mtq.rq import leases
from mtq.rq.claims import Claims, Prepared
from mtq.rq.jobs import Outcome, Resolver, load_job
from mtq.rq.waiting import Waiters

if TYPE_CHECKING:
    from rq.worker import SimpleWorker as _Base
else:
    _Base = object


class Claiming(_Base):
    """The claiming half of BatchWorker (a mixin: it uses the worker's connection,
    name, queues and the claims it holds)."""

    scripts: leases.Scripts
    claims: Claims
    resolver: Resolver
    accept_pickle: bool
    lease_ms: int
    max_claim: int
    target_batch_ms: float
    _dequeue_strategy: DequeueStrategy
    #: seconds a job takes (a moving average); None: no job timed yet
    _avg_job_s: float | None
    #: True while the loop waits for work (the stop signal then ends it at once)
    _idle: bool
    _waiters: Waiters | None

    def _claim_size(self, limit: int | None = None) -> int:
        """How many jobs to claim: about ``target_batch_ms`` of them once a job was
        timed, one before; never more than ``limit`` (what max_jobs leaves)."""
        if self._avg_job_s is None:
            n = 1
        else:
            n = int(self.target_batch_ms / 1000 / max(self._avg_job_s, 1e-6))
        n = max(1, min(self.max_claim, n))
        return n if limit is None else max(0, min(n, limit))

    def _claim_from(self, want: int) -> list[tuple[str, str, Queue]]:
        got: list[tuple[str, str, Queue]] = []
        if self._dequeue_strategy == DequeueStrategy.ROUND_ROBIN:
            # one job from each queue in turn, as RQ's worker takes them
            while len(got) < want:
                before = len(got)
                for q in list(self._ordered_queues):
                    if len(got) >= want:
                        break
                    for job_id, owner in leases.claim(self.scripts, q.name, self.name, 1,
                                                      self.lease_ms):
                        got.append((job_id, owner, q))
                        self.reorder_queues(reference_queue=q)
                if len(got) == before:
                    break
        else:
            if self._dequeue_strategy == DequeueStrategy.RANDOM:
                self.reorder_queues(reference_queue=self._ordered_queues[0])  # shuffles
            for q in self._ordered_queues:
                if len(got) >= want:
                    break
                for job_id, owner in leases.claim(self.scripts, q.name, self.name,
                                                  want - len(got), self.lease_ms):
                    got.append((job_id, owner, q))
        if got:
            claims = self.claims
            with claims.lock:
                for job_id, owner, q in got:
                    claims.held[job_id] = (q.name, owner)
                if not claims.running:
                    claims.vouch(time.monotonic(), self.lease_ms)
        return got

    def _wait_for_work(self, timeout: float) -> None:
        """Block until a queue has a job (or ``timeout`` s), through the worker's
        long-lived waiter threads (one per queue, see :mod:`mtq.rq.waiting`)."""
        if self._waiters is None:
            self._waiters = Waiters(self.connection.connection_pool,
                                    [q.key for q in self._ordered_queues], name=self.name)
        self._waiters.wait(max(0.001, timeout))

    def _claim(self, block: bool, limit: int | None = None,
               wait: float | None = None) -> list[Prepared]:
        """A batch of at most ``limit`` jobs; when there is none and ``block``, wait
        for one (at most ``wait`` s, and a third of the worker TTL) and try again."""
        want = self._claim_size(limit)
        if want <= 0:
            return []
        got = self._claim_from(want)
        if not got:
            if not block:
                return []
            self.set_state(WorkerStatus.IDLE)
            self._idle = True
            try:
                if not self._stop_requested:
                    timeout = max(1, self.worker_ttl // 3)
                    self._wait_for_work(timeout if wait is None else min(timeout, wait))
            finally:
                self._idle = False
            got = self._claim_from(want)
            if not got:
                return []
        batch = self._load(got)
        self._fill(batch, limit)
        return batch

    def _load(self, got: Sequence[tuple[str, str, Queue]]) -> list[Prepared]:
        with self.connection.pipeline(transaction=False) as pipe:
            for job_id, _, _ in got:
                pipe.hgetall(leases.job_key(job_id))
            for job_id, _, q in got:
                pipe.hget(leases.deliveries_key(q.name), job_id)
            replies = pipe.execute()
        raws, counts = replies[:len(got)], replies[len(got):]
        out: list[Prepared] = []
        gone: list[tuple[str, str, str]] = []
        for (job_id, owner, q), raw, count in zip(got, raws, counts):
            if not raw:  # deleted since it was queued: RQ's dequeue skips it too
                gone.append((q.name, job_id, owner))
                continue
            try:
                job, refused = load_job(job_id, raw, self.connection, self.accept_pickle)
            except Exception as exc:
                job = Job(job_id, connection=self.connection, serializer=JSONSerializer)
                job.restore({k: v for k, v in raw.items() if k != b"meta"})
                refused = f"job {job_id} cannot be read: {type(exc).__name__}: {exc}"
            p = Prepared(job, owner, q, *leases.parse_deliveries(count))
            if refused:
                p.outcome = Outcome("fail", exc_string=refused, ended_at=now())
            out.append(p)
        for qname, job_id, owner in gone:
            leases.give_back(self.scripts, qname, [(job_id, owner)])
            with self.claims.lock:
                self.claims.held.pop(job_id, None)
        return out

    def _fill(self, batch: list[Prepared], limit: int | None = None) -> None:
        """If the batch holds jobs of a batched function with room left, claim more for
        up to its max_wait_ms (mtq's dynamic batching), then stop; ``limit``: at most
        that many jobs in all."""
        from mtq.rq.batched import batched_spec
        from mtq.rq.jobs import is_model_class

        size, wait_ms = 0, 0.0
        for p in batch:
            if p.outcome is not None:
                continue
            try:
                f = self.resolver.func(p.job)
            except Exception:
                continue
            spec = batched_spec(f)
            if spec is not None:
                size, wait_ms = max(size, spec.max_batch_size), max(wait_ms, spec.max_wait_ms)
            elif is_model_class(f):
                size = max(size, int(getattr(f, "max_batch_size", 32)))
                wait_ms = max(wait_ms, float(getattr(f, "max_wait_ms", 5.0)))
        if limit is not None:
            size = min(size, limit)
        if not size:
            return
        deadline = time.monotonic() + wait_ms / 1000
        while len(batch) < size:
            more = self._claim_from(size - len(batch))
            if more:
                batch.extend(self._load(more))
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._wait_for_work(left)

    @staticmethod
    def _isolate_suspects(batch: list[Prepared]) -> list[list[Prepared]]:
        """Split the batch so that the jobs that were running when a worker died
        (suspects: one may kill this worker too) run, and are committed, in parts of
        at most their cap (half their fatal call: a poison job in a batched call is
        isolated by bisection, a plain one runs alone); the others keep their batch.
        Queue order is kept."""
        if not any(p.deliveries for p in batch):
            return [batch]
        parts: list[list[Prepared]] = [[]]
        suspect = False
        for p in batch:
            cur = parts[-1]
            if p.deliveries:
                cap = min([p.cap, *(x.cap for x in cur)]) if suspect else p.cap
                if not suspect or len(cur) >= max(1, cap):
                    parts.append([])
                suspect = True
            elif suspect:
                parts.append([])
                suspect = False
            parts[-1].append(p)
        return [part for part in parts if part]
