"""The queue protocol: one method per Lua script, with typed arguments and replies.

A :class:`Broker` is bound to one queue and one Redis client. Each operation has
a ``*_call`` form that returns a :class:`~mtq.broker.scripts.Call`, so callers on
hot paths can pipeline several operations in one round trip (a worker acks its
last batch and claims the next one together), and a plain form that runs it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import redis

from mtq.broker import scripts
from mtq.broker.codes import Code
from mtq.broker.connection import redis_errors
from mtq.broker.keys import QUEUES, QueueKeys
from mtq.settings import QueueSettings

#: nack actions understood by nack.lua
RETRY, FAIL, DEAD, CANCEL, RELEASE = "retry", "fail", "dead", "cancel", "release"
REQUEUE = "requeue"

#: ``Claimed.live_until`` of a task whose lease Redis reported lost
LOST = float("-inf")

TERMINAL = frozenset({"succeeded", "failed", "dead", "cancelled", "expired"})


@dataclass(frozen=True, slots=True)
class NewTask:
    """One task to submit, already encoded and validated."""

    id: str
    payload: bytes
    stream: str = ""
    key: str = ""
    ttl_ms: int = 0
    retries: int | None = None


@dataclass(slots=True)
class Claimed:
    """A task a worker holds a lease on."""

    id: str
    token: str
    payload: bytes
    stream: str | None
    attempts: int
    deliveries: int
    retries: int | None
    #: ms since it was submitted (server clock) when it was claimed
    age_ms: int = 0
    #: local ``time.monotonic()`` until which the lease is known to be live: the time
    #: the claim (or the last extend) was *sent* plus the lease, so never later than
    #: Redis's own deadline; :data:`LOST` once Redis said another worker owns it.
    #: A process that was frozen or starved finds it past and asks Redis again
    #: before it runs the task (see ``Worker._live``).
    live_until: float = 0.0

    @property
    def suspect(self) -> bool:
        """True if an earlier delivery ended without an outcome (its worker died,
        hung or was killed): such a task is run alone, so it cannot take a batch down."""
        return self.deliveries - self.attempts > 1


@dataclass(frozen=True, slots=True)
class ClaimResult:
    """What one claim call returned."""

    tasks: list[Claimed]
    #: ms until the earliest lease deadline or due retry; -1 if there is none
    next_timer_ms: int
    #: expired leases reclaimed by this call
    reaped: int


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _parse_claim(raw: list[Any]) -> ClaimResult:
    tasks = []
    for i in range(2, len(raw), 8):
        stream = _s(raw[i + 3])
        retries = _s(raw[i + 6])
        tasks.append(Claimed(
            id=_s(raw[i]), token=_s(raw[i + 1]), payload=raw[i + 2],
            stream=stream or None, attempts=int(raw[i + 4]), deliveries=int(raw[i + 5]),
            retries=int(retries) if retries else None, age_ms=int(raw[i + 7]),
        ))
    return ClaimResult(tasks, int(raw[0]), int(raw[1]))


#: most reply channels one task carries (its submitter's and clients watching it)
MAX_WATCHERS = 8


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A task's stored state, as :meth:`Broker.watch` reads it."""

    status: str
    result: bytes | None
    error: str | None
    deliveries: int
    #: encoded tokens from the index asked for, in order
    tokens: list[bytes]
    #: Redis server time of the read (s)
    ts: float = 0.0


def _parse_watch(raw: list[Any]) -> Snapshot | None:
    if not raw:
        return None
    status, result, error, deliveries, tokens, now_us = raw
    return Snapshot(_s(status), result or None, _s(error) or None, int(deliveries), list(tokens),
                    int(now_us) / 1e6)


def _codes(raw: list[Any]) -> list[int]:
    return [int(c) for c in raw]


