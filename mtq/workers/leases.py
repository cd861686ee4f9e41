"""Lease checks before every call of the model: never run a task whose lease this
process cannot show to be live.

A lease is known live until its claim or last extend was sent plus the lease
(local monotonic clock, which keeps counting while a process is stopped). The
heartbeat extends every lease at least every lease/3, so a task known live for
less than :data:`REVALIDATE_BELOW` of a lease more is rare: the process was
frozen, starved or cut off. Such a task is checked with Redis first (one extend
round trip, from the model thread).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from mtq.broker.connection import Backoff
from mtq.broker.consumer import Consumer
from mtq.broker.protocol import LOST, Claimed
from mtq.errors import BrokerError
from mtq.workers.batching import BatchSlot
from mtq.workers.ledger import Ledger, Lifecycle, Tally

log = logging.getLogger("mtq.workers.worker")  # the worker's log, as its users read it

#: a task whose lease is known live for less than this share of the lease is checked
#: with Redis before the model is called on it (a heartbeat extends every lease/3 at
#: most, so this happens only when the process was frozen, starved or cut off)
REVALIDATE_BELOW = 0.5


class Leases:
    """Checks the leases of held tasks before the model runs them (model thread)."""

    def __init__(self, consumer: Consumer, ledger: Ledger, life: Lifecycle, slot: BatchSlot,
                 tally: Tally) -> None:
        self.consumer = consumer
        self.ledger = ledger
        self.life = life
        self.slot = slot
        self.tally = tally

    def floor(self) -> float:
        """How long a lease must still be known live for a task to run unasked (s)."""
        return self.consumer.lease_s() * REVALIDATE_BELOW

    def live(self, tasks: Sequence[Claimed], floor: float | None = None) -> list[Claimed]:
        """The tasks whose lease this process can show to be live, the others dropped
        unrun (Redis gave them to another worker after their lease ran out). One known
        live for less than ``floor`` more (default :meth:`floor`) is asked about."""
        now = time.monotonic()
        if floor is None:
            floor = self.floor()
        doubtful = [t for t in tasks if t.live_until - now < floor]
        if not doubtful:
            return list(tasks)
        lost = self.revalidate(doubtful)
        return [t for t in tasks if t.id not in lost] if lost else list(tasks)

    def revalidate(self, tasks: Sequence[Claimed]) -> set[str]:
        """Ask Redis which of ``tasks`` this worker still owns (their leases are
        extended); returns the ids of the others, now forgotten. Tasks Redis already
        reported lost are not asked about; if Redis cannot be reached, every task
        asked about is treated as lost (it comes back when its lease expires)."""
        known = {t.id for t in tasks if t.live_until == LOST}
        ask = [t for t in tasks if t.live_until != LOST]
        lost = set(known)
        tokens = {t.id: t.token for t in tasks}
        if ask:
            backoff = Backoff()
            for attempt in range(4):
                try:
                    gone, _cancel = self.consumer.extend(ask)
                    lost.update(gone)
                    break
                except BrokerError:
                    if attempt == 3 or self.life.stop.wait(backoff.next()):
                        log.warning("could not check %d lease(s) with Redis; not running "
                                    "those tasks (they return when their leases expire)",
                                    len(ask), exc_info=True)
                        for t in ask:  # dropped for good: a later check must not revive it
                            t.live_until = LOST
                        lost.update(t.id for t in ask)
                        break
        if lost:
            ledger = self.ledger
            with ledger.lock:  # the same lease: an id may be held again under a new one
                fresh = [i for i in sorted(lost)
                         if i in ledger.held and ledger.held[i].token == tokens[i]]
            if fresh:
                log.warning("worker %s: the lease of %d task(s) ran out while this process "
                            "was stopped or starved; another worker owns them, so they are "
                            "dropped unrun", self.consumer.worker_id, len(fresh))
                self.tally.totals["revoked"] += len(fresh)
                ledger.forget([(i, tokens[i]) for i in fresh])
            self.slot.remove(lost, {t.id: t.token for t in tasks if t.id in lost})
        return lost
