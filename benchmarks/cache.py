"""The result cache: what a hit costs, and what its bookkeeping costs the misses.

* a cache hit's round trip against an uncached one through a warm worker, in
  alternating blocks of 100;
* no-op drain rate with the cache on (every payload distinct: all misses) against off,
  in pairs whose order alternates;
* redis-server's CPU and commands per task, submit and drain, off against on; and its
  instructions per drained task and per hit (callgrind), which repeat where rates
  on a shared machine do not.

    python -m benchmarks.cache            # full run, writes the cache block
    python -m benchmarks.cache --quick    # smaller, prints only
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import redis

import mtq
from benchmarks import targets
from benchmarks.broker import run_worker
from benchmarks.children.noop import handle
from benchmarks.harness.meters import machine_info, pct
from benchmarks.harness.procs import worker_env
from benchmarks.harness.report import write_block
from benchmarks.harness.server import ROOT, CallgrindServer, Server, bench_binary
from mtq.broker import catalogue
from mtq.broker.consumer import Consumer
from mtq.replies import hub_of
from mtq.workers.catalogue import version_of
from mtq.workers.model import FunctionModel


def round_trips(server: Server, r: redis.Redis, samples: int) -> dict[str, float]:
    q = mtq.Queue("bench-rt", server.url, client=r)
    q.configure(cache_ttl_s=3600)
    env = worker_env(server.url)
    proc = subprocess.Popen([sys.executable, "-m", "mtq", "worker", "run",
                             "benchmarks.children.noop:handle", "--queue", "bench-rt"], env=env,
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        q.submit({"x": "warm"}, cache=False).result(timeout=60)
        q.submit({"x": "hit"}).result(timeout=60)  # the entry
        hits, misses = [], []
        block = 100
        # alternating blocks, not single samples: an uncached round trip leaves the
        # worker finishing its loop (and the client's listener reading the done message)
        # for a while after result() returns, on the CPU the next sample needs
        for start in range(0, samples, block):
            for _ in range(min(block, samples - start)):
                t0 = time.perf_counter()
                t = q.submit({"x": "hit"})
                t.result(timeout=10)
                hits.append(time.perf_counter() - t0)
                assert t.cached
            for i in range(start, min(start + block, samples)):
                t0 = time.perf_counter()
                q.submit({"x": i}, cache=False).result(timeout=10)
                misses.append(time.perf_counter() - t0)
    finally:
        proc.terminate()
        proc.wait(30)
    return {"hit_p50": pct(hits, 50, True) * 1e3, "hit_p99": pct(hits, 99, True) * 1e3,
            "run_p50": pct(misses, 50, True) * 1e3, "run_p99": pct(misses, 99, True) * 1e3}


def drain_rates(server: Server, r: redis.Redis, n: int, passes: int) -> dict[str, Any]:
    import benchmarks.broker as b

    original = b.presubmit
    rates: dict[str, list[float]] = {"off": [], "on": []}

    def presubmit_cached(q: mtq.Queue, count: int, streams: int = 0, **kw: object) -> list:
        q.configure(cache_ttl_s=3600)
        # the version the worker will compute (so that its acks write the entries)
        version = version_of(FunctionModel(handle))
        catalogue.record(r, q.name, {"event": "loaded"},
                         {"target": "benchmarks.children.noop:handle", "version": version,
                          "kind": "function", "deterministic": 0, "cacheable": 1})
        return original(q, count, streams, **kw)  # type: ignore[arg-type]

    ratios = []
    for i in range(passes):
        # pairs, the order alternating: drift of a noisy machine cancels out
        for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
            b.presubmit = presubmit_cached if mode == "on" else original  # type: ignore[assignment]
            try:
                drain_s, *_ = run_worker(server, r, n)
            finally:
                b.presubmit = original
            rates[mode].append(n / drain_s)
        ratios.append(rates["on"][-1] / rates["off"][-1])
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    return {"on": on, "off": off, "slower_pct": 100 * (1 - statistics.median(ratios)),
            "medians_pct": 100 * (1 - on / off),
            "on_all": rates["on"], "off_all": rates["off"]}


def redis_cost(server: Server, r: redis.Redis, n: int, passes: int) -> dict[str, float]:
    """redis-server's CPU and commands per task, cache off vs on (all misses): for the
    submit (``submit_many`` of n) and, apart, for the drain (one ``mtq worker run
    --burst``), each window opened by CONFIG RESETSTAT and closed before anything else
    runs (INFO cpu; commandstats, scripts' inner commands included). Less noisy than
    rates on a shared machine. Medians of ``passes`` runs per mode, order alternating."""
    env = worker_env(server.url)
    out: dict[str, dict[str, list[float]]] = {
        m: {"submit_us": [], "drain_us": [], "submit_cmds": [], "drain_cmds": [],
            "drain_script_us": []}
        for m in ("off", "on")}

    def window() -> tuple[float, float, float]:
        info = r.info("cpu")
        stats = r.info("commandstats")
        calls = sum(v["calls"] for k, v in stats.items()
                    if k not in ("cmdstat_evalsha", "cmdstat_config", "cmdstat_info"))
        scripts = sum(v["usec"] for k, v in stats.items()
                      if k in ("cmdstat_evalsha", "cmdstat_eval"))
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"]), calls, scripts

    for i in range(passes):
        for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
            q = mtq.Queue(f"bench-cost-{i}-{mode}", client=r)
            if mode == "on":
                q.configure(cache_ttl_s=3600, cache_max_entries=10 * n)  # no eviction
                catalogue.record(r, q.name, {"event": "loaded"},
                                 {"target": "benchmarks.children.noop:handle",
                                  "version": version_of(FunctionModel(handle)),
                                  "kind": "function", "deterministic": 0, "cacheable": 1})
            items = [{"text": "hello world", "i": j} for j in range(n)]
            r.config_resetstat()
            c0, _, _ = window()
            q.submit_many(items)
            c1, calls, _ = window()
            out[mode]["submit_us"].append((c1 - c0) / n * 1e6)
            out[mode]["submit_cmds"].append(calls / n)
            r.config_resetstat()
            c0, _, _ = window()
            subprocess.run([sys.executable, "-m", "mtq", "worker", "run", "benchmarks.children.noop:handle",
                            "--queue", q.name, "--batch-size", "64", "--burst"], env=env,
                           cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=300, check=True)
            c1, calls, script_us = window()
            assert q.stats()["succeeded"] == n
            out[mode]["drain_script_us"].append(script_us / n)
            out[mode]["drain_us"].append((c1 - c0) / n * 1e6)
            out[mode]["drain_cmds"].append(calls / n)
            r.flushdb()
    return {f"{k}_{m}": statistics.median(v) for m, d in out.items() for k, v in d.items()}


def counted(prepare: Callable[[redis.Redis], Callable[[], None]]) -> int:
    """redis-server's instructions while the function that ``prepare(client)`` returns
    runs, on a fresh server under callgrind (``prepare`` sets up, not counted)."""
    server = CallgrindServer()
    server.start()
    r = redis.Redis(port=server.port)
    try:
        run = prepare(r)
        server.instrument(True)
        run()
        server.instrument(False)
        hub_of(r).close_all()
        return server.total()
    finally:
        r.close()
        server.stop()


def with_model(r: redis.Redis, q: mtq.Queue, version: str) -> None:
    catalogue.record(r, q.name, {"event": "loaded"},
                     {"target": "benchmarks.children.noop:handle", "version": version,
                      "kind": "function", "deterministic": 0, "cacheable": 1})


def redis_instructions(n: int, passes: int, batch: int = 64) -> dict[str, list[float]] | None:
    """redis-server's instructions per drained task, cache off vs on (all misses), and
    per cache hit (:func:`counted`). Drained: n tasks submitted with instrumentation
    off, then claimed and acked ``batch`` at a time from this process (the scripts and
    arguments a worker runs; the worker's own side does not change with the cache).
    A hit: n submits answered by the cache. None without valgrind."""
    if not (shutil.which("valgrind") and shutil.which("callgrind_control")):
        return None
    version = version_of(FunctionModel(handle))
    out: dict[str, list[float]] = {"off": [], "on": [], "hit": []}

    def drain(mode: str) -> Callable[[redis.Redis], Callable[[], None]]:
        def prepare(r: redis.Redis) -> Callable[[], None]:
            q = mtq.Queue(f"bench-ir-{mode}", client=r)
            if mode == "on":
                q.configure(cache_ttl_s=3600, cache_max_entries=10 * n)
            with_model(r, q, version)
            q.submit_many([{"text": "hello world", "i": j} for j in range(n + batch)])
            consumer = Consumer(q.name, client=r)
            consumer.broker.model_version = version  # as the worker sets it
            # one batch outside the window: scripts loaded, settings read
            consumer.settle([mtq.Outcome(t, ok=True, value=None)
                             for t in consumer.claim(batch)])

            def run() -> None:
                done = 0
                while done < n:
                    got = consumer.claim(batch)
                    consumer.settle([mtq.Outcome(t, ok=True, value=None) for t in got])
                    done += len(got)
                assert q.stats()["succeeded"] == n + batch
            return run
        return prepare

    def hits(r: redis.Redis) -> Callable[[], None]:
        q = mtq.Queue("bench-ir-hit", client=r)
        q.configure(cache_ttl_s=3600)
        with_model(r, q, version)
        consumer = Consumer(q.name, client=r)
        consumer.broker.model_version = version
        q.submit({"text": "hello world"})
        consumer.settle([mtq.Outcome(t, ok=True, value={"v": [0.25] * 8})
                         for t in consumer.claim(1)])
        assert q.submit({"text": "hello world"}).cached

        def run() -> None:
            for _ in range(n):
                q.submit({"text": "hello world"})
        return run

    for i in range(passes):
        for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
            out[mode].append(counted(drain(mode)) / n)
        out["hit"].append(counted(hits) / n)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--samples", type=int, default=None)
    ap.add_argument("--no-pin", dest="pin", action="store_false",
                    help="leave CPU placement to the OS (default: redis-server on the first "
                    "CPU, this process and the workers it starts on the second)")
    args = ap.parse_args(argv)
    samples = args.samples or (500 if args.quick else 2000)
    n, passes = (5000, 3) if args.quick else (20000, 11)
    cpus = sorted(os.sched_getaffinity(0))
    pinned = args.pin and len(cpus) >= 2

    def start(binary: str | None = None) -> tuple[Server, redis.Redis, str]:
        server = Server(binary)
        server.start()
        if pinned and server.proc is not None:
            # a Redis round trip costs 35-90 us here depending on placement: pinned,
            # the passes differ less, so the pairs' ratios mean more
            os.sched_setaffinity(server.proc.pid, {cpus[0]})
            os.sched_setaffinity(0, {cpus[1]})
        r = redis.Redis.from_url(server.url)
        return server, r, str(r.info("server")["redis_version"])

    # the hit's round trip on a production Redis 7 too, when one is installed apart
    # from the embedded server's binary (Debian's, as scripts/install-system-deps
    # installs it): most of a hit's time is the submit script inside Redis
    others: dict[str, dict[str, float]] = {}
    system = shutil.which("redis-server", path="/usr/bin:/usr/local/bin")
    if system and os.path.realpath(system) != os.path.realpath(bench_binary()):
        other, r, version = start(system)
        try:
            others[version] = round_trips(other, r, samples)
        finally:
            other.stop()
    server, r, server_version = start()
    try:
        rt = round_trips(server, r, samples)
        r.flushdb()
        dr = drain_rates(server, r, n, passes)
        cost = redis_cost(server, r, n, 3 if args.quick else 5)
    finally:
        server.stop()
    ir = redis_instructions(1024 if args.quick else 4096, 1 if args.quick else 3)
    def more(k: str) -> str:
        return f"{100 * cost[k + '_on'] / cost[k + '_off'] - 100:+.0f} %"
    lines = [
        "| measure | value | target |", "|---|---|---|",
        f"| cache-hit round trip submit -> result, p50 / p99 ({samples} warm; "
        f"redis-server {server_version}, the embedded server's, as every other row) | "
        f"{rt['hit_p50']:.3f} / {rt['hit_p99']:.3f} ms | p50 <= {targets.CACHE_HIT_P50_MS:g} ms |",
        f"| uncached round trip through a warm worker, p50 / p99 (same run) | "
        f"{rt['run_p50']:.3f} / {rt['run_p99']:.3f} ms | (baseline) |",
        *(f"| the same two on redis-server {v} (Debian's): hit p50 / p99; uncached p50 / p99 | "
          f"{o['hit_p50']:.3f} / {o['hit_p99']:.3f} ms; {o['run_p50']:.3f} / "
          f"{o['run_p99']:.3f} ms | p50 <= {targets.CACHE_HIT_P50_MS:g} ms |" for v, o in others.items()),
        f"| no-op drain, cache off, median of {passes} ({n} tasks) | {dr['off']:,.0f} tasks/s | |",
        f"| no-op drain, cache on, all misses, median of {passes} | {dr['on']:,.0f} tasks/s "
        f"({dr['slower_pct']:+.1f} % slower: the median of the pairs' ratios; of the medians "
        f"{dr['medians_pct']:+.1f} %) | <= {targets.CACHE_SLOWDOWN:.0%} slower |",
        f"| redis-server CPU per task, submit: cache off / on, all misses | "
        f"{cost['submit_us_off']:.1f} / {cost['submit_us_on']:.1f} us ({more('submit_us')}) | |",
        f"| redis-server CPU per task, drain (claim, ack): cache off / on | "
        f"{cost['drain_us_off']:.1f} / {cost['drain_us_on']:.1f} us ({more('drain_us')}) | |",
        f"| of which inside the scripts (commandstats EVALSHA usec), drain: cache off / on | "
        f"{cost['drain_script_us_off']:.1f} / {cost['drain_script_us_on']:.1f} us "
        f"({more('drain_script_us')}) | |",
        ("| redis-server instructions per drained task (claim, ack; callgrind, "
         f"{len(ir['off'])} passes each): cache off / on | {statistics.median(ir['off']):,.0f} / "
         f"{statistics.median(ir['on']):,.0f} "
         f"({100 * statistics.median(ir['on']) / statistics.median(ir['off']) - 100:+.1f} %) "
         f"| <= {targets.CACHE_INSTRUCTIONS:.0%} more |" if ir else
         "| redis-server instructions per drained task | (valgrind not installed) | |"),
        *([f"| redis-server instructions per cache hit (its submit; callgrind) | "
           f"{statistics.median(ir['hit']):,.0f} | |"] if ir else []),
        f"| Redis commands per task (scripts' inner ones): submit off / on; drain off / on | "
        f"{cost['submit_cmds_off']:.2f} / {cost['submit_cmds_on']:.2f}; "
        f"{cost['drain_cmds_off']:.2f} / {cost['drain_cmds_on']:.2f} | |",
        "| drain passes (tasks/s), in pairs whose order alternates | off "
        + ", ".join(f"{v:,.0f}" for v in dr["off_all"]) + "; on "
        + ", ".join(f"{v:,.0f}" for v in dr["on_all"]) + " | |",
    ]
    print("\n".join(lines))
    if not args.quick:
        write_block("cache", lines, "python -m benchmarks.cache", machine_info(
            None, f"redis-server {server_version}", "pinned" if pinned else "not pinned"))


if __name__ == "__main__":
    main()
