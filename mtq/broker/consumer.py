"""The low-level consumer API that workers are built on.

A :class:`Consumer` claims batches, settles them (ack / retry / fail / dead-letter
/ release), extends leases and sleeps on the wake list when there is nothing to
do. Every operation is one round trip for the whole batch, and
:meth:`Consumer.settle_and_claim` settles one batch and claims the next in a
single round trip, which is what the workers' hot loop uses.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import time
import traceback
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from mtq import serialization
from mtq.broker.cluster import for_queue
from mtq.broker.codes import Code
from mtq.broker.config import SettingsSource, SettingsSpec
from mtq.broker.connection import Backoff, connect, redis_errors
from mtq.broker.protocol import (
    CANCEL,
    DEAD,
    FAIL,
    LOST,
    RELEASE,
    REQUEUE,
    RETRY,
    Broker,
    Claimed,
    ClaimResult,
    parse_handed,
)
from mtq.errors import MtqError, RedisUnavailable
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


@dataclass(frozen=True, slots=True)
class Encoded:
    """A result or chunk value already encoded with :func:`mtq.serialization.dumps`
    (by the worker process, before it crossed to its outlet process)."""

    data: bytes


def encode(value: Any) -> bytes:
    """``value`` as stored bytes (an :class:`Encoded` is passed through)."""
    return value.data if isinstance(value, Encoded) else serialization.dumps(value)


@dataclass(frozen=True)
class Outcome:
    """How one claimed task ended in the handler."""

    task: Claimed
    ok: bool
    value: Any = None          # the result when ok
    error: str | None = None   # "Type: message" when not ok
    retryable: bool = True     # False: fail at once (e.g. an undecodable payload)
    cancelled: bool = False    # the handler stopped on a cancel request
    traceback: str | None = None  # where it was raised (bounded: see format_traceback)


#: the most of a traceback kept on a task (its end: the frames nearest the error)
TRACEBACK_MAX = 8000


def format_traceback(exc: BaseException) -> str:
    """``exc``'s traceback as Python prints it, cut to its last TRACEBACK_MAX
    characters (the frames nearest the error)."""
    text = "".join(traceback.format_exception(exc)).rstrip("\n")
    if len(text) > TRACEBACK_MAX:
        text = "...\n" + text[-TRACEBACK_MAX:].split("\n", 1)[-1]
    return text


def _utf8(text: str) -> str:
    """``text`` that Redis can take: a lone surrogate (bytes of a file name that were
    not UTF-8, in an exception's message) written as its escape, not an error that
    would leave the task unsettled."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


@dataclass(slots=True)
class Chunk:
    """A token (or chunk) of a running task, streamed to its client; index -1 is a
    progress report. (Not frozen: a generator makes one per token, and a frozen
    dataclass's ``__init__`` costs three times as much.)"""

    task: Claimed
    index: int
    value: Any


#: the counters a SettleReport and a worker's running totals share
OUTCOME_COUNTERS = ("succeeded", "retried", "failed", "dead", "cancelled")


@dataclass
class SettleReport:
    """What a settle call did."""

    succeeded: int = 0
    retried: int = 0
    failed: int = 0
    dead: int = 0
    cancelled: int = 0
    #: tasks whose lease had expired: their outcome was discarded (another worker owns them)
    lost: list[str] = field(default_factory=list)
    #: running tasks whose tokens were refused (lease lost) or could not be encoded
    #: (the task was failed): stop generating them
    stream_lost: list[str] = field(default_factory=list)
    #: tokens written to the tasks' streams
    streamed: int = 0


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
        """Exponential backoff with full jitter over the upper half: attempt n waits
        between 0.5 and 1 times min(max, base * 2**n)."""
        s = self.settings
        ceiling = min(s.retry_backoff_max_ms, s.retry_backoff_ms * (2 ** min(attempts, 30)))
        return int(ceiling * (0.5 + self._rng.random() / 2))

    def _plan(self, outcomes: Sequence[Outcome]
              ) -> tuple[list[tuple[str, str, bytes]], list[tuple[str, str, str, str]]]:
        acks: list[tuple[str, str, bytes]] = []
        nacks: list[tuple[str, str, str, str]] = []
        for o in outcomes:
            t = o.task
            if o.ok:
                try:
                    acks.append((t.id, t.token, encode(o.value)))
                    continue
                except Exception as exc:  # PayloadError, or anything a tensor's .cpu() raises
                    o = Outcome(t, ok=False, error=f"{type(exc).__name__}: {exc}",
                                retryable=False)
            if o.cancelled:
                nacks.append((t.id, t.token, CANCEL, ""))
                continue
            error = _utf8((o.error or "error")[:4000]).replace("\0", " ")
            if o.traceback:  # nack.lua stores what follows a NUL as the traceback
                error += "\0" + _utf8(o.traceback[-TRACEBACK_MAX - 4:]).replace("\0", " ")
            allowed = self.settings.max_retries if t.retries is None else t.retries
            if o.retryable and t.attempts < allowed:
                nacks.append((t.id, t.token, RETRY, f"{self.backoff_ms(t.attempts)}|{error}"))
            elif o.retryable and self.settings.dead_letter:
                nacks.append((t.id, t.token, DEAD, error))
            else:
                nacks.append((t.id, t.token, FAIL, error))
        return acks, nacks

    @staticmethod
    def _count(acks: Sequence[tuple[str, str, bytes]], nacks: Sequence[tuple[str, str, str, str]],
               ack_codes: list[int], nack_codes: list[int]) -> SettleReport:
        report = SettleReport()
        for (task_id, _, _), code in zip(acks, ack_codes):
            if code == Code.LEASE_LOST:
                report.lost.append(task_id)
            else:
                report.succeeded += 1
        names = {RETRY: "retried", FAIL: "failed", DEAD: "dead", CANCEL: "cancelled"}
        for (task_id, _, action, _), code in zip(nacks, nack_codes):
            if code == Code.LEASE_LOST:
                report.lost.append(task_id)
            elif action in names:
                setattr(report, names[action], getattr(report, names[action]) + 1)
        return report

    def settle(self, outcomes: Sequence[Outcome], chunks: Sequence[Chunk] = ()) -> SettleReport:
        """Stream ``chunks``, then ack the successes and nack the failures (retry with
        backoff, or dead-letter / fail when retries run out), in one round trip.
        A task's chunks reach its client before its completion."""
        report, _ = self.settle_and_claim(outcomes, 0, chunks=chunks)
        return report

    def _stream_items(self, chunks: Sequence[Chunk]
                      ) -> tuple[list[tuple[str, str, int, bytes]], list[Outcome], set[str]]:
        items: list[tuple[str, str, int, bytes]] = []
        failed: list[Outcome] = []
        bad: set[str] = set()
        for c in chunks:
            t = c.task
            if t.id in bad:
                continue
            try:
                items.append((t.id, t.token, c.index, encode(c.value)))
            except Exception as exc:  # an unencodable token fails its task, no other
                bad.add(t.id)
                failed.append(Outcome(t, ok=False, retryable=False,
                                      error=f"{type(exc).__name__}: token {c.index}: {exc}"))
        return items, failed, bad

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
        items, failed, bad = self._stream_items(chunks) if chunks else ([], [], set())
        if bad:
            outcomes = [o for o in outcomes if o.task.id not in bad] + failed
        acks, nacks = self._plan(outcomes)
        lease_ms = self.settings.lease_ms if lease_ms is None else lease_ms
        calls = []
        if items:
            calls.append(self.broker.emit_call(items))
        if acks:
            calls.append(self.broker.ack_call(acks))
        if nacks:
            calls.append(self.broker.nack_call(nacks))
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
        report = self._count(acks, nacks, ack_codes, nack_codes)
        lost = {i[0] for i, c in zip(items, emit_codes) if c == Code.LEASE_LOST}
        report.stream_lost = sorted(lost | bad)
        report.streamed = sum(1 for i, c in zip(items, emit_codes) if c == 1 and i[2] >= 0)
        claimed = self._claimed(replies[0], sent, lease_ms) if batch_size > 0 else []
        return report, claimed

    def release(self, tasks: Sequence[Claimed]) -> int:
        """Give claimed but unstarted tasks back to the head of their streams,
        without counting a delivery (graceful drain). Returns how many went back."""
        if not tasks:
            return 0
        # Each release LPUSHes to the head: they go last-first so the batch keeps its order.
        return self.release_leases([(t.id, t.token) for t in tasks])

    def give_back(self, running: Sequence[tuple[str, str]], rest: Sequence[tuple[str, str]],
                  reason: str) -> list[int]:
        """The process holding these (id, token) tasks died or was killed; put them back
        now instead of waiting for their leases, in one round trip.

        ``running`` (the items of the predict call it died in) go back with the
        delivery counted, dead as poison at ``max_deliveries``; ``rest`` (claimed, not
        started) go back uncounted. Both go to the head of their streams, the running
        ones in front, since they were claimed first.
        """
        arg = f"{self.settings.max_deliveries}|{reason}"
        items = [(i, t, RELEASE, "") for i, t in reversed(rest)]
        items += [(i, t, REQUEUE, arg) for i, t in reversed(running)]
        return self.broker.nack(items) if items else []

    def give_back_all(self, worker: str, running: Sequence[tuple[str, str]],
                      rest: Sequence[tuple[str, str]], reason: str,
                      skip: Collection[str] = ()) -> list[int]:
        """:meth:`give_back` for a worker process that died, plus every task Redis still
        shows running under its id ``worker`` that the caller did not know of (a claim
        answered just before the process died, before it could report it): those
        were never started, so they go back uncounted; ``skip``: ids another process
        runs now (a suspect handed to the quarantine process). Call it once the process's
        connections are gone (:meth:`wait_disconnected`), so no claim of it can still
        run after this. Its idle registration is dropped first, so that no submit hands
        it anything more; what was handed to it is running under its id, and goes back
        with the rest. Three round trips, the second O(running tasks of the queue)."""
        self.broker.retire(worker)
        known = {i for i, _ in running} | {i for i, _ in rest} | set(skip)
        unknown = [(i, t) for i, t in self.broker.orphans(worker) if i not in known]
        if unknown:
            log.info("worker %s died with %d task(s) claimed but not reported; giving "
                     "them back", worker, len(unknown))
        return self.give_back(running, [*rest, *unknown], reason)

    def wait_disconnected(self, name: str, timeout: float = 1.0) -> bool:
        """Wait until Redis has closed every connection named ``name`` (see
        :func:`mtq.broker.connection.connect`): a command a dead process sent before
        it died has then run. Redis has no blocking call for this, so it asks again
        every 5 ms; a killed process's connections are normally gone at the first
        look. Returns False on timeout, or when the server does not allow CLIENT LIST
        (an ACL user without it), after one look or none."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                clients = self.redis.client_list()
            except redis.exceptions.RedisError:
                return False
            if not any(c.get("name") == name for c in clients):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)

    def release_leases(self, leases: Sequence[tuple[str, str]]) -> int:
        """:meth:`release` by (id, token) pairs (a supervisor holds no Claimed objects)."""
        return sum(1 for c in self.give_back([], leases, "") if c == 1)

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
        return reaped
