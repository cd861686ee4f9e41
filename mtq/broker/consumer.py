"""The low-level consumer API that workers are built on.

A :class:`Consumer` claims batches, settles them (ack / retry / fail / dead-letter
/ release), extends leases and sleeps on the wake list when there is nothing to
do. Every operation is one round trip for the whole batch, and
:meth:`Consumer.settle_and_claim` settles one batch and claims the next in a
single round trip, which is what the workers' hot loop uses. What to ack, retry,
dead-letter or fail is decided in :mod:`mtq.broker.outcomes` (which also holds
:class:`Outcome`, :class:`Chunk` and :class:`SettleReport`, which can be imported
from here too); giving tasks back, in :mod:`mtq.broker.recovery`.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import time
from collections.abc import Collection, Sequence

import redis

from mtq.broker import chains, recovery
from mtq.broker.cluster import for_queue
from mtq.broker.codes import Code
from mtq.broker.config import SettingsSource, SettingsSpec
from mtq.broker.connection import Backoff, connect, redis_errors
from mtq.broker.outcomes import (
    OUTCOME_COUNTERS,
    TRACEBACK_MAX,
    Chunk,
    Encoded,
    Outcome,
    SettleReport,
    backoff_ms,
    count,
    encode,
    format_traceback,
    plan,
    stream_items,
)
from mtq.broker.protocol import LOST, Broker, Claimed, ClaimResult, parse_handed
from mtq.errors import BrokerError, MtqError, RedisUnavailable
from mtq.settings import QueueSettings
from mtq.validation import check_queue_name

log = logging.getLogger(__name__)

#: longest single sleep on the wake list when no timer is pending (a safety net)
MAX_IDLE_S = 10.0


def default_worker_id() -> str:
    """host:pid:random, unique per consumer."""
    return f"{socket.gethostname()}:{os.getpid()}:{os.urandom(3).hex()}"


def connection_name(worker_id: str) -> str:
    """The name a supervised worker process gives its Redis connections (CLIENT SETNAME
    takes no spaces or newlines; host names and worker ids have none)."""
    return "mtq-worker:" + "".join(c if c.isprintable() and not c.isspace() else "_"
                                   for c in worker_id)


class Consumer:
    """Claims and settles tasks of one queue on behalf of one worker."""

    def __init__(self, queue: str, url: str | None = None, *,
                 settings: SettingsSpec = None, client: redis.Redis | None = None,
                 worker_id: str | None = None) -> None:
        self.queue = check_queue_name(queue)
        # a cluster's client for the queue's slot (mtq.broker.cluster); else the client
        self.redis = for_queue(client if client is not None else connect(url), self.queue)
        self.broker = Broker(self.redis, self.queue, SettingsSource.shared(self.redis, self.queue,
                                                                    settings))
        self.worker_id = worker_id or default_worker_id()
        self.wake_key = self.broker.keys.worker_wake(self.worker_id)
        self.inbox_key = self.broker.keys.worker_inbox(self.worker_id)
        #: ms until the next lease deadline / due retry, from the last claim (-1: none)
        self.next_timer_ms = -1
        #: the queue schedules, as the last claim said (a slow model's worker then claims
        #: no task ahead: see mtq.workers.dynamic)
        self.scheduling = False
        #: take tasks handed over directly: a claim that takes all there is and leaves
        #: room registers this consumer idle, and :meth:`wait` returns what a submit
        #: hands it (see "Direct delivery" in lua/_lib.lua). Set by a worker whose
        #: fetcher waits with :meth:`wait` and takes what it returns; never registered
        #: on a durable queue
        self.direct = False
        #: (time the registering claim was sent, its lease ms, its window ms, its room:
        #: the most one submit hands it) while this consumer may be registered idle;
        #: None when it is not
        self._registered: tuple[float, int, int, int] | None = None
        self._rng = random.Random()
        #: submits the next steps of chained tasks this consumer acks (made at first use)
        self._handoff: chains.HandOff | None = None

    @property
    def settings(self) -> QueueSettings:
        """The queue's settings now (stored in Redis, with this process's overrides:
        see mtq.broker.config)."""
        return self.broker.settings

    # -- claiming --------------------------------------------------------------
    def lease_s(self, lease_ms: int | None = None) -> float:
        """The lease a claim or extend asks for, in seconds."""
        return (self.settings.lease_ms if lease_ms is None else lease_ms) / 1000

    def _claimed(self, result: ClaimResult, sent: float, lease_ms: int | None) -> list[Claimed]:
        self.next_timer_ms = result.next_timer_ms
        self.scheduling = result.scheduling
        until = sent + self.lease_s(lease_ms)
        wall = time.time()
        for t in result.tasks:
            t.live_until = until
            if t.traceparent:  # where its queue wait ends (see mtq.tracing)
                t.claimed_at = wall
        return result.tasks

    def claim(self, batch_size: int, lease_ms: int | None = None,
              room: int | None = None) -> list[Claimed]:
        """Claim up to ``batch_size`` tasks (one round trip). With :attr:`direct`, the
        tasks handed to this consumer since its last claim come first, and a claim
        that takes all there is registers it idle, with the room it left, ``room`` at
        most (the most one submit hands it; None: no other bound)."""
        sent = time.monotonic()
        # the lease asked for and the one recorded must be the same (the settings may
        # be re-read between two reads of them)
        settings = self.settings
        lease_ms = settings.lease_ms if lease_ms is None else lease_ms
        window = 0
        if self.direct and batch_size > 0 and not settings.durable_replicas:
            # back (BLPOP's limit) before the registration lapses, and a hand-off at its
            # end still leaves half a lease known live (see _handed)
            window = int(min(MAX_IDLE_S * 1000, lease_ms / 2))
        was = self._registered
        result = self.broker.claim(self.worker_id, batch_size, lease_ms, window, was is not None,
                                   room)
        tasks = self._claimed(result, sent, lease_ms)
        if result.handed and was is not None:
            tasks = self._handed(result.handed, was) + tasks
        # registered by this claim if it left room (it took all there was)
        left = batch_size - len(result.tasks)
        room = left if room is None else min(left, room)
        self._registered = (sent, lease_ms, window, room) \
            if window and room > 0 and not result.handed else None
        return tasks

    @property
    def registered(self) -> bool:
        """This consumer may be registered idle (a submit may hand it tasks)."""
        return self._registered is not None

    @staticmethod
    def _handed(tasks: list[Claimed], registered: tuple[float, int, int, int]
                ) -> list[Claimed]:
        """Tasks handed over under the registration made by a claim sent at
        ``registered[0]``: their leases began after that claim ran, so that time plus
        the lease is never later than Redis's deadline (as for a claim, see
        ``Claimed.live_until``)."""
        until = registered[0] + registered[1] / 1000
        wall = time.time()
        for t in tasks:
            t.live_until = until
            if t.traceparent:
                t.claimed_at = wall
        return tasks

    def wait(self, timeout: float | None = None) -> list[Claimed] | bool:
        """Sleep until woken by a submit, the next timer, or ``timeout`` (BLPOP).

        Returns the tasks a submit handed over (with :attr:`direct`; they are this
        consumer's now, as if claimed), else True if woken by a marker, False on a
        timeout. Call it after a claim returned nothing, or after a hand-off that left
        this consumer registered (:attr:`registered`).
        """
        limit = MAX_IDLE_S if timeout is None else min(timeout, MAX_IDLE_S)
        if self.next_timer_ms >= 0:
            limit = min(limit, self.next_timer_ms / 1000 + 0.001)
        registered = self._registered
        if registered is not None:
            # back (a claim) before the registration lapses
            left = registered[0] + registered[2] / 1000 - time.monotonic()
            limit = max(0.001, min(limit, left))
        popped = self.broker.wait_for_work(limit, self.wake_key,
                                           self.inbox_key if registered else None)
        if isinstance(popped, bytes):
            assert registered is not None  # only then is the inbox waited on
            tasks = self._handed(parse_handed(popped), registered)
            # registered still unless that submit handed it its whole room: a submit
            # keeps a registration whose worker came back for its last reply
            # (submit.lua). If it found one unread, it ended it, and the tasks it
            # queued then wake this consumer for a claim
            if len(tasks) >= registered[3]:
                self._registered = None
            return tasks
        return popped

    def retire(self) -> list[Claimed]:
        """Stop taking tasks handed over: drop this consumer's idle registration and
        return what was handed to it and not taken yet (running under it: release
        them). A worker calls it when it stops, or when a wait failed and what it
        popped may be lost."""
        self._registered = None
        return self.broker.retire(self.worker_id)

    def interrupt(self) -> None:
        """End a :meth:`wait` in progress (from another thread) at once."""
        self.broker.interrupt(self.wake_key)

    def clear_interrupts(self) -> None:
        """Drop this worker's own wake key (when it stops)."""
        with redis_errors("while stopping"):
            self.redis.delete(self.wake_key)

    # -- settling --------------------------------------------------------------
    def backoff_ms(self, attempts: int) -> int:
        """The delay before retry ``attempts`` + 1 (see
        :func:`mtq.broker.outcomes.backoff_ms`)."""
        s = self.settings
        return backoff_ms(attempts, s.retry_backoff_ms, s.retry_backoff_max_ms,
                          self._rng.random())

    def settle(self, outcomes: Sequence[Outcome], chunks: Sequence[Chunk] = ()) -> SettleReport:
        """Stream ``chunks``, then ack the successes and nack the failures (retry with
        backoff, or dead-letter / fail when retries run out), in one round trip.
        A task's chunks reach its client before its completion."""
        report, _ = self.settle_and_claim(outcomes, 0, chunks=chunks)
        return report

    def settle_retrying(self, outcomes: Sequence[Outcome], chunks: Sequence[Chunk] = (),
                        give_up_after: float | None = None) -> SettleReport | None:
        """:meth:`settle`, retried with backoff while Redis is unreachable; None when
        ``give_up_after`` seconds passed (the tasks run again when their leases expire)."""
        start = time.monotonic()
        backoff = Backoff()
        while True:
            try:
                return self.settle(outcomes, chunks)
            except MtqError as exc:
                delay = backoff.next()
                log.warning("settling %d task(s) failed (%s); retrying in %.2f s",
                            len(outcomes), exc, delay,
                            exc_info=not isinstance(exc, RedisUnavailable))
                if give_up_after is not None and time.monotonic() - start > give_up_after:
                    log.error("gave up settling %d task(s); they run again when their "
                              "leases expire", len(outcomes))
                    return None
                time.sleep(delay)  # back off while Redis is unreachable

    def settle_and_claim(self, outcomes: Sequence[Outcome], batch_size: int,
                         lease_ms: int | None = None, chunks: Sequence[Chunk] = ()
                         ) -> tuple[SettleReport, list[Claimed]]:
        """(Stream chunks,) settle a batch and claim the next one in one round trip."""
        items, failed, bad = stream_items(chunks) if chunks else ([], [], set())
        if bad:
            outcomes = [o for o in outcomes if o.task.id not in bad] + failed
        acks, nacks = plan(outcomes, self.settings, self._rng) if outcomes else ([], [])
        lease_ms = self.settings.lease_ms if lease_ms is None else lease_ms
        costs = {o.task.id: o.cost for o in outcomes if o.cost is not None}
        calls = []
        if items:
            calls.append(self.broker.emit_call(items))
        if acks:
            calls.append(self.broker.ack_call(acks, costs))
        if nacks:
            calls.append(self.broker.nack_call(nacks, costs))
        if batch_size > 0:
            calls.append(self.broker.claim_call(self.worker_id, batch_size, lease_ms))
        if not calls:
            return SettleReport(), []
        sent = time.monotonic()
        # a durable queue's acks and nacks wait for its replicas too: one lost with a
        # primary that died is sent again to the replica promoted in its place
        replies = self.broker.run_durable(*calls) if acks or nacks else self.broker.run(*calls)
        emit_codes = replies.pop(0) if items else []
        ack_codes = replies.pop(0) if acks else []
        nack_codes = replies.pop(0) if nacks else []
        report = count(acks, nacks, ack_codes, nack_codes)
        if chains.CHAINED in ack_codes:
            self._hand_off(acks, ack_codes)
        lost = {i[0] for i, c in zip(items, emit_codes) if c == Code.LEASE_LOST}
        report.stream_lost = sorted(lost | bad)
        report.streamed = sum(1 for i, c in zip(items, emit_codes) if c == 1 and i[2] >= 0)
        claimed = self._claimed(replies[0], sent, lease_ms) if batch_size > 0 else []
        return report, claimed

    @property
    def handoff(self) -> chains.HandOff:
        if self._handoff is None:
            self._handoff = chains.HandOff(self.redis, self.queue)
        return self._handoff

    def _hand_off(self, acks: Sequence[tuple[str, str, bytes]], codes: Sequence[int]) -> None:
        """Submit the next steps of the chained tasks just acked (see mtq.broker.chains),
        from what ack.lua answered for them and the results sent; a failure leaves their
        records for the reaper's recovery."""
        ids = [a[0] for a, c in zip(acks, codes) if c == chains.CHAINED]
        told = getattr(codes, "chained", {})
        known = {a[0]: (*told[a[0]], a[2]) for a in acks if a[0] in told}
        try:
            self.handoff.run(ids, known)
        except MtqError as exc:
            log.warning("chain hand-off of %d task(s) failed (%s); the reaper completes "
                        "it", len(ids), exc)

    def release(self, tasks: Sequence[Claimed]) -> int:
        """Give claimed but unstarted tasks back to the head of their streams,
        without counting a delivery (graceful drain). Returns how many went back."""
        if not tasks:
            return 0
        # Each release LPUSHes to the head: they go last-first so the batch keeps its order.
        return recovery.release_leases(self.broker, [(t.id, t.token) for t in tasks])

    # -- giving back (mtq.broker.recovery) ----------------------------------------
    def give_back(self, running: Sequence[tuple[str, str]], rest: Sequence[tuple[str, str]],
                  reason: str) -> list[int]:
        """Put back now the (id, token) tasks of a process that died: ``running`` with
        the delivery counted, ``rest`` uncounted (:func:`recovery.give_back`)."""
        return recovery.give_back(self.broker, running, rest, reason)

    def give_back_all(self, worker: str, running: Sequence[tuple[str, str]],
                      rest: Sequence[tuple[str, str]], reason: str,
                      skip: Collection[str] = ()) -> list[int]:
        """:meth:`give_back`, plus what Redis still shows running under the dead
        worker's id ``worker`` (:func:`recovery.give_back_all`); call it after
        :meth:`wait_disconnected`."""
        return recovery.give_back_all(self.broker, worker, running, rest, reason, skip)

    def run_here(self, task: Claimed) -> None:
        """Record that ``task``, claimed by another process, runs in this one (a
        suspect taken by the quarantine process): its start names this worker. A
        failure is logged, and the task runs all the same."""
        try:
            if not self.broker.handover(self.worker_id, task.id, task.token):
                log.debug("task %s: lease lost before it was taken over", task.id)
        except BrokerError:
            log.warning("could not record that task %s runs in worker %s", task.id,
                        self.worker_id, exc_info=True)

    def wait_disconnected(self, name: str, timeout: float = 1.0) -> bool:
        """Wait until Redis has closed every connection named ``name``
        (:func:`recovery.wait_disconnected`)."""
        return recovery.wait_disconnected(self.redis, name, timeout)

    def release_leases(self, leases: Sequence[tuple[str, str]]) -> int:
        """:meth:`release` by (id, token) pairs (a supervisor holds no Claimed objects)."""
        return recovery.release_leases(self.broker, leases)

    def extend(self, tasks: Sequence[Claimed], lease_ms: int | None = None
               ) -> tuple[list[str], list[str]]:
        """Extend the leases of ``tasks`` (one round trip), and record how long each is
        now known to be live (``Claimed.live_until``; :data:`LOST` for the lost ones).

        Returns (lost ids, ids with a cancel request).
        """
        if not tasks:
            return [], []
        sent = time.monotonic()
        lease_ms = self.settings.lease_ms if lease_ms is None else lease_ms
        codes = self.broker.extend([(t.id, t.token) for t in tasks], lease_ms)
        until = sent + self.lease_s(lease_ms)
        lost, cancel = [], []
        for t, c in zip(tasks, codes):
            if c == Code.LEASE_LOST:
                t.live_until = LOST
                lost.append(t.id)
            else:
                t.live_until = max(t.live_until, until)
                if c == 2:
                    cancel.append(t.id)
        return lost, cancel

    def reap(self) -> int:
        """Reclaim expired leases and promote due retries now; returns leases reclaimed."""
        reaped, _promoted, nxt = self.broker.reap()
        self.next_timer_ms = nxt
        try:  # chain hand-offs a dead worker left (one round trip when there are none)
            chains.recover(self.handoff, self.settings.lease_ms)
        except MtqError as exc:
            log.warning("recovering chain hand-offs failed (%s); will retry", exc)
        return reaped


__all__ = [
    "MAX_IDLE_S",
    "OUTCOME_COUNTERS",
    "TRACEBACK_MAX",
    "Chunk",
    "Consumer",
    "Encoded",
    "Outcome",
    "SettleReport",
    "connection_name",
    "default_worker_id",
    "encode",
    "format_traceback",
]
