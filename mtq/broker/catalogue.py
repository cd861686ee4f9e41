"""The model catalogue: which model (target, version) each queue's workers serve.

Each queue has one model record (``QueueKeys.model``, a hash: target, version, kind,
deterministic, cacheable, loaded, host, worker, options: the
``--set`` values as a JSON object), written by a worker when its model
is set up and after each successful reload: the result cache keys on its version
(see ``lua/submit.lua``). A global list (:data:`~mtq.broker.keys.MODELS_HISTORY`)
keeps the last :data:`HISTORY_KEEP` events (loaded, reloaded, reload_failed,
stopped) of every queue, newest first; it has no expiry, so it outlives the
workers. Every write is one pipelined round trip.
"""

from __future__ import annotations

import json
from typing import Any

import redis

from mtq.broker.cluster import shared
from mtq.broker.connection import redis_errors
from mtq.broker.keys import MODELS_HISTORY, QueueKeys

#: most history records kept (all queues together)
HISTORY_KEEP = 1000
#: the model record's fields
FIELDS = ("target", "version", "kind", "deterministic", "cacheable", "loaded", "host",
          "worker", "options")


def record(client: redis.Redis, queue: str, event: dict[str, Any],
           model: dict[str, Any] | None = None) -> None:
    """Append ``event`` (a JSON-encodable dict; ``queue`` is added) to the history and,
    when ``model`` is given, write it as the queue's model record (one round trip)."""
    with redis_errors("while writing the model catalogue"):
        pipe = shared(client).pipeline(transaction=False)  # the history is no queue's
        if model is not None:
            pipe.hset(QueueKeys(queue).model, mapping={k: str(v) for k, v in model.items()})
        pipe.lpush(MODELS_HISTORY, json.dumps({"queue": queue, **event}, sort_keys=True))
        pipe.ltrim(MODELS_HISTORY, 0, HISTORY_KEEP - 1)
        pipe.execute()


def models(client: redis.Redis, queues: list[str]) -> dict[str, dict[str, str]]:
    """The model record of each queue that has one (one round trip)."""
    with redis_errors("while reading the model catalogue"):
        pipe = shared(client).pipeline(transaction=False)  # queues of any slot
        for q in queues:
            pipe.hgetall(QueueKeys(q).model)
        rows = pipe.execute() if queues else []
    return decode_records(queues, rows)


def decode_records(queues: list[str], rows: list[dict[bytes, bytes]]
                   ) -> dict[str, dict[str, str]]:
    """The model records of ``queues`` from their HGETALL replies (empty ones left out)."""
    return {q: {k.decode(): v.decode() for k, v in row.items()}
            for q, row in zip(queues, rows) if row}


def _options(rec: dict[str, str]) -> dict[str, Any]:
    try:
        value = json.loads(rec.get("options") or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def served(workers: list[dict[str, Any]], records: dict[str, dict[str, str]]
           ) -> list[dict[str, Any]]:
    """One row per (queue, model, version) that live ``workers`` (registry entries)
    serve: target, kind, replicas, hosts, devices, when loaded, and whether it is the
    queue's recorded model (``current``;
    its ``options`` are the recorded ``--set`` values; False for a replica left on an old version
    half way through a reload). A queue whose record has no live worker gets a row
    with 0 replicas. ``mtq models`` and the dashboard show these rows."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for w in workers:
        key = (str(w.get("queue")), str(w.get("model")), str(w.get("version")))
        groups.setdefault(key, []).append(w)
    rows = []
    seen = set()
    for (q, model, version), ws in sorted(groups.items()):
        rec = records.get(q, {})
        seen.add(q)
        current = rec.get("version") == version
        rows.append({
            "queue": q, "model": model, "version": version,
            "target": rec.get("target") if current else None,
            "kind": rec.get("kind"), "replicas": len(ws),
            "hosts": sorted({str(w.get("host")) for w in ws}),
            "devices": sorted({str(w.get("device")) for w in ws}),
            "loaded": int(rec["loaded"]) if current and rec.get("loaded") else None,
            "current": current, "options": _options(rec) if current else {},
        })
    for q, rec in sorted(records.items()):
        if q not in seen:
            rows.append({"queue": q, "model": None, "version": rec.get("version"),
                         "target": rec.get("target"), "kind": rec.get("kind"), "replicas": 0,
                         "hosts": [rec.get("host", "-")], "devices": [], "current": True,
                         "options": _options(rec),
                         "loaded": int(rec["loaded"]) if rec.get("loaded") else None})
    return rows


def history(client: redis.Redis, count: int = 20, queue: str | None = None
            ) -> list[dict[str, Any]]:
    """The last ``count`` history records, newest first (of ``queue`` only, if given:
    then the whole kept list is read, at most HISTORY_KEEP records)."""
    with redis_errors("while reading the model history"):
        raw = shared(client).lrange(MODELS_HISTORY, 0, (HISTORY_KEEP if queue else count) - 1)
    out = []
    for line in raw:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if queue is None or rec.get("queue") == queue:
            out.append(rec)
    return out[:count]
