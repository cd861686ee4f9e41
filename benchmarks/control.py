#!/usr/bin/env python
"""Running work under control: one section per measured figure.

    python -m benchmarks.control                  # every section, writes the control block
    python -m benchmarks.control --only memory    # one section (repeat --only for more)
    python -m benchmarks.control --quick          # smaller sizes, prints only

Each section is a function ``measure_<name>(quick) -> dict`` that returns its rows
(``rows``: (measurement, figure, unit, note)) and targets (``targets``: (what, met,
detail, comparable)); :func:`main` runs the sections asked for and writes their rows
into the ``bench:control`` block of docs/benchmarks.md.

memory: the Redis memory a drained queue keeps. 200,000 no-op tasks over 10,000
streams through one ``mtq worker run`` of a batched no-op model (batch 32), with the
queue's ``retention_s`` set to 2 s for the run (so that finished tasks are gone when it
is measured); drained, the worker stopped, the task keys expired; then ``MEMORY USAGE``
(SAMPLES 0) of every key left, summed by kind, and the server's ``used_memory`` against
the same server's before anything was written.
"""

from __future__ import annotations

import re
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import redis

import mtq
from benchmarks.harness.meters import machine_info
from benchmarks.harness.procs import Proc, wait_for, worker_env
from benchmarks.harness.report import Results, cli_parser, docs_of, write_block
from benchmarks.harness.server import Server, compile_tree, uniq

#: the memory target: what a drained queue keeps beyond its settings, in bytes
MEMORY_TARGET = 1 << 20

_ID = re.compile(r"^mtq:\{[^}]*\}:([a-z_]+)(?::.*)?$")


def key_kind(key: str) -> str:
    """A key's kind: the part after ``mtq:{queue}:`` without its id (``task``,
    ``batches``, ``latency``, ...), or the whole name of a key outside a queue with its
    id stripped (``mtq:worker``)."""
    m = _ID.match(key)
    if m:
        return m.group(1)
    parts = key.split(":")
    return ":".join(parts[:2]) if len(parts) > 2 else key


def key_memory(r: redis.Redis) -> dict[str, tuple[int, int]]:
    """kind -> (keys, bytes: MEMORY USAGE ... SAMPLES 0 summed) of every key."""
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for raw in r.scan_iter(count=1000):
        key = raw.decode()
        used = r.memory_usage(key, samples=0)
        if used is None:  # expired between the scan and now
            continue
        row = out[key_kind(key)]
        row[0] += 1
        row[1] += int(used)
    return {k: (v[0], v[1]) for k, v in sorted(out.items())}


def drained_memory(server: Server, tasks: int, streams: int, settings: Mapping[str, Any],
                   batch: int = 32, timeout: float = 600) -> dict[str, Any]:
    """Drain ``tasks`` no-op tasks over ``streams`` streams through one worker, with the
    queue's ``settings`` stored first (``retention_s`` short: the run waits for it);
    then the memory of every key left, by kind, and ``used_memory`` above the empty
    server's."""
    r = redis.Redis.from_url(server.url)
    r.flushall()
    before = r.info("memory")
    stats0 = r.memory_stats()
    name = uniq("memory")
    q = mtq.Queue(name, client=r)
    q.configure(**settings)
    t0 = time.perf_counter()
    chunk = 5_000
    for start in range(0, tasks, chunk):
        n = min(chunk, tasks - start)
        q.submit_many([mtq.Request(None, stream=f"s{(start + i) % streams}")
                       for i in range(n)])
    submitted_s = time.perf_counter() - t0
    r.config_resetstat()
    p = Proc(["worker", "run", "benchmarks.children.noop:NoopModel", "--queue", name,
              "--redis", server.url, "--batch-size", str(batch)], worker_env(server.url))
    try:
        wait_for("the drain", lambda: q.stats()["succeeded"] >= tasks, timeout, [p], every=0.2)
        drained_s = time.perf_counter() - t0
        stats = r.info("commandstats")
        calls = sum(int(v["calls"]) for name, v in stats.items()
                    if name not in ("cmdstat_info", "cmdstat_config|resetstat"))
        p.stop()
        if p.proc.returncode not in (0, None):
            raise p.fail(f"the worker exited {p.proc.returncode}")
    finally:
        p.close()
    task_prefix = q.broker.keys.task_prefix + "*"
    wait_for("the finished tasks' retention", lambda: not any(
        True for _ in r.scan_iter(match=task_prefix, count=5000)),
        float(settings.get("retention_s", 3600)) + 60, every=0.5)
    kinds = key_memory(r)
    records = int(r.llen(q.broker.keys.batches))
    after = r.info("memory")
    used = int(after["used_memory"]) - int(before["used_memory"])
    stats1 = r.memory_stats()
    # the server's own structures (MEMORY STATS): the keyspace's hash tables (still sized
    # for the tasks that were there until Redis shrinks them), clients' buffers, scripts
    db0, db1 = stats0.get("db.0") or {}, stats1.get("db.0") or {}
    overhead = {"the keyspace's hash tables": sum(
        int(db1.get(f, 0)) - int(db0.get(f, 0))
        for f in ("overhead.hashtable.main", "overhead.hashtable.expires"))}
    for name, f in (("clients' buffers", "clients.normal"),
                    ("the Lua scripts' cache", "lua.caches")):
        overhead[name] = int(stats1.get(f, 0)) - int(stats0.get(f, 0))
    mtq.replies.hub_of(r).close_all()
    r.close()
    return {"kinds": kinds, "used_memory": used, "overhead": overhead,
            "submit_s": submitted_s, "records": records,
            "drain_s": drained_s, "commands": calls / tasks}


