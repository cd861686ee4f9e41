"""The model catalogue: which model (target, version) each queue's workers serve.

Each queue has one model record (``QueueKeys.model``, a hash: target, version, kind,
deterministic, cacheable, loaded, host, worker), written by a worker when its model
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

from mtq.broker.connection import redis_errors
from mtq.broker.keys import MODELS_HISTORY, QueueKeys

#: most history records kept (all queues together)
HISTORY_KEEP = 1000
#: the model record's fields
FIELDS = ("target", "version", "kind", "deterministic", "cacheable", "loaded", "host",
          "worker")


def record(client: redis.Redis, queue: str, event: dict[str, Any],
           model: dict[str, Any] | None = None) -> None:
    """Append ``event`` (a JSON-encodable dict; ``queue`` is added) to the history and,
    when ``model`` is given, write it as the queue's model record (one round trip)."""
    with redis_errors("while writing the model catalogue"):
        pipe = client.pipeline(transaction=False)
        if model is not None:
            pipe.hset(QueueKeys(queue).model, mapping={k: str(v) for k, v in model.items()})
        pipe.lpush(MODELS_HISTORY, json.dumps({"queue": queue, **event}, sort_keys=True))
        pipe.ltrim(MODELS_HISTORY, 0, HISTORY_KEEP - 1)
        pipe.execute()


def models(client: redis.Redis, queues: list[str]) -> dict[str, dict[str, str]]:
    """The model record of each queue that has one (one round trip)."""
    with redis_errors("while reading the model catalogue"):
        pipe = client.pipeline(transaction=False)
        for q in queues:
            pipe.hgetall(QueueKeys(q).model)
        rows = pipe.execute() if queues else []
    return {q: {k.decode(): v.decode() for k, v in row.items()}
            for q, row in zip(queues, rows) if row}


def history(client: redis.Redis, count: int = 20, queue: str | None = None
            ) -> list[dict[str, Any]]:
    """The last ``count`` history records, newest first (of ``queue`` only, if given:
    then the whole kept list is read, at most HISTORY_KEEP records)."""
    with redis_errors("while reading the model history"):
        raw = client.lrange(MODELS_HISTORY, 0, (HISTORY_KEEP if queue else count) - 1)
    out = []
    for line in raw:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if queue is None or rec.get("queue") == queue:
            out.append(rec)
    return out[:count]
