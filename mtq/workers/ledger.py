"""The worker's shared state: the tasks one process holds, and what its threads tell
each other about them.

A worker process runs four threads (model, fetcher, publisher, heartbeat; see
:mod:`mtq.workers.worker`) and one that keeps run timeouts (:mod:`mtq.workers.aborts`),
and a generator's engine and outlet act on the same tasks. What they share lives here, in three small classes that every part
receives, each with the lock it needs:

* :class:`Ledger`: the held tasks (claimed or handed over, not settled yet) with
  their leases, the cancel and lost marks on them, what the model thread runs
  now, and the outcomes handed to the publisher and not settled yet.
* :class:`Lifecycle`: stop, drain and reload, as the threads see them.
* :class:`Tally`: what the worker counted (totals, batch sizes, time in predict).

:class:`Monitor` is what a worker tells its supervisor (nothing, when it runs
alone); the ledger tells it when deliveries leave the process.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterable, Mapping, Sequence

from mtq.broker.consumer import OUTCOME_COUNTERS
from mtq.broker.protocol import Claimed

#: a delivery: (task id, lease token)
Lease = tuple[str, str]


class Monitor:
    """What a worker tells its supervisor (nothing, when it runs alone).

    The supervisor uses it to give back the tasks of a process that died and to kill
    a process whose predict call overran the timeout; see :mod:`mtq.workers.supervisor`.
    """

    def held(self, leases: Sequence[Lease]) -> None:
        """Tasks were claimed into this process."""

    def batch(self, leases: Sequence[Lease]) -> None:
        """The model thread started on these tasks, in this order."""

    def call(self, lo: int, hi: int) -> None:
        """predict started on items lo..hi-1 of the current batch."""

    def idle(self) -> None:
        """predict returned."""

    def settled(self, leases: Sequence[Lease]) -> None:
        """These deliveries left this process (settled or given back)."""

    def reloaded(self, timeout_s: float | None, model: str,
                 options: dict[str, str] | None = None) -> None:
        """A reload (or a load) swapped the model in; its timeout may have changed.
        ``options``: every model option it was loaded with (text, as ``--set``);
        None when not known. A supervisor starts its later processes with them."""

    def aborted(self, reasons: Mapping[str, str], grace_s: float) -> None:
        """Every task of the running predict call was cancelled or timed out
        (``reasons``: task id -> ``"cancel"`` or ``"timeout"``): a supervisor kills the
        process if that call still runs ``grace_s`` from now, settles these tasks as
        their reasons say, and gives the rest of what the process held back uncounted.
        The next :meth:`call` or :meth:`idle` clears it. Alone, nothing can stop it."""

    def quarantine(self, task: Claimed) -> bool:
        """A claimed task is a suspect (a process died while running it): True if the
        supervisor takes it, to run it alone in its quarantine process; False (no
        supervisor) and this process runs it alone itself."""
        return False


class Lifecycle:
    """Stop, drain and reload as every thread of a worker sees them. The flags are
    plain attributes, each written by one side and read by the others."""

    __slots__ = ("draining", "reload", "stop")

    def __init__(self) -> None:
        #: set once: the worker stops (threads waiting on it wake)
        self.stop = threading.Event()
        #: work until the queue is empty, then stop
        self.draining = False
        #: a reload was asked for and not begun yet (the model thread runs it)
        self.reload = False


class Tally:
    """What a worker counted: outcomes and tasks, batch sizes, model-thread time."""

    __slots__ = ("hist", "timing", "totals")

    def __init__(self) -> None:
        self.totals = dict.fromkeys((*OUTCOME_COUNTERS, "lost", "revoked", "batches", "tasks",
                                     "tokens"), 0)
        #: batch size -> batches run at that size
        self.hist: collections.Counter[int] = collections.Counter()
        #: model-thread seconds inside predict, and around it (decode, hand-off)
        self.timing = {"predict_s": 0.0, "overhead_s": 0.0}


class Ledger:
    """The tasks a worker process holds, and their leases.

    :attr:`lock` guards ``held``, ``cancel``, ``lost``, ``timed_out``, ``deadlines``,
    ``busy``, ``current`` and ``unsettled`` (the engine reads a set's truth without it, on its hot path); the
    other fields are written by one side at a time, as noted on each.
    """

    def __init__(self, monitor: Monitor) -> None:
        self.lock = threading.Lock()
        self.monitor = monitor
        #: task id -> its delivery held here (claimed or handed over, not yet settled)
        self.held: dict[str, Claimed] = {}
        #: held tasks with a cancel request
        self.cancel: set[str] = set()
        #: running tasks whose lease was lost: a generator stops generating them
        self.lost: set[str] = set()
        #: running tasks past their run timeout, and task id -> (monotonic deadline, its
        #: timeout in s, lease token) of those with one that started running
        #: (mtq.workers.aborts)
        self.timed_out: set[str] = set()
        self.deadlines: dict[str, tuple[float, float, str]] = {}
        #: notified (under :attr:`lock`) when a cancel mark or a run deadline is added:
        #: the aborts thread waits on it
        self.changed = threading.Condition(self.lock)
        #: task id -> when it was submitted, on this process's monotonic clock (its
        #: age at claim, server clock, taken from the time of the claim); added by the
        #: side that takes tasks in, removed by forget()
        self.submitted: dict[str, float] = {}
        #: (id, token) of suspects handed to the supervisor: they still run under this
        #: worker's id in Redis, in the quarantine process (see Fetcher.release_unknown);
        #: the fetcher's (or the model thread's, waiting in its place)
        self.handed: set[Lease] = set()
        #: the model thread runs a batch now, of this many tasks
        self.busy = False
        self.current = 0
        #: when the model thread last ended a batch (unix s; the engine's last use)
        self.last_busy = 0.0
        #: lists put in the publisher's outbox and not yet settled: while any is, the
        #: model thread leaves its outcomes to the publisher too, so that a task's
        #: chunks still in hand there reach Redis before its outcome
        self.unsettled = 0
        #: how long the model thread's recent dynamic batches ran (s: the last one's time,
        #: or half the one before if more, as that one's: a decaying maximum), and the last
        #: one's size; inf until one has, after a reload, and always for a generator, whose
        #: engine never sets it (model thread writes, fetcher reads: no lock)
        self.batch_s = float("inf")
        self.batch_n = 1

    def hold(self, tasks: Iterable[Claimed]) -> None:
        """Tasks claimed or handed over: held (their leases extended) until forgotten."""
        with self.lock:
            for t in tasks:
                self.held[t.id] = t

    def forget(self, leases: Iterable[Lease]) -> None:
        """These deliveries left this process. By (id, token): a task settled as a
        retry can be back in its stream and claimed here again before this runs; its
        new delivery stays held (its lease extended, its figures kept)."""
        gone: list[Lease] = []
        with self.lock:
            for i, token in leases:
                t = self.held.get(i)
                if t is not None and t.token != token:
                    continue
                self.held.pop(i, None)
                self.submitted.pop(i, None)
                self.cancel.discard(i)
                self.lost.discard(i)
                self.timed_out.discard(i)
                self.deadlines.pop(i, None)
                gone.append((i, token))
        if gone:
            self.monitor.settled(gone)

    def add_cancel(self, ids: Iterable[str]) -> None:
        """A cancel was requested for these held tasks."""
        with self.lock:
            self.cancel.update(ids)
            self.changed.notify_all()

    def mark_lost(self, ids: Iterable[str]) -> None:
        """These tasks' leases were lost (or their streams cannot go on): a generator
        stops generating the ones it runs."""
        with self.lock:
            self.lost.update(i for i in ids if i in self.held)

    def lose_all(self) -> None:
        """Every held task is to stop (the outlet died: their streams have holes)."""
        with self.lock:
            self.lost.update(self.held)

    def take_aborted(self) -> tuple[set[str], set[str]]:
        """(cancelled ids, lost ids) now; the lost marks are taken (the engine drops
        those tasks), the cancel marks stay until the tasks are forgotten."""
        with self.lock:
            cancel = set(self.cancel)
            lost = set(self.lost)
            self.lost.clear()
        return cancel, lost

    def cancelled(self, task_id: str) -> bool:
        with self.lock:
            return task_id in self.cancel

    def set_busy(self, busy: bool, current: int) -> None:
        """The model thread started (or ended) a batch of ``current`` tasks."""
        with self.lock:
            self.busy = busy
            self.current = current
            if not busy:
                self.last_busy = time.time()
