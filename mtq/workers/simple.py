"""The minimal worker: claims batches, runs a plain function per task, settles.

It is deliberately small: one process, one thread running tasks plus a heartbeat
thread extending leases. The GPU-pinned supervisor with dynamic batching builds on
the same :class:`~mtq.broker.consumer.Consumer`.

Hot loop: one round trip per batch (settle the last batch and claim the next in
one pipeline). Idle: blocks on the wake list (BLPOP) until a submit, the next
lease deadline or retry, never polling.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mtq import serialization
from mtq.broker.consumer import OUTCOME_COUNTERS, Consumer, Outcome, SettleReport
from mtq.broker.protocol import Claimed
from mtq.errors import PayloadError
from mtq.settings import QueueSettings

log = logging.getLogger(__name__)


class WorkerInterrupted(BaseException):
    """Raised from a signal handler to break a worker out of its idle wait."""


@dataclass
class WorkerStats:
    """Counts since the worker started."""

    batches: int = 0
    succeeded: int = 0
    retried: int = 0
    failed: int = 0
    dead: int = 0
    cancelled: int = 0
    lost: int = 0


class SimpleWorker:
    """Runs ``func(payload) -> result`` for every task of ``queue``."""

    def __init__(self, queue: str, func: Callable[[Any], Any], *, url: str | None = None,
                 settings: QueueSettings | None = None, batch_size: int = 64,
                 worker_id: str | None = None, consumer: Consumer | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.func = func
        self.batch_size = batch_size
        self.consumer = consumer or Consumer(queue, url, settings=settings, worker_id=worker_id)
        self.stats = WorkerStats()
        self.stop_event = threading.Event()
        self.waiting = False  # True while blocked on the wake list (safe to interrupt)
        self._in_flight: list[Claimed] = []
        self._cancel: set[str] = set()
        self._lock = threading.Lock()

    def stop(self) -> None:
        """Ask the worker to stop after the current batch."""
        self.stop_event.set()

    def _heartbeat(self) -> None:
        interval = self.consumer.settings.lease_ms / 3000
        while not self.stop_event.wait(interval):
            with self._lock:
                tasks = list(self._in_flight)
            if not tasks:
                continue
            try:
                _lost, cancel = self.consumer.extend(tasks)
                with self._lock:
                    self._cancel.update(cancel)
            except Exception:  # a Redis blip must not kill the heartbeat
                log.warning("lease extension failed; will retry", exc_info=True)

    def _run_one(self, task: Claimed) -> Outcome:
        try:
            payload = serialization.loads(task.payload)
        except PayloadError as exc:
            return Outcome(task, ok=False, error=f"PayloadError: {exc}", retryable=False)
        try:
            return Outcome(task, ok=True, value=self.func(payload))
        except Exception as exc:
            log.debug("task %s failed:\n%s", task.id, traceback.format_exc())
            return Outcome(task, ok=False, error=f"{type(exc).__name__}: {exc}")

    def run(self, *, burst: bool = False, max_tasks: int | None = None) -> WorkerStats:
        """Work until :meth:`stop` (or a signal). ``burst``: return as soon as the
        queue has nothing claimable and no timer pending. ``max_tasks``: return
        after settling that many tasks."""
        beat = threading.Thread(target=self._heartbeat, name="mtq-heartbeat", daemon=True)
        beat.start()
        c = self.consumer
        done = 0
        try:
            tasks = c.claim(self.batch_size)
            while True:
                if not tasks:
                    if self.stop_event.is_set() or (burst and c.next_timer_ms < 0):
                        break
                    self.waiting = True
                    try:
                        if self.stop_event.is_set():
                            break
                        c.wait()
                        self.waiting = False  # inside the try: a signal now is caught below
                    except WorkerInterrupted:
                        break
                    finally:
                        self.waiting = False
                    tasks = c.claim(self.batch_size)
                    continue
                with self._lock:
                    self._in_flight = tasks
                outcomes = [self._run_one(t) for t in tasks]
                with self._lock:
                    cancel, self._cancel = self._cancel, set()
                if cancel:
                    outcomes = [Outcome(o.task, ok=False, cancelled=True)
                                if o.task.id in cancel and not o.ok else o for o in outcomes]
                done += len(outcomes)
                stopping = self.stop_event.is_set() or (max_tasks is not None and done >= max_tasks)
                report, tasks = c.settle_and_claim(outcomes, 0 if stopping else self.batch_size)
                with self._lock:
                    self._in_flight = []
                self._record(report)
                if stopping:
                    break
        finally:
            self.stop_event.set()
            beat.join(timeout=5)
        return self.stats

    def _record(self, report: SettleReport) -> None:
        s = self.stats
        s.batches += 1
        for name in OUTCOME_COUNTERS:
            setattr(s, name, getattr(s, name) + getattr(report, name))
        s.lost += len(report.lost)
        if report.lost:
            log.warning("lease lost on %d task(s); their results were discarded", len(report.lost))
