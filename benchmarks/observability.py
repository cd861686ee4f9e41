#!/usr/bin/env python
"""Observability: what the worker histograms and the exporter cost.

    python -m benchmarks.observability            # ~2 minutes, writes the observability block
    python -m benchmarks.observability --quick    # smaller, prints only

(a) one ``mtq worker run --burst`` draining no-op tasks (batch 32) with the queue's
``metrics`` setting on and off, in interleaved passes, rates from the first completion
to the last (server clock); (b) ``mtq metrics serve`` scraped over HTTP at 1,000 queues
with histogram data and 8 workers, a tenth of the queues given new observations before
each scrape.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from collections.abc import Sequence

import httpx
import redis

from benchmarks import targets
from benchmarks.harness.drain import drain
from benchmarks.harness.meters import CpuMeter, cpu_mark, machine_info, median, pct
from benchmarks.harness.procs import worker_env
from benchmarks.harness.report import cli_args, write_block
from benchmarks.harness.server import Server, compile_tree, free_port
from mtq.broker.keys import QUEUES, QueueKeys
from mtq.workers import registry
from mtq.workers.stats import Histograms

BATCH = 32


def drain_rate(server: Server, r: redis.Redis, n: int, metrics: bool) -> float:
    """Tasks/s of one ``mtq worker run --burst`` draining ``n`` pre-submitted no-op
    tasks at batch 32 with the queue's ``metrics`` setting on or off, from the first
    completion to the last (server clock)."""
    return drain(server, r, "benchmarks.children.noop:NoopModel",
                 [{"i": i} for i in range(n)], BATCH, burst=True,
                 prepare=lambda q: q.configure(metrics=metrics)).rate


def fill_queues(r: redis.Redis, queues: int, workers: int) -> None:
    """``queues`` queues with stats and histogram data, and ``workers`` registry entries."""
    rng = random.Random(7)
    pipe = r.pipeline(transaction=False)
    for i in range(queues):
        name = f"obs-{i:04d}"
        k = QueueKeys(name)
        pipe.sadd(QUEUES, name)
        pipe.hset(k.stats, mapping={"waiting": rng.randint(0, 50), "streams": 1,
                                    "submitted": 10_000, "succeeded": 9_900, "failed": 20,
                                    "retried": 30, "cache_hits": 40, "cache_misses": 60})
        h = Histograms()
        for _ in range(200):
            h.observe("queue_wait", rng.expovariate(20))
            h.observe("run", rng.expovariate(50))
            h.observe("latency", rng.expovariate(10))
        h.flush(pipe, k.hist)
    pipe.execute()
    for w in range(workers):
        registry.beat(r, f"bench-{w}", {
            "queue": f"obs-{w:04d}", "host": "bench", "device": "cpu", "model": "noop",
            "state": "running", "histogram": {"32": 900, "7": 12}, "busy_s": 12.5,
            "restarts": 0, "tasks": 28_884}, ttl_s=600)


#: the share of queues whose histograms and counters change between two scrapes (as
#: their workers' beats would): the exporter re-renders only what changed
ACTIVE_SHARE = 0.10


def scrape_times(server: Server, port: int, n: int, queues: int = 0
                 ) -> tuple[list[float], list[float], int]:
    """Wall ms of ``n`` scrapes over HTTP, the exporter's own Redis read ms, body bytes.
    Before each scrape (outside its time), :data:`ACTIVE_SHARE` of the ``queues``
    filled by :func:`fill_queues` get new observations and counts."""
    r = redis.Redis.from_url(server.url)
    rng = random.Random(11)
    env = worker_env(server.url)
    p = subprocess.Popen([sys.executable, "-m", "mtq", "metrics", "serve", "--port",
                          str(port), "--redis", server.url], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        deadline = time.monotonic() + 20
        with httpx.Client(timeout=10) as client:
            while True:
                try:
                    client.get(url)  # also the first scrape: imports, the packed commands
                    break
                except httpx.TransportError:
                    if p.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit("the exporter did not answer") from None
                    time.sleep(0.05)
            walls, reads, size = [], [], 0
            for _ in range(n):
                pipe = r.pipeline(transaction=False)
                for i in rng.sample(range(queues), int(queues * ACTIVE_SHARE)):
                    k = QueueKeys(f"obs-{i:04d}")
                    h = Histograms()
                    for _ in range(5):
                        h.observe("run", rng.expovariate(50))
                        h.observe("latency", rng.expovariate(10))
                    h.flush(pipe, k.hist)
                    pipe.hincrby(k.stats, "succeeded", 5)
                pipe.execute()
                t = time.perf_counter()
                res = client.get(url)
                walls.append((time.perf_counter() - t) * 1000)
                if res.status_code != 200 or "mtq_up 1" not in res.text:
                    raise SystemExit(f"bad scrape: {res.status_code} {res.text[-300:]}")
                size = len(res.content)
                line = next(ln for ln in res.text.splitlines()
                            if ln.startswith("mtq_scrape_duration_seconds "))
                reads.append(float(line.split()[1]) * 1000)
    finally:
        p.terminate()
        p.wait(10)
        r.close()
    return walls, reads, size


def main(argv: Sequence[str] | None = None) -> int:
    quick, docs = cli_args(argv, __doc__, "~30 s")
    n, passes, scrapes, queues = (5_000, 3, 20, 1_000) if quick else (20_000, 5, 40, 1_000)
    compile_tree()
    server = Server()
    server.start()
    r = redis.Redis.from_url(server.url)
    meter = CpuMeter()
    on: list[float] = []
    off: list[float] = []
    started = time.time()
    try:
        drain_rate(server, r, 2_000, True)  # warm-up: imports, the page cache
        for i in range(passes):
            for metrics in ((True, False) if i % 2 == 0 else (False, True)):
                mark = cpu_mark()
                rate = drain_rate(server, r, n, metrics)
                (on if metrics else off).append(rate)
                meter.add(f"drain metrics={'on' if metrics else 'off'}", mark)
                print(f"pass {i + 1} metrics={metrics}: {rate:,.0f} tasks/s", flush=True)
        fill_queues(r, queues, 8)
        mark = cpu_mark()
        walls, reads, size = scrape_times(server, free_port(), scrapes, queues)
        meter.add("scrapes", mark)
    finally:
        r.close()
        server.stop()
    on_m, off_m = median(on), median(off)
    # each pass's pair ran back to back: their ratio is steadier than the medians' when
    # the machine's load drifts over the run
    slowdown = 1 - median([a / b for a, b in zip(on, off)])
    p50, worst = pct(walls, 50), max(walls)
    rows = [
        ("no-op drain, metrics on (median)", f"{on_m:,.0f} tasks/s",
         ", ".join(f"{x:,.0f}" for x in on)),
        ("no-op drain, metrics off (median)", f"{off_m:,.0f} tasks/s",
         ", ".join(f"{x:,.0f}" for x in off)),
        ("metrics on vs off (median of the passes' ratios)", f"{-slowdown:+.1%}",
         f"ratio of the medians {on_m / off_m - 1:+.1%}; "
         f"target: at most {targets.METRICS_SLOWDOWN:.0%} slower: "
         + ("met" if slowdown <= targets.METRICS_SLOWDOWN else "NOT met")),
        (f"scrape, {queues:,} queues, over HTTP: p50", f"{p50:.1f} ms",
         f"max {worst:.1f} ms over {len(walls)} scrapes; {size / 1e6:.1f} MB of text; target "
         f"<= {targets.SCRAPE_MS:g} ms: " + ("met" if worst <= targets.SCRAPE_MS else
                                            "p50 met, max not" if p50 <= targets.SCRAPE_MS
                                            else "NOT met")),
        ("  of which reading Redis (mtq_scrape_duration_seconds)", f"{pct(reads, 50):.1f} ms",
         f"p50; max {max(reads):.1f} ms"),
    ]
    table = ["| measure | value | notes |", "|---|---|---|", *(f"| {a} | {b} | {c} |"
                                                               for a, b, c in rows)]
    print("\n".join(table))
    if docs is not None:
        command = "python -m benchmarks.observability" + (" --quick" if quick else "")
        write_block("observability", table, command, machine_info(
            None, f"other processes {meter.share():.0%} of the CPU"), time.time() - started, docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
