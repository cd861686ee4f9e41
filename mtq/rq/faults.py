"""Jobs that take their worker down: poison jobs and hung calls.

A worker process tells its supervisor what it is running, as mtq's own workers do
(:mod:`mtq.workers.child`): one pipe message per batch (its jobs, in the order of its
calls) and, in a small shared array, the current call's start time, timeout and the
range of the batch it runs (written without a system call, so it costs nothing per
job). When the process dies, the supervisor knows which jobs were *running* (every
job of a batched call runs; claimed jobs waiting for their turn were not) and:

- counts one delivery of each running job (``mtq:rq:{<queue>}:deliveries``); a job
  that reaches ``max_deliveries`` is failed into RQ's ``FailedJobRegistry`` with
  :func:`poison_message` (it likely crashes the worker: a segfault, ``os._exit``, the
  OOM killer), instead of going back to the head of the queue to kill the next one;
- when the supervisor killed the process itself because a call overran its jobs'
  ``job_timeout`` plus a grace (a call stuck in C code, which RQ's SIGALRM cannot
  interrupt), fails the running jobs with RQ's timeout message instead.

The rest goes back to the head of the queue uncounted. A worker runs a job whose
count is above zero in a batch of its own, so a poison job does not take innocent
jobs of its batch down with it again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import redis
from rq.job import JobStatus

from mtq.rq import leases

log = logging.getLogger(__name__)

#: the shared array's slots: call started at (time.monotonic(), 0 = no call running),
#: its timeout (s, 0 = none), the range [LO, HI) of the batch's order it runs
STARTED, TIMEOUT, LO, HI = 0, 1, 2, 3
SHARED_SLOTS = 4


def poison_message(deliveries: int) -> str:
    return (f"the job's process died {deliveries} times while running it: it likely "
            "crashes the worker (a segfault, os._exit, the out-of-memory killer); mtq rq "
            "worker failed it instead of giving it to the next worker (--max-deliveries). "
            "Run it alone, e.g. under rq worker --burst, to see why")


def hang_message(timeout: float, waited: float) -> str:
    return (f"rq.timeouts.JobTimeoutException: Task exceeded maximum timeout value "
            f"({int(timeout)} seconds); the call did not return to Python (stuck in C "
            f"code, which SIGALRM cannot interrupt), so mtq rq worker killed its process "
            f"after {waited:.1f} s")


class ChildLink:
    """A worker process's side of the link to its supervisor."""

    def __init__(self, conn: Connection, shared: Any) -> None:
        self.conn = conn
        self.shared = shared

    def batch(self, order: Sequence[tuple[str, str]]) -> None:
        """The batch's (queue, job id) pairs in the order its calls will run."""
        self.shared[STARTED] = 0.0
        try:
            self.conn.send(("batch", list(order)))
        except (OSError, ValueError):  # the supervisor is gone
            pass

    def call(self, lo: int, hi: int, timeout: float) -> None:
        self.shared[LO] = lo
        self.shared[HI] = hi
        self.shared[TIMEOUT] = max(0.0, float(timeout))
        self.shared[STARTED] = time.monotonic()

    def idle(self) -> None:
        self.shared[STARTED] = 0.0


def running(order: Sequence[tuple[str, str]], shared: Any) -> list[tuple[str, str]]:
    """The (queue, id) pairs of the call running when the process stopped."""
    if not shared[STARTED]:
        return []
    return list(order[int(shared[LO]):int(shared[HI])])


def fail_held(client: redis.Redis, queue: str, worker: str, job_id: str, exc_string: str
              ) -> bool:
    """Fail a job that the dead ``worker`` still holds, through RQ's own failure path
    (status failed, FailedJobRegistry, a failure Result, out of StartedJobRegistry,
    dependents enqueued as RQ does); returns whether it did. The job's on_failure
    callback is not run (it is user code: the supervisor imports none)."""
    from rq.queue import Queue
    from rq.serializers import JSONSerializer

    from mtq.rq.jobs import load_job

    okey, ekey = leases.owner_key(queue), leases.executions_key(job_id)
    for _ in range(20):
        with client.pipeline() as pipe:
            try:
                pipe.watch(okey, leases.job_key(job_id), ekey)
                owner = pipe.hget(okey, job_id)
                text = owner.decode() if isinstance(owner, bytes) else ""
                if not text.startswith(worker + "|"):
                    return False
                raw = pipe.hgetall(leases.job_key(job_id))
                executions = pipe.zrange(ekey, 0, -1)
                if not raw:
                    pipe.multi()
                else:
                    job, _ = load_job(job_id, raw, client, accept_pickle=False)  # type: ignore[arg-type]
                    job.ended_at = job.ended_at or _now()
                    pipe.multi()
                    job.set_status(JobStatus.FAILED, pipeline=pipe)
                    job._handle_failure(exc_string, pipeline=pipe, worker_name=worker)
                    for ex in executions:
                        pipe.zrem(leases.wip_key(queue),
                                  f"{job_id}:{ex.decode() if isinstance(ex, bytes) else ex}")
                    pipe.delete(ekey)
                pipe.hdel(okey, job_id)
                pipe.zrem(leases.leases_key(queue), job_id)
                pipe.hdel(leases.deliveries_key(queue), job_id)
                pipe.execute()
            except redis.exceptions.WatchError:
                continue
        if raw:
            try:
                Queue(queue, connection=client, serializer=JSONSerializer
                      ).enqueue_dependents(job)
            except Exception:
                log.warning("could not enqueue the dependents of failed job %s", job_id,
                            exc_info=True)
        return True
    return False


def _now() -> Any:
    from rq.utils import now

    return now()