class Broker:
    """Protocol operations of one queue over one Redis client (thread-safe)."""

    def __init__(self, client: redis.Redis, queue: str, settings: QueueSettings) -> None:
        self.redis = client
        self.queue = queue
        self.keys = QueueKeys(queue)
        self.settings = settings
        self._head = self.keys.channels

    def run(self, *calls: scripts.Call) -> list[Any]:
        """Run several calls in one round trip."""
        return scripts.run(self.redis, *calls)

    def _call(self, name: str, args: Sequence[Any], parse: Any) -> scripts.Call:
        return scripts.Call(scripts.script(name), self.keys.script_keys, [*self._head, *args], parse)

    # -- producers -------------------------------------------------------------
    def submit_call(self, tasks: Sequence[NewTask], reply: str = "") -> scripts.Call:
        s = self.settings
        args: list[Any] = [s.max_length, s.wake_cap, s.idempotency_window_s, reply, len(tasks)]
        for t in tasks:
            args += [t.id, t.payload, t.stream, t.key, t.ttl_ms,
                     "" if t.retries is None else t.retries]
        return self._call("submit", args, lambda raw: [
            int(r) if isinstance(r, int) else _s(r) for r in raw])

    def submit(self, tasks: Sequence[NewTask], reply: str = "") -> list[str | int]:
        """Submit tasks in one round trip. Returns ids (or negative codes per task);
        ``[Code.QUEUE_FULL, waiting]`` if they do not fit. ``reply``: the submitting
        client's reply channel (:meth:`QueueKeys.reply`), where their events go."""
        return self.run(self.submit_call(tasks, reply))[0]

    def register(self) -> None:
        """Record the queue name in the global registry (read by mtq status)."""
        with redis_errors():
            self.redis.sadd(QUEUES, self.queue)

    def cancel(self, task_id: str) -> tuple[int, str]:
        """Cancel one task; returns (code, previous status). See cancel.lua."""
        raw = self.run(self._call("cancel", [task_id, self.settings.retention_s],
                                  lambda r: (int(r[0]), _s(r[1]))))
        return raw[0]

    def watch_call(self, task_id: str, reply: str, tokens_from: int = -1) -> scripts.Call:
        return self._call("watch", [task_id, reply, tokens_from, MAX_WATCHERS], _parse_watch)

    def watch(self, task_id: str, reply: str, tokens_from: int = -1) -> Snapshot | None:
        """Read a task's state and its stored tokens from ``tokens_from`` (-1: none),
        adding ``reply`` to the channels its events go to (one round trip).
        None if there is no such task."""
        return self.run(self.watch_call(task_id, reply, tokens_from))[0]

    # -- consumers -------------------------------------------------------------
    def claim_call(self, worker: str, batch: int, lease_ms: int | None = None) -> scripts.Call:
        s = self.settings
        args = [worker, batch, s.lease_ms if lease_ms is None else lease_ms, s.max_deliveries,
                s.reap_limit, s.retention_s, s.dead_retention_s, s.dead_max]
        return self._call("claim", args, _parse_claim)

    def claim(self, worker: str, batch: int, lease_ms: int | None = None) -> ClaimResult:
        """Claim up to ``batch`` tasks (after reaping and promoting due retries)."""
        return self.run(self.claim_call(worker, batch, lease_ms))[0]

    def ack_call(self, results: Sequence[tuple[str, str, bytes]]) -> scripts.Call:
        args: list[Any] = [self.settings.retention_s, len(results)]
        for task_id, token, result in results:
            args += [task_id, token, result]
        return self._call("ack", args, _codes)

    def ack(self, results: Sequence[tuple[str, str, bytes]]) -> list[int]:
        """Record (id, token, encoded result) triples; one code per task."""
        return self.run(self.ack_call(results))[0]

    def nack_call(self, items: Sequence[tuple[str, str, str, str]]) -> scripts.Call:
        s = self.settings
        args: list[Any] = [s.retention_s, s.dead_retention_s, s.dead_max, len(items)]
        for item in items:
            args += item
        return self._call("nack", args, _codes)

    def nack(self, items: Sequence[tuple[str, str, str, str]]) -> list[int]:
        """Settle (id, token, action, argument) tuples; see nack.lua."""
        return self.run(self.nack_call(items))[0]

    def emit_call(self, items: Sequence[tuple[str, str, int, bytes]]) -> scripts.Call:
        # raw strings: the cmsgpack of Redis 6.2 predates the bin types
        return self._call("emit", [msgpack.packb(items, use_bin_type=False)], _codes)

    def emit(self, items: Sequence[tuple[str, str, int, bytes]]) -> list[int]:
        """Stream (id, token, index, encoded data) items; index -1 is a progress
        report. One code per item; see emit.lua."""
        return self.run(self.emit_call(items))[0]

    def extend_call(self, leases: Sequence[tuple[str, str]], lease_ms: int | None = None
                    ) -> scripts.Call:
        args: list[Any] = [self.settings.lease_ms if lease_ms is None else lease_ms, len(leases)]
        for task_id, token in leases:
            args += [task_id, token]
        return self._call("extend", args, _codes)

    def extend(self, leases: Sequence[tuple[str, str]], lease_ms: int | None = None) -> list[int]:
        """Extend leases of (id, token) pairs; 1 ok, 2 ok + cancel requested, LEASE_LOST."""
        return self.run(self.extend_call(leases, lease_ms))[0]

    def orphans(self, worker: str) -> list[tuple[str, str]]:
        """(id, lease token) of every task still running under ``worker`` (one round
        trip, O(running tasks of the queue)). See orphans.lua."""
        def parse(raw: list[Any]) -> list[tuple[str, str]]:
            return [(_s(raw[i]), _s(raw[i + 1])) for i in range(0, len(raw), 2)]

        return self.run(self._call("orphans", [worker, 0], parse))[0]

    def reap(self) -> tuple[int, int, int]:
        """Reclaim expired leases and promote due retries: (reaped, promoted, next timer ms)."""
        s = self.settings
        args = [s.max_deliveries, s.reap_limit, s.retention_s, s.dead_retention_s,
                s.dead_max, s.wake_cap]
        raw = self.run(self._call("reap", args, lambda r: tuple(int(x) for x in r)))
        return raw[0]

    def wait_for_work(self, timeout_s: float, interrupt: str | None = None) -> bool:
        """Block until a submit wakes this worker or ``timeout_s`` passes (BLPOP).

        ``interrupt``: a worker's own wake key (:meth:`QueueKeys.worker_wake`), which
        its other threads push to when they need the sleeper back (pause, stop).
        Redis checks blocking timeouts at its ``hz`` (10/s by default), so a timeout
        may overrun by up to 100 ms; nothing on a latency path depends on it.
        """
        keys = [self.keys.wake] if interrupt is None else [self.keys.wake, interrupt]
        with redis_errors("while waiting for work"):
            return self.redis.blpop(keys, timeout=max(timeout_s, 0.001)) is not None

    def interrupt(self, key: str) -> None:
        """Wake the worker sleeping on its own wake key ``key``."""
        with redis_errors("while waking a worker"):
            pipe = self.redis.pipeline(transaction=False)
            pipe.rpush(key, "1")
            pipe.expire(key, 60)
            pipe.execute()

    # -- maintenance -------------------------------------------------------------
    def purge(self, limit: int = 1000) -> tuple[int, bool]:
        """Drop up to ``limit`` waiting tasks (they end cancelled, error 'purged').
        Returns (purged, more may remain). See purge.lua."""
        raw = self.run(self._call("purge", [limit, self.settings.retention_s],
                                  lambda r: (int(r[0]), bool(int(r[1])))))
        return raw[0]

    def dlq(self, action: str, ids: Sequence[str] = (), limit: int = 1000) -> tuple[int, bool]:
        """Retry (``"retry"``) or delete (``"purge"``) dead letters: ``ids``, or the
        oldest ``limit``. Returns (done, more may remain). See dlq.lua."""
        raw = self.run(self._call("dlq", [action, limit, self.settings.wake_cap, len(ids), *ids],
                                  lambda r: (int(r[0]), bool(int(r[1])))))
        done, more = raw[0]
        if done == Code.BAD_ARGUMENT:
            raise ValueError(f"unknown dead-letter action {action!r}: use retry or purge")
        return done, more

    # -- inspection ------------------------------------------------------------
    def dead_letters(self, start: int = 0, count: int = 20) -> list[dict[str, Any]]:
        """Dead letters, newest first: id, stream, error, attempts, deliveries,
        created, finished (ms). Two round trips; cost grows with ``count`` only."""
        k = self.keys
        with redis_errors("while reading the dead letters"):
            ids = [_s(i) for i in self.redis.lrange(k.dead, start, start + count - 1)]
            pipe = self.redis.pipeline(transaction=False)
            names = ("stream", "error", "attempts", "deliveries", "created", "finished")
            for i in ids:
                pipe.hmget(k.task(i), *names)
            rows = pipe.execute() if ids else []
        out = []
        for i, values in zip(ids, rows):
            row: dict[str, Any] = {"id": i}
            for name, v in zip(names, values):
                text = None if v is None else _s(v)
                row[name] = int(text) if text is not None and name in (
                    "attempts", "deliveries", "created", "finished") else text
            out.append(row)
        return out

    def trace(self, task_id: str) -> list[tuple[int, str, str]]:
        """A task's life, oldest first: (server ms, kind, detail)."""
        with redis_errors("while reading a task's trace"):
            raw = self.redis.lrange(self.keys.trace(task_id), 0, -1)
        out = []
        for line in raw:
            ts, kind, detail = _s(line).split("|", 2)
            out.append((int(ts), kind, detail))
        return out

    def snapshot_into(self, pipe: Any) -> Any:
        """Queue the reads of :meth:`parse_snapshot` on ``pipe``: O(1) counters, the
        last latencies and failures. Cost grows with nothing but their caps."""
        k = self.keys
        pipe.hgetall(k.stats)
        pipe.zcard(k.leases)
        pipe.zcard(k.delayed)
        pipe.llen(k.dead)
        pipe.scard(k.busy)
        pipe.lrange(k.latency, 0, -1)
        pipe.lrange(k.failures, 0, 9)
        return 7

    @staticmethod
    def parse_snapshot(replies: Sequence[Any]) -> dict[str, Any]:
        counters, running, delayed, dead, busy, latency, failures = replies
        out = _counters(counters, running, delayed, dead, busy)
        out["latency_ms"] = [int(v) for v in latency]
        out["failures"] = [json.loads(f) for f in failures]
        return out

    def stats(self) -> dict[str, int]:
        """O(1) counters of the queue (one round trip, cost independent of its size)."""
        k = self.keys
        with redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            pipe.hgetall(k.stats)
            pipe.zcard(k.leases)
            pipe.zcard(k.delayed)
            pipe.llen(k.dead)
            pipe.scard(k.busy)
            counters, running, delayed, dead, busy = pipe.execute()
        return _counters(counters, running, delayed, dead, busy)


def _counters(counters: dict[bytes, bytes], running: int, delayed: int, dead: int,
              busy: int) -> dict[str, Any]:
    out = {_s(name): int(value) for name, value in counters.items()}
    out.pop("free_marked", None)
    names = ("waiting", "streams", "submitted", "succeeded", "failed", "dead_total",
             "cancelled", "expired", "retried", "redelivered")
    result: dict[str, Any] = {name: out.get(name, 0) for name in names}
    result.update(running=running, delayed=delayed, dead=dead, busy_streams=busy)
    return result


__all__ = [
    "CANCEL",
    "DEAD",
    "FAIL",
    "LOST",
    "RELEASE",
    "REQUEUE",
    "RETRY",
    "TERMINAL",
    "Broker",
    "ClaimResult",
    "Claimed",
    "Code",
    "NewTask",
    "Snapshot",
]
