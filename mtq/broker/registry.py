"""The worker registry: each worker process reports its health every heartbeat.

A hash per worker (``mtq:worker:<id>``, expiring after a few missed beats) and a
sorted set of worker id by last beat. A worker that stops beating expires from
both (readers prune the sorted set), and the reaper takes its tasks back when
their leases run out. Reading takes three round trips (prune, read the index, one
pipeline of HGETALL per live worker): it grows with workers, never with tasks.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import redis

from mtq.broker import keys
from mtq.broker.cluster import shared
from mtq.broker.connection import redis_errors


def beat(client: redis.Redis, worker_id: str, fields: dict[str, Any], ttl_s: float,
         extra: Callable[[Any], None] | None = None) -> None:
    """Write one worker's entry (one round trip). Every value is JSON-encoded, so
    readers get back the types that were written. ``extra(pipe)`` may queue more
    writes in the same round trip (the worker's batch records)."""
    now = time.time()
    flat: dict[str | bytes, str] = {
        k: json.dumps(v) for k, v in fields.items()}
    flat["beat"] = json.dumps(now)
    key = keys.worker(worker_id)
    with redis_errors("while reporting to the worker registry"):
        pipe = shared(client).pipeline(transaction=False)
        pipe.hset(key, mapping=flat)
        pipe.expire(key, max(1, int(ttl_s + 0.999)))
        pipe.zadd(keys.WORKERS, {worker_id: now})
        if extra is not None:
            extra(pipe)
        pipe.execute()


def remove(client: redis.Redis, worker_id: str) -> None:
    """Delete a worker's entry (it stopped cleanly)."""
    with redis_errors("while leaving the worker registry"):
        pipe = shared(client).pipeline(transaction=False)
        pipe.delete(keys.worker(worker_id))
        pipe.zrem(keys.WORKERS, worker_id)
        pipe.execute()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _decode(raw: dict[bytes, bytes]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in raw.items():
        text = v.decode()
        try:
            out[k.decode()] = json.loads(text)
        except ValueError:
            out[k.decode()] = text
    return out


def list_workers(client: redis.Redis, queue: str | None = None,
                 stale_s: float = 60.0) -> list[dict[str, Any]]:
    """Live workers (optionally of one queue), oldest first, each a dict of the fields
    it reported plus ``id`` and ``heartbeat_age_s``. Entries whose hash expired are
    pruned from the index, and so is anything not seen for ``stale_s``."""
    now = time.time()
    client = shared(client)  # the registry belongs to no queue
    with redis_errors("while reading the worker registry"):
        client.zremrangebyscore(keys.WORKERS, "-inf", now - stale_s)
        ids = [_text(i) for i in client.zrange(keys.WORKERS, 0, -1)]
        if not ids:
            return []
        pipe = client.pipeline(transaction=False)
        for worker_id in ids:
            pipe.hgetall(keys.worker(worker_id))
        rows = pipe.execute()
        gone = [w for w, raw in zip(ids, rows) if not raw]
        if gone:
            client.zrem(keys.WORKERS, *gone)
    out = []
    for worker_id, raw in zip(ids, rows):
        if not raw:
            continue
        entry = _decode(raw)
        if queue is not None and entry.get("queue") != queue:
            continue
        entry["id"] = worker_id
        entry["heartbeat_age_s"] = round(max(0.0, now - float(entry.get("beat", now))), 3)
        out.append(entry)
    return out
