"""The result cache: what a hit costs, and what its bookkeeping costs the misses.

* cache-hit round trip, submit -> result (the submit's one script call answers it,
  the result inline), warm, vs an uncached round trip through a warm real worker
  (``mtq worker run benchmarks.noop:handle``) in the same run; target hit p50 <= 0.3 ms;
* no-op drain rate of a queue with the cache on and every payload distinct (all
  misses: single-flight markers, cache fields, entry writes) vs the cache off, same
  run, in pairs whose order alternates; the median of the pairs' ratios; target <= 3 %
  slower.

    python -m benchmarks.cache            # full run, rewrites "## Result cache" in docs/benchmarks.md
    python -m benchmarks.cache --quick    # smaller, prints only
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import date

import redis

import mtq
from benchmarks.broker import ROOT, Server, run_worker, write_docs
from benchmarks.noop import handle
from mtq.broker import catalogue
from mtq.workers.catalogue import version_of
from mtq.workers.model import FunctionModel


def pct(values: list[float], p: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(p / 100 * len(v)))]


def round_trips(server: Server, r: redis.Redis, samples: int) -> dict[str, float]:
    q = mtq.Queue("bench-rt", server.url, client=r)
    q.configure(cache_ttl_s=3600)
    env = {**os.environ, "MTQ_REDIS_URL": server.url,
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                         if p)}
    proc = subprocess.Popen([sys.executable, "-m", "mtq", "worker", "run",
                             "benchmarks.noop:handle", "--queue", "bench-rt"], env=env,
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        q.submit({"x": "warm"}, cache=False).result(timeout=60)
        q.submit({"x": "hit"}).result(timeout=60)  # the entry
        hits, misses = [], []
        for i in range(samples):  # interleaved: same conditions for both
            t0 = time.perf_counter()
            t = q.submit({"x": "hit"})
            t.result(timeout=10)
            hits.append(time.perf_counter() - t0)
            assert t.cached
            t0 = time.perf_counter()
            q.submit({"x": i}, cache=False).result(timeout=10)
            misses.append(time.perf_counter() - t0)
    finally:
        proc.terminate()
        proc.wait(30)
    return {"hit_p50": pct(hits, 50) * 1e3, "hit_p99": pct(hits, 99) * 1e3,
            "run_p50": pct(misses, 50) * 1e3, "run_p99": pct(misses, 99) * 1e3}


def drain_rates(server: Server, r: redis.Redis, n: int, passes: int) -> dict[str, float]:
    import benchmarks.broker as b

    original = b.presubmit
    rates: dict[str, list[float]] = {"off": [], "on": []}
    # redis-server's CPU per task (INFO cpu, from the presubmit to the worker's exit):
    # less noisy than rates on a shared machine
    redis_us: dict[str, list[float]] = {"off": [], "on": []}

    def redis_cpu() -> float:
        info = r.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    def presubmit_cached(q: mtq.Queue, count: int, streams: int = 0, **kw: object) -> list:
        q.configure(cache_ttl_s=3600)
        # the version the worker will compute (so that its acks write the entries)
        version = version_of(FunctionModel(handle))
        catalogue.record(r, q.name, {"event": "loaded"},
                         {"target": "benchmarks.noop:handle", "version": version,
                          "kind": "function", "deterministic": 0, "cacheable": 1})
        return original(q, count, streams, **kw)  # type: ignore[arg-type]

    ratios = []
    for i in range(passes):
        # pairs, the order alternating: drift of a noisy machine cancels out
        for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
            b.presubmit = presubmit_cached if mode == "on" else original
            redis_before = redis_cpu()
            try:
                drain_s, *_ = run_worker(server, r, n)
            finally:
                b.presubmit = original
            redis_us[mode].append((redis_cpu() - redis_before) / n * 1e6)
            rates[mode].append(n / drain_s)
        ratios.append(rates["on"][-1] / rates["off"][-1])
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    return {"on": on, "off": off, "slower_pct": 100 * (1 - statistics.median(ratios)),
            "medians_pct": 100 * (1 - on / off),
            "redis_us_on": statistics.median(redis_us["on"]),
            "redis_us_off": statistics.median(redis_us["off"]),
            "on_all": rates["on"], "off_all": rates["off"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--samples", type=int, default=None)
    args = ap.parse_args(argv)
    samples = args.samples or (500 if args.quick else 2000)
    n, passes = (5000, 3) if args.quick else (20000, 7)
    server = Server()
    server.start()
    try:
        r = redis.Redis.from_url(server.url)
        rt = round_trips(server, r, samples)
        r.flushdb()
        dr = drain_rates(server, r, n, passes)
    finally:
        server.stop()
    cpu_pct = 100 * dr["redis_us_on"] / dr["redis_us_off"] - 100
    lines = [
        "## Result cache", "",
        f"{date.today().isoformat()}, `python -m benchmarks.cache{' --quick' if args.quick else ''}`"
        f" ({platform.machine()}, {os.cpu_count()} cpus, Python {platform.python_version()}).",
        "",
        "| measure | value | target |", "|---|---|---|",
        f"| cache-hit round trip submit -> result, p50 / p99 ({samples} warm) | "
        f"{rt['hit_p50']:.3f} / {rt['hit_p99']:.3f} ms | p50 <= 0.3 ms |",
        f"| uncached round trip through a warm worker, p50 / p99 (same run) | "
        f"{rt['run_p50']:.3f} / {rt['run_p99']:.3f} ms | (baseline) |",
        f"| no-op drain, cache off, median of {passes} ({n} tasks) | {dr['off']:,.0f} tasks/s | |",
        f"| no-op drain, cache on, all misses, median of {passes} | {dr['on']:,.0f} tasks/s "
        f"({dr['slower_pct']:+.1f} % slower: the median of the pairs' ratios; of the medians "
        f"{dr['medians_pct']:+.1f} %) | <= 3 % slower |",
        f"| redis-server CPU per task (submit, claim, ack), cache off (median) | "
        f"{dr['redis_us_off']:.1f} us | |",
        f"| redis-server CPU per task, cache on, all misses (median) | "
        f"{dr['redis_us_on']:.1f} us ({cpu_pct:+.1f} %) | |",
        "",
        "Passes (tasks/s), in pairs whose order alternates: off " + ", ".join(f"{v:,.0f}" for v in dr["off_all"])
        + "; on " + ", ".join(f"{v:,.0f}" for v in dr["on_all"]) + ".",
    ]
    section = "\n".join(lines) + "\n"
    print(section)
    if not args.quick:
        write_docs(ROOT / "docs" / "benchmarks.md", section, "## Result cache")


if __name__ == "__main__":
    main()
