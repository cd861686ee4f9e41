"""The publisher: a worker's outcomes and chunks to Redis, from a thread of its own.

It settles outcomes (acks with results, retries, failures) in one pipelined round
trip for everything that finished since its last trip. A
:class:`~mtq.workers.generator.Generator` publishes from a process of its own
instead (:class:`~mtq.workers.outlet.Outlet`, the same
:class:`~mtq.workers.protocols.OutcomeSink`); the thread is its fallback. An idle
worker's model thread settles a dynamic batch's last outcomes itself
(:meth:`Publisher.settle_here`).
"""

from __future__ import annotations

import logging
import queue as queue_mod
import time
from collections.abc import Callable, Sequence

from mtq.broker.connection import single_attempt
from mtq.broker.consumer import OUTCOME_COUNTERS, Chunk, Consumer, Outcome, SettleReport
from mtq.broker.lane import yielding
from mtq.workers.batching import BatchSlot
from mtq.workers.batchlog import BatchLog
from mtq.workers.ledger import Lease, Ledger, Tally
from mtq.workers.protocols import OutcomeSink

log = logging.getLogger("mtq.workers.worker")  # the worker's log, as its users read it


class Publisher:
    """Routes outcomes to the outlet or its own thread, settles them, counts them.

    It is the worker's :class:`~mtq.workers.protocols.OutcomeSink` (its thread) and
    the :class:`~mtq.workers.protocols.SettleReports` its outlet reports to."""

    def __init__(self, consumer: Consumer, ledger: Ledger, tally: Tally, slot: BatchSlot,
                 batchlog: BatchLog, *, interval_s: Callable[[], float],
                 wake: Callable[[], None]) -> None:
        self.consumer = consumer
        self.ledger = ledger
        self.tally = tally
        self.slot = slot
        self.batchlog = batchlog
        #: the model's stream_interval_ms now, in seconds (it may change on a reload)
        self.interval_s = interval_s
        #: after a trip: a draining worker's fetcher looks again (Fetcher.wake_if_draining)
        self.wake = wake
        #: a generator's publisher process (see mtq.workers.outlet); None: the thread
        self.outlet: OutcomeSink | None = None
        self._outbox: queue_mod.SimpleQueue[list[Outcome | Chunk] | None] = \
            queue_mod.SimpleQueue()

    # -- the model thread's side ---------------------------------------------------
    def publish(self, items: list[Outcome | Chunk], last: bool = False) -> None:
        """Hand outcomes and chunks to the outlet process, or the publisher thread;
        ``last`` (the model thread, with a dynamic batch's last outcomes): settle them
        here if nothing else waits (see :meth:`settle_here`)."""
        if self.batchlog.open:  # traced tasks run: close those that ended
            self.batchlog.ended(items)
        if last and self.settle_here(items):  # type: ignore[arg-type]
            return
        if self.outlet is None or not self.outlet.put(items):
            self.put(items)

    def put(self, items: Sequence[Outcome | Chunk]) -> bool:
        """The thread's side of :class:`~mtq.workers.protocols.OutcomeSink`: always taken."""
        with self.ledger.lock:
            self.ledger.unsettled += 1
        self._outbox.put(items)  # type: ignore[arg-type]
        return True

    def settle_here(self, outcomes: list[Outcome]) -> bool:
        """Settle a batch's last outcomes in the model thread, when no batch waits in the
        slot and the publisher has nothing in hand: the model thread would only go to
        sleep, and the hand-off to the publisher (its wake-up, a switch of the GIL) is
        saved on every round trip of an idle worker. Under load the next batch waits
        in the slot, and the publisher settles while the model runs it.

        One try (:class:`single_attempt`): False if it failed, and the publisher takes
        the outcomes over (retrying with backoff while Redis is away; an ack whose
        reply was lost is then refused by its lease token, never applied twice).
        As the ack's reply comes in, this thread yields its CPU once (lane.yielding),
        before it reads the reply: Redis published the outcome to the task's client in
        the same moment, and a client on the same CPU (a co-located web app, the
        benchmarks) reads it before this thread's bookkeeping runs."""
        if not outcomes or self.outlet is not None or self.ledger.unsettled or len(self.slot):
            return False
        try:
            with single_attempt(), yielding():
                report = self.consumer.settle(outcomes)
        except Exception as exc:  # Redis unreachable (or worse): the publisher's way
            log.debug("settling %d task(s) failed (%s); the publisher retries",
                      len(outcomes), exc)
            return False
        self.record(report)
        self.ledger.forget([(o.task.id, o.task.token) for o in outcomes])
        self.wake()  # as the publisher does (see loop)
        return True

    # -- the thread ------------------------------------------------------------------
    def loop(self) -> None:
        done = False
        last = 0.0
        outbox = self._outbox
        while not done:
            item = outbox.get()
            gap = self.interval_s() - (time.monotonic() - last)
            if gap > 0 and item is not None:  # let a few decode steps' tokens gather
                time.sleep(gap)
            last = time.monotonic()
            batch: list[Outcome | Chunk] = []
            took = 0  # lists taken from the outbox (see Ledger.unsettled)
            if item is None:
                done = True
            else:
                batch.extend(item)
                took += 1
            while True:  # everything that finished meanwhile goes in the same trip
                try:
                    more = outbox.get_nowait()
                except queue_mod.Empty:
                    break
                if more is None:
                    done = True
                else:
                    batch.extend(more)
                    took += 1
            if batch:
                outcomes = [o for o in batch if isinstance(o, Outcome)]
                chunks = [c for c in batch if isinstance(c, Chunk)]
                try:
                    self.settle(outcomes, give_up_after=10.0 if done else None, chunks=chunks)
                except Exception:  # never let the publisher die: nothing would settle again
                    log.exception("settling %d task(s) failed; they run again when their "
                                  "leases expire", len(outcomes))
                    self.ledger.forget([(o.task.id, o.task.token) for o in outcomes])
            with self.ledger.lock:
                self.ledger.unsettled -= took
            # a stream's next task may be claimable now, or the queue is empty
            self.wake()

    def close(self) -> None:
        """The thread settles what it has and ends (after the outlet is closed)."""
        self._outbox.put(None)

    def settle(self, outcomes: list[Outcome], give_up_after: float | None,
               chunks: Sequence[Chunk] = ()) -> None:
        report = self.consumer.settle_retrying(outcomes, chunks, give_up_after)
        if report is not None:
            self.record(report)
        self.ledger.forget([(o.task.id, o.task.token) for o in outcomes])

    # -- SettleReports ---------------------------------------------------------------
    def record(self, report: SettleReport) -> None:
        ledger = self.ledger
        totals = self.tally.totals
        with ledger.lock:  # the publisher and the model thread (settle_here) both record
            for name in OUTCOME_COUNTERS:
                totals[name] += getattr(report, name)
            totals["lost"] += len(report.lost)
            totals["tokens"] += report.streamed
            if report.stream_lost:
                ledger.lost.update(i for i in report.stream_lost if i in ledger.held)
        if report.lost:
            log.warning("lease lost on %d task(s); their results were discarded", len(report.lost))

    def settled(self, leases: Sequence[Lease]) -> None:
        """The outlet settled (or gave up) these deliveries."""
        self.ledger.forget(leases)
        self.wake()  # a stream's next task may be claimable now
