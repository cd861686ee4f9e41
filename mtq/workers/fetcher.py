"""The fetcher: claims tasks into the batch slot, claims ahead, waits for work, and
gives back what will not run here.

It claims tasks into the :class:`~mtq.workers.batching.BatchSlot` (one round trip
per claim), keeping up to one batch claimed ahead while the model runs (two or more
for a fast model on a deep queue, many small ones in a claim: see
:meth:`Fetcher.claim_ahead`), and sleeps on the wake list (BLPOP) when there is
nothing to claim. While the worker is registered for direct delivery and its model
is fast, that wait is offered to the model thread (:meth:`Fetcher.wait_here`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from mtq.broker.connection import Backoff
from mtq.broker.consumer import Consumer
from mtq.broker.protocol import Claimed
from mtq.errors import BrokerError, RedisUnavailable
from mtq.observe.histograms import Histograms
from mtq.workers.batching import NOT_TAKEN, BatchSlot
from mtq.workers.ledger import Ledger, Lifecycle, Monitor

log = logging.getLogger("mtq.workers.worker")  # the worker's log, as its users read it

#: a batch that ran in less than this is a fast model's: while its claims come back
#: full, the fetcher keeps two batches claimed ahead (see Fetcher.claim_ahead)
FAST_BATCH_S = 0.01
#: ... or, when its batches are small, as many as hold about this much of its work (by
#: its last batch), in claims of many batches each ...
AHEAD_WORK_S = 0.002
#: ... and no more tasks than this (a claim the size of the default batch)
AHEAD_MOST = 64


class Fetcher:
    """Claiming, claim-ahead, waiting for work and giving back, for one worker."""

    def __init__(self, consumer: Consumer, ledger: Ledger, life: Lifecycle, slot: BatchSlot,
                 monitor: Monitor, stats: Histograms, *, quarantine: bool, hand_off: bool,
                 on_drained: Callable[[], None]) -> None:
        self.consumer = consumer
        self.ledger = ledger
        self.life = life
        self.slot = slot
        self.monitor = monitor
        self.stats = stats
        #: a quarantine process claims nothing: its tasks come from the supervisor
        self.quarantine = quarantine
        #: offer the suspects it claims to the supervisor (Monitor.quarantine)
        self.hand_off = hand_off
        #: called once the drained queue is empty (the worker stops)
        self.on_drained = on_drained
        #: it sleeps on Redis now (whoever makes a draining worker idle wakes it)
        self.sleeping = False

    # -- waking --------------------------------------------------------------------
    def interrupt(self) -> None:
        try:
            self.consumer.interrupt()
        except BrokerError as exc:
            log.warning("could not wake the fetcher (%s)", exc,
                        exc_info=not isinstance(exc, RedisUnavailable))

    def wake_if_draining(self) -> None:
        """After a settle: a draining worker's fetcher checks whether a stream's next
        task is claimable now, or the queue is empty."""
        if self.life.draining and self.sleeping:
            self.interrupt()

    # -- the loop --------------------------------------------------------------------
    def loop(self) -> None:
        if self.quarantine:  # its tasks come from the supervisor
            self.life.stop.wait()
            return
        c = self.consumer
        slot = self.slot
        backoff = Backoff()
        in_doubt = False  # a claim failed: it may have run, its reply lost with the connection
        handed = False  # its last wait returned tasks handed over (taken already)
        tasks: list[Claimed] = []
        while True:
            if c.registered and (slot.paused or slot.full()):
                # paused (or reloading), or its slot filled by what it was handed, with
                # its registration left: a submit must not hand it tasks it would hold
                # unstarted until it resumes or has room (another worker may be idle)
                self.retire()
            need = slot.wait_space()
            if need <= 0:
                return
            # handed over: it sleeps again while registered, else claims
            if not (handed and c.registered):
                try:
                    if in_doubt:
                        self.release_unknown()
                        in_doubt = False
                    # registered (it took all there was) with the room of one claim at
                    # most, however many it claims ahead (see claim_ahead), sized to
                    # its work (mtq.workers.claims)
                    tasks = c.claim(need, room=slot.unit())
                    now = time.monotonic()
                    backoff.reset()
                except Exception as exc:  # Redis unreachable, or a reply we did not expect
                    in_doubt = True
                    delay = backoff.next()
                    (log.warning if backoff.failures in (1, 2) else log.debug)(
                        "claim failed (%s); retrying in %.2f s", exc, delay,
                        exc_info=not isinstance(exc, RedisUnavailable))
                    if self.life.stop.wait(delay):
                        return
                    continue
                full = len(tasks) == need
                self.claim_ahead(full)
                tasks = self.accept(tasks, now)
                if full:
                    continue
            handed = False
            # set before the drain check: whoever makes the worker idle after the check
            # sees it and wakes the fetcher (see wake_if_draining)
            self.sleeping = True
            woke: list[Claimed] | bool = False
            try:
                if self.life.draining and not tasks and c.next_timer_ms < 0 and self.idle():
                    log.info("worker %s drained the queue; stopping", c.worker_id)
                    self.on_drained()
                    return
                woke = self.wait()
            except BrokerError as exc:
                # the wake-up may have been lost with the connection, or tasks handed
                # over: claim again now, after giving back any such (see release_unknown)
                log.debug("waiting for work failed (%s); claiming again", exc)
                in_doubt = True
                if self.life.stop.wait(backoff.next()):
                    return
            finally:
                self.sleeping = False
            if isinstance(woke, list):
                # a slot they filled ends the registration (above), and the loop waits
                # for room before it waits for more
                tasks = self.take_handed(woke)
                handed = True

    def take_handed(self, tasks: list[Claimed]) -> list[Claimed]:
        """Take tasks a submit handed over (the fetcher's wait, or the model thread's in
        its place) at once: held, so their leases are kept, whatever room the slot has."""
        self.claim_ahead(not self.consumer.registered)
        return self.accept(tasks, time.monotonic())

    def accept(self, tasks: list[Claimed], now: float) -> list[Claimed]:
        """Take claimed or handed-over tasks into the slot (the fetcher, or the model
        thread waiting in its place): suspects go to the supervisor's quarantine, the
        rest are held, and given back if the slot refuses them (paused, closed).
        Returns the tasks less those sent to the quarantine."""
        if self.hand_off and any(t.suspect for t in tasks):
            # a process died running these: under a supervisor they run in its
            # quarantine process, so that if they kill it again, no batch is lost
            handed = [t for t in tasks if t.suspect and self.monitor.quarantine(t)]
            if handed:
                self.ledger.handed.update((t.id, t.token) for t in handed)
                tasks = [t for t in tasks if t not in handed]
        if tasks:
            self.ledger.hold(tasks)
            if self.stats.enabled:
                waits = [t.age_ms / 1000 for t in tasks]
                self.ledger.submitted.update((t.id, now - w) for t, w in zip(tasks, waits))
                self.stats.observe_many("queue_wait", waits)
            self.monitor.held([(t.id, t.token) for t in tasks])
            refused = self.slot.put(tasks, now)
            if refused:
                self.give_back(refused)
        return tasks

    # -- waiting ---------------------------------------------------------------------
    def wait(self) -> list[Claimed] | bool:
        """Consumer.wait, for the fetcher. While the worker is registered for direct
        delivery (idle, a queue with nothing to claim) and its model is fast, the wait
        is offered to the model thread, which takes it when it has nothing to run: a
        submit then wakes the thread that runs the task, and the hand-off from the
        fetcher (a wake-up, a switch of the GIL) is saved on every round trip (see
        docs/benchmarks.md, Hot path). The fetcher sleeps until the wait comes back with
        anything but a task to run now. Only for a model whose tasks run as soon as
        they come (``max_wait_ms`` 0): a batch that waits to fill needs the fetcher
        collecting hand-offs meanwhile."""
        c = self.consumer
        if c.registered and not self.life.draining and self.ledger.batch_s < FAST_BATCH_S \
                and self.slot.max_wait_s == 0:
            got = self.slot.offer_wait()
            if isinstance(got, BrokerError):
                raise got
            if got is not NOT_TAKEN:
                return got
        return c.wait()

    def wait_here(self) -> None:
        """The fetcher's wait on Redis, offered to the model thread (see :meth:`wait`):
        wait for work (Consumer.wait). Tasks handed over are taken as the fetcher takes
        them (:meth:`take_handed`) and run next, and the wait stays here while the
        worker is registered; anything else (a wake-up marker, the end of the
        registration, an error) goes back to the fetcher."""
        c = self.consumer
        if self.ledger.batch_s >= FAST_BATCH_S:  # the model showed itself slow meanwhile
            self.slot.return_wait(NOT_TAKEN)
            return
        try:
            woke = c.wait()
        except BrokerError as exc:  # the fetcher's business (see loop)
            self.slot.return_wait(exc)
            return
        if not (isinstance(woke, list) and woke):
            self.slot.return_wait(woke)
            return
        self.take_handed(woke)
        if not (c.registered and self.slot.max_wait_s == 0):
            self.slot.return_wait(True)  # the fetcher claims, or waits for more

    def claim_ahead(self, full: bool) -> None:
        """How many batches the fetcher keeps claimed ahead, after a claim: one, or, while
        the claims come back full (a deep queue) and the model's last batch ran in less
        than FAST_BATCH_S, two; and more than two when its batches are small: as many
        as hold AHEAD_WORK_S of its work by its last batch, AHEAD_MOST tasks at most.

        The model thread's Python holds the GIL while it runs a batch, so the claim the
        fetcher makes when the model takes a batch goes out only when that batch ends:
        with one batch ahead, a fast model then waits for that claim's round trip after
        every batch (Redis and the worker take turns instead of overlapping; see
        docs/workers.md, Dynamic batching). A slow model hides the claim behind its
        batch and keeps one, so that on a queue shared by several workers the last
        batches spread over them; a generator keeps one (its running batch holds places
        in the slot; only dynamic batches set Ledger.batch_s).

        Small batches of a fast model (``--max-batch-size 1`` of a function that returns
        in microseconds) would otherwise cost a claim, with its fixed cost in Redis and
        in this process, for every batch or two. With more than two batches ahead the
        fetcher waits until half of them are taken, then claims all the room in one
        call (the slot's refill); one that comes back short registers the worker idle
        with the room of one batch, as any other claim (the most one submit hands it).
        The work held stays under AHEAD_WORK_S beyond the two batches, so the last
        tasks of a queue still spread over its workers.

        A "batch" here is a claim of :meth:`BatchSlot.unit` tasks: for a model that runs
        its tasks one after another, as many as hold about CLAIM_AHEAD_S of its work
        (mtq.workers.claims), one task of a slow function."""
        batch_s = self.ledger.batch_s
        if not (full and batch_s < FAST_BATCH_S):
            self.slot.claim_ahead(1)
            return
        size = self.slot.unit()  # a claim's size (mtq.workers.claims)
        fit = AHEAD_MOST if batch_s <= 0 else \
            min(AHEAD_MOST, int(AHEAD_WORK_S * self.ledger.batch_n / batch_s))
        ahead = max(2, fit // size)
        self.slot.claim_ahead(ahead, ahead * size // 2 if ahead > 2 else 0)

    # -- giving back -------------------------------------------------------------------
    def release_unknown(self) -> None:
        """After a claim (or a wait) whose reply was lost: give back the tasks Redis shows
        running under this worker that it does not hold (that claim ran, or a submit
        handed them over), uncounted. Its idle registration goes first, so that nothing
        is handed over while it looks."""
        c = self.consumer
        ledger = self.ledger
        c.retire()
        mine = c.broker.orphans(c.worker_id)
        ledger.handed &= set(mine)  # those no longer running are done with
        with ledger.lock:
            unknown = [(i, t) for i, t in mine
                       if i not in ledger.held and (i, t) not in ledger.handed]
        if unknown:
            n = c.release_leases(unknown)
            log.info("worker %s: gave back %d task(s) of a claim whose reply was lost",
                     c.worker_id, n)

    def idle(self) -> bool:
        """Nothing running, waiting in the slot or waiting to be settled here."""
        ledger = self.ledger
        with ledger.lock:
            return not ledger.busy and not ledger.held and len(self.slot) == 0

    def retire(self) -> None:
        """No more direct deliveries: take the idle registration back, and give back what
        was handed over and not taken."""
        if not self.consumer.direct:
            return
        try:
            handed = self.consumer.retire()
        except BrokerError as exc:
            log.warning("could not take back the idle registration (%s); tasks handed to "
                        "this worker as it stopped return when their leases expire", exc,
                        exc_info=not isinstance(exc, RedisUnavailable))
            return
        self.give_back(handed)

    def give_back(self, tasks: Sequence[Claimed]) -> None:
        """Release unstarted tasks to the head of their streams (no delivery counted)."""
        if not tasks:
            return
        try:
            self.consumer.release(tasks)
        except BrokerError as exc:
            log.warning("could not give back %d task(s) (%s); they return when their leases "
                        "expire", len(tasks), exc, exc_info=not isinstance(exc, RedisUnavailable))
        self.ledger.forget([(t.id, t.token) for t in tasks])
