"""What a :class:`mtq.rq.worker.BatchWorker` holds: the jobs it claimed, each with its
lease's owner token, those of them started, those whose lease it lost, and until when
its leases are known to be live. The worker's loop, its heartbeat thread and its
commit thread share one :class:`Claims` and change it under its lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue

from mtq.rq.jobs import Outcome


class Prepared:
    """A claimed job on its way: its lease, its queue, its Execution."""

    __slots__ = ("cap", "counters", "deliveries", "dependents", "execution", "job", "outcome",
                 "owner", "queue")

    def __init__(self, job: Job, owner: str, queue: Queue, deliveries: int = 0,
                 cap: int = 0) -> None:
        self.job = job
        self.owner = owner
        self.queue = queue
        self.deliveries = deliveries  # times a worker died while running it
        self.cap = cap  # then: the most jobs it may share a call (and a commit) with
        self.execution: Execution | None = None
        self.outcome: Outcome | None = None
        #: how many jobs depend on it (read under WATCH before the commit)
        self.dependents = 0
        #: (retries_left, number_of_retries) as claimed: RQ's retry bookkeeping changes
        #: them in memory, and a commit that must be tried again starts from these
        self.counters = (job.retries_left, job.number_of_retries)


class Claims:
    """The worker's claimed jobs and their leases (read and written under ``lock``)."""

    __slots__ = ("held", "lock", "lost", "running", "valid_until")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: job id -> (queue name, lease owner token): every job claimed and not committed
        self.held: dict[str, tuple[str, str]] = {}
        #: job id -> the job, for those started (RQ's start bookkeeping written)
        self.running: dict[str, Prepared] = {}
        #: jobs whose lease an extension found gone (given back while this worker stalled)
        self.lost: set[str] = set()
        #: time.monotonic() until which the leases held are live (the last extension's
        #: start plus most of a lease)
        self.valid_until = 0.0

    def vouch(self, since: float, lease_ms: int) -> None:
        """The leases were extended (or taken) at ``since``: live for most of a lease
        from then. Call under :attr:`lock`."""
        self.valid_until = since + lease_ms / 1000 * 0.8

    @staticmethod
    def by_queue(held: Iterable[tuple[str, tuple[str, str]]]
                 ) -> dict[str, list[tuple[str, str]]]:
        """``(job id, (queue, owner))`` pairs grouped as queue -> [(job id, owner)]."""
        out: dict[str, list[tuple[str, str]]] = {}
        for job_id, (qname, owner) in held:
            out.setdefault(qname, []).append((job_id, owner))
        return out

