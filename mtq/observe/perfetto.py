"""``mtq trace``: a queue's recent life as a Chrome trace / Perfetto JSON file.

Sources (nothing is scanned; every read is bounded):

* the queue's batch list (``mtq:{q}:batches``, newest first, written by the
  workers, see :mod:`mtq.workers.batchlog`), read until its records are older
  than the window: which tasks ran, in which batches, on which worker;
* the tasks waiting, delayed or running now (the stream-less list, the streams of
  the ready ring and of the busy set, the retry and lease sorted sets), at most
  ``limit`` ids;
* the recent failures list (tasks that expired unrun);
* then each of those tasks' trace list (``ms|kind|detail``, server clock), in
  pipelines.

The conversion (:func:`chrome_trace`) is a pure function of what was read. The
file holds one process per worker (its batches on thread 0 and its tasks'
deliveries on lanes beneath, instants where a delivery was restarted or failed)
and one ``queue <name>`` process whose lanes hold a ``wait`` slice per stay of a
task in the queue (submit or requeue to claim). Overlapping slices are laid on
separate lanes (tids). Times are µs since the epoch (batch records use the
worker's clock, trace lists the Redis server's).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgpack

from mtq.errors import ConfigError

#: ``--since`` units, in seconds
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_SINCE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
#: kinds of a trace line that put a task (back) in the queue
_WAITS = {"queued", "restarted", "retry", "released"}
TERMINAL = {"succeeded", "failed", "dead", "cancelled", "expired"}
#: kinds shown as instant events as well
_INSTANTS = {"restarted", "retry", "failed", "dead", "expired", "cancel requested"}
_STARTED = re.compile(r"delivery (\d+) on (.+)$")
QUEUE_PID = 1


def parse_since(text: str) -> float:
    """``500ms``, ``90s``, ``5m``, ``2h`` or a plain number of seconds, as seconds.
    Raises ValueError naming what is accepted."""
    m = _SINCE.match(text)
    if not m or float(m.group(1)) <= 0:
        raise ConfigError(f"bad --since {text!r}: give a positive duration such as 500ms, "
                         "90s, 5m, 2h, or a number of seconds")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def parse_record(raw: bytes | str) -> dict[str, Any] | None:
    """One batch record (see mtq.workers.batchlog: a msgpack array, or the JSON object
    of an older worker) as ``{"w", "h", "p", "k", "t0", "t1", "ids"}``, or None if it
    cannot be read."""
    try:
        if isinstance(raw, bytes) and raw[:1] != b"{":
            return _unpack_record(msgpack.unpackb(raw, raw=False))
        rec = json.loads(raw)
        if not isinstance(rec, dict):
            return None
        rec["t0"], rec["t1"] = int(rec["t0"]), int(rec["t1"])
        rec["ids"] = [str(i) for i in rec.get("ids") or []]
        return rec
    except (ValueError, TypeError, KeyError, msgpack.UnpackException):
        return None


def _unpack_record(fields: Any) -> dict[str, Any] | None:
    """``[worker, start ms, duration ms, ids, kind?, host?, pid?]`` as a record."""
    if not isinstance(fields, list) or len(fields) < 4:
        return None
    worker, t0, dt, ids = str(fields[0]), int(fields[1]), int(fields[2]), fields[3]
    kind = str(fields[4]) if len(fields) > 4 else "batch"
    if len(fields) > 6:
        host, pid = str(fields[5]), fields[6]
    else:  # the id tells them: host:pid:random
        parts = worker.split(":")
        host, pid = (parts[0], int(parts[1])) if len(parts) >= 3 and parts[1].isdigit() \
            else ("?", "?")
    return {"w": worker, "h": host, "p": pid, "k": kind, "t0": t0, "t1": t0 + dt,
            "ids": [str(i) for i in ids or []]}


def parse_line(raw: bytes | str) -> tuple[int, str, str] | None:
    """One trace line ``ms|kind|detail``."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    parts = text.split("|", 2)
    if len(parts) < 2 or not parts[0].isdigit():
        return None
    return int(parts[0]), parts[1], parts[2] if len(parts) > 2 else ""


