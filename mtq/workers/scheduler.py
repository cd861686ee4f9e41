"""The scheduler: runs the schedules of :mod:`mtq.client.schedules`. Any number may run
(``mtq schedule run``, a thread of ``mtq workers start``); one is the leader, holding
a lease (``LEASE``: its token, expiring after ``lease_ms``, renewed every third of it).
The others wait on the schedules' channel, for at most the lease's remaining time,
and take the lease when it lapses.

The leader, per tick: reloads the schedules when their version changed; for each, the
occurrences after its cursor up to now (those older than ``grace_s`` are missed: the
schedule's catch-up policy says which are submitted); submits each with the task id
:func:`mtq.client.schedules.task_id` (a second submit of an occurrence is refused by
its queue as a duplicate, which counts as done); then advances the cursor under its
token (a leader that lost its lease advances nothing, and stops leading). Then it
sleeps until the next occurrence, its next renewal, or a change, whichever is first,
on a pub/sub read (no polling).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from mtq.broker.cluster import shared
from mtq.broker.connection import connect, redis_errors
from mtq.client import schedules as sch
from mtq.errors import DuplicateTask, MtqError

log = logging.getLogger(__name__)

_RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""
_ADVANCE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if redis.call('HEXISTS', KEYS[2], ARGV[2]) == 0 then return 2 end
local cur = tonumber(redis.call('HGET', KEYS[2], ARGV[2]) or '0')
if tonumber(ARGV[3]) > cur then redis.call('HSET', KEYS[2], ARGV[2], ARGV[3]) end
return 1
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[2], 'released')
return 1
"""


