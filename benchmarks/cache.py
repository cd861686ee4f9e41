"""The result cache: what a hit costs, and what its bookkeeping costs the misses.

* a cache hit's round trip against an uncached one through a warm worker, in
  alternating blocks of 100;
* no-op drain rate with the cache on (every payload distinct: all misses) against off,
  in pairs whose order alternates;
* redis-server's instructions per drained task, off against on, and per hit
  (callgrind), which repeat where rates on a shared machine do not.

    python -m benchmarks.cache            # full run, writes the cache block
    python -m benchmarks.cache --quick    # smaller, prints only
"""

from __future__ import annotations

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
from benchmarks.children.noop import handle
from benchmarks.harness.drain import drain
from benchmarks.harness.meters import machine_info, pct
from benchmarks.harness.procs import worker_env
from benchmarks.harness.report import cli_parser, docs_of, write_block
from benchmarks.harness.server import ROOT, CallgrindServer, Server
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
    """No-op drains (batch 64, ``--burst``) with the cache off and on (every payload
    distinct: all misses), in pairs whose order alternates so that a noisy machine's
    drift cancels out."""
    version = version_of(FunctionModel(handle))

    def cache_on(q: mtq.Queue) -> None:
        q.configure(cache_ttl_s=3600)
        with_model(r, q, version)  # the version the worker computes: its acks write entries

    rates: dict[str, list[float]] = {"off": [], "on": []}
    ratios = []
    payloads = [{"text": "hello world", "i": i} for i in range(n)]
    for i in range(passes):
        for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
            rates[mode].append(drain(server, r, "benchmarks.children.noop:handle", payloads, 64,
                                     burst=True, prepare=cache_on if mode == "on" else None).rate)
        ratios.append(rates["on"][-1] / rates["off"][-1])
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    return {"on": on, "off": off, "slower_pct": 100 * (1 - statistics.median(ratios)),
            "medians_pct": 100 * (1 - on / off),
            "on_all": rates["on"], "off_all": rates["off"]}


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

    def drained(mode: str) -> Callable[[redis.Redis], Callable[[], None]]:
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
            out[mode].append(counted(drained(mode)) / n)
        out["hit"].append(counted(hits) / n)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = cli_parser(__doc__, "~1 minute")
    ap.add_argument("--samples", type=int, default=None)
    ap.add_argument("--no-pin", dest="pin", action="store_false",
                    help="leave CPU placement to the OS (default: redis-server on the first "
                    "CPU, this process and the workers it starts on the second)")
    args = ap.parse_args(argv)
    docs = docs_of(args)
    samples = args.samples or (500 if args.quick else 2000)
    n, passes = (5000, 3) if args.quick else (20000, 11)
    cpus = sorted(os.sched_getaffinity(0))
    pinned = args.pin and len(cpus) >= 2

    server = Server()
    server.start()
    if pinned and server.proc is not None:
        # a Redis round trip costs 35-90 us here depending on placement: pinned,
        # the passes differ less, so the pairs' ratios mean more
        os.sched_setaffinity(server.proc.pid, {cpus[0]})
        os.sched_setaffinity(0, {cpus[1]})
    r = redis.Redis.from_url(server.url)
    server_version = str(r.info("server")["redis_version"])
    try:
        rt = round_trips(server, r, samples)
        r.flushdb()
        dr = drain_rates(server, r, n, passes)
    finally:
        server.stop()
    ir = redis_instructions(1024 if args.quick else 4096, 1 if args.quick else 3)
    lines = [
        "| measure | value | target |", "|---|---|---|",
        f"| cache-hit round trip submit -> result, p50 / p99 ({samples} warm) | "
        f"{rt['hit_p50']:.3f} / {rt['hit_p99']:.3f} ms | p50 <= {targets.CACHE_HIT_P50_MS:g} ms |",
        f"| uncached round trip through a warm worker, p50 / p99 (same run) | "
        f"{rt['run_p50']:.3f} / {rt['run_p99']:.3f} ms | (baseline) |",
        f"| no-op drain, cache off, median of {passes} ({n} tasks) | {dr['off']:,.0f} tasks/s | |",
        f"| no-op drain, cache on, all misses, median of {passes} | {dr['on']:,.0f} tasks/s "
        f"({dr['slower_pct']:+.1f} % slower: the median of the pairs' ratios; of the medians "
        f"{dr['medians_pct']:+.1f} %) | <= {targets.CACHE_SLOWDOWN:.0%} slower |",
        ("| redis-server instructions per drained task (claim, ack; callgrind, "
         f"{len(ir['off'])} passes each): cache off / on | {statistics.median(ir['off']):,.0f} / "
         f"{statistics.median(ir['on']):,.0f} "
         f"({100 * statistics.median(ir['on']) / statistics.median(ir['off']) - 100:+.1f} %) "
         f"| <= {targets.CACHE_INSTRUCTIONS:.0%} more |" if ir else
         "| redis-server instructions per drained task | (valgrind not installed) | |"),
        *([f"| redis-server instructions per cache hit (its submit; callgrind) | "
           f"{statistics.median(ir['hit']):,.0f} | |"] if ir else []),
        "| drain passes (tasks/s), in pairs whose order alternates | off "
        + ", ".join(f"{v:,.0f}" for v in dr["off_all"]) + "; on "
        + ", ".join(f"{v:,.0f}" for v in dr["on_all"]) + " | |",
    ]
    print("\n".join(lines))
    if docs is not None:
        write_block("cache", lines, "python -m benchmarks.cache", machine_info(
            None, f"redis-server {server_version}", "pinned" if pinned else "not pinned"),
            path=docs)


if __name__ == "__main__":
    main()
