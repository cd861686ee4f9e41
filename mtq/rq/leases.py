"""mtq's lease index over an RQ queue: keys, Lua scripts and one wrapper per script.

RQ keeps a queue as the list ``rq:queue:<name>`` of job ids. ``mtq rq worker`` takes
ids from its head with :func:`claim` (one atomic script: pop and lease), so a worker
killed at any instant loses nothing: an id is either still in the queue or in the
lease index, from which :func:`reap` gives it back to the head of the queue, in claim
order. Keys (next to RQ's own, under ``mtq:rq:``):

==============================  ==========  =============================================
``mtq:rq:{<queue>}:leases``     sorted set  job id -> lease deadline (ms, server clock)
``mtq:rq:{<queue>}:owner``      hash        job id -> ``"<worker name>|<token>"``
``mtq:rq:{<queue>}:token``      string      the token counter (tokens fence and order)
``mtq:rq:{<queue>}:deliveries`` hash        job id -> ``<deaths>:<cap>``: times a worker
                                            died running it, most jobs per call since
==============================  ==========  =============================================

The scripts are in ``mtq/rq/lua/`` rather than ``mtq/broker/lua/``: they work on RQ's
key space (rq's own keys are not hash-tagged, so, like RQ itself, this bridge does not
run on Redis Cluster), not on the twenty-two keys that every script of mtq's broker shares.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import cache
from importlib import resources
from typing import Any

import redis

from mtq.broker.keys import rq_lease


def queue_key(queue: str) -> str:
    return f"rq:queue:{queue}"


def leases_key(queue: str) -> str:
    return rq_lease(queue, "leases")


def owner_key(queue: str) -> str:
    return rq_lease(queue, "owner")


def token_key(queue: str) -> str:
    return rq_lease(queue, "token")


def deliveries_key(queue: str) -> str:
    return rq_lease(queue, "deliveries")


def wip_key(queue: str) -> str:
    return f"rq:wip:{queue}"


def job_key(job_id: str) -> str:
    return f"rq:job:{job_id}"


def dependents_key(job_id: str) -> str:
    return f"rq:job:{job_id}:dependents"


def executions_key(job_id: str) -> str:
    return f"rq:executions:{job_id}"


@cache
def _source(name: str) -> str:
    return resources.files("mtq.rq").joinpath("lua").joinpath(name + ".lua").read_text("utf-8")


class Scripts:
    """The five scripts registered on one client (EVALSHA; loaded on NOSCRIPT)."""

    def __init__(self, client: redis.Redis) -> None:
        self.claim = client.register_script(_source("claim"))
        self.extend = client.register_script(_source("extend"))
        self.fence = client.register_script(_source("fence"))
        self.reap = client.register_script(_source("reap"))
        self.count = client.register_script(_source("count"))


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def claim(scripts: Scripts, queue: str, worker: str, n: int, lease_ms: int
          ) -> list[tuple[str, str]]:
    """Lease up to ``n`` ids from the head of ``queue``: ``[(job id, owner value)]`` in
    queue order (empty when the queue is empty)."""
    reply = scripts.claim(keys=[queue_key(queue), leases_key(queue), owner_key(queue),
                                token_key(queue)], args=[worker, n, lease_ms])
    if not reply:
        return []
    first = int(reply[0])
    return [(_text(i), f"{worker}|{first + k}") for k, i in enumerate(reply[1:])]


def extend(scripts: Scripts, queue: str, held: Iterable[tuple[str, str]], lease_ms: int
           ) -> set[str]:
    """Extend the leases in ``held`` ((id, owner value) pairs); the ids lost."""
    args: list[Any] = [lease_ms]
    for job_id, owner in held:
        args += [job_id, owner]
    if len(args) == 1:
        return set()
    return {_text(i) for i in scripts.extend(keys=[leases_key(queue), owner_key(queue)],
                                             args=args)}


def fence(scripts: Scripts, client: Any, queue: str, ids: Sequence[str]
          ) -> list[tuple[str, str, int]]:
    """(owner value, status, number of dependents) of each job, read on ``client`` (a
    pipeline in WATCH mode: the read runs at once)."""
    keys = [owner_key(queue)]
    for job_id in ids:
        keys += [job_key(job_id), dependents_key(job_id)]
    reply = scripts.fence(keys=keys, args=list(ids), client=client)
    return [(_text(reply[i]), _text(reply[i + 1]), int(reply[i + 2]))
            for i in range(0, len(reply), 3)]


def _reap(scripts: Scripts, queue: str, mode: str, worker: str, ids: Sequence[str],
          args: list[Any]) -> list[str]:
    keys = [queue_key(queue), leases_key(queue), owner_key(queue), wip_key(queue)]
    for job_id in ids:
        keys += [job_key(job_id), executions_key(job_id)]
    return [_text(i) for i in scripts.reap(keys=keys, args=[mode, worker, *args])]


def give_back(scripts: Scripts, queue: str, held: Sequence[tuple[str, str]]) -> list[str]:
    """Give back jobs this worker holds ((id, owner value) pairs) to the head of the
    queue, in claim order; returns the ids pushed back."""
    if not held:
        return []
    flat: list[Any] = []
    for job_id, owner in held:
        flat += [job_id, owner]
    return _reap(scripts, queue, "exact", "", [i for i, _ in held], flat)


def reap_expired(scripts: Scripts, client: redis.Redis, queue: str, limit: int = 500
                 ) -> list[str]:
    """Give back the jobs of ``queue`` whose lease has expired (a frozen or dead worker)."""
    t = client.time()
    now_ms = int(t[0]) * 1000 + int(t[1]) // 1000
    ids = [_text(i) for i in client.zrangebyscore(leases_key(queue), "-inf", now_ms,
                                                  start=0, num=limit)]
    if not ids:
        return []
    return _reap(scripts, queue, "expired", "", ids, ids)


def reap_worker(scripts: Scripts, client: redis.Redis, queue: str, worker: str) -> list[str]:
    """Give back every job of ``queue`` held by ``worker`` (a process that died)."""
    prefix = worker + "|"
    ids = [_text(k) for k, v in client.hscan_iter(owner_key(queue), count=1000)
           if _text(v).startswith(prefix)]
    if not ids:
        return []
    return _reap(scripts, queue, "worker", worker, ids, ids)


def count_deliveries(scripts: Scripts, queue: str, worker: str, ids: Sequence[str],
                     call_size: int) -> dict[str, int]:
    """Count one more delivery of each job in ``ids`` (of a fatal call of ``call_size``
    jobs) that the dead ``worker`` still owns; returns their death counts."""
    if not ids:
        return {}
    reply = scripts.count(keys=[owner_key(queue), deliveries_key(queue)],
                          args=[worker, call_size, *ids])
    return {_text(reply[i]): int(reply[i + 1]) for i in range(0, len(reply), 2)}


def parse_deliveries(value: Any) -> tuple[int, int]:
    """(deaths, cap) of a deliveries entry; (0, 0) when there is none."""
    if not value:
        return 0, 0
    deaths, _, cap = _text(value).partition(":")
    return int(deaths or 0), int(cap or 1)
