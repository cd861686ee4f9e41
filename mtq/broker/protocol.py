"""The queue protocol: one method per Lua script, with typed arguments and replies.

A :class:`Broker` is bound to one queue and one Redis client. Each operation has
a ``*_call`` form that returns a :class:`~mtq.broker.scripts.Call`, so callers on
hot paths can pipeline several operations in one round trip (a worker acks its
last batch and claims the next one together), and a plain form that runs it.
The records the scripts take and return, and the parsers of their replies, live in
:mod:`mtq.broker.records` (and are imported from here too).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import redis

from mtq.broker import codes, lane, scripts
from mtq.broker.cluster import for_queue, shared
from mtq.broker.codes import Code
from mtq.broker.config import SettingsSource
from mtq.broker.connection import redis_errors, single_attempt
from mtq.broker.keys import QUEUES, QueueKeys
from mtq.broker.records import (
    CANCEL,
    DEAD,
    FAIL,
    LOST,
    RELEASE,
    REQUEUE,
    RETRY,
    TERMINAL,
    Answer,
    Claimed,
    ClaimResult,
    NewTask,
    Snapshot,
    Submitted,
    parse_ack,
    parse_claim,
    parse_codes,
    parse_handed,
    parse_submit,
    parse_watch,
    text,
)
from mtq.settings import QueueSettings
from mtq.validation import check_cost

log = logging.getLogger(__name__)

#: how many of the last latencies a queue's snapshot reads (LATENCY_KEEP in _lib.lua)
LATENCY_KEEP = 1000

#: most reply channels one task carries (its submitter's and clients watching it)
MAX_WATCHERS = 8

#: how long a result cache entry may point at a task not finished yet (s), beyond the
#: cache's TTL: a task that runs longer loses its entry (no answer from the cache, and
#: identical requests run again); every end but success deletes it anyway
RUN_TTL_S = 3600


def read_traces(client: Any, queue: str, ids: Sequence[str]) -> list[list[bytes]]:
    """The raw trace lines ("ms|kind|detail") of each of ``ids``, in one round trip
    (trace.lua: a task on the happy path keeps its trace in its own fields, the others
    in a list). Raises MtqError (RedisUnavailable, BrokerError)."""
    k = QueueKeys(queue)
    call = scripts.Call(scripts.script("trace"), k.script_keys, [*k.channels, *ids], list)
    return list(scripts.run(client, call)[0])


class Broker:
    """Protocol operations of one queue over one Redis client (thread-safe)."""

    def __init__(self, client: redis.Redis, queue: str,
                 settings: QueueSettings | SettingsSource) -> None:
        #: the client of the queue's keys (on a cluster, of its slot: mtq.broker.cluster)
        self.redis = client = for_queue(client, queue)
        #: the client of the keys that belong to no queue (the list of queues)
        self.shared = shared(client)
        self.queue = queue
        self.keys = QueueKeys(queue)
        self.source = settings if isinstance(settings, SettingsSource) else \
            SettingsSource(client, queue, settings)
        self._head = self.keys.channels
        #: the version of the model this process serves (a worker sets it): ack writes
        #: a result into the cache only if it equals the queue's model record's
        self.model_version = ""

    @property
    def settings(self) -> QueueSettings:
        """The queue's settings now (see mtq.broker.config: stored in Redis, re-read
        every few seconds, with this process's overrides)."""
        return self.source.get()

    def run(self, *calls: scripts.Call) -> list[Any]:
        """Run several calls in one round trip."""
        return scripts.run(self.redis, *calls)

    def run_durable(self, *calls: scripts.Call) -> list[Any]:
        """:meth:`run`, then WAIT for the queue's ``durable_replicas`` (in the same round
        trip; see scripts.run_durable), when it asks for any; else just :meth:`run`."""
        s = self.settings
        if not s.durable_replicas:
            return self.run(*calls)
        values, acks = scripts.run_durable(self.redis, calls, s.durable_replicas,
                                           s.durable_timeout_ms)
        if acks < s.durable_replicas:
            log.warning("queue %s: %d of the %d replica(s) asked for confirmed a claim or "
                        "ack within %d ms; it stands on the primary alone (check INFO "
                        "replication, or lower durable_replicas)", self.queue, acks,
                        s.durable_replicas, s.durable_timeout_ms)
        return values

    def _call(self, name: str, args: Sequence[Any], parse: Any) -> scripts.Call:
        return scripts.Call(scripts.script(name), self.keys.script_keys, [*self._head, *args], parse)

    # -- producers -------------------------------------------------------------
    def submit_call(self, tasks: Sequence[NewTask], reply: str = "") -> scripts.Call:
        s = self.settings
        # the scheduling fields only when a task of the call has one (see submit.lua)
        sched = any(t.band != "s" or t.tenant or t.cost is not None or t.admit for t in tasks)
        # a run timeout closes each group only when a task of the call has one
        timed = any(t.timeout_ms for t in tasks)
        args: list[Any] = [s.max_length, s.wake_cap, s.idempotency_window_s, reply, len(tasks),
                           (12 if sched else 8) + timed, s.retention_s, s.cache_ttl_s,
                           s.cache_max_entries, RUN_TTL_S, s.tenant_weights, s.tenant_rpm,
                           s.tenant_tpm, s.rate_limit_mode]
        for t in tasks:
            args += [t.id, t.payload, t.stream, t.key, t.ttl_ms,
                     "" if t.retries is None else t.retries, t.digest, t.traceparent]
            if sched:
                args += [t.band, t.tenant, "" if t.cost is None else repr(t.cost),
                         "1" if t.admit else ""]
            if timed:
                args.append(t.timeout_ms or "")
        chained = any(t.chain for t in tasks)
        delayed = any(t.delay_ms for t in tasks)
        if chained or delayed:  # after the groups (submit.lua)
            args.append(",".join(str(t.delay_ms) for t in tasks) if delayed else "")
        if chained:  # two per task: its chain fields (submit.lua)
            for t in tasks:
                args += [t.chain, t.then]
        return self._call("submit", args, parse_submit)

    def submit(self, tasks: Sequence[NewTask], reply: str = "") -> Answer:
        """Submit tasks in one round trip. Returns ids (or negative codes per task;
        ``(id, encoded result)`` for a task answered from the result cache);
        ``[Code.QUEUE_FULL, waiting]`` if they do not fit; its ``handed``: how many went
        straight to a sleeping worker. ``reply``: the submitting client's reply channel
        (:meth:`QueueKeys.reply`), where their events go."""
        return self.run(self.submit_call(tasks, reply))[0]

    def submit_durable(self, tasks: Sequence[NewTask], reply: str = ""
                       ) -> tuple[Answer, int]:
        """:meth:`submit`, then wait (same round trip) until ``durable_replicas``
        replicas have its writes, at most ``durable_timeout_ms``: (the answer, how
        many replicas acknowledged)."""
        s = self.settings
        return scripts.run_then_wait(self.redis, self.submit_call(tasks, reply),
                                     s.durable_replicas, s.durable_timeout_ms)

    def register(self) -> None:
        """Record the queue name in the global registry (read by mtq status)."""
        with redis_errors():
            self.shared.sadd(QUEUES, self.queue)

    def delete_queue(self, chunk: int = 500) -> int:
        """Delete every key of the queue (SCAN and UNLINK, ``chunk`` at a time) and
        its name in the list of queues. Returns how many keys were deleted."""
        deleted = 0
        with redis_errors("while deleting the queue"):
            batch: list[bytes] = []
            # queue names hold no glob characters (see check_queue_name)
            for key in self.redis.scan_iter(match=self.keys.base + "*", count=1000):
                batch.append(key)
                if len(batch) >= chunk:
                    deleted += self.redis.unlink(*batch)
                    batch = []
            if batch:
                deleted += self.redis.unlink(*batch)
            self.shared.srem(QUEUES, self.queue)
        return deleted

    def cancel(self, task_id: str) -> tuple[int, str]:
        """Cancel one task; returns (code, previous status). See cancel.lua."""
        raw = self.run(self._call("cancel", [task_id, self.settings.retention_s],
                                  lambda r: (int(r[0]), text(r[1]))))
        return raw[0]

    def watch_call(self, task_id: str, reply: str, tokens_from: int = -1) -> scripts.Call:
        return self._call("watch", [task_id, reply, tokens_from, MAX_WATCHERS], parse_watch)

    def watch(self, task_id: str, reply: str, tokens_from: int = -1) -> Snapshot | None:
        """Read a task's state and its stored tokens from ``tokens_from`` (-1: none),
        adding ``reply`` to the channels its events go to (one round trip).
        None if there is no such task."""
        return self.run(self.watch_call(task_id, reply, tokens_from))[0]

    # -- consumers -------------------------------------------------------------
    def claim_call(self, worker: str, batch: int, lease_ms: int | None = None,
                   window_ms: int = 0, registered: bool = False,
                   room: int | None = None) -> scripts.Call:
        """``window_ms``: register the worker idle for this long if it claims nothing (0:
        not at all); ``registered``: it may be registered still; ``room``: the most one
        submit may hand it if registered (None: what it left of ``batch``; see
        claim.lua)."""
        s = self.settings
        args = [worker, batch, s.lease_ms if lease_ms is None else lease_ms, s.max_deliveries,
                s.reap_limit, s.retention_s, s.dead_retention_s, s.dead_max, window_ms,
                "1" if registered else "0", batch if room is None else room,
                s.tenant_weights, s.band_min_share, s.tenant_rpm, s.tenant_tpm,
                s.rate_limit_mode]
        return self._call("claim", args, parse_claim)

    def claim(self, worker: str, batch: int, lease_ms: int | None = None,
              window_ms: int = 0, registered: bool = False,
              room: int | None = None) -> ClaimResult:
        """Claim up to ``batch`` tasks (after reaping and promoting due retries). On a
        durable queue the claim returns once a replica has it (:meth:`run_durable`): a
        task runs only once a replica knows who runs it, so its ack, sent again to the
        replica promoted after its primary died, finds it running under its token
        (else it would be queued there, and run twice)."""
        return self.run_durable(self.claim_call(worker, batch, lease_ms, window_ms,
                                                registered, room))[0]

    def ack_call(self, results: Sequence[tuple[str, str, bytes]],
                 costs: Mapping[str, float] | None = None) -> scripts.Call:
        s = self.settings
        args: list[Any] = [s.retention_s, len(results)]
        for task_id, token, result in results:
            args += [task_id, token, result]
        args += [s.cache_ttl_s, self.model_version,
                 _costs([r[0] for r in results], costs) if costs else ""]
        return self._call("ack", args, parse_ack)

    def ack(self, results: Sequence[tuple[str, str, bytes]],
            costs: Mapping[str, float] | None = None) -> list[int]:
        """Record (id, token, encoded result) triples; one code per task. ``costs``:
        task id -> the cost it really had (scheduling: settled against the cost its
        claim charged; a task not in it keeps that charge)."""
        return self.run(self.ack_call(results, costs))[0]

    def nack_call(self, items: Sequence[tuple[str, str, str, str]],
                  costs: Mapping[str, float] | None = None) -> scripts.Call:
        s = self.settings
        args: list[Any] = [s.retention_s, s.dead_retention_s, s.dead_max, len(items)]
        for item in items:
            args += item
        args.append(_costs([i[0] for i in items], costs) if costs else "")
        return self._call("nack", args, parse_codes)

    def nack(self, items: Sequence[tuple[str, str, str, str]],
             costs: Mapping[str, float] | None = None) -> list[int]:
        """Settle (id, token, action, argument) tuples; see nack.lua. ``costs`` as for
        :meth:`ack`."""
        return self.run(self.nack_call(items, costs))[0]

    def emit_call(self, items: Sequence[tuple[str, str, int, bytes]]) -> scripts.Call:
        # raw strings: the cmsgpack of Redis 6.2 predates the bin types
        return self._call("emit", [msgpack.packb(items, use_bin_type=False)], parse_codes)

    def emit(self, items: Sequence[tuple[str, str, int, bytes]]) -> list[int]:
        """Stream (id, token, index, encoded data) items; index -1 is a progress
        report. One code per item; see emit.lua."""
        return self.run(self.emit_call(items))[0]

    def extend_call(self, leases: Sequence[tuple[str, str]], lease_ms: int | None = None
                    ) -> scripts.Call:
        args: list[Any] = [self.settings.lease_ms if lease_ms is None else lease_ms, len(leases)]
        for task_id, token in leases:
            args += [task_id, token]
        return self._call("extend", args, parse_codes)

    def extend(self, leases: Sequence[tuple[str, str]], lease_ms: int | None = None) -> list[int]:
        """Extend leases of (id, token) pairs; 1 ok, 2 ok + cancel requested, LEASE_LOST."""
        return self.run(self.extend_call(leases, lease_ms))[0]

    def orphans(self, worker: str) -> list[tuple[str, str]]:
        """(id, lease token) of every task still running under ``worker`` (one round
        trip, O(running tasks of the queue)). See orphans.lua."""
        def parse(raw: list[Any]) -> list[tuple[str, str]]:
            return [(text(raw[i]), text(raw[i + 1])) for i in range(0, len(raw), 2)]

        return self.run(self._call("orphans", [worker, 0], parse))[0]

    def handover(self, worker: str, task_id: str, token: str) -> bool:
        """Task ``task_id`` (lease ``token``) runs in worker ``worker``'s process, not its
        claimer's: its start names that worker (see handover.lua). False: the lease is
        lost."""
        return self.run(self._call("handover", [worker, task_id, token],
                                   lambda r: int(r) == 1))[0]

    def reap(self) -> tuple[int, int, int]:
        """Reclaim expired leases and promote due retries: (reaped, promoted, next timer ms)."""
        s = self.settings
        args = [s.max_deliveries, s.reap_limit, s.retention_s, s.dead_retention_s,
                s.dead_max, s.wake_cap]
        raw = self.run(self._call("reap", args, lambda r: tuple(int(x) for x in r)))
        return raw[0]

    def wait_for_work(self, timeout_s: float, interrupt: str | None = None,
                      inbox: str | None = None) -> bytes | bool:
        """Block until a submit wakes this worker or ``timeout_s`` passes (BLPOP).

        ``interrupt``: a worker's own wake key (:meth:`QueueKeys.worker_wake`), which
        its other threads push to when they need the sleeper back (pause, stop).
        ``inbox``: its inbox (:meth:`QueueKeys.worker_inbox`), where a submit hands
        tasks to a worker registered idle. Returns the inbox entry popped (see
        :func:`parse_handed`), True if woken by a marker, False on timeout.
        Redis checks blocking timeouts at its ``hz`` (10/s by default), so a timeout
        may overrun by up to 100 ms; nothing on a latency path depends on it.
        """
        # its inbox first: what was handed to it before a marker for the rest
        keys = [k for k in (inbox, self.keys.wake, interrupt) if k is not None]
        # sent once: a BLPOP repeated after a dropped connection would sleep on, though
        # the marker it had popped was lost with the connection; RedisUnavailable tells
        # the worker to claim at once instead (and to look for what it was handed)
        with redis_errors("while waiting for work"), single_attempt():
            popped = lane.exchange(self.redis, [("BLPOP", *keys, max(timeout_s, 0.001))])[0]
            if isinstance(popped, Exception):
                raise popped
        if popped is None:
            return False
        if inbox is not None and popped[0] == inbox.encode():
            return bytes(popped[1])
        return True

    def retire(self, worker: str) -> list[Claimed]:
        """Take worker ``worker``'s idle registration back, and what was handed to it and
        not yet taken (its inbox), in one transaction: no submit hands it anything
        after this. Returns those tasks (still running under it: release them)."""
        with redis_errors("while retiring a worker"):
            pipe = self.redis.pipeline(transaction=True)
            pipe.hdel(self.keys.idle, worker)
            pipe.lrange(self.keys.worker_inbox(worker), 0, -1)
            pipe.delete(self.keys.worker_inbox(worker))
            _, entries, _ = pipe.execute()
        return [t for e in entries for t in parse_handed(e)]

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
            raise codes.error(done, queue=self.queue, detail=f"unknown dead-letter action "
                              f"{action!r}: use retry or purge")
        return done, more

    # -- inspection ------------------------------------------------------------
    def dead_letters(self, start: int = 0, count: int = 20) -> list[dict[str, Any]]:
        """Dead letters, newest first: id, stream, error, attempts, deliveries,
        created, finished (ms), traceback (None when the handler raised none: a
        poison task that killed its process). Two round trips; cost grows with
        ``count`` only."""
        k = self.keys
        with redis_errors("while reading the dead letters"):
            ids = [text(i) for i in self.redis.lrange(k.dead, start, start + count - 1)]
            pipe = self.redis.pipeline(transaction=False)
            names = ("stream", "error", "attempts", "deliveries", "created", "finished",
                     "traceback")
            for i in ids:
                pipe.hmget(k.task(i), *names)
            rows = pipe.execute() if ids else []
        out = []
        for i, values in zip(ids, rows):
            row: dict[str, Any] = {"id": i}
            for name, v in zip(names, values):
                shown = None if v is None else text(v)
                row[name] = int(shown) if shown is not None and name in (
                    "attempts", "deliveries", "created", "finished") else shown
            out.append(row)
        return out

    def trace(self, task_id: str) -> list[tuple[int, str, str]]:
        """A task's life, oldest first: (server ms, kind, detail)."""
        with redis_errors("while reading a task's trace"):
            raw = read_traces(self.redis, self.queue, [task_id])[0]
        out = []
        for line in raw:
            ts, kind, detail = text(line).split("|", 2)
            out.append((int(ts), kind, detail))
        return out

    def snapshot_into(self, pipe: Any) -> Any:
        """Queue the reads of :meth:`parse_snapshot` on ``pipe``: O(1) counters, the
        last latencies and failures. Cost grows with nothing but their caps."""
        k = self.keys
        pipe.hgetall(k.stats)
        pipe.zcount(k.leases, "-inf", "(+inf")  # running: not the +inf mark (_lib.lua)
        pipe.zcard(k.delayed)
        pipe.llen(k.dead)
        pipe.scard(k.busy)
        pipe.lrange(k.latency, 0, LATENCY_KEEP - 1)  # up to 200 more may follow (_lib.lua)
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
        with redis_errors():
            return stats_many(self.redis, [self.queue])[self.queue]