class _Lanes:
    """Greedy interval partitioning: a slice goes on the first lane free at its start."""

    def __init__(self, first: int) -> None:
        self.first = first
        self.ends: list[int] = []

    def place(self, ts: int, end: int) -> int:
        for i, e in enumerate(self.ends):
            if e <= ts:
                self.ends[i] = end
                return self.first + i
        self.ends.append(end)
        return self.first + len(self.ends) - 1


def _worker_label(worker: str, rec: dict[str, Any] | None) -> tuple[str, str]:
    """(host, pid) of a worker, from its batch records or its id (host:pid:random)."""
    if rec is not None:
        return str(rec.get("h", "?")), str(rec.get("p", "?"))
    parts = worker.split(":")
    return (parts[0], parts[1]) if len(parts) >= 3 else (worker, "?")


def task_segments(task_id: str, lines: Sequence[tuple[int, str, str]], now_ms: int
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A task's stays in the queue and its deliveries, from its trace lines:
    (waits, runs), each a dict with start, end (ms), status, ``instants`` (the
    (ms, kind, detail) lines shown as instant events), for waits ``why`` (what put
    it in the queue) and for runs the delivery and worker. A stay or delivery
    still open ends at ``now_ms``."""
    waits: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    wait: dict[str, Any] | None = None
    run: dict[str, Any] | None = None
    for ms, kind, detail in sorted(lines, key=lambda x: x[0]):
        if kind == "started":
            m = _STARTED.search(detail)
            if wait is not None:
                wait.update(end=ms, status="started")
                waits.append(wait)
                wait = None
            if run is not None:  # a delivery whose end was not recorded
                run.update(end=ms, status="lost")
                runs.append(run)
            run = {"start": ms, "delivery": int(m.group(1)) if m else 0,
                   "worker": m.group(2) if m else "?", "instants": []}
        elif kind in _WAITS:
            if run is not None:
                run.update(end=ms, status=kind, detail=detail)
                if kind in _INSTANTS:
                    run["instants"].append((ms, kind, detail))
                runs.append(run)
                run = None
            if wait is None:
                wait = {"start": ms, "why": kind, "instants": []}
            elif kind in _INSTANTS:
                wait["instants"].append((ms, kind, detail))
        elif kind in TERMINAL:
            target = run if run is not None else wait
            if target is None:
                continue
            target.update(end=ms, status=kind)
            if kind != "succeeded":
                target["detail"] = detail
            if kind in _INSTANTS:
                target["instants"].append((ms, kind, detail))
            (runs if target is run else waits).append(target)
            run = wait = None
        elif kind in _INSTANTS:  # cancel requested
            target = run if run is not None else wait
            if target is not None:
                target["instants"].append((ms, kind, detail))
    if wait is not None:
        wait.update(end=now_ms, status="waiting")
        waits.append(wait)
    if run is not None:
        run.update(end=now_ms, status="running")
        runs.append(run)
    return waits, runs


def _stream(lines: Sequence[tuple[int, str, str]]) -> str:
    for _, kind, detail in lines:
        if kind == "queued" and detail.startswith("stream "):
            return detail[7:]
    return ""


def in_window(lines: Sequence[tuple[int, str, str]], since_ms: int) -> bool:
    """A task belongs to the window if any event of it is in it, or it is still
    waiting or running (its last event is not terminal)."""
    if not lines:
        return False
    return any(ms >= since_ms for ms, _, _ in lines) or lines[-1][1] not in TERMINAL


def _us(ms: int) -> int:
    return ms * 1000


def chrome_trace(queue: str, records: Iterable[dict[str, Any]],
                 traces: Mapping[str, Sequence[tuple[int, str, str]]], since_ms: int,
                 now_ms: int) -> dict[str, Any]:
    """The Chrome trace (``{"traceEvents": [...], "displayTimeUnit": "ms"}``) of a
    queue: ``records`` are batch records, ``traces`` each task's trace lines; only
    batches that ended and tasks with an event at or after ``since_ms`` are shown."""
    events: list[dict[str, Any]] = []
    workers: dict[str, int] = {}
    labels: dict[str, dict[str, Any] | None] = {}
    lanes: dict[int, _Lanes] = {}

    def pid_of(worker: str) -> int:
        if worker not in workers:
            workers[worker] = QUEUE_PID + 1 + len(workers)
            lanes[workers[worker]] = _Lanes(1)
        return workers[worker]

    recs = sorted((r for r in records if r["t1"] >= since_ms), key=lambda r: r["t0"])
    for r in recs:
        labels.setdefault(str(r.get("w")), r)
    batch_of: dict[tuple[str, str], int] = {}
    for n, r in enumerate(recs):
        w = str(r.get("w"))
        pid = pid_of(w)
        kind = r.get("k", "batch")
        events.append({"name": f"{kind} x{len(r['ids'])}", "cat": "batch", "ph": "X",
                       "ts": _us(r["t0"]), "dur": _us(max(0, r["t1"] - r["t0"])),
                       "pid": pid, "tid": 0,
                       "args": {"batch": n, "kind": kind, "size": len(r["ids"]),
                                "ids": r["ids"], "worker": w}})
        for i in r["ids"]:
            batch_of[(w, i)] = n

    queue_lanes = _Lanes(1)
    for task_id in sorted(traces, key=lambda i: traces[i][0][0] if traces[i] else 0):
        lines = traces[task_id]
        if not in_window(lines, since_ms):
            continue
        stream = _stream(lines)
        waits, runs = task_segments(task_id, lines, now_ms)
        for wt in waits:
            tid = queue_lanes.place(wt["start"], wt["end"])
            args = {"id": task_id, "stream": stream, "status": wt["status"], "after": wt["why"]}
            events.append({"name": "wait", "cat": "queue", "ph": "X", "ts": _us(wt["start"]),
                           "dur": _us(wt["end"] - wt["start"]), "pid": QUEUE_PID, "tid": tid,
                           "args": args})
            for ms, kind, detail in wt["instants"]:
                events.append({"name": kind, "cat": "task", "ph": "i", "s": "t", "ts": _us(ms),
                               "pid": QUEUE_PID, "tid": tid,
                               "args": {"id": task_id, "detail": detail}})
        for rn in runs:
            w = rn["worker"]
            pid = pid_of(w)
            tid = lanes[pid].place(rn["start"], rn["end"])
            args = {"id": task_id, "stream": stream, "delivery": rn["delivery"],
                    "status": rn["status"], "worker": w}
            if rn.get("detail"):
                args["detail"] = rn["detail"]
            if (w, task_id) in batch_of:
                args["batch"] = batch_of[(w, task_id)]
            events.append({"name": f"task {task_id}", "cat": "task", "ph": "X",
                           "ts": _us(rn["start"]), "dur": _us(rn["end"] - rn["start"]),
                           "pid": pid, "tid": tid, "args": args})
            for ms, kind, detail in rn["instants"]:
                events.append({"name": kind, "cat": "task", "ph": "i", "s": "t", "ts": _us(ms),
                               "pid": pid, "tid": tid,
                               "args": {"id": task_id, "delivery": rn["delivery"],
                                        "detail": detail}})

    meta: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "ts": 0, "pid": QUEUE_PID, "tid": 0,
         "args": {"name": f"queue {queue}"}},
        {"name": "process_sort_index", "ph": "M", "ts": 0, "pid": QUEUE_PID, "tid": 0,
         "args": {"sort_index": 0}},
    ]
    meta += [{"name": "thread_name", "ph": "M", "ts": 0, "pid": QUEUE_PID, "tid": QUEUE_PID + i,
              "args": {"name": f"wait {i + 1}"}} for i in range(len(queue_lanes.ends))]
    for w, pid in workers.items():
        host, proc = _worker_label(w, labels.get(w))
        meta += [
            {"name": "process_name", "ph": "M", "ts": 0, "pid": pid, "tid": 0,
             "args": {"name": f"worker {host} pid {proc} ({w})"}},
            {"name": "process_labels", "ph": "M", "ts": 0, "pid": pid, "tid": 0,
             "args": {"labels": f"host={host},pid={proc},worker={w}"}},
            {"name": "process_sort_index", "ph": "M", "ts": 0, "pid": pid, "tid": 0,
             "args": {"sort_index": pid}},
            {"name": "thread_name", "ph": "M", "ts": 0, "pid": pid, "tid": 0,
             "args": {"name": "batches"}},
        ]
        meta += [{"name": "thread_name", "ph": "M", "ts": 0, "pid": pid, "tid": 1 + i,
                  "args": {"name": f"tasks {i + 1}"}} for i in range(len(lanes[pid].ends))]
    return {"traceEvents": meta + events, "displayTimeUnit": "ms",
            "otherData": {"queue": queue, "since_ms": since_ms, "now_ms": now_ms}}


# -- reading Redis -----------------------------------------------------------------
#: batch records read per LRANGE while walking back to the window's start
PAGE = 500
#: trace lists read per pipeline
CHUNK = 1000


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def queue_exists(client: Any, queue: str) -> bool:
    """The queue is registered (``mtq:queues``) or has its counters (one round trip)."""
    from mtq.broker.cluster import shared
    from mtq.broker.keys import QUEUES, QueueKeys

    pipe = shared(client).pipeline(transaction=False)  # any slot, on a cluster
    pipe.sismember(QUEUES, queue)
    pipe.exists(QueueKeys(queue).stats, QueueKeys(queue).batches)
    member, n = pipe.execute()
    return bool(member) or int(n) > 0


def collect(client: Any, queue: str, since_s: float, limit: int = 10_000
            ) -> dict[str, Any]:
    """Read what :func:`chrome_trace` needs for the last ``since_s`` seconds of
    ``queue`` (see the module docstring) and convert it. ``limit`` bounds the
    waiting, delayed and running ids read. Raises redis-py's errors."""
    from mtq.broker.cluster import for_queue
    from mtq.broker.keys import QueueKeys
    from mtq.broker.protocol import read_traces

    k = QueueKeys(queue)
    client = for_queue(client, queue)  # its node's clock, on a cluster
    sec, usec = client.time()
    now_ms = int(sec) * 1000 + int(usec) // 1000
    since_ms = now_ms - int(since_s * 1000)
    records: list[dict[str, Any]] = []
    start = 0
    while True:  # newest first: stop at the first page that reaches back far enough
        page = client.lrange(k.batches, start, start + PAGE - 1)
        parsed = [r for r in map(parse_record, page) if r is not None]
        records += [r for r in parsed if r["t1"] >= since_ms]
        if len(page) < PAGE or any(r["t1"] < since_ms for r in parsed):
            break
        start += PAGE
    ids: dict[str, None] = {}
    for r in records:
        ids.update(dict.fromkeys(r["ids"]))
    # what waits, waits for a retry or runs now (bounded by ``limit``)
    pipe = client.pipeline(transaction=False)
    pipe.lrange(k.ready, 0, limit - 1)
    pipe.srandmember(k.busy, limit)
    pipe.lrange(k.free, 0, limit - 1)
    pipe.zrange(k.delayed, 0, limit - 1)
    pipe.zrangebyscore(k.leases, "-inf", "(+inf", 0, limit)  # not the mark
    pipe.lrange(k.failures, 0, -1)
    ready, busy, free, delayed, leases, failures = pipe.execute()
    live: list[str] = [_text(i) for i in (*free, *delayed, *leases)]
    streams = {_text(s) for s in (*ready, *busy)} - {""}
    if streams:
        pipe = client.pipeline(transaction=False)
        for s in sorted(streams):
            pipe.lrange(k.stream(s), 0, limit - 1)
        for waiting in pipe.execute():
            live += [_text(i) for i in waiting]
            if len(live) >= 3 * limit:
                break
    ids.update(dict.fromkeys(live[:3 * limit]))
    for f in failures:  # expired unrun: in no batch, no list
        try:
            row = json.loads(f)
            if int(row.get("ts", 0)) >= since_ms:
                ids[str(row["id"])] = None
        except (ValueError, KeyError, TypeError):
            continue
    traces: dict[str, list[tuple[int, str, str]]] = {}
    order = list(ids)
    for at in range(0, len(order), CHUNK):
        part = order[at:at + CHUNK]
        for i, lines in zip(part, read_traces(client, queue, part)):
            parsed_lines = [p for p in map(parse_line, lines) if p is not None]
            if parsed_lines:
                traces[i] = parsed_lines
    return chrome_trace(queue, records, traces, since_ms, now_ms)
