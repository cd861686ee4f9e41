"""The end of a batch in :class:`mtq.rq.worker.BatchWorker`: RQ's end-of-job writes for
every job of the batch, committed in one ``WATCH``/``MULTI`` transaction for the jobs
whose lease still holds the worker's token (fencing), on the worker's commit thread
(:mod:`mtq.rq.committer`).
"""

from __future__ import annotations

import calendar
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import redis
from rq.job import Job, JobStatus, Retry
from rq.queue import Queue
from rq.registry import ScheduledJobRegistry
from rq.results import Result
from rq.utils import now

from mtq.rq import leases
from mtq.rq.claims import Claims, Prepared

if TYPE_CHECKING:
    from rq.worker import SimpleWorker as _Base
else:
    _Base = object


def _schedule(job: Job, queue: Queue, interval: float, pipe: Any) -> None:
    """Schedule a retry ``interval`` s from now, every write in ``pipe`` (RQ's
    ``Queue.schedule_job`` writes the ScheduledJobRegistry entry, and ``Job.retry`` and
    ``Job._handle_retry_result`` the status, straight to Redis: inside the commit's
    transaction that would touch the WATCHed job hash, abort the EXEC and leave the job
    scheduled with its retry uncounted, and it would schedule a job this worker may
    have lost). The same keys and values as RQ's."""
    when = now() + timedelta(seconds=interval)
    pipe.sadd(queue.redis_queues_keys, queue.key)
    queue._persist_job(job, pipe, status=JobStatus.SCHEDULED)
    pipe.zadd(ScheduledJobRegistry(queue=queue).key,
              {job.id: calendar.timegm(when.utctimetuple())})


