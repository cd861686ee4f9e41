"""The heartbeat: extends the leases of every task a worker process holds, reports to
the worker registry, picks up cancel requests, writes the histograms and runs the
reaper on a schedule, from a thread of its own."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from mtq.broker import registry
from mtq.broker.cluster import shared
from mtq.broker.connection import redis_errors
from mtq.broker.consumer import Consumer, Outcome
from mtq.broker.keys import QUEUES, QueueKeys
from mtq.errors import BrokerError, ConfigError
from mtq.observe.histograms import Histograms
from mtq.settings import QueueSettings
from mtq.workers.batching import BatchSlot
from mtq.workers.batchlog import BatchLog
from mtq.workers.ledger import Ledger, Tally
from mtq.workers.outcomes import Outcomes

log = logging.getLogger("mtq.workers.worker")  # the worker's log, as its users read it

#: how often the heartbeat reports to the registry (leases are extended at least
#: every lease/3, whichever comes first)
BEAT_S = 1.0
#: what reading the queue's settings raises when they could never be read (Redis
#: away since the start, or stored settings it cannot parse): the defaults stand
SETTINGS_UNREAD = (BrokerError, ConfigError)


class Heartbeat:
    """Leases, registry, cancels, histograms and the reaper, for one worker."""

    def __init__(self, consumer: Consumer, ledger: Ledger, tally: Tally, slot: BatchSlot,
                 batchlog: BatchLog, stats: Histograms, outcomes: Outcomes, *,
                 publish: Callable[[list[Any]], None],
                 report: Callable[[float], dict[str, Any]],
                 tick: Callable[[], None] | None = None) -> None:
        self.consumer = consumer
        self.ledger = ledger
        self.tally = tally
        self.slot = slot
        self.batchlog = batchlog
        self.stats = stats
        self.outcomes = outcomes
        #: hands outcomes to be settled (the worker's publisher)
        self.publish = publish
        #: the worker's registry entry, given its task rate
        self.report = report
        #: called once a beat (the engine's idle unload)
        self.tick = tick
        #: set once the running batch is settled: leases are extended until then
        self.stop = threading.Event()
        #: the lease it last extended with (s; 0 before its first beat): the child's
        #: beat tells it to the supervisor, which fences off a frozen process within
        #: part of it (mtq.workers.fencing)
        self.lease_s = 0.0

    def loop(self) -> None:
        last_reap = time.monotonic()
        totals = self.tally.totals
        last_tasks, last_t = 0, time.monotonic()
        c = self.consumer
        while True:
            # the queue's lease may change while it runs (mtq queue config): the beat
            # follows it, or leases shortened under it would expire
            lease_ms = self.lease_ms()
            self.lease_s = lease_ms / 1000
            interval = min(BEAT_S, lease_ms / 3000)
            reap_every = max(interval, lease_ms / 2000)
            try:
                self.batchlog.spans()
                self.extend()
                now = time.monotonic()
                rate = (totals["tasks"] - last_tasks) / max(now - last_t, 1e-6)
                last_tasks, last_t = totals["tasks"], now
                self.read_settings()
                registry.beat(c.redis, c.worker_id, self.report(rate),
                              ttl_s=max(3 * interval, 5.0), extra=self.batchlog.write)
                self.batchlog.written()
                self.flush_stats()
                if now - last_reap >= reap_every:
                    c.reap()
                    last_reap = now
                if self.tick is not None:
                    self.tick()
            except BrokerError as exc:  # Redis away: one line, no traceback
                log.warning("heartbeat failed (%s); will retry", exc)
            except Exception:  # a report that cannot be encoded
                log.warning("heartbeat failed; will retry", exc_info=True)
            if self.stop.wait(interval):
                return

    def lease_ms(self) -> int:
        try:
            return self.consumer.settings.lease_ms
        except SETTINGS_UNREAD:  # the settings could never be read
            return QueueSettings.lease_ms

    def extend(self) -> None:
        ledger = self.ledger
        with ledger.lock:
            tasks = list(ledger.held.values())
        if not tasks:
            return
        lost, cancel = self.consumer.extend(tasks)
        tokens = {t.id: t.token for t in tasks}
        if cancel:
            ledger.add_cancel(cancel)
            dropped = self.slot.remove(set(cancel), tokens)
            if dropped:  # not started: settle them as cancelled now
                self.publish([Outcome(t, ok=False, cancelled=True) for t in dropped])
        if lost:
            ledger.forget([(t.id, t.token) for t in self.slot.remove(set(lost), tokens)])
            ledger.mark_lost(lost)  # a generator stops generating the ones it runs

    # -- histograms (mtq.observe.histograms) ------------------------------------------------
    def read_settings(self) -> None:
        """Follow the queue's ``metrics``, ``max_retries`` and diagnostics settings."""
        try:
            s = self.consumer.settings
        except SETTINGS_UNREAD:  # never read: the defaults stand
            return
        self.stats.enabled = s.metrics
        self.outcomes.max_retries = s.max_retries
        self.outcomes.aborts.configure(s)  # run timeouts, the grace of an aborted call
        self.batchlog.settings = s  # the diagnostics' bounds

    def flush_stats(self) -> None:
        """Write the histograms gathered since the last write (one MULTI/EXEC: applied
        whole or not at all; kept for the next beat when Redis cannot be reached). Two
        round trips a beat, only when there is something to write."""
        c = self.consumer
        try:
            with redis_errors("while writing the histograms"):
                pipe = c.redis.pipeline(transaction=True)
                key = QueueKeys(c.queue).hist
                sent = self.stats.flush(pipe, key)
                if sent is None:
                    return
                # an idle queue's histograms go (docs/operations.md, diagnostics)
                pipe.pexpire(key, self.batchlog.settings.diagnostics_ttl_s * 1000)
                # a queue deleted under its workers (mtq queue delete --force) stays
                # deleted: what they observed of it is dropped, not written back
                if shared(c.redis).sismember(QUEUES, c.queue):
                    pipe.execute()
                self.stats.commit(sent)
        except BrokerError as exc:
            log.warning("could not write the histograms (%s); kept for the next beat", exc)
