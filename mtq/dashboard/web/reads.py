"""What a queue page and a task page read beyond the shared snapshot, each bounded.

* :func:`queue_details`: the busiest streams and the longest waits. Redis keeps no
  index of streams by length or of waiting tasks by age, so these are read from a
  bounded sample: the first :data:`RING_SAMPLE` entries of the queue's round-robin
  rings (one per scheduling lane, at most :data:`LANE_SAMPLE` lanes) and up to
  :data:`RING_SAMPLE` streams of the set of busy ones, then each sampled stream's
  length and head task, and the heads of the stream-less free lists. Four round trips
  whatever the queue holds; with more streams than that, the lists are the busiest
  and oldest *of the sample* (the page says so).
* :func:`dead_page`: one page of the dead-letter list (LLEN, LRANGE, then one HMGET
  each).
* :func:`task_details`: a task's fields, its trace, and previews of its payload and
  result capped at :data:`PREVIEW_CHARS` (the rest counted, never sent).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import msgpack
import redis

from mtq.admin import find_task
from mtq.broker.cluster import shared
from mtq.broker.connection import redis_errors
from mtq.broker.keys import QUEUES
from mtq.broker.protocol import Broker
from mtq.client.records import TaskInfo, TraceEntry
from mtq.settings import QueueSettings
from mtq.validation import BAND_NAMES, check_queue_name

#: ring entries (streams) read per lane, and busy streams sampled
RING_SAMPLE = 200
#: scheduling lanes whose rings are sampled
LANE_SAMPLE = 50
#: rows shown of the busiest streams and of the longest waits
TOP = 10
#: characters of a payload, result or traceback shown; the rest is counted
PREVIEW_CHARS = 2000
#: dead letters per page
DEAD_PAGE = 20


def _text(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def queue_known(client: redis.Redis, queue: str) -> bool:
    """Whether ``queue`` is a valid name that was ever submitted to."""
    try:
        check_queue_name(queue)
    except ValueError:
        return False
    with redis_errors("while looking for the queue"):
        return bool(shared(client).sismember(QUEUES, queue))


@dataclass
class QueueDetails:
    """The busiest streams (name, waiting, whether one of its tasks runs) and the
    longest waits (id, stream, tenant, band, created ms) of a bounded sample."""

    streams: list[dict[str, Any]] = field(default_factory=list)
    waits: list[dict[str, Any]] = field(default_factory=list)
    #: streams sampled, and whether the sample may have left some out
    sampled: int = 0
    partial: bool = False


def queue_details(client: redis.Redis, queue: str, top: int = TOP) -> QueueDetails:
    """See the module docstring: four round trips, bounded by the samples."""
    b = Broker(client, queue, QueueSettings())
    k = b.keys
    rc = b.redis
    with redis_errors("while reading the queue's streams"):
        pipe = rc.pipeline(transaction=False)
        pipe.lrange(k.ready, 0, RING_SAMPLE - 1)
        pipe.srandmember(k.busy, RING_SAMPLE)
        pipe.scard(k.busy)
        pipe.srandmember(k.sched + "lanes", LANE_SAMPLE)
        pipe.lrange(k.free, 0, top - 1)
        ready, busy, nbusy, lanes, free = pipe.execute()
        lanes = [_text(x) for x in lanes or []]
        pipe = rc.pipeline(transaction=False)
        for lane in lanes:
            pipe.lrange(k.sched + "ready:" + lane, 0, RING_SAMPLE - 1)
            pipe.lrange(k.sched + "free:" + lane, 0, top - 1)
        lane_reads = pipe.execute() if lanes else []
        rings = [s for ring in lane_reads[0::2] for s in ring]
        names = dict.fromkeys(_text(s) for s in [*ready, *busy, *rings] if s)
        heads = [_text(i) for i in [*free, *(i for fl in lane_reads[1::2] for i in fl)]]
        streams = list(names)
        pipe = rc.pipeline(transaction=False)
        for s in streams:
            pipe.llen(k.stream(s))
            pipe.lindex(k.stream(s), 0)
        replies = pipe.execute() if streams else []
        busy_set = {_text(s) for s in busy}
        rows: list[dict[str, Any]] = []
        for i, s in enumerate(streams):
            n, head = replies[2 * i], replies[2 * i + 1]
            if n:
                rows.append({"stream": s, "waiting": int(n), "running": s in busy_set})
            if head is not None:
                heads.append(_text(head))
        heads = list(dict.fromkeys(heads))
        pipe = rc.pipeline(transaction=False)
        for tid in heads:
            pipe.hmget(k.task(tid), "status", "stream", "tenant", "band", "created")
        fields = pipe.execute() if heads else []
    rows.sort(key=lambda r: (-r["waiting"], r["stream"]))
    waits: list[dict[str, Any]] = []
    for tid, (status, stream, tenant, band, created) in zip(heads, fields):
        if status is None or _text(status) != "queued" or created is None:
            continue
        waits.append({"id": tid, "stream": _text(stream) if stream else None,
                      "tenant": _text(tenant) if tenant else "",
                      "band": BAND_NAMES.get(_text(band), _text(band)) if band else "standard",
                      "created": int(created)})
    waits.sort(key=lambda w: w["created"])
    partial = len(ready) >= RING_SAMPLE or int(nbusy) > RING_SAMPLE or len(lanes) >= LANE_SAMPLE
    return QueueDetails(rows[:top], waits[:top], len(streams), partial)


def dead_page(client: redis.Redis, queue: str, page: int = 1, size: int = DEAD_PAGE
              ) -> tuple[list[dict[str, Any]], int]:
    """Page ``page`` (from 1; one past the last: the last) of ``queue``'s dead
    letters, newest first, and their total."""
    b = Broker(client, queue, QueueSettings())
    with redis_errors("while counting the dead letters"):
        total = int(b.redis.llen(b.keys.dead))
    page = max(1, min(page, -(-total // size)))
    return b.dead_letters((page - 1) * size, size), total


# -- a task ------------------------------------------------------------------------
@dataclass(frozen=True)
class Preview:
    """At most :data:`PREVIEW_CHARS` of a value as text, and how much was left out."""

    text: str
    more_bytes: int = 0


def _ext(code: int, data: bytes) -> str:
    """A tensor or an array in a stored value: named, never decoded (no torch here)."""
    try:
        kind, shape, _raw = msgpack.unpackb(data, raw=False)
    except Exception:
        return f"<extension type {code}, {len(data)} bytes>"
    return f"<array {kind} {list(shape)}, {len(data)} bytes>"


def preview(raw: bytes | None, limit: int = PREVIEW_CHARS) -> Preview | None:
    """A stored msgpack value as JSON text (indented), cut to ``limit`` characters."""
    if raw is None:
        return None
    try:
        value = msgpack.unpackb(raw, ext_hook=_ext, raw=False, strict_map_key=False)
        text = json.dumps(value, indent=2, ensure_ascii=False, default=repr)
    except Exception:
        text = raw[:limit * 4].decode("utf-8", "replace")
        return cap(text, limit, len(raw) - len(text.encode()))
    return cap(text, limit)


def cap(text: str, limit: int = PREVIEW_CHARS, already_left: int = 0) -> Preview:
    """``text`` cut to ``limit`` characters; ``more_bytes`` counts the rest in UTF-8."""
    if len(text) <= limit:
        return Preview(text, already_left)
    return Preview(text[:limit], len(text[limit:].encode()) + already_left)


@dataclass
class TaskDetails:
    queue: str
    info: TaskInfo
    trace: list[TraceEntry]
    fields: dict[str, str]
    payload: Preview | None
    result: Preview | None
    traceback: Preview | None
    error: Preview | None
    #: whether the task streamed tokens (its token log exists or existed)
    streamed: bool


def task_details(client: redis.Redis, task_id: str, queue: str | None = None,
                 limit: int = PREVIEW_CHARS, *, payload: bool = True) -> TaskDetails:
    """The task ``task_id`` (in ``queue`` or any known one). Raises TaskNotFound.
    ``payload``: read it too (False: ``payload`` is None; the live sections, which do
    not show it, spare reading and decoding it every refresh). The result is read once
    the task has succeeded."""
    task = find_task(client, task_id, queue)
    info = task.info()
    trace = task.trace()
    b = Broker(client, task.queue.name, QueueSettings())
    succeeded = info.status == "succeeded"
    with redis_errors("while reading the task"):
        tenant, band, cost, out, *values = b.redis.hmget(
            b.keys.task(task.id), "tenant", "band", "cost", "out",
            *(["payload"] if payload else []), *(["result"] if succeeded else []))
    stored = values[0] if payload else None
    result = values[-1] if succeeded else None
    fields = {"tenant": _text(tenant) if tenant else "(none)",
              "band": BAND_NAMES.get(_text(band), _text(band)) if band else "standard",
              "cost": _text(cost) if cost else "1"}
    return TaskDetails(
        queue=task.queue.name, info=info, trace=trace, fields=fields,
        payload=preview(stored, limit),
        result=preview(result, limit) if succeeded else None,
        traceback=cap(info.traceback, limit) if info.traceback else None,
        error=cap(info.error, limit) if info.error else None,
        streamed=out is not None)
