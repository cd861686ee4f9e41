"""``BatchWorker``: an RQ worker (rq.worker.SimpleWorker subclass, so ``rq info`` and
rq-dashboard list it) whose work loop claims jobs in batches.

One round of the loop:

1. claim up to N job ids from the head of the queues, in the worker's queue order,
   with one atomic script per queue (pop + lease; see :mod:`mtq.rq.leases`); when
   every queue is empty, wait on the worker's waiter threads (one per queue, blocking
   on ``BLMOVE q q LEFT LEFT`` only while the loop is idle; :mod:`mtq.rq.waiting`)
   (:mod:`mtq.rq.claiming`);
2. read the jobs' hashes (one pipelined round trip) and RQ's start bookkeeping for
   the whole batch in one pipeline (Execution, StartedJobRegistry, status started);
3. run the jobs: plain functions one job per call, batched functions and mtq.Model
   classes one call per group (waiting up to max_wait_ms for the group to fill;
   :mod:`mtq.rq.running`);
4. finish the batch in one MULTI/EXEC under WATCH of the jobs' hashes, and only for
   the jobs whose lease still holds this worker's token (fencing: a worker resumed
   after a freeze, whose jobs were given back, drops its results); RQ's own
   success / failure / retry bookkeeping goes into that transaction
   (:mod:`mtq.rq.finishing`). The commit runs on a thread of its own
   (:mod:`mtq.rq.committer`) while the loop goes on with the next batch.

A heartbeat thread (:mod:`mtq.rq.heartbeat`) extends the leases of the jobs held,
RQ's worker and execution heartbeats, and gives back jobs whose lease expired (a
frozen or killed worker).

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
from typing import Any

import redis
from rq.defaults import DEFAULT_LOGGING_DATE_FORMAT, DEFAULT_LOGGING_FORMAT
from rq.exceptions import StopRequested
from rq.serializers import JSONSerializer
from rq.utils import now
from rq.worker import DequeueStrategy, SimpleWorker

from mtq.errors import ConfigError
from mtq.rq import leases
from mtq.rq.claiming import Claiming
from mtq.rq.claims import Claims, Prepared
from mtq.rq.committer import Committer
from mtq.rq.faults import ChildLink
from mtq.rq.heartbeat import Heartbeat
from mtq.rq.jobs import Resolver, memoize_serializer_resolution
from mtq.rq.running import Running
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


class BatchWorker(Claiming, Heartbeat, Running, SimpleWorker):
    """Serves RQ queues in batches (see the module docstring). Takes SimpleWorker's
    arguments plus ``accept_pickle``, ``lease_ms``, ``device``, ``target_batch_ms``,
    ``link`` (a :class:`mtq.rq.faults.ChildLink` to the supervisor, or None) and
    ``model_options`` (the mtq.Model options of ``--set``, see
    :func:`mtq.rq.jobs.model_options`).

    Its parts: :class:`~mtq.rq.claiming.Claiming` (the next batch),
    :class:`~mtq.rq.running.Running` (running it) with
    :class:`~mtq.rq.finishing.Finishing` (its commit), and
    :class:`~mtq.rq.heartbeat.Heartbeat` (leases and RQ's heartbeats), sharing one
    :class:`~mtq.rq.claims.Claims`; this class holds the loop, the signals and the
    stop."""

    def __init__(self, queues: Any, name: str | None = None, *args: Any,
                 accept_pickle: bool = False, lease_ms: int = LEASE_MS, device: str = "cpu",
                 target_batch_ms: float = 20.0, max_claim: int = MAX_CLAIM,
                 link: ChildLink | None = None,
                 model_options: dict[str, dict[str, str]] | None = None, **kwargs: Any) -> None:
        # RQ's positional arguments too (Worker.find_by_key, Worker.all build workers so)
        if kwargs.get("serializer") is None:
            kwargs["serializer"] = JSONSerializer
        memoize_serializer_resolution()
        super().__init__(queues, name, *args, **kwargs)
        self.accept_pickle = accept_pickle
        self.lease_ms = int(lease_ms)
        self.resolver = Resolver(device, model_options)
        self.target_batch_ms = target_batch_ms
        self.max_claim = max_claim
        self.link = link
        self._order: dict[str, int] = {}  # job id -> its place in the batch's call order
        self.scripts = leases.Scripts(self.connection)
        self.claims = Claims()
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
            raise ConfigError(f"dequeue strategy {dequeue_strategy!r} is not allowed: use "
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