class Finishing(_Base):
    """The finishing half of BatchWorker (a mixin: it uses the worker's connection,
    name, counters and the claims it holds)."""

    scripts: leases.Scripts
    claims: Claims

    def _bookkeeping(self, p: Prepared, pipe: Any) -> None:
        """RQ's end-of-job writes for one job (BaseWorker.handle_job_success /
        handle_job_failure / handle_job_retry, with a per-job Execution), into ``pipe``."""
        job, outcome, queue, ex = p.job, p.outcome, p.queue, p.execution
        assert outcome is not None
        job.retries_left, job.number_of_retries = p.counters  # as claimed: see Prepared
        ex_id = ex.id if ex else None
        ex_started = ex.created_at if ex else None
        ended = outcome.ended_at or now()
        job.ended_at = ended
        if outcome.kind == "ok":
            result_ttl = job.get_result_ttl(self.default_result_ttl)
            if result_ttl != 0:
                job._handle_success(result_ttl, pipeline=pipe, worker_name=self.name,
                                    execution_id=ex_id, execution_started_at=ex_started,
                                    execution_ended_at=ended)
            if job.repeats_left is not None and job.repeats_left > 0:
                from rq.repeat import Repeat

                Repeat.schedule(job, queue, pipeline=pipe)
            else:
                self._cleanup(p, result_ttl, pipe)
        elif outcome.kind == "retry":
            retry: Retry = outcome.value
            if job.number_of_retries and job.number_of_retries >= retry.max:
                job.set_status(JobStatus.FAILED, pipeline=pipe)
                job.failed_job_registry.add(job, ttl=job.failure_ttl, exc_string="",
                                            pipeline=pipe)
                Result.create_max_retries_exceeded(
                    job, job.failure_ttl, return_value=retry, worker_name=self.name,
                    pipeline=pipe, execution_id=ex_id or "",
                    execution_started_at=ex_started or ended, execution_ended_at=ended)
            else:  # Job._handle_retry_result, with its writes in the transaction
                Result.create_retried(job, job.failure_ttl, return_value=retry,
                                      worker_name=self.name, pipeline=pipe,
                                      execution_id=ex_id or "",
                                      execution_started_at=ex_started or ended,
                                      execution_ended_at=ended)
                interval = Retry.get_interval(job.number_of_retries or 0, retry.intervals)
                job.number_of_retries = (job.number_of_retries or 0) + 1
                if interval:
                    _schedule(job, queue, interval, pipe)
                else:
                    queue._enqueue_job(job, pipeline=pipe)
        elif job.should_retry:  # Job.retry, with its writes in the transaction
            interval = job.get_retry_interval()
            job.retries_left = (job.retries_left or 0) - 1
            if interval:
                _schedule(job, queue, interval, pipe)
            else:
                queue._enqueue_job(job, pipeline=pipe, at_front=job.enqueue_at_front_on_retry)
        else:
            job.set_status(JobStatus.FAILED, pipeline=pipe)
            if not self.disable_default_exception_handler:  # RQ's FailedJobRegistry entry
                job._handle_failure(outcome.exc_string, pipeline=pipe, worker_name=self.name,
                                    execution_id=ex_id, execution_started_at=ex_started,
                                    execution_ended_at=ended)
        if ex is not None:
            ex.delete(job=job, pipeline=pipe)

    def _cancelled(self, p: Prepared, pipe: Any) -> None:
        """The end of a job cancelled while it ran (``job.cancel()``, ``rq cancel``): its
        result is stored, as RQ's worker stores it, but the job keeps the canceled
        status and its place in the CanceledJobRegistry, is neither retried nor counted
        as finished or failed, and its dependents stay deferred (RQ's worker also marks
        it finished and adds it to the FinishedJobRegistry: docs/rq.md)."""
        job, outcome, ex = p.job, p.outcome, p.execution
        assert outcome is not None
        ended = outcome.ended_at or now()
        ex_id, ex_started = (ex.id, ex.created_at) if ex else (None, None)
        if outcome.kind == "ok":
            ttl = job.get_result_ttl(self.default_result_ttl)
            if ttl != 0:
                Result.create(job, Result.Type.SUCCESSFUL, return_value=outcome.value, ttl=ttl,
                              worker_name=self.name, pipeline=pipe, execution_id=ex_id,
                              execution_started_at=ex_started, execution_ended_at=ended)
        elif outcome.kind == "fail":
            Result.create_failure(job, job.failure_ttl, exc_string=outcome.exc_string or "",
                                  worker_name=self.name, pipeline=pipe, execution_id=ex_id,
                                  execution_started_at=ex_started, execution_ended_at=ended)
        # a returned Retry: the job is not retried, and there is no result to store
        if ex is not None:
            ex.delete(job=job, pipeline=pipe)

    @staticmethod
    def _cleanup(p: Prepared, ttl: int, pipe: Any) -> None:
        """``job.cleanup(ttl)`` after a success, without the writes it would make on
        keys known not to exist: a job with no dependents (read under WATCH), no
        dependencies and no group has no ``:dependents`` or ``:dependencies`` key, and
        its only execution is ours (deleted with it; a give-back deletes the others).
        With ``result_ttl=0`` RQ's ``Job.delete`` reads the job's status and its
        executions back from Redis, one job at a time; here the same keys go in one
        DEL. Any other job: RQ's own cleanup."""
        job = p.job
        if p.dependents or job._dependency_ids or job.group_id:
            job.cleanup(ttl, pipeline=pipe, remove_from_queue=False)
        elif ttl == 0:
            pipe.delete(job.key)
        elif ttl > 0:
            pipe.expire(job.key, ttl)

    def _counters(self, done: list[Prepared], pipe: Any) -> None:
        ok = sum(1 for p in done if p.outcome and p.outcome.kind == "ok")
        if ok:
            self.successful_job_count += ok
            pipe.hincrby(self.key, "successful_job_count", ok)
        if len(done) - ok:
            self.failed_job_count += len(done) - ok
            pipe.hincrby(self.key, "failed_job_count", len(done) - ok)
        working = sum(((p.job.ended_at - p.job.started_at).total_seconds()
                       for p in done if p.job.ended_at and p.job.started_at), 0.0)
        if working:
            self.total_working_time += working
            pipe.hincrbyfloat(self.key, "total_working_time", working)

    @staticmethod
    def _terminal(p: Prepared) -> bool:
        """Whether this outcome ends the job (then its dependents may be enqueued, and
        the ``failed`` webhook fires), judged on its retry counters as claimed (the
        bookkeeping changes them in memory)."""
        o = p.outcome
        assert o is not None
        retries_left, retries = p.counters
        if o.kind == "ok":
            return True
        if o.kind == "retry":
            return bool(retries and retries >= o.value.max)
        return not retries_left

    def _finish(self, batch: list[Prepared]) -> None:
        """Commit the batch's outcomes in one transaction, for the jobs still ours."""
        if not batch:
            return
        pending = list(batch)
        for _attempt in range(50):
            if not pending:
                break
            with self.connection.pipeline() as pipe:
                try:
                    pending = self._commit(pending, pipe)
                except redis.exceptions.WatchError:
                    continue
        else:
            self.log.error("Worker %s: could not commit %d job(s) after 50 tries; their leases "
                           "will expire and they run again", self.name, len(pending))
        claims = self.claims
        with claims.lock:
            for p in batch:
                claims.held.pop(p.job.id, None)
                claims.running.pop(p.job.id, None)

    def _commit(self, batch: list[Prepared], pipe: Any) -> list[Prepared]:
        """One WATCH / read / MULTI..EXEC. Returns the jobs left for a later round (those
        with dependents, committed one per transaction as RQ does)."""
        pipe.watch(*[k for p in batch for k in (p.job.key, p.job.dependents_key)])
        states: dict[str, tuple[str, str, int]] = {}
        by_queue: dict[str, list[Prepared]] = {}
        for p in batch:
            by_queue.setdefault(p.queue.name, []).append(p)
        for qname, ps in by_queue.items():
            ids = [p.job.id for p in ps]
            for job_id, st in zip(ids, leases.fence(self.scripts, pipe, qname, ids)):
                states[job_id] = st
        mine: list[Prepared] = []
        later: list[Prepared] = []
        lost: list[Prepared] = []
        cancelled: list[Prepared] = []
        parent: Prepared | None = None  # at most one job with dependents per transaction
        for p in batch:
            owner, status, deps = states[p.job.id]
            p.dependents = deps
            if owner == p.owner and status == JobStatus.CANCELED:
                cancelled.append(p)  # cancelled while it ran: still ours to end
            elif owner != p.owner or status not in ("started", "queued"):
                lost.append(p)
            elif deps and self._terminal(p):
                if parent is None:
                    parent = p
                    mine.append(p)
                else:
                    later.append(p)
            else:
                mine.append(p)
        if parent is not None:  # reads under WATCH, then MULTI (RQ's handle_job_success)
            # the parent's status in Redis is still "started": RQ must judge its
            # dependents by the status this transaction gives it (a failed parent
            # enqueues only those with allow_failure)
            ok = parent.outcome is not None and parent.outcome.kind == "ok"
            parent.job._status = JobStatus.FINISHED if ok else JobStatus.FAILED
            parent.queue.enqueue_dependents(parent.job, pipeline=pipe,
                                            refresh_job_status=False)
        if not pipe.explicit_transaction:
            pipe.multi()
        ended: dict[str, list[str]] = {}
        for p in mine:
            self._bookkeeping(p, pipe)
            ended.setdefault(p.queue.name, []).append(p.job.id)
            if p.deliveries:
                pipe.hdel(leases.deliveries_key(p.queue.name), p.job.id)
        for p in cancelled:
            self._cancelled(p, pipe)
            ended.setdefault(p.queue.name, []).append(p.job.id)
            if p.deliveries:
                pipe.hdel(leases.deliveries_key(p.queue.name), p.job.id)
        for qname, ids in ended.items():  # the leases, one command per queue
            pipe.hdel(leases.owner_key(qname), *ids)
            pipe.zrem(leases.leases_key(qname), *ids)
        self._counters(mine, pipe)
        with self.claims.lock:
            idle = not (self.claims.running.keys() - {p.job.id for p in batch})
        if idle:  # no later batch started meanwhile (commits run beside the loop)
            self.set_current_job_id(None, pipeline=pipe)
        pipe.execute()
        for p in cancelled:
            self.log.info("Worker %s: job %s was cancelled while it ran; its result is "
                          "stored, its status stays canceled", self.name, p.job.id)
        for p in lost:
            self.log.warning("Worker %s: job %s was given back while this worker held it "
                             "(a stall past its lease); its outcome here is dropped",
                             self.name, p.job.id)
        for p in mine:
            o = p.outcome
            assert o is not None
            if o.kind == "ok":
                p.job.send_webhooks(JobStatus.FINISHED)
            elif self._terminal(p):
                p.job.send_webhooks(JobStatus.FAILED, exc_string=o.exc_string)
            self.log.debug("Worker %s: %s: %s (%s)", self.name, p.queue.name, o.kind, p.job.id)
        return later