def measure_memory(quick: bool = False, *, tasks: int | None = None,
                   streams: int | None = None, settings: Mapping[str, Any] | None = None,
                   target: int = MEMORY_TARGET) -> dict[str, Any]:
    """The Redis memory a drained queue keeps (see the module's docstring): rows by key
    kind, and the target (under ``target`` bytes beyond the queue's settings)."""
    tasks = tasks or (5_000 if quick else 200_000)
    streams = streams or (250 if quick else 10_000)
    settings = {"retention_s": 2, **(settings or {})}
    server = Server()
    server.start()
    try:
        out = drained_memory(server, tasks, streams, settings)
    finally:
        server.stop()
    kinds = out["kinds"]
    kept = sum(b for k, (_, b) in kinds.items() if k != "config")
    rows: list[tuple[str, float | None, str, str]] = [
        (f"drained queue: every key left but its settings ({tasks:,} tasks, "
         f"{streams:,} streams)", kept, "bytes", f"target < {target:,}"),
        ("  used_memory above the empty server's", out["used_memory"], "bytes",
         "INFO memory, same server: the keys, and what the server keeps for its clients "
         "and scripts"),
    ]
    for name, b in out["overhead"].items():
        rows.append((f"    of which {name}", b, "bytes", "MEMORY STATS, once per server"))
    for kind, (n, b) in kinds.items():
        rows.append((f"  {kind} ({n} key{'s' if n != 1 else ''})", b, "bytes",
                     "MEMORY USAGE, SAMPLES 0"))
    rows.append(("  batch records kept (LLEN of the batch log)", out["records"], "records",
                 "batch_log_max, batch_log_bytes"))
    rows.append(("  drain (submit to last ack)", out["drain_s"], "s", ""))
    rows.append(("  Redis commands per task over the drain", out["commands"], "commands",
                 "INFO commandstats from the worker's start (scripts' own commands "
                 "included; the run's stats polls too)"))
    return {"rows": rows, "kept": kept, "kinds": kinds, "used_memory": out["used_memory"],
            "commands": out["commands"],
            "targets": [(f"a drained queue keeps < {target / (1 << 20):g} MiB beyond its "
                         "settings", kept < target, f"{kept:,} bytes", True)]}


#: the sections, by the name --only takes
SECTIONS: dict[str, Callable[[bool], dict[str, Any]]] = {
    "memory": measure_memory,
}
TITLES = {
    "memory": "Redis memory a drained queue keeps (retention_s 2 for the run)",
}


def main(argv: Sequence[str] | None = None) -> int:
    ap = cli_parser(__doc__, "about a minute")
    ap.add_argument("--only", action="append", choices=sorted(SECTIONS),
                    help="run only this section (repeatable)")
    args = ap.parse_args(argv)
    docs = docs_of(args)
    names = args.only or list(SECTIONS)
    compile_tree()
    results = Results(unjudged=args.quick)
    started = time.time()
    for name in names:
        results.section = TITLES.get(name, name)
        section = SECTIONS[name](args.quick)
        for row in section["rows"]:
            results.add(*row)
        for what, met, detail, comparable in section.get("targets", ()):
            results.target(what, met, detail, comparable)
    results.print("mtq control benchmark")
    if docs is not None:
        command = "python -m benchmarks.control" + "".join(f" --only {n}" for n in names)
        write_block("control", results.markdown(), command, machine_info(),
                    time.time() - started, docs)
    return 0 if all(met is not False for _, met, _ in results.targets) else 1


if __name__ == "__main__":
    sys.exit(main())
