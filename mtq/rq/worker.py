"""``BatchWorker``: an RQ worker (rq.worker.SimpleWorker subclass, so ``rq info`` and
rq-dashboard list it) whose work loop claims jobs in batches.

One round of the loop:

1. claim up to N job ids from the head of the queues, in the worker's queue order,
   with one atomic script per queue (pop + lease; see :mod:`mtq.rq.leases`); when
   every queue is empty, wait on the worker's waiter threads (one per queue, blocking
   on ``BLMOVE q q LEFT LEFT`` only while the loop is idle; :mod:`mtq.rq.waiting`);
2. read the jobs' hashes (one pipelined round trip) and RQ's start bookkeeping for
   the whole batch in one pipeline (Execution, StartedJobRegistry, status started);
3. run the jobs: plain functions one job per call, batched functions and mtq.Model
   classes one call per group (waiting up to max_wait_ms for the group to fill);
4. finish the batch in one MULTI/EXEC under WATCH of the jobs' hashes, and only for
   the jobs whose lease still holds this worker's token (fencing: a worker resumed
   after a freeze, whose jobs were given back, drops its results); RQ's own
   success / failure / retry bookkeeping goes into that transaction
   (:mod:`mtq.rq.finishing`). The commit runs on a thread of its own
   (:mod:`mtq.rq.committer`) while the loop goes on with the next batch.

A heartbeat thread extends the leases of the jobs held, RQ's worker and execution
heartbeats, and gives back jobs whose lease expired (a frozen or killed worker).
N adapts: as many jobs as take about ``target_batch_ms`` to run (at least 1), so
slow jobs are claimed one at a time and spread over the workers, fast ones in
batches (fewer Redis round trips per job). Until it has timed a job, a worker claims
one: it cannot know yet whether the jobs behind the first are slow, and another
worker may be idle. ``max_jobs`` is exact: a claim takes no more than are left.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Sequence
from typing import Any

import redis
from rq.defaults import DEFAULT_LOGGING_DATE_FORMAT, DEFAULT_LOGGING_FORMAT
from rq.exceptions import StopRequested
from rq.executions import Execution
from rq.job import Job, JobStatus, Retry
from rq.queue import Queue
from rq.serializers import JSONSerializer
from rq.timeouts import JobTimeoutException, UnixSignalDeathPenalty
from rq.utils import now
from rq.worker import DequeueStrategy, SimpleWorker, WorkerStatus

from mtq.rq import leases
from mtq.rq.committer import Committer
from mtq.rq.faults import ChildLink
from mtq.rq.finishing import Finishing, Prepared
from mtq.rq.jobs import (
    Outcome,
    Resolver,
    Unit,
    call_plain,
    check_storable,
    format_exc,
    load_job,
    memoize_serializer_resolution,
    plan,
)
from mtq.rq.waiting import Waiters

log = logging.getLogger(__name__)

#: lease of a claimed job; extended every LEASE_MS / 3 while it is held. Far shorter
#: than the expiry of RQ's StartedJobRegistry entries (job_monitoring_interval + 60 s),
#: so a frozen worker's jobs are given back by mtq before RQ's own cleanup would
#: call them abandoned.
LEASE_MS = 15_000
MAX_CLAIM = 256


class _Interrupted(Exception):
    """Raised by the stop signal's handler while the worker waits for work (idle)."""


