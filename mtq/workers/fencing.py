"""Fencing: the supervisor kills a child that no longer answers for its calls.

Three things end a child from outside, each without asking Redis:

* **An overrun.** A predict call that runs past its engine's ``timeout_s`` (the
  shared array says when it started): a hung kernel cannot be interrupted from a
  thread.
* **A freeze.** Each child proves it is alive with a thread of its own
  (:class:`mtq.workers.beat.Beat`) that writes ``time.monotonic()`` into the shared array every
  :data:`~mtq.workers.beat.BEAT_EVERY_S`, and its engines' leases beside it; it touches no Redis and
  no lock of the worker's, so a Redis outage or a long CPU-bound predict (the
  interpreter switches threads every few milliseconds) does not stop it. A child
  whose beat is older than its fence (:func:`fence_s`: :data:`MARGIN_S` before the
  earliest its leases could run out, and at least half the smallest lease of its
  engines and :data:`FENCE_FLOOR_S`) is frozen:
  stopped (SIGSTOP, a paused cgroup), or inside a call that holds the interpreter
  (a hung driver call), or starved of CPU. The supervisor kills it (SIGKILL) and
  handles it as a death: its tasks go back at once, the running call's counted
  (the call may be what hung the driver: a request that does so every time ends
  dead-lettered after ``max_deliveries``), and the process is replaced.

* **An abandoned call.** Every task of an engine's running call was cancelled or
  timed out, and the worker said so (:meth:`PipeMonitor.aborted
  <mtq.workers.child.PipeMonitor.aborted>`, with the grace, the queue's
  ``cancel_grace_s``); the call still runs when the grace ends (the shared array
  shows the same call start: a later call or idle clears it). The process is
  killed; those tasks end as their stops say (cancelled; a TaskTimeout failure,
  retried under the task's retry policy: as the worker would have settled them),
  and everything else it held goes back uncounted: it was not their fault
  (:func:`mtq.workers.children.give_back`).

Why this fence. A worker extends its leases every ``min(1 s, lease/3)``, so a
process frozen at time F last extended at F - min(1 s, lease/3) at worst, and Redis
may give its tasks to another worker from F + lease - min(1 s, lease/3) on (7 s at
the default 8 s lease). The fence comes :data:`MARGIN_S` before that (6 s), so a
process that merely holds the interpreter for a long call (a huge ``json.loads``)
is killed only when its leases were about to go anyway: from outside it cannot be
told from a frozen one. The margin is for the supervisor's own latency (its timer,
a loaded machine); the kill itself and the give-back take milliseconds. Under short
leases the margin would eat the fence, so the fence is never under half a lease
(2/3 of a lease is the earliest reclaim there, a sixth of it is left), nor under the
floor, which keeps a scheduling hiccup from killing a process: with a lease under
1.5 s it may leave less than 0.25 s for the kill, and under 1 s the fence can come
after the reclaim.

A supervisor that wakes up late (stopped or starved itself: a whole host frozen,
supervisor included) does not count its own gap against its children: their beats
are judged from when it resumed, so each gets a whole fence to beat again. They
were frozen with it, and their leases, if lost, are dealt with by the lease checks
before every call (see docs/guarantees.md for what remains).

Only a child that reported itself ready is fenced (it holds no task before), and
not a warm standby (it holds none), nor one that said goodbye or was already
killed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from mtq.workers import child
from mtq.workers.children import Abort, Child

#: a child whose beat is older than its fence is killed: this long (s) before the
#: earliest its leases could run out (lease - min(1 s, lease/3) after its last beat) ...
MARGIN_S = 1.0
#: ... but never before this share of its smallest lease ...
FENCE_FRACTION = 0.5
#: ... nor before this (s)
FENCE_FLOOR_S = 0.5
#: the supervisor itself woke this much later than it asked: it was stopped or
#: starved, with its children (a whole host frozen), whose beats are then judged
#: from when it resumed
LATE_S = 0.25


def fence_s(lease_s: float) -> float:
    """How old a child's beat may be before it is killed, given its smallest lease."""
    reclaim = lease_s - min(1.0, lease_s / 3)  # the earliest its tasks can go elsewhere
    return max(FENCE_FLOOR_S, FENCE_FRACTION * lease_s, reclaim - MARGIN_S)


