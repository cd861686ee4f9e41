"""Timeouts and cancels of running work, in a worker process.

A task's run timeout (``submit(..., timeout=S)``, else the queue's ``task_timeout_s``)
starts when a predict call or a generator's step first runs it (:meth:`Aborts.begin`,
from the model thread) and is kept in :attr:`Ledger.deadlines`. One thread of the
worker, ``mtq-aborts``, sleeps until the earliest deadline (or until a cancel mark or
a new deadline is added: :attr:`Ledger.changed`), marks the tasks past theirs in
:attr:`Ledger.timed_out`, and, when every task of the running call is cancelled or
timed out, tells the monitor once (:meth:`Monitor.aborted`: a supervisor kills the
process if that call still runs ``cancel_grace_s`` later). No Redis is read for it.

What stops the work itself:

* a generator (a plain generator function, a streaming ``predict``, an
  :class:`mtq.Generator`) between two steps (:meth:`Aborts.stopped_all`);
* a cooperative function or model through :func:`mtq.current_task`
  (:mod:`mtq.workers.current`).

Whatever comes back of a stopped task, its outcome is the stop's
(:meth:`Aborts.outcome`): cancelled, or a TaskTimeout failure; never a success.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from mtq.broker.consumer import Outcome
from mtq.broker.protocol import Claimed
from mtq.errors import TaskCancelled, TaskTimeout
from mtq.settings import QueueSettings
from mtq.workers import current
from mtq.workers.ledger import Ledger, Monitor

log = logging.getLogger("mtq.workers.worker")

CANCEL, TIMEOUT = "cancel", "timeout"


class Aborts:
    """The run timeouts and cancels of one worker's running calls."""

    def __init__(self, ledger: Ledger, monitor: Monitor) -> None:
        self.ledger = ledger
        self.monitor = monitor
        #: the queue's task_timeout_s and cancel_grace_s (the heartbeat sets them)
        self.default_s = QueueSettings.task_timeout_s
        self.grace_s = QueueSettings.cancel_grace_s
        #: the tasks of the call running now (model thread writes), and whether the
        #: monitor was told it is wholly aborted
        self.call: Sequence[Claimed] = ()
        self.reported = False
        #: held while the monitor is told: a call that ended is never reported after
        self._report = threading.Lock()
        self._stop = False
        self._thread: threading.Thread | None = None
        #: what mtq.current_task() gives inside this worker's calls
        self.view = current.CurrentTask(self)

    def configure(self, s: QueueSettings) -> None:
        self.default_s, self.grace_s = s.task_timeout_s, s.cancel_grace_s

    # -- the model thread -------------------------------------------------------------
    def begin(self, tasks: Sequence[Claimed]) -> bool:
        """A call (predict, a generator's prefill or step) starts on ``tasks``: the
        run timeouts of those it runs for the first time start now, and
        ``mtq.current_task()`` in this thread is theirs until :meth:`end`. True when
        nothing of the call is wanted already (each task cancelled or past its run
        timeout while it waited: the caller skips the call, then calls :meth:`end`)."""
        led = self.ledger
        default = self.default_s
        self.reported = False
        self.call = tasks
        current.local.task = self.view
        if default <= 0 and not led.deadlines:  # (most calls: no timeouts, no cancels)
            for t in tasks:
                if t.timeout_ms:
                    break
            else:
                if not (led.cancel or led.timed_out):
                    return False  # (no lock, no list: the hot path)
                with led.lock:  # (a call on cancelled tasks is told)
                    led.changed.notify_all()
                return self.stopped_all(tasks)
        now = time.monotonic()
        with led.lock:
            added = False
            for t in tasks:
                dl = led.deadlines.get(t.id)
                if dl is None or dl[2] != t.token:  # (a retry claimed here again before
                    led.timed_out.discard(t.id)     # its last delivery was forgotten)
                    s = t.timeout_ms / 1000 if t.timeout_ms else default
                    if s > 0:
                        led.deadlines[t.id] = (now + s, s, t.token)
                        added = True
                    elif dl is not None:
                        del led.deadlines[t.id]
            if added or led.cancel or led.timed_out:  # (a call on stopped tasks is told)
                led.changed.notify_all()
        return self.stopped_all(tasks)

    @property
    def ids(self) -> tuple[str, ...]:
        """The ids of the running call's tasks."""
        return tuple(t.id for t in self.call)

    def end(self) -> None:
        """The call returned (or raised): ``mtq.current_task()`` in this thread is
        inert from now on (its view reads the call, now none)."""
        led = self.ledger
        if led.cancel or led.timed_out:  # the aborts thread may be reporting this call
            with self._report:
                self.call = ()
        else:  # (nothing to report: a task leaves those sets only once settled)
            self.call = ()

    def reason(self, task_id: str) -> str | None:
        """"cancel", "timeout" or None (neither) for a held task, now."""
        led = self.ledger
        if task_id in led.cancel:
            return CANCEL
        if task_id in led.timed_out:
            return TIMEOUT
        dl = led.deadlines.get(task_id)
        if dl is not None and time.monotonic() >= dl[0]:
            return TIMEOUT
        return None

    def stopped(self, ids: Sequence[str]) -> list[str]:
        """Those of ``ids`` cancelled or past their run timeout, now."""
        led = self.ledger
        if not led.cancel and not led.timed_out and not led.deadlines:  # most calls
            return []
        return [i for i in ids if self.reason(i) is not None]

    def stopped_all(self, tasks: Sequence[Claimed]) -> bool:
        """Every one of ``tasks`` is cancelled or past its run timeout: nothing of the
        call is still wanted."""
        led = self.ledger
        if not (led.cancel or led.timed_out or led.deadlines):  # most calls
            return False
        return bool(tasks) and all(self.reason(t.id) is not None for t in tasks)

    def error(self, task_id: str) -> BaseException:
        """The exception a stopped task's item gets in place of a result."""
        if self.reason(task_id) == TIMEOUT:
            return TaskTimeout(self.timeout_of(task_id))
        return TaskCancelled(task_id, "cancelled", "stopped on a cancel request")

    def timeout_of(self, task_id: str) -> float | None:
        dl = self.ledger.deadlines.get(task_id)
        return dl[1] if dl is not None else None

    def outcome(self, task: Claimed, reason: str, cost: float | None = None) -> Outcome:
        """A stopped task's outcome: cancelled, or failed with TaskTimeout (retried
        under its retry policy), whatever its call gave."""
        if reason == CANCEL:
            return Outcome(task, ok=False, cancelled=True, cost=cost)
        exc = TaskTimeout(self.timeout_of(task.id))
        return Outcome(task, ok=False, error=f"TaskTimeout: {exc}", retryable=True, cost=cost)

    # -- the aborts thread ------------------------------------------------------------------
    def start(self) -> None:
        self._stop = False
        self._thread = threading.Thread(target=self.loop, name="mtq-aborts", daemon=True)
        self._thread.start()

    def close(self) -> None:
        with self.ledger.lock:
            self._stop = True
            self.ledger.changed.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def loop(self) -> None:
        led = self.ledger
        while True:
            with led.lock:
                if self._stop:
                    return
                now = time.monotonic()
                wait = float("inf")
                for i, (dl, _s, _token) in led.deadlines.items():
                    if i in led.timed_out:
                        continue
                    if dl <= now:
                        led.timed_out.add(i)
                    else:
                        wait = min(wait, dl - now)
                call = self.call
                ids = [t.id for t in call]
                reasons = None
                if ids and not self.reported and \
                        all(i in led.cancel or i in led.timed_out for i in ids):
                    reasons = {i: CANCEL if i in led.cancel else TIMEOUT for i in ids}
                else:
                    led.changed.wait(None if wait == float("inf") else wait)
                    continue
            with self._report:  # (outside the ledger's lock: the monitor may write a pipe)
                if self.call is call and not self.reported:
                    self.reported = True
                    log.debug("every task of the running call was cancelled or timed out "
                              "(%s)", ", ".join(f"{i}: {r}" for i, r in reasons.items()))
                    try:
                        self.monitor.aborted(reasons, self.grace_s)
                    except Exception:
                        log.warning("could not tell the supervisor of an aborted call",
                                    exc_info=True)