class Scheduler:
    """One scheduler process's (or thread's) loop: :meth:`run` until :meth:`stop`.
    ``lease_ms``: how long a leader that stops renewing keeps the lease (a killed
    leader's schedules wait at most this long); ``grace_s``: how late an occurrence may
    be submitted and still count as on time rather than missed."""

    def __init__(self, url: str | None = None, *, client: Any = None,
                 lease_ms: int = 10_000, grace_s: float | None = None) -> None:
        self.redis = shared(client if client is not None else connect(url))
        self.lease_ms = lease_ms
        self.grace_s = grace_s if grace_s is not None else max(1.0, 2 * lease_ms / 1000)
        self.token = secrets.token_hex(8)
        self.leader = False
        self._stop = threading.Event()
        self._version: bytes | None = None
        self._defs: list[sch.Schedule] = []
        self._queues: dict[str, Any] = {}
        self.submitted = 0

    def stop(self) -> None:
        self._stop.set()

    def _queue(self, name: str) -> Any:
        q = self._queues.get(name)
        if q is None:
            from mtq.client.queue import Queue

            q = self._queues[name] = Queue(name, client=self.redis)
        return q

    def _lead(self) -> bool:
        """Take or renew the lease; whether this scheduler leads now."""
        if self.leader:
            self.leader = bool(int(self.redis.eval(_RENEW, 1, sch.LEASE, self.token,
                                                   self.lease_ms)))
            if not self.leader:
                log.warning("scheduler %s lost its lease", self.token)
        else:
            self.leader = bool(self.redis.set(sch.LEASE, self.token, nx=True,
                                              px=self.lease_ms))
            if self.leader:
                log.info("scheduler %s leads", self.token)
                self._version = None
        return self.leader

    def _reload(self) -> None:
        version = self.redis.get(sch.VERSION)
        if version != self._version or self._version is None:
            self._defs = sch.list_schedules(self.redis)
            self._version = version

    def tick(self, now: float) -> float:
        """Submit what is due; the unix time of the next occurrence (or now + 60)."""
        self._reload()
        cursors = sch.cursors(self.redis)
        upcoming = now + 60.0
        for s in self._defs:
            if s.name not in cursors:
                continue
            try:
                self._run_one(s, cursors[s.name], now)
                upcoming = min(upcoming, s.next_after(now))
            except MtqError as exc:  # a schedule whose queue refuses: the next tick retries
                log.warning("schedule %s: %s", s.name, exc)
            if not self.leader:
                break
        return upcoming

    def _run_one(self, s: sch.Schedule, cursor: float, now: float) -> None:
        due = sch.occurrences(s.cron, s.tz, cursor, now)
        if not due:
            return
        on_time = [t for t in due if now - t <= self.grace_s]
        missed = [t for t in due if now - t > self.grace_s]
        if s.catch_up == "all":
            run = (missed[-sch.CATCH_UP_MAX:] if len(missed) > sch.CATCH_UP_MAX
                   else missed) + on_time
        elif s.catch_up == "latest":
            run = ([missed[-1]] if missed and not on_time else []) + on_time
        else:
            run = on_time
        if missed and len(run) < len(due):
            log.info("schedule %s: %d missed occurrence(s) skipped (catch_up=%s)",
                     s.name, len(due) - len(run), s.catch_up)
        q = self._queue(s.queue)
        for t in run:
            if not self._advance_ok():
                return
            try:
                q.submit(s.payload, stream=s.stream, tenant=s.tenant,
                         id=sch.task_id(s.name, t))
                self.submitted += 1
            except DuplicateTask:
                pass  # submitted before (a killed or stale leader): done once already
            if not self._advance(s.name, t):
                return
        if not run:  # (else its last is due[-1]: the cursor is there already)
            self._advance(s.name, due[-1])

    def _advance_ok(self) -> bool:
        return self.leader and not self._stop.is_set()

    def _advance(self, name: str, t: float) -> bool:
        got = int(self.redis.eval(_ADVANCE, 2, sch.LEASE, sch.CURSOR, self.token, name,
                                  str(int(t))))
        if not got:
            self.leader = False
            log.warning("scheduler %s lost its lease mid-tick", self.token)
        return got == 1  # 2: the schedule was removed meanwhile: submit no more of it

    def run(self) -> None:
        """Lead or wait until :meth:`stop`; releases the lease on the way out. Redis
        errors (a restart, a dropped connection) are logged and retried after a
        renewal's time; they never end the loop."""
        pubsub: Any = None
        renew_s = self.lease_ms / 3000
        try:
            while not self._stop.is_set():
                try:
                    if pubsub is None:
                        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
                        pubsub.subscribe(sch.CHANNEL)
                        self._version = None  # changes may have been missed meanwhile
                    if self._lead():
                        wake = min(self.tick(time.time()), time.time() + renew_s)
                    else:
                        ttl = self.redis.pttl(sch.LEASE)
                        # -2: no lease (take it now); -1: one without expiry (not ours)
                        wait = ttl / 1000 if ttl > 0 else (0.0 if ttl == -2 else renew_s)
                        wake = time.time() + wait
                    self._sleep(pubsub, wake)
                except Exception as exc:  # Redis down, a queue refusing: retry later
                    if self._stop.is_set():
                        break
                    log.warning("scheduler: %s", exc)
                    if pubsub is not None:
                        _close(pubsub)
                        pubsub = None
                    self._stop.wait(renew_s)
        finally:
            if pubsub is not None:
                _close(pubsub)
            if self.leader:
                try:
                    self.redis.eval(_RELEASE, 1, sch.LEASE, self.token, sch.CHANNEL)
                except Exception:  # best effort on the way out: the lease lapses anyway
                    log.debug("scheduler %s: lease not given back", self.token)

    def _sleep(self, pubsub: Any, wake: float) -> None:
        """Wait on the channel until ``wake`` (a change wakes it sooner); stop() is seen
        within 0.5 s."""
        while not self._stop.is_set():
            left = wake - time.time()
            if left <= 0:
                return
            msg = pubsub.get_message(timeout=min(left, 0.5))
            if msg is not None:
                self._version = None
                return


def _close(pubsub: Any) -> None:
    try:
        pubsub.close()
    except Exception:  # a connection already gone
        log.debug("scheduler: closing its subscription failed")


def start_thread(url: str | None = None, **kw: Any) -> tuple[Scheduler, threading.Thread]:
    """A scheduler in a daemon thread (``mtq workers start``)."""
    s = Scheduler(url, **kw)
    t = threading.Thread(target=s.run, name="mtq-scheduler", daemon=True)
    t.start()
    return s, t


@contextmanager
def alongside(url: str | None, enabled: bool = True,
              schedules: tuple[dict[str, Any], ...] = ()) -> Iterator[Scheduler | None]:
    """``mtq workers start``'s scheduler: a host file's ``schedules`` put (added or
    replaced) in Redis, then, if ``enabled``, a scheduler thread while the block runs."""
    client = connect(url)
    with redis_errors("while writing the host file's schedules"):
        for entry in schedules:
            args = dict(entry)
            sch.put(client, args.pop("name"), args.pop("queue"), args.pop("cron"),
                    args.pop("payload"), **args)
    if not enabled:
        yield None
        return
    sched, t = start_thread(client=client)
    try:
        yield sched
    finally:
        sched.stop()
        # it sees the stop within 0.5 s and gives its lease back in a round trip; a
        # Redis that answers nothing must not lengthen the supervisor's bounded stop
        # (a daemon: the lease lapses on its own)
        t.join(0.6)