class Fence:
    """The supervisor's side: when each running child is next due a look, and the
    kill of one that overran its timeout or froze."""

    def __init__(self, lease_s: float, host: bool, on_event: Callable[[str], None]) -> None:
        #: the lease assumed for a child that has not told its own yet (the smallest
        #: of the supervisor's queues, read at its start)
        self.lease_s = lease_s
        self.host = host
        self.on_event = on_event
        #: when the loop asked to be woken for a fence (monotonic), and when it last
        #: woke late (its children's beats count from then at the oldest)
        self._due: float | None = None
        self._resumed = 0.0

    def child_fence_s(self, c: Child) -> float:
        """``c``'s fence: from the smallest lease of its engines."""
        leases = [x for i in range(len(c.engines))
                  if (x := float(c.shared[child.at(i, child.LEASE)])) > 0]
        return fence_s(min(leases, default=self.lease_s))

    @staticmethod
    def beat(c: Child) -> float:
        """When ``c`` last proved it was alive (monotonic)."""
        return float(c.shared[child.beat_at(len(c.engines))]) or c.started

    @staticmethod
    def guarded(c: Child) -> bool:
        return c.ready and not c.killed_for and not c.forced and not c.bye

    # -- an aborted call: every task of it cancelled or timed out ----------------------
    @staticmethod
    def aborted(c: Child, i: int, body: dict[str, Any], now: float) -> None:
        """Engine ``i`` of ``c`` said its running call was wholly cancelled or timed
        out: it is killed if that call still runs ``grace_s`` from now."""
        grace = float(body.get("grace_s") or 0.0)
        c.engines[i].aborted = Abort(list(body.get("tasks") or []), now + grace, grace,
                                     float(body.get("started") or 0.0))

    @staticmethod
    def abandoned(c: Child, now: float) -> tuple[int, float | None]:
        """(an engine whose aborted call still runs past its grace, or -1; seconds
        until the next such grace ends, or None). An aborted call that ended (its
        engine's call start changed) is forgotten."""
        nxt: float | None = None
        for i, e in enumerate(c.engines):
            a = e.aborted
            if a is None:
                continue
            if c.predict_started(i) != a.started:  # that call ended: nothing to kill
                e.aborted = None
                continue
            if now >= a.until:
                return i, 0.0
            nxt = a.until - now if nxt is None else min(nxt, a.until - now)
        return -1, nxt

    def deadline(self, now: float, running: Iterable[Child]) -> float | None:
        """Seconds until a running child may overrun its timeout, be due its fence, or
        end the grace of an aborted call."""
        out: float | None = None
        due: float | None = None  # (without the looks below: what lateness is judged by)
        for c in running:
            if c.killed_for or c.forced:  # a killed one is waited for by its sentinel
                continue
            d = c.next_timeout(now)
            _, grace = self.abandoned(c, now)
            if grace is not None:
                d = grace if d is None else min(d, grace)
            look = d
            if self.guarded(c):
                f = self.last(c) + self.child_fence_s(c) - now
                d = f if d is None else min(d, f)
                # looked at again within the floor at most: a lease shortened meanwhile
                # (mtq queue config) is fenced by the new one, not the one slept on
                look = min(d, FENCE_FLOOR_S)
            if d is not None:
                due = d if due is None else min(due, d)
            if look is not None:
                out = look if out is None else min(out, look)
        self._due = None if due is None else now + max(due, 0.0)
        return out

    def last(self, c: Child) -> float:
        """``c``'s last sign of life as the fence judges it: its beat, or when the
        supervisor last resumed from a freeze of its own, whichever is later."""
        return max(self.beat(c), self._resumed)

    def _late(self, now: float) -> None:
        """Note a wake-up that came late (the supervisor was frozen or starved itself,
        as a whole frozen host is): its children, frozen with it, are judged from now."""
        if self._due is not None and now > self._due + LATE_S:
            self._resumed = now
        self._due = None

    def check(self, now: float, running: Iterable[Child]) -> None:
        """Kill the children whose predict call overran its timeout, or that froze."""
        self._late(now)
        for c in running:
            if c.killed_for:
                continue
            who = "the quarantine process" if c.quarantine else f"worker {c.slot}"
            i = c.overrunning(now)
            if i is not None:
                e = c.engines[i]
                of = f" of queue {e.queue!r}" if self.host else ""
                c.killed_for, c.overran = f"predict{of} ran past its {e.timeout_s:g} s timeout", i
                self.on_event(f"{who} ({e.worker_id}): {c.killed_for}; killing it")
                c.process.kill()
                continue
            j, _ = self.abandoned(c, now)
            if j >= 0 and not c.forced:
                a = c.engines[j].aborted
                assert a is not None
                whys = {t[5] for t in a.tasks}
                what = "cancelled or timed out" if len(whys) > 1 else \
                    "timed out" if whys == {"timeout"} else "cancelled"
                c.killed_for = (f"its call of {len(a.tasks)} task(s), all {what}, still ran "
                                f"{a.grace_s:g} s later; killed")
                c.abandoned = True
                c.process.kill()
                continue
            if not self.guarded(c):
                continue
            age, fence = now - self.last(c), self.child_fence_s(c)
            if age > fence:
                # one line: the reap says it (the process dies at once, stopped or not)
                c.killed_for = (f"frozen: no sign of life for {age:.2f} s, past its fence of "
                                f"{fence:g} s; killed, its tasks given back")
                c.process.kill()