class BatchWorker(Finishing, SimpleWorker):
    """Serves RQ queues in batches (see the module docstring). Takes SimpleWorker's
    arguments plus ``accept_pickle``, ``lease_ms``, ``device``, ``target_batch_ms``, and
    ``link`` (a :class:`mtq.rq.faults.ChildLink` to the supervisor, or None)."""

    def __init__(self, queues: Any, name: str | None = None, *args: Any,
                 accept_pickle: bool = False, lease_ms: int = LEASE_MS, device: str = "cpu",
                 target_batch_ms: float = 20.0, max_claim: int = MAX_CLAIM,
                 link: ChildLink | None = None, **kwargs: Any) -> None:
        # RQ's positional arguments too (Worker.find_by_key, Worker.all build workers so)
        if kwargs.get("serializer") is None:
            kwargs["serializer"] = JSONSerializer
        memoize_serializer_resolution()
        super().__init__(queues, name, *args, **kwargs)
        self.accept_pickle = accept_pickle
        self.lease_ms = int(lease_ms)
        self.resolver = Resolver(device)
        self.target_batch_ms = target_batch_ms
        self.max_claim = max_claim
        self.link = link
        self._order: dict[str, int] = {}  # job id -> its place in the batch's call order
        self.scripts = leases.Scripts(self.connection)
        self._held: dict[str, tuple[str, str]] = {}  # id -> (queue, owner)
        self._running: dict[str, Prepared] = {}
        self._lost: set[str] = set()
        self._lock = threading.Lock()
        self._valid_until = 0.0  # monotonic: the leases held are live until then
        self._avg_job_s: float | None = None  # seconds a job takes; None: none timed yet
        self._beat_stop = threading.Event()
        self._signals = 0
        self._idle = False
        self._waiters: Waiters | None = None
        self._committer: Committer[list[Prepared]] | None = None
        self.jobs_done = 0
        self.batch_sizes: list[int] = []

    # -- the loop ----------------------------------------------------------------
    def work(self, burst: bool = False, logging_level: str | None = "INFO",
             date_format: str = DEFAULT_LOGGING_DATE_FORMAT,
             log_format: str = DEFAULT_LOGGING_FORMAT, max_jobs: int | None = None,
             max_idle_time: int | None = None, with_scheduler: bool = False,
             dequeue_strategy: DequeueStrategy = DequeueStrategy.DEFAULT) -> bool:
        """Serve until stopped (SIGTERM/SIGINT: finish the running batch, give back the
        rest), or, with ``burst``, until the queues are empty, or after ``max_jobs`` jobs,
        or once idle for ``max_idle_time`` s. ``dequeue_strategy``: ``default`` (the
        queues in order), ``round_robin`` (one job from each in turn) or ``random``, as
        RQ's worker. Returns whether any job ran."""
        if dequeue_strategy not in ("default", "random", "round_robin"):
            raise ValueError(f"dequeue strategy {dequeue_strategy!r} is not allowed: use "
                             "default, random or round_robin")
        self._dequeue_strategy = DequeueStrategy(dequeue_strategy)
        self._beat_stop.clear()  # work() may be called again on the same worker (RQ's may)
        self.bootstrap(logging_level, date_format, log_format)
        if with_scheduler:
            self._start_scheduler(burst, logging_level)
        self._install_signal_handlers()
        beat = threading.Thread(target=self._beat_loop, name="mtq-rq-heartbeat", daemon=True)
        beat.start()
        self._committer = Committer(self._finish)
        done = 0
        idle_since = time.monotonic()
        try:
            while not self._stop_requested:
                try:
                    self.check_for_suspension(burst)
                except StopRequested:  # `rq suspend` in burst mode: exit, as RQ's worker does
                    break
                if self.should_run_maintenance_tasks:
                    self.run_maintenance_tasks()
                left = None if max_jobs is None else max_jobs - done
                wait = None
                if max_idle_time is not None:
                    wait = max(0.0, max_idle_time - (time.monotonic() - idle_since))
                batch = self._claim(block=not burst, limit=left, wait=wait)
                if not batch and burst and self._committer is not None:
                    # a commit still running may enqueue dependents (or retries)
                    self._committer.drain()
                    batch = self._claim(block=False, limit=left)
                if not batch:
                    if burst:
                        self.log.info("Worker %s: done, quitting", self.name)
                        break
                    if (max_idle_time is not None
                            and time.monotonic() - idle_since >= max_idle_time):
                        self.log.info("Worker %s: idle for %d seconds, quitting", self.name,
                                      max_idle_time)
                        break
                    continue
                for part in self._isolate_suspects(batch):
                    done += self._run_batch(part)
                idle_since = time.monotonic()
                if max_jobs is not None and done >= max_jobs:
                    self.log.info("Worker %s: finished executing %d jobs, quitting",
                                  self.name, done)
                    break
        except _Interrupted:
            pass  # stopped while idle: it holds no job
        except redis.exceptions.ConnectionError:
            self.log.error("Worker %s: lost Redis, quitting", self.name, exc_info=True)
            raise
        finally:
            try:
                self._committer.close()  # the batches run so far, committed
            finally:
                self._beat_stop.set()
                if self._waiters is not None:
                    self._waiters.close(timeout=0)  # daemon threads: gone within one BLMOVE
                self._give_back_unstarted()
                beat.join(timeout=5)
                self.teardown()
        self.jobs_done = done
        return bool(done)

    def _install_signal_handlers(self) -> None:
        def on_signal(signum: int, _frame: Any) -> None:
            self._signals += 1
            if self._signals > 1:
                os._exit(130)  # cold: the supervisor or the reaper gives the jobs back
            self.log.info("Worker %s: warm shutdown requested", self.name)
            if self._idle:  # blocked on an empty queue: holds no job, stop at once (as
                # RQ's worker, which then returns without setting its stop flag)
                self._idle = False
                self._shutdown_requested_date = now()
                raise _Interrupted()
            self._warm_stop()

        self._signals = 0

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def request_stop(self, signum: Any = None, frame: Any = None) -> None:
        """RQ's 'rq shutdown' command (and the signals): stop after the running batch."""
        self._warm_stop()

    def _warm_stop(self) -> None:
        """Stop after the running batch; a busy worker records when that was asked in
        its RQ hash (``shutdown_requested_date``), as RQ's worker does."""
        self._shutdown_requested_date = now()
        self._stop_requested = True
        if not self._idle:
            try:
                self.set_shutdown_requested_date()
            except redis.RedisError:
                self.log.warning("Worker %s: could not record the shutdown request", self.name)

    # -- claiming ----------------------------------------------------------------
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
            with self._lock:
                for job_id, owner, q in got:
                    self._held[job_id] = (q.name, owner)
                if not self._running:
                    self._valid_until = time.monotonic() + self.lease_ms / 1000 * 0.8
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
            with self._lock:
                self._held.pop(job_id, None)
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

    # -- running -----------------------------------------------------------------
    def _prepare(self, batch: list[Prepared]) -> None:
        """RQ's start bookkeeping for the whole batch, in one pipeline."""
        with self.connection.pipeline(transaction=False) as pipe:
            for p in batch:
                if p.outcome is not None:
                    continue
                ttl = self.get_heartbeat_ttl(p.job)
                p.execution = Execution.create(p.job, ttl, pipeline=pipe, worker_name=self.name)
                p.job.prepare_for_execution(self.name, pipeline=pipe)
                pipe.persist(p.job.key)
            self.set_state(WorkerStatus.BUSY, pipeline=pipe)
            self.set_current_job_id(batch[0].job.id, pipeline=pipe)
            pipe.execute()
        with self._lock:
            for p in batch:
                self._running[p.job.id] = p

    def _still_ours(self, batch: list[Prepared]) -> list[Prepared]:
        """Fencing of starts: past the time the last lease extension vouches for (a
        freeze, a slow call), ask Redis which leases are still this worker's."""
        if time.monotonic() < self._valid_until:
            return batch
        t0 = time.monotonic()
        lost: set[str] = set()
        by_queue: dict[str, list[tuple[str, str]]] = {}
        for p in batch:
            by_queue.setdefault(p.queue.name, []).append((p.job.id, p.owner))
        for qname, held in by_queue.items():
            lost |= leases.extend(self.scripts, qname, held, self.lease_ms)
        with self._lock:
            self._lost |= lost
            self._valid_until = t0 + self.lease_ms / 1000 * 0.8
        if lost:
            self.log.warning("Worker %s: lost the lease of %d job(s) (given back while this "
                             "worker was stalled); not running them", self.name, len(lost))
        return [p for p in batch if p.job.id not in lost]

    def _run_batch(self, batch: list[Prepared]) -> int:
        self._prepare(batch)
        self.batch_sizes.append(len(batch))
        by_id = {p.job.id: p for p in batch}
        todo = [p for p in batch if p.outcome is None]
        units, failed = plan([p.job for p in todo], self.resolver)
        for job_id, outcome in failed.items():
            outcome.ended_at = now()
            by_id[job_id].outcome = outcome
        # the call order, for the supervisor: it tells running jobs from waiting ones
        order = [by_id[j.id] for unit in units for j in unit.jobs]
        self._order = {p.job.id: i for i, p in enumerate(order)}
        if self.link is not None:
            self.link.batch([(p.queue.name, p.job.id) for p in order])
        t0 = time.monotonic()
        ran = 0
        for unit in units:
            live = [p for p in self._still_ours([by_id[j.id] for j in unit.jobs])
                    if p.job.id not in self._lost]
            live_ids = {p.job.id for p in live}
            if len(live_ids) != len(unit.jobs):
                keep = [i for i, j in enumerate(unit.jobs) if j.id in live_ids]
                unit.jobs = [unit.jobs[i] for i in keep]
                if unit.payloads:
                    unit.payloads = [unit.payloads[i] for i in keep]
            if not unit.jobs:
                continue
            for job, outcome in self._run_unit(unit):
                by_id[job.id].outcome = outcome
            ran += len(unit.jobs)
        if ran:
            per_job = (time.monotonic() - t0) / ran
            self._avg_job_s = (per_job if self._avg_job_s is None
                               else 0.7 * self._avg_job_s + 0.3 * per_job)
        finished = [p for p in batch if p.outcome is not None]
        if self._committer is not None:
            self._committer.put(finished)
        else:
            self._finish(finished)
        return len(batch)

    def _penalty(self, jobs: Sequence[Job]) -> tuple[int, Any]:
        timeouts = [j.timeout or self.queue_class.DEFAULT_TIMEOUT for j in jobs]
        timeout = min(int(t) for t in timeouts)
        return timeout, UnixSignalDeathPenalty

    def _run_unit(self, unit: Unit) -> list[tuple[Job, Outcome]]:
        if unit.batch is None:
            job = unit.jobs[0]
            return [(job, self._run_plain(job, unit.func))]
        return self._run_group(unit)

    def _guarded(self, jobs: Sequence[Job], fn: Any, *args: Any) -> Any:
        timeout, penalty = self._penalty(jobs)
        link = self.link
        if link is not None:
            places = [self._order.get(j.id, 0) for j in jobs]
            link.call(min(places), max(places) + 1, max(0, timeout))
        try:
            if timeout <= 0:
                return fn(*args)
            with penalty(timeout, JobTimeoutException, job_id=jobs[0].id):
                return fn(*args)
        finally:
            if link is not None:
                link.idle()

    def _run_plain(self, job: Job, func: Any) -> Outcome:
        try:
            value = self._guarded([job], call_plain, job, func)
            job.ended_at = now()
            check_storable(job, value)
            if not isinstance(value, Retry):
                job._result = value
                job._status = JobStatus.FINISHED
                job.execute_success_callback(self.death_penalty_class, value)
                return Outcome("ok", value, ended_at=job.ended_at)
            return Outcome("retry", value, ended_at=job.ended_at)
        except Exception as exc:
            return self._failure(job, exc)

    def _failure(self, job: Job, exc: BaseException) -> Outcome:
        job.ended_at = job.ended_at or now()
        job._status = JobStatus.FAILED
        exc_info = (type(exc), exc, exc.__traceback__)
        exc_string = format_exc(exc)
        try:
            job.execute_failure_callback(self.death_penalty_class, *exc_info)
        except Exception as cb_exc:
            exc_string = format_exc(cb_exc)
        self.handle_exception(job, *exc_info)
        return Outcome("fail", exc_string=exc_string, ended_at=job.ended_at)

    def _run_group(self, unit: Unit) -> list[tuple[Job, Outcome]]:
        """One call for the group; if it raises, bisect so a bad job fails alone."""
        assert unit.batch is not None
        spec = unit.batch
        out: list[tuple[Job, Outcome]] = []

        def run(jobs: list[Job], payloads: list[Any]) -> None:
            try:
                results = self._guarded(jobs, spec.call_batch, payloads)
            except Exception as exc:
                if len(jobs) == 1 or isinstance(exc, JobTimeoutException):
                    for j in jobs:
                        out.append((j, self._failure(j, exc)))
                    return
                half = len(jobs) // 2
                run(jobs[:half], payloads[:half])
                run(jobs[half:], payloads[half:])
                return
            ended = now()
            for j, value in zip(jobs, results):
                j.ended_at = ended
                if isinstance(value, BaseException):
                    out.append((j, self._failure(j, value)))
                    continue
                try:
                    check_storable(j, value)
                    j._result = value
                    j._status = JobStatus.FINISHED
                    j.execute_success_callback(self.death_penalty_class, value)
                    out.append((j, Outcome("ok", value, ended_at=ended)))
                except Exception as exc:
                    out.append((j, self._failure(j, exc)))

        run(list(unit.jobs), list(unit.payloads))
        return out

    # -- heartbeats, recovery, shutdown ---------------------------------------------
    def _beat_loop(self) -> None:
        interval = max(0.05, min(self.lease_ms / 1000 / 3, 5.0))
        while not self._beat_stop.wait(interval):
            try:
                self._beat()
            except Exception:
                self.log.warning("Worker %s: heartbeat failed", self.name, exc_info=True)

    def _beat(self) -> None:
        with self._lock:
            held = dict(self._held)
            running = list(self._running.values())
        t0 = time.monotonic()
        by_queue: dict[str, list[tuple[str, str]]] = {}
        for job_id, (qname, owner) in held.items():
            by_queue.setdefault(qname, []).append((job_id, owner))
        lost: set[str] = set()
        for qname, pairs in by_queue.items():
            lost |= leases.extend(self.scripts, qname, pairs, self.lease_ms)
        with self._lock:
            self._lost |= lost
            if held:
                self._valid_until = t0 + self.lease_ms / 1000 * 0.8
        with self.connection.pipeline(transaction=False) as pipe:
            self.heartbeat(self.job_monitoring_interval + 60, pipeline=pipe)
            for p in running:
                if p.execution is not None and p.job.id not in lost:
                    ttl = int(self.get_heartbeat_ttl(p.job))
                    p.execution.heartbeat(p.job.started_job_registry, ttl, pipeline=pipe)
            pipe.execute()
        for q in self.queues:
            back = leases.reap_expired(self.scripts, self.connection, q.name)
            if back:
                self.log.warning("Worker %s: gave back %d job(s) of %s whose lease expired "
                                 "(a frozen or dead worker): %s", self.name, len(back), q.name,
                                 ", ".join(back[:10]))

    def _give_back_unstarted(self) -> None:
        with self._lock:
            held = {k: v for k, v in self._held.items() if k not in self._running}
            self._held = {k: v for k, v in self._held.items() if k in self._running}
        by_queue: dict[str, list[tuple[str, str]]] = {}
        for job_id, (qname, owner) in held.items():
            by_queue.setdefault(qname, []).append((job_id, owner))
        for qname, pairs in by_queue.items():
            try:
                leases.give_back(self.scripts, qname, pairs)
            except redis.RedisError:
                self.log.warning("Worker %s: could not give back %d job(s); their leases "
                                 "expire instead", self.name, len(pairs))
