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
    env = {**os.environ, "MTQ_REDIS_URL": server.url,
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                         if p)}
    out: dict[str, dict[str, list[float]]] = {
        m: {"submit_us": [], "drain_us": [], "submit_cmds": [], "drain_cmds": []}
        for m in ("off", "on")}

    def window() -> tuple[float, float]:
        info = r.info("cpu")
        stats = r.info("commandstats")
        calls = sum(v["calls"] for k, v in stats.items()
                    if k not in ("cmdstat_evalsha", "cmdstat_config", "cmdstat_info"))
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"]), calls

    for i in range(passes):
        for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
            q = mtq.Queue(f"bench-cost-{i}-{mode}", client=r)
            if mode == "on":
                q.configure(cache_ttl_s=3600, cache_max_entries=10 * n)  # no eviction
                catalogue.record(r, q.name, {"event": "loaded"},
                                 {"target": "benchmarks.noop:handle",
                                  "version": version_of(FunctionModel(handle)),
                                  "kind": "function", "deterministic": 0, "cacheable": 1})
            items = [{"text": "hello world", "i": j} for j in range(n)]
            r.config_resetstat()
            c0, _ = window()
            q.submit_many(items)
            c1, calls = window()
            out[mode]["submit_us"].append((c1 - c0) / n * 1e6)
            out[mode]["submit_cmds"].append(calls / n)
            r.config_resetstat()
            c0, _ = window()
            subprocess.run([sys.executable, "-m", "mtq", "worker", "run", "benchmarks.noop:handle",
                            "--queue", q.name, "--batch-size", "64", "--burst"], env=env,
                           cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=300, check=True)
            c1, calls = window()
            assert q.stats()["succeeded"] == n
            out[mode]["drain_us"].append((c1 - c0) / n * 1e6)
            out[mode]["drain_cmds"].append(calls / n)
            r.flushdb()
    return {f"{k}_{m}": statistics.median(v) for m, d in out.items() for k, v in d.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--samples", type=int, default=None)
    args = ap.parse_args(argv)
    samples = args.samples or (500 if args.quick else 2000)
    n, passes = (5000, 3) if args.quick else (20000, 11)
    server = Server()
    server.start()
    try:
        r = redis.Redis.from_url(server.url)
        rt = round_trips(server, r, samples)
        r.flushdb()
        dr = drain_rates(server, r, n, passes)
        cost = redis_cost(server, r, n, 3 if args.quick else 5)
    finally:
        server.stop()
    def more(k: str) -> str:
        return f"{100 * cost[k + '_on'] / cost[k + '_off'] - 100:+.0f} %"
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
        f"| redis-server CPU per task, submit: cache off / on, all misses | "
        f"{cost['submit_us_off']:.1f} / {cost['submit_us_on']:.1f} us ({more('submit_us')}) | |",
        f"| redis-server CPU per task, drain (claim, ack): cache off / on | "
        f"{cost['drain_us_off']:.1f} / {cost['drain_us_on']:.1f} us ({more('drain_us')}) | |",
        f"| Redis commands per task (scripts' inner ones): submit off / on; drain off / on | "
        f"{cost['submit_cmds_off']:.2f} / {cost['submit_cmds_on']:.2f}; "
        f"{cost['drain_cmds_off']:.2f} / {cost['drain_cmds_on']:.2f} | |",
        "",
        "A miss costs Redis a GET and a SET of the entry (which names the task; the result "
        "is not copied) at submit and the index once per submit call; the drain path runs "
        "the same commands as without the cache (the rows above). The drain of no-op "
        "tasks is bound by redis-server's CPU on this 2-core machine, so what the misses "
        "add there shows in the rate.",
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