def stats_many(client: redis.Redis, queues: list[str]) -> dict[str, dict[str, Any]]:
    """:meth:`Broker.stats` of each queue in ``queues``, in ONE pipelined round trip
    (six O(1) commands a queue), for an exporter that reads many queues at once.
    Raises redis-py's errors as they are (the caller decides what an outage means)."""
    pipe = client.pipeline(transaction=False)
    for name in queues:
        k = QueueKeys(name)
        pipe.hgetall(k.stats)
        pipe.zcount(k.leases, "-inf", "(+inf")  # running: not the +inf mark (_lib.lua)
        pipe.zcard(k.delayed)
        pipe.llen(k.dead)
        pipe.scard(k.busy)
        pipe.zcard(k.cache_index)
    replies = pipe.execute() if queues else []
    return {name: _counters(*replies[6 * i:6 * i + 6]) for i, name in enumerate(queues)}


def _counters(counters: dict[bytes, bytes], running: int, delayed: int, dead: int,
              busy: int, cache_entries: int = 0) -> dict[str, Any]:
    out = {text(name): int(value) for name, value in counters.items()}
    out.pop("free_marked", None)
    names = ("waiting", "streams", "submitted", "succeeded", "failed", "dead_total",
             "cancelled", "expired", "retried", "redelivered",
             "cache_hits", "cache_misses", "cache_joined")
    result: dict[str, Any] = {name: out.get(name, 0) for name in names}
    result.update(running=running, delayed=delayed, dead=dead, busy_streams=busy,
                  cache_entries=cache_entries)
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
    "Answer",
    "Broker",
    "ClaimResult",
    "Claimed",
    "Code",
    "NewTask",
    "Snapshot",
    "Submitted",
    "stats_many",
]


def _costs(ids: Sequence[str], costs: Mapping[str, float]) -> str:
    """The costs ack.lua and nack.lua take: "index=cost,..." (index from 1). Raises
    InvalidArgument, before anything is sent, for a cost that is not a finite number
    in [0, MAX_COST] (Redis would fail the script after it had settled some tasks)."""
    return ",".join(f"{i}={check_cost(costs[t], f'the cost reported for {t}')!r}"
                    for i, t in enumerate(ids, 1) if t in costs)
