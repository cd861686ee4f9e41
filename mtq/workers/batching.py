"""Dynamic batching: the batch being formed (running it with failure isolation is
:mod:`mtq.workers.splitting`'s).

The fetcher thread claims tasks into a :class:`BatchSlot`; the model thread takes a
batch from it as soon as ``max_batch_size`` tasks are there, or when the oldest has
waited ``max_wait_ms`` since it was *submitted* (the claim reports each task's age
in server time, so the deadline does not depend on clock skew). Deadlines are
kept with a local condition variable: Redis checks blocking timeouts only at its
``hz`` (every 100 ms by default), far too coarse for a 5 ms batching window.

While the model is busy the slot keeps filling, so a batch that waited for the
device is as large as the traffic allows, at no latency cost.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mtq.broker.protocol import Claimed
from mtq.errors import BatchShapeError  # defined there; imported from here too
from mtq.workers.splitting import ItemResult, run_isolated, run_one  # and from here

__all__ = ["NOT_TAKEN", "OFFERED", "BatchShapeError", "BatchSlot", "Costed", "ItemResult",
           "run_isolated", "run_one"]


class _Offered(list):
    """The type of :data:`OFFERED` (told apart by identity)."""


#: what :meth:`BatchSlot.take` returns to the model thread when the fetcher has offered
#: it the wait on Redis (see :meth:`BatchSlot.offer_wait`)
OFFERED: list[Claimed] = _Offered()
#: what :meth:`BatchSlot.offer_wait` returns when the model thread did not take the wait
NOT_TAKEN = object()
#: tasks a slot remembers as having run out of memory alone (see BatchSlot.run_alone)
ALONE_MAX = 1000


@dataclass(slots=True)
class _Pending:
    task: Claimed
    ready_at: float  # monotonic time at which it must run (arrival + max wait)


class BatchSlot:
    """The batch being formed: filled by the fetcher, taken by the model thread."""

    def __init__(self, max_batch_size: int, max_wait_ms: float) -> None:
        lock = threading.RLock()
        self.cond = threading.Condition(lock)
        #: where the fetcher waits while the model thread holds its wait on Redis
        #: (offer_wait): woken when the wait comes back, or the slot is paused, kicked
        #: or closed, and not by every batch put and taken
        self._back = threading.Condition(lock)
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000
        self._pending: list[_Pending] = []
        #: False when no task in the slot is a suspect; True when one may be (set as a
        #: suspect comes in, cleared by the scan that finds none): the slot is scanned
        #: for suspects only then, not at every batch it gives out
        self._suspects = False
        self.paused = False
        self.closed = False
        self._kicked = False
        #: places taken by tasks already out of the slot (a generator's running batch)
        self._reserved = 0
        #: a batch :meth:`take` returns keeps its places until the model thread ends it
        #: (:meth:`reserve` 0): the fetcher claims nothing ahead while it runs (a slow
        #: model on a queue that schedules: see mtq.workers.dynamic)
        self.hold_running = False
        #: batches the fetcher keeps claimed ahead (the worker raises it for a fast model
        #: on a deep queue: see mtq.workers.fetcher.Fetcher.claim_ahead and :meth:`claim_ahead`)
        self.ahead = 1
        #: 0: the fetcher claims as soon as the slot has room, at most a batch a claim;
        #: n > 0: it waits until the slot has room for n tasks, then claims all the room
        #: (many small batches in one claim: see :meth:`claim_ahead`)
        self.refill = 0
        #: tasks per claim, at most max_batch_size (None: max_batch_size): a model that
        #: runs its tasks one after another claims about as many as it starts soon
        #: (mtq.workers.claims); the slot holds :attr:`ahead` claims of this size
        self.claim_size: int | None = None
        #: who waits on Redis for work while the worker is idle: None (the fetcher),
        #: "offered" (the fetcher offers it to the model thread), "taken" (the model
        #: thread waits; see :meth:`offer_wait`)
        self._waiter: str | None = None
        self._waited: Any = None  # what the model thread's wait returned
        #: ids of tasks that ran out of memory alone: when they come back (a retry), they
        #: run alone, in a call of their own (the oldest forgotten past ALONE_MAX)
        self._alone: dict[str, None] = {}
        #: ids of tasks put back as suspects of running out of memory (see put_back)
        self._suspected: dict[str, None] = {}

    def configure(self, max_batch_size: int, max_wait_ms: float) -> None:
        """New limits (after a reload)."""
        with self.cond:
            self.max_batch_size = max_batch_size
            self.max_wait_s = max_wait_ms / 1000
            self.cond.notify_all()

    def set_batch_size(self, max_batch_size: int) -> None:
        """The most tasks a batch takes from now on (the worker lowers it after running
        out of memory, and raises it again): the fetcher claims for batches of that size."""
        with self.cond:
            self.max_batch_size = max_batch_size
            self.cond.notify_all()

    def set_claim_size(self, n: int | None) -> None:
        """Tasks per claim from now on (None: max_batch_size; see mtq.workers.claims)."""
        with self.cond:
            if n != self.claim_size:
                grew = n is None or (self.claim_size is not None and n > self.claim_size)
                self.claim_size = n
                if grew:
                    self.cond.notify_all()  # a fetcher waiting for room may have it now

    def unit(self) -> int:
        """Tasks per claim now: :attr:`claim_size`, at most max_batch_size."""
        n = self.claim_size
        b = self.max_batch_size
        return b if n is None or n > b else n

    def run_alone(self, ids: Sequence[str]) -> None:
        """These tasks ran out of memory alone: when they come back, they run alone (a
        batch model calls predict on each of them on its own, in the batch it takes them
        in; a generator runs them with no other request)."""
        with self.cond:
            for i in ids:
                self._alone[i] = None
            while len(self._alone) > ALONE_MAX:
                del self._alone[next(iter(self._alone))]

    def alone(self, task: Claimed) -> bool:
        """``task`` ran out of memory alone before (see :meth:`run_alone`)."""
        return bool(self._alone) and task.id in self._alone

    def put_back(self, tasks: Sequence[Claimed], suspected: Sequence[str] = ()) -> list[Claimed]:
        """Tasks a batch took and did not run (see mtq.workers.splitting: ``carry``),
        first in the next batch, which they do not make due before ``max_wait_ms`` (the
        slot fills meanwhile); ``suspected``: the ids of those among them that one of
        them, not known which, runs out of memory. Returns those refused (the slot is
        paused or closed), which the caller must give back."""
        with self.cond:
            if self.closed or self.paused:
                return list(tasks)
            due = time.monotonic() + self.max_wait_s
            self._pending[:0] = [_Pending(t, due) for t in tasks]
            for i in suspected:
                self._suspected[i] = None
            while len(self._suspected) > ALONE_MAX:
                del self._suspected[next(iter(self._suspected))]
            self.cond.notify_all()
            return []

    def trim(self) -> list[Claimed]:
        """Take out the tasks beyond what the slot holds now (its claims were made
        smaller: mtq.workers.claims), from the tail; the caller gives them back."""
        with self.cond:
            over = -self._room()
            if over <= 0 or not self._pending:
                return []
            out = [p.task for p in self._pending[-over:]]
            del self._pending[-over:]
            return out

    def suspected_in(self, tasks: Sequence[Claimed]) -> list[int]:
        """The positions in ``tasks`` of those put back as suspected (see
        :meth:`put_back`), no longer suspected once asked about."""
        if not self._suspected:  # nearly always
            return []
        with self.cond:
            out = [j for j, t in enumerate(tasks) if t.id in self._suspected]
            for j in out:
                self._suspected.pop(tasks[j].id, None)
            return out

    def alone_in(self, tasks: Sequence[Claimed]) -> list[int]:
        """The positions in ``tasks`` of those that ran out of memory alone before."""
        if not self._alone:  # nearly always
            return []
        return [j for j, t in enumerate(tasks) if t.id in self._alone]

    def solo(self, task: Claimed) -> bool:
        """``task`` runs with no other: a suspect, or one that ran out of memory alone."""
        return task.suspect or self.alone(task)

    def __len__(self) -> int:
        with self.cond:
            return len(self._pending)

    def ids(self) -> list[Claimed]:
        """The tasks waiting in the slot (a copy)."""
        with self.cond:
            return [p.task for p in self._pending]

    # -- fetcher side -----------------------------------------------------------
    def claim_ahead(self, ahead: int, refill: int = 0) -> None:
        """Hold up to ``ahead`` batches; ``refill``: see :attr:`refill` (the fetcher
        and the model thread both set it, as they take tasks)."""
        with self.cond:
            if (ahead, refill) != (self.ahead, self.refill):
                self.ahead, self.refill = ahead, refill
                self.cond.notify_all()  # a fetcher waiting for room may have it now

    def _room(self) -> int:
        return self.ahead * self.unit() - len(self._pending) - self._reserved

    def wait_space(self) -> int:
        """Block until the slot has room (for :attr:`refill` tasks, if set) and is not
        paused; returns how many tasks to claim (at most a claim's :meth:`unit`, or all
        the room with :attr:`refill`), or 0 once the slot is closed. The slot holds up
        to :attr:`ahead` claims of that size."""
        with self.cond:
            while not self.closed and (self.paused or self._room() < max(1, self.refill)):
                self.cond.wait()
            if self.closed:
                return 0
            room = self._room()
            return room if self.refill else min(self.unit(), room)

    def full(self) -> bool:
        """The slot holds all it may: :meth:`wait_space` waits for room."""
        with self.cond:
            return self._room() <= 0

    def reserve(self, n: int) -> None:
        """``n`` places are held by tasks that left the slot but still count against
        its size (the generator's running batch): the fetcher claims only into the
        room that is left, so idle workers get the rest."""
        with self.cond:
            if n < self._reserved:
                self.cond.notify_all()
            self._reserved = n

    def put(self, tasks: Sequence[Claimed], claimed_at: float) -> list[Claimed]:
        """Add claimed tasks; returns those refused (the slot is paused or closed),
        which the caller must give back."""
        with self.cond:
            if self.closed or self.paused:
                return list(tasks)
            for t in tasks:
                self._pending.append(_Pending(t, claimed_at - t.age_ms / 1000 + self.max_wait_s))
                if t.suspect:
                    self._suspects = True
            self.cond.notify_all()
            return []

    def offer_wait(self) -> Any:
        """Fetcher: offer its wait on Redis (``Consumer.wait``) to the model thread,
        which takes it when it comes back to :meth:`take` with nothing to run, and block
        until the model thread hands it back (:meth:`return_wait`, or :meth:`take`
        when the slot is paused, kicked or closed). Returns what the model thread's
        wait came back with, or :data:`NOT_TAKEN`: the slot was paused, kicked or
        closed before the model thread took the wait (the fetcher waits itself). For
        a slot whose tasks are due at once (``max_wait_ms`` 0: none waits for a batch
        to fill while no one waits on Redis)."""
        with self.cond:
            if self.closed or self.paused or self._kicked:
                return NOT_TAKEN
            self._waiter = "offered"
            self.cond.notify_all()
            while True:
                if self._waiter is None:
                    got, self._waited = self._waited, None
                    return got
                if self._waiter == "offered" and (self.closed or self.paused or self._kicked):
                    self._waiter = None
                    return NOT_TAKEN
                self._back.wait()

    def return_wait(self, got: Any) -> None:
        """Model thread: hand the wait back to the fetcher, with what it returned."""
        with self.cond:
            self._waiter, self._waited = None, got
            self._back.notify_all()

    # -- model side -------------------------------------------------------------
    def _pop_suspect(self) -> Claimed | None:
        """Take the first suspect out of the slot (it killed a worker before: it runs
        alone). Call with the lock held."""
        if not self._suspects:
            return None
        for i, p in enumerate(self._pending):
            if p.task.suspect:
                del self._pending[i]
                self.cond.notify_all()  # room for the fetcher
                return p.task
        self._suspects = False
        return None

    def _pop(self, n: int) -> list[Claimed]:
        """The first ``n`` tasks, taken out of the slot (in place: the slot may hold many
        small batches). Call with the lock held."""
        pending = self._pending
        batch = [p.task for p in pending[:n]]
        del pending[:n]
        self.cond.notify_all()  # room for the fetcher
        return batch

    def take(self) -> list[Claimed] | None:
        """Block until a batch is due and return it; None once closed; [] after
        :meth:`kick` (the caller has something to do between batches); :data:`OFFERED`
        when the slot is empty and the fetcher offered its wait on Redis (the caller
        waits, then hands the wait back with :meth:`return_wait`, or keeps it and
        comes back here, which returns OFFERED again while the slot is empty)."""
        with self.cond:
            while True:
                if self._waiter == "taken" and (self.closed or self.paused or self._kicked):
                    # the model thread holds the wait, and is not in it: back to the
                    # fetcher, which must see this (a paused worker takes nothing)
                    self._waiter, self._waited = None, True
                    self._back.notify_all()
                if self.closed:
                    return None
                if self._kicked:
                    self._kicked = False
                    return []
                pending = self._pending
                if pending and not self.paused:
                    suspect = self._pop_suspect()
                    if suspect is not None:
                        return self._running([suspect])
                    b = self.max_batch_size
                    # (all a claim brings: as full as the batch gets)
                    wait = 0.0 if len(pending) >= b or len(pending) >= self.unit() else \
                        min(p.ready_at for p in pending) - time.monotonic()
                    if wait <= 0:
                        return self._running(self._pop(b))
                    self.cond.wait(wait)
                elif self._waiter is not None and not pending and not self.paused:
                    self._waiter = "taken"
                    return OFFERED
                else:
                    self.cond.wait()

    def _running(self, batch: list[Claimed]) -> list[Claimed]:
        if self.hold_running:  # (under the lock: the fetcher sees no room meanwhile)
            self._reserved = len(batch)
        return batch

    def take_now(self, limit: int, block: bool) -> list[Claimed] | None:
        """Up to ``limit`` tasks at once, without waiting for a batching deadline (the
        continuous-batching engine admits between steps). ``block``: when the slot is
        empty, wait for a task. Returns None once closed, [] after :meth:`kick`.
        A suspect is returned alone (the engine runs it with nothing else)."""
        if not block and not self._pending and not self.closed and not self._kicked:
            return []  # most decode steps: nothing new (no lock taken; a task put just
            # now is taken at the next step)
        with self.cond:
            while True:
                if self.closed:
                    return None
                if self._kicked:
                    self._kicked = False
                    return []
                pending = self._pending
                if pending and not self.paused and limit > 0:
                    suspect = self._pop_suspect()
                    if suspect is not None:
                        return [suspect]
                    return self._pop(limit)
                if not block:
                    return []
                self.cond.wait()

    # -- control ----------------------------------------------------------------
    def kick(self) -> None:
        """Make a waiting :meth:`take` return [] once."""
        with self.cond:
            self._kicked = True
            self.cond.notify_all()
            self._back.notify_all()

    def set_paused(self, paused: bool) -> list[Claimed]:
        """Pause or resume; pausing empties the slot and returns its tasks."""
        with self.cond:
            self.paused = paused
            out = [] if not paused else [p.task for p in self._pending]
            if paused:
                self._pending = []
            self.cond.notify_all()
            self._back.notify_all()
            return out

    def close(self) -> list[Claimed]:
        """Stop both sides; returns the unstarted tasks to give back."""
        with self.cond:
            self.closed = True
            out = [p.task for p in self._pending]
            self._pending = []
            self.cond.notify_all()
            self._back.notify_all()
            return out

    def remove(self, ids: set[str], tokens: dict[str, str] | None = None) -> list[Claimed]:
        """Take the tasks with these ids out of the slot (cancelled, or lease lost).
        ``tokens``: only a task claimed under this token (an id may have been given
        back and claimed again under a new lease meanwhile)."""
        def hit(t: Claimed) -> bool:
            return t.id in ids and (tokens is None or tokens.get(t.id) == t.token)

        with self.cond:
            out = [p.task for p in self._pending if hit(p.task)]
            if out:
                self._pending = [p for p in self._pending if not hit(p.task)]
                self.cond.notify_all()
            return out


@dataclass(frozen=True, slots=True)
class Costed:
    """A result with the cost its item really had, returned by ``predict`` in the
    item's place: ``mtq.Costed(vector, cost=n_tokens)``. The queue's fair share of
    tenants (docs/scheduling.md) charges the task's estimate when it is claimed and
    settles the difference with this when it ends; the client gets ``value``."""

    value: Any
    cost: float
