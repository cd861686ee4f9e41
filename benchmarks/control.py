#!/usr/bin/env python
"""Running work under control: one section per measured figure.

    python -m benchmarks.control                  # every section, writes the control block
    python -m benchmarks.control --only memory    # one section (repeat --only for more)
    python -m benchmarks.control --only spread    # slow functions over idle workers
    python -m benchmarks.control --only local     # mtq.local's start and stop
    python -m benchmarks.control --only frozen    # a frozen child under load
    python -m benchmarks.control --only kill      # a stopped call killed after the grace
    python -m benchmarks.control --only cancel    # cancel and timeouts of running work
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

stop: ``mtq workers start ... --replicas 5`` with five tasks running and its
redis-server stopped; the time from the second SIGTERM to the supervisor's exit (a
forced stop), and from a single SIGTERM (a graceful stop, which waits at most one
lease for Redis, then goes on as a forced stop; ``--lease-ms 2000`` here).

spread: slow plain functions spread over idle workers (20 tasks of 0.5 s over five
replicas of ``mtq workers start``); see :mod:`benchmarks.control_spread`.

local: the start and stop of ``mtq.local`` (a private Redis and a supervisor inside a
script); see :mod:`benchmarks.control_local`.

frozen: a supervised worker under load on 8 streams with one child SIGSTOPped for
three leases, then SIGCONT: overlapping calls per stream, lost, twice, time to the
fence and to recovery; see :mod:`benchmarks.control_frozen`.

kill: the time from ``Task.cancel()`` to ``cancelled`` for a supervised plain function
that ignores it (the grace, then the kill), and the same for a timeout; see
:mod:`benchmarks.control_kill`.

cancel: the time from ``Task.cancel()`` to the task's end for a plain generator, an
``mtq.Generator`` request and a cooperative function, and how late a ``timeout=1``
stops a cooperative function; see :mod:`benchmarks.control_cancel`.

A run of only some sections prints its figures and writes the block only with
``--docs`` (the block holds every section).
"""

from __future__ import annotations

import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import redis

import mtq
from benchmarks.control_cancel import measure_cancel
from benchmarks.control_frozen import measure_frozen
from benchmarks.control_kill import measure_kill
from benchmarks.control_local import measure_local
from benchmarks.control_spread import measure_spread
from benchmarks.harness.procs import Proc, kill_group, spawn, wait_for, worker_env
from benchmarks.harness.sections import run_sections
from benchmarks.harness.server import RedisServer, Server, uniq
from mtq.replies import hub_of
from mtq.workers.registry import list_workers

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
              "--redis", server.url, "--max-batch-size", str(batch)], worker_env(server.url))
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


REPLICAS = 5
LEASE_MS = 2000


def _one_stop(tmp: Path, signals: int) -> float:
    """Seconds from the last of ``signals`` SIGTERMs to the supervisor's exit, with five
    tasks running and Redis stopped just before."""
    server = RedisServer()
    server.start()
    queue = uniq("stop")  # and a log of its own: "stopping" must be this run's
    mark, log = tmp / f"{queue}.mark", tmp / f"{queue}.log"
    sup = spawn(["workers", "start", "benchmarks.children.held:hold", "--queue", queue,
                 "--replicas", str(REPLICAS), "--max-batch-size", "1", "--standby", "0",
                 "--lease-ms", str(LEASE_MS), "--redis", server.url],
                worker_env(server.url, MTQ_BENCH_MARK=str(mark)), log=log)
    try:
        r = redis.Redis.from_url(server.url)
        wait_for("the workers", lambda: len(list_workers(r, queue)) == REPLICAS, 60)
        q = mtq.Queue(queue, client=r, lease_ms=LEASE_MS)
        q.submit_many([{"s": 600} for _ in range(2 * REPLICAS)])
        hub_of(r).close_all()  # its reply listener would reconnect, on this CPU
        wait_for("a task running in every worker", lambda: mark.exists() and len(
            set(mark.read_text().split())) == REPLICAS, 60)
        r.close()
        server.stop()
        sup.send_signal(signal.SIGTERM)
        if signals == 2:
            wait_for("the first signal seen", lambda: b"stopping" in log.read_bytes(), 10)
            sup.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        try:
            sup.wait(120)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"the supervisor did not stop in 120 s:\n{log.read_text()}"
                             ) from None
        took = time.monotonic() - t0
        if signals == 2 and took > 2:  # over the target: what the supervisor said
            print(f"a stop took {took:.2f} s; the supervisor's log ends:\n"
                  f"{log.read_text(errors='replace')[-2000:]}")
        return took
    finally:
        kill_group(sup)
        server.stop()


def measure_stop(quick: bool = False) -> dict[str, Any]:
    """The forced and the graceful stop's time with Redis away (seconds)."""
    runs = 1 if quick else 5
    with tempfile.TemporaryDirectory(prefix="mtq-bench-stop-") as d:
        forced = [_one_stop(Path(d), 2) for _ in range(runs)]
        graceful = [_one_stop(Path(d), 1) for _ in range(max(1, runs // 2))]
    runs_f = ", ".join(f"{x:.2f}" for x in forced)
    runs_g = ", ".join(f"{x:.2f}" for x in graceful)
    return {
        "forced_s": forced, "graceful_s": graceful,
        "rows": [
            (f"forced stop with Redis away, {REPLICAS} replicas busy: second SIGTERM to "
             f"exit, median of {runs}", statistics.median(forced), "s",
             f"target <= 2 s; runs {runs_f}"),
            (f"graceful stop with Redis away (--lease-ms {LEASE_MS}): SIGTERM to exit, "
             f"median of {len(graceful)}", statistics.median(graceful), "s",
             f"bound: found away at the signal (1 s checks), one lease, then a forced stop; "
             f"runs {runs_g}"),
        ],
    }


#: the sections, by the name --only takes
SECTIONS: dict[str, Callable[[bool], dict[str, Any]]] = {
    "memory": measure_memory,
    "stop": measure_stop,
    "spread": measure_spread,
    "local": measure_local,
    "frozen": measure_frozen,
    "kill": measure_kill,
    "cancel": measure_cancel,
}
TITLES = {
    "memory": "Redis memory a drained queue keeps (retention_s 2 for the run)",
    "stop": "Stops with Redis away",
    "spread": "Slow plain functions over idle workers (mtq workers start, default settings)",
    "local": "mtq.local: a private Redis and workers inside a script, started and stopped",
    "frozen": "A frozen child under load (mtq workers start --replicas 2, SIGSTOP for 3 leases)",
    "kill": "A plain function that ignores its stop, killed after the grace (mtq workers start)",
    "cancel": "Cancel and timeouts of running work (bare mtq worker run, one per kind)",
}


def main(argv: Sequence[str] | None = None) -> int:
    return run_sections("control", __doc__, "about a minute", SECTIONS, TITLES, argv)


if __name__ == "__main__":
    sys.exit(main())
