"""How a :class:`mtq.rq.worker.BatchWorker` runs a batch: RQ's start bookkeeping for
the whole batch in one pipeline, the fencing of starts (a job whose lease was lost is
not run), plain functions one job per call and batched functions and mtq.Model
classes one call per group (bisected when a call raises, so a bad job fails alone),
each call under RQ's job timeout; then the batch goes to its commit
(:mod:`mtq.rq.finishing`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from rq.executions import Execution
from rq.job import Job, JobStatus, Retry
from rq.timeouts import JobTimeoutException, UnixSignalDeathPenalty
from rq.utils import now
from rq.worker import WorkerStatus

from mtq.rq import leases
from mtq.rq.claims import Claims, Prepared
from mtq.rq.committer import Committer
from mtq.rq.faults import ChildLink
from mtq.rq.finishing import Finishing
from mtq.rq.jobs import Outcome, Resolver, Unit, call_plain, check_storable, format_exc, plan


class Running(Finishing):
    """The running half of BatchWorker (a mixin: it uses the worker's connection,
    name, the claims it holds and its link to the supervisor)."""

    claims: Claims
    resolver: Resolver
    lease_ms: int
    link: ChildLink | None
    #: seconds a job takes (a moving average); None: no job timed yet
    _avg_job_s: float | None
    #: job id -> its place in the running batch's call order (for the supervisor)
    _order: dict[str, int]
    _committer: Committer[list[Prepared]] | None
    batch_sizes: list[int]

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
        with self.claims.lock:
            for p in batch:
                self.claims.running[p.job.id] = p

    def _still_ours(self, batch: list[Prepared]) -> list[Prepared]:
        """Fencing of starts: past the time the last lease extension vouches for (a
        freeze, a slow call), ask Redis which leases are still this worker's."""
        claims = self.claims
        if time.monotonic() < claims.valid_until:
            return batch
        t0 = time.monotonic()
        lost: set[str] = set()
        by_queue: dict[str, list[tuple[str, str]]] = {}
        for p in batch:
            by_queue.setdefault(p.queue.name, []).append((p.job.id, p.owner))
        for qname, held in by_queue.items():
            lost |= leases.extend(self.scripts, qname, held, self.lease_ms)
        with claims.lock:
            claims.lost |= lost
            claims.vouch(t0, self.lease_ms)
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
                    if p.job.id not in self.claims.lost]
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
