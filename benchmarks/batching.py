#!/usr/bin/env python
"""Batching benchmark: mtq workers serving a real model (all-MiniLM-L6-v2 on CPU).

    python -m benchmarks.batching            # full run (~3 minutes on 2 cores), writes docs
    python -m benchmarks.batching --quick    # smaller run (~1 minute), prints only

It starts its own redis-server on a free loopback port (persistence off) and
measures, in the same run, with the same sentences:

a. the ceiling: the model called directly in this process, batches of 32 and of 1
   (``examples.embeddings.encode``, the code path of ``MiniLM.predict``);
b. one ``mtq worker run`` process at batch size 32 serving chunks of single-sentence
   tasks submitted at once, each timed from its first completion to its last (model
   load left out), in turns with the direct passes of (a);
c. the same at batch size 1;
d. latency (submit -> result stored) under a steady open-loop Poisson load at half
   of (b)'s throughput, served by ``mtq workers start`` with the model's max_wait_ms;
e. the queue's own cost per batch: a no-op model at batch 32, drained by one worker;
f. recovery: a worker killed with SIGKILL mid-batch (lease 2 s): how long until the
   tasks it was running are given back and running again, (1) under ``mtq workers
   start`` with one replica (the supervisor gives them back and restarts the process,
   which loads the model again), (2) with two replicas (the other one takes them),
   (3) without a supervisor (a second ``mtq worker run`` reaps them when the lease
   expires).

It prints a table and rewrites the "## Batching (workers)" section of
docs/benchmarks.md (a full run; ``--quick`` only prints unless ``--docs`` is given).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

import mtq
from benchmarks import targets
from benchmarks.harness.meters import (
    MAX_FOREIGN,
    CpuMeter,
    cpu_mark,
    foreign,
    machine_info,
    median,
    pct,
    proc_cpu,
    torch_info,
    wait_quiet,
)
from benchmarks.harness.procs import Proc, wait_for, worker_env
from benchmarks.harness.report import Results, cli_args, write_block
from benchmarks.harness.server import Server, compile_tree, uniq
from mtq.workers import control
from mtq.workers.registry import list_workers

LEASE_MS = 2000                # lease of the recovery runs; target: back within 2 x lease
MAX_WAIT_MS = 10.0             # examples.embeddings:MiniLM.max_wait_ms (checked at start)
BATCH = 32


@dataclass(frozen=True)
class Sizes:
    corpus: int            # distinct sentences (one chunk at batch 32)
    pairs32: int           # direct pass + worker chunk pairs at batch 32
    n1: int                # sentences per pass / chunk at batch 1
    pairs1: int
    load_s: float          # seconds of open-loop load
    noop_batches: int      # batches of 32 drained by the no-op model (per run)
    noop_reps: int
    kills: dict[str, int]  # recovery variant -> kills
    quiet_s: float         # longest wait for a quiet machine before each step
    latency_retakes: int   # latency runs taken again at most when the machine was busy
    retakes: int           # pairs taken again at most, per pair, when the machine was busy


FULL = Sizes(corpus=320, pairs32=6, n1=160, pairs1=4, load_s=15.0, noop_batches=500,
             noop_reps=3, kills={"supervised, 1 replica": 3, "supervised, 2 replicas": 3,
                                 "no supervisor, 2 workers": 1}, quiet_s=20,
             latency_retakes=1, retakes=1)
QUICK = Sizes(corpus=320, pairs32=2, n1=160, pairs1=1, load_s=6.0, noop_batches=300,
              noop_reps=1, kills={"supervised, 1 replica": 1, "supervised, 2 replicas": 1},
              quiet_s=3, latency_retakes=0, retakes=0)


# -- sentences -------------------------------------------------------------------
_SUBJECTS = ["the user", "a customer from Lyon", "my manager", "the new intern", "our support team",
             "the billing service", "this search query", "a small dog", "the night train",
             "the research group", "an angry reviewer", "the mobile app"]
_VERBS = ["asked about", "complained about", "wrote a short report on", "is still waiting for",
          "could not find", "just released", "strongly recommended", "compared prices for",
          "explained", "forgot to mention", "is looking for", "cancelled"]
_OBJECTS = ["the quarterly results", "a cheaper flight to Berlin", "the latest GPU drivers",
            "an Italian restaurant near the station", "the refund policy", "two tickets",
            "a faster way to embed sentences", "the broken login page", "the weather in Oslo",
            "a quiet hotel room with a view of the lake", "the delivery of order 4417",
            "a good book about distributed systems"]
_TAILS = ["", "", "yesterday", "before the meeting on Monday", "because the first answer was wrong",
          "and expects a reply by tonight", "in the support chat", "while travelling abroad",
          "for the third time this week", "without giving any details"]


def sentences(n: int, seed: int = 7) -> list[str]:
    """n varied English sentences (about 6 to 30 words), the same on every run."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS),
                 rng.choice(_TAILS)]
        if rng.random() < 0.35:
            parts += ["and", rng.choice(_VERBS), rng.choice(_OBJECTS)]
        text = " ".join(p for p in parts if p)
        out.append(text[0].upper() + text[1:] + ".")
    return out


# -- helpers ---------------------------------------------------------------------


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def server_ms(r: redis.Redis) -> int:
    sec, usec = r.time()
    return int(sec) * 1000 + int(usec) // 1000


def live_workers(r: redis.Redis, queue: str) -> list[dict[str, Any]]:
    return list_workers(r, queue)


def task_fields(r: redis.Redis, q: mtq.Queue, tasks: Sequence[mtq.Task],
                *names: str) -> list[list[int | None]]:
    pipe = r.pipeline(transaction=False)
    for t in tasks:
        pipe.hmget(q.broker.keys.task(t.id), names)
    return [[None if v is None else int(v) for v in row] for row in pipe.execute()]


@dataclass
class Drain:
    """One ``mtq worker run`` drain of pre-submitted tasks."""

    n: int
    rate: float            # tasks/s from the first completion to the last (server clock)
    span_s: float          # that interval
    drain_s: float         # first started -> last finished (server clock)
    calls: list[tuple[float, float, int]]  # predict calls logged by benchmarks.children.timed
    commands: dict[str, dict[str, float]]  # INFO commandstats over the run
    wall_s: float          # process start -> exit
    redis_cpu_s: float     # redis-server user+system CPU over the run

    def cycle_ms(self) -> float:
        """Mean time from one predict call's start to the next one's, from the worker's
        own log (perf_counter)."""
        c = self.calls
        return (c[-1][0] - c[0][0]) / (len(c) - 1) * 1000 if len(c) > 1 else float("nan")


def drain(server: Server, r: redis.Redis, target: str, payloads: Sequence[Any], batch: int,
          burst: bool = False, timeout: float = 180, args: Sequence[str] = ()) -> Drain:
    """Pre-submit the payloads as single tasks, then drain them with one ``mtq worker
    run`` process (``args`` added to its command line: ``--device cuda:0``, say),
    stopped with SIGTERM once everything succeeded (or, with ``burst``, run with
    --burst so that it exits by itself)."""
    qname = uniq("drain")
    q = mtq.Queue(qname, client=r)
    tasks = q.submit_many(payloads)
    timings = tempfile.NamedTemporaryFile(prefix="mtq-bench-", suffix=".json", delete=False)
    timings.close()
    r.config_resetstat()
    redis_pid = server.proc.pid if server.proc else 0
    redis_cpu = proc_cpu(redis_pid)
    t0 = time.perf_counter()
    p = Proc(["worker", "run", target, "--queue", qname, "--redis", server.url,
              "--batch-size", str(batch), *(["--burst"] if burst else []), *args],
             worker_env(server.url, MTQ_BENCH_TIMINGS=timings.name))
    try:
        if not burst:
            wait_for("the drain", lambda: q.stats()["succeeded"] >= len(tasks), timeout, [p],
                     every=0.01 if target.endswith("Noop") else 0.1)
            p.stop()
        code = p.wait(timeout)
        wall = time.perf_counter() - t0
        if code != 0:
            raise p.fail(f"worker exited with {code}")
        stats = q.stats()
        if stats["succeeded"] != len(tasks):
            raise p.fail(f"worker drained {stats['succeeded']} of {len(tasks)} tasks: {stats}")
    finally:
        p.close()
    redis_cpu = proc_cpu(redis_pid) - redis_cpu
    commands = {k.removeprefix("cmdstat_"): v for k, v in r.info("commandstats").items()}
    text = Path(timings.name).read_text()
    os.unlink(timings.name)
    calls = [(float(a), float(b), int(k)) for a, b, k in json.loads(text)] if text else []
    rows = task_fields(r, q, tasks, "started", "finished")
    started = min(s for s, _ in rows if s is not None)
    finished = [f for _, f in rows if f is not None]
    first, last = min(finished), max(finished)
    n_first = sum(1 for f in finished if f == first)
    span = (last - first) / 1000
    r.flushdb()
    return Drain(len(tasks), (len(finished) - n_first) / span if span > 0 else float("nan"),
                 span, (last - started) / 1000, calls, commands, wall, redis_cpu)


# -- a./b./c. throughput -------------------------------------------------------------
@dataclass
class Ceiling:
    b32: float        # sentences/s
    b1: float
    batch_ms: float   # one 32-batch's compute time (median)
    b1_ms: float


def direct_pass(texts: list[str], batch: int) -> tuple[float, list[float]]:
    """One pass over ``texts`` in the model's batches: (sentences/s, seconds per call)."""
    from examples.embeddings import encode

    times = []
    t0 = time.perf_counter()
    for i in range(0, len(texts), batch):
        b0 = time.perf_counter()
        encode(texts[i:i + batch])
        times.append(time.perf_counter() - b0)
    return len(texts) / (time.perf_counter() - t0), times


@dataclass
class Paired:
    """Direct passes and worker chunks of the same sentences, taken in turns."""

    batch: int
    n: int                                  # sentences per pass / chunk
    direct: list[float]                     # sentences/s per direct pass
    direct_s: list[float]                   # seconds per direct call
    worker: list[float]                     # sentences/s per worker chunk
    calls: list[tuple[float, float, int]]   # the worker's predict log (benchmarks.children.timed)
    foreign: list[float] = field(default_factory=list)  # others' share of the machine
    retaken: int = 0                        # pairs dropped because that share was high
    windows: list[tuple[float, float]] = field(default_factory=list)  # kept pairs

    def ratios(self) -> list[float]:
        return [w / d for w, d in zip(self.worker, self.direct)]

    def log_stats(self, idle_s: float = 0.05) -> dict[str, float]:
        """From the worker's own log; gaps over ``idle_s`` (between chunks) left out."""
        c = self.calls
        if len(c) < 3:
            return {}
        pairs = [(c[i][1] - c[i][0], c[i + 1][0] - c[i][1]) for i in range(len(c) - 1)
                 if c[i + 1][0] - c[i][1] < idle_s]
        gaps = [g for _, g in pairs] or [0.0]
        busy = sum(x for x, _ in pairs)
        top = max(n for _, _, n in c)
        return {
            "batches": len(c), "full": sum(1 for _, _, n in c if n == top) / len(c),
            "busy": busy / (busy + sum(gaps)) if busy else float("nan"),
            "predict_ms": median([(t1 - t0) * 1000 for t0, t1, _ in c]),
            "gap_ms": median(gaps) * 1000, "gap_p90_ms": pct(gaps, 90) * 1000,
            "gap_mean_ms": sum(gaps) / len(gaps) * 1000,
        }


def paired(server: Server, r: redis.Redis, texts: list[str], batch: int,
           pairs: int, retakes: int, budget_s: float) -> Paired:
    """One ``mtq worker run`` process at ``batch``, started and warmed first; then, in
    turns, a direct pass over ``texts`` in this process and the same texts submitted at
    once as single tasks to the (idle) worker, timed from its first completion to its
    last. Taking them in turns keeps a change in the machine's load from favouring one."""
    qname = uniq(f"b{batch}")
    q = mtq.Queue(qname, client=r)
    timings = tempfile.NamedTemporaryFile(prefix="mtq-bench-", suffix=".json", delete=False)
    timings.close()
    out = Paired(batch, len(texts), [], [], [], [])
    proc = Proc(["worker", "run", "benchmarks.children.timed:TimedMiniLM", "--queue", qname,
                 "--redis", server.url, "--batch-size", str(batch)],
                worker_env(server.url, MTQ_BENCH_TIMINGS=timings.name))
    try:
        wait_for("the worker to load the model", lambda: len(live_workers(r, qname)) >= 1,
                 120, [proc])
        warm = q.submit_many(texts[:max(2 * batch, 8)])
        wait_for("the warm-up", lambda: q.stats()["succeeded"] >= len(warm), 60, [proc])
        deadline = time.perf_counter() + budget_s  # for taking pairs again
        while len(out.worker) < pairs:
            mark = cpu_mark()
            rate, times = direct_pass(texts, batch)
            done = q.stats()["succeeded"]
            tasks = q.submit_many(texts)
            wait_for("a chunk", lambda: q.stats()["succeeded"] >= done + len(tasks),  # noqa: B023
                     120, [proc])
            share = foreign(mark)[1]
            if (share > MAX_FOREIGN and out.retaken < retakes
                    and time.perf_counter() < deadline):
                out.retaken += 1  # other processes took too much of the machine: again
                wait_quiet(5)
                continue
            finished = [f for (f,) in task_fields(r, q, tasks, "finished") if f is not None]
            first, last = min(finished), max(finished)
            n_first = sum(1 for f in finished if f == first)
            out.direct.append(rate)
            out.direct_s += times
            out.worker.append((len(finished) - n_first) / max((last - first) / 1000, 1e-3))
            out.foreign.append(share)
            out.windows.append((mark[0], time.perf_counter()))
        proc.stop()
        if proc.proc.returncode != 0:
            raise proc.fail(f"worker exited with {proc.proc.returncode}")
    finally:
        proc.close()
        r.flushdb()
    text = Path(timings.name).read_text()
    os.unlink(timings.name)
    calls = [(float(a), float(b), int(k)) for a, b, k in json.loads(text)] if text else []
    # perf_counter is CLOCK_MONOTONIC on Linux, so the worker's log and these windows
    # share a clock: keep the predict calls of the pairs that were kept
    out.calls = [c for c in calls if any(lo <= c[0] <= hi for lo, hi in out.windows)]
    return out


def spread_of(values: Sequence[float], digits: int = 0, pct_: bool = False) -> str:
    if len(values) < 2:
        return ""
    f = (lambda v: f"{v:.0%}") if pct_ else (lambda v: f"{v:.{digits}f}")
    return f"; median of {len(values)} ({f(min(values))}-{f(max(values))})"


def bench_throughput(server: Server, r: redis.Redis, s: Sizes, res: Results,
                     corpus: list[str]) -> tuple[Ceiling, Paired, Paired]:
    from examples.embeddings import encode

    encode(corpus[:BATCH])  # load + warm-up in this process
    encode(corpus[BATCH:2 * BATCH])
    for t in corpus[:8]:
        encode([t])
    p32 = paired(server, r, corpus, BATCH, s.pairs32, s.retakes * s.pairs32, 40)
    p1 = paired(server, r, corpus[:s.n1], 1, s.pairs1, s.retakes * s.pairs1, 25)
    ceil = Ceiling(median(p32.direct), median(p1.direct), median(p32.direct_s) * 1000,
                   median(p1.direct_s) * 1000)

    res.section = "a. ceiling: the model called directly (examples.embeddings.encode)"
    res.add(f"direct, batch 32 ({s.pairs32} x {len(corpus)} sentences)", ceil.b32,
            "sentences/s", "ceiling (= 100%)" + spread_of(p32.direct))
    res.add("  one 32-batch's compute time", ceil.batch_ms, "ms",
            f"median of {len(p32.direct_s)} batches (p90 {pct(p32.direct_s, 90) * 1000:.0f} "
            "ms); the 'batch' in the latency target")
    res.add(f"direct, batch 1 ({s.pairs1} x {s.n1} sentences)", ceil.b1, "sentences/s",
            f"{ceil.b1_ms:.1f} ms per sentence (median)" + spread_of(p1.direct))
    own = ceil.b32 / ceil.b1
    res.add("  the model's own batching gain (direct b32 / b1)", own, "x",
            "what batching can give on this CPU at best")

    res.section = "b./c. one worker serving floods of single-sentence tasks"
    for pr, label in ((p32, "b"), (p1, "c")):
        st = pr.log_stats()
        direct_ms = median(pr.direct_s) * 1000
        ratio = median(pr.ratios())
        note = f"{ratio:.0%} of direct b{pr.batch} (median of the paired ratios" + (
            f", {min(pr.ratios()):.0%}-{max(pr.ratios()):.0%})" if len(pr.worker) > 1 else ")")
        if pr.batch == BATCH:
            note += "; " + res.target(
                f">= {targets.CEILING:.0%} of the direct batch-32 ceiling ((b)/(a))",
                ratio >= targets.CEILING,
                f"{median(pr.worker):.0f} vs {median(pr.direct):.0f} sentences/s; paired "
                f"ratio {ratio:.1%}")
        res.add(f"{label}. worker, batch {pr.batch} ({len(pr.worker)} x {pr.n} tasks)",
                median(pr.worker), "sentences/s",
                note + spread_of(pr.worker) + "; first -> last completion of each chunk; "
                f"other processes used {max(pr.foreign):.0%} of the machine at most"
                + (f" ({pr.retaken} pair(s) taken again: over {MAX_FOREIGN:.0%})"
                   if pr.retaken else ""))
        if st:
            res.add("  predict time per batch, in the worker", st["predict_ms"], "ms",
                    f"median; direct: {direct_ms:.1f} ms ({st['predict_ms'] / direct_ms:.2f}x)")
            res.add("  model thread between two predict calls", st["gap_ms"], "ms",
                    f"median (mean {st['gap_mean_ms']:.2f}, p90 {st['gap_p90_ms']:.2f}): take, "
                    f"decode, hand off; model busy {st['busy']:.1%} of the time in a chunk; "
                    f"{st['batches']:.0f} batches, {st['full']:.0%} full")
    g = median(p32.worker) / median(p1.worker)
    res.add("(b)/(c): batching gain through the queue", g, "x",
            res.target(f">= {targets.GAIN:g}x batch 32 vs batch 1 through the queue ((b)/(c))",
                       g >= targets.GAIN,
                       f"{g:.2f}x; the model itself gains {own:.2f}x from batching on this "
                       "CPU (direct b32/b1)"
                       + (f", so {targets.GAIN:g}x cannot be reached here" if own < targets.GAIN
                          else "") + f"; the queue gives {g / own:.0%} of the model's own gain"))
    res.add("  ... relative to the model's own gain (direct b32/b1)", g / own, "x",
            f"{g:.2f}x / {own:.2f}x")
    return ceil, p32, p1


# -- d. latency under load ---------------------------------------------------------
def start_supervisor(server: Server, r: redis.Redis, qname: str, replicas: int,
                     *extra: str, target: str = "examples.embeddings:MiniLM",
                     env: dict[str, str] | None = None) -> Proc:
    p = Proc(["workers", "start", target, "--queue", qname, "--redis", server.url,
              "--devices", "cpu", "--replicas", str(replicas), *extra],
             env or worker_env(server.url))
    wait_for(f"{replicas} worker(s) ready", lambda: len(live_workers(r, qname)) >= replicas,
             120, [p])
    return p


def bench_latency(server: Server, r: redis.Redis, s: Sizes, res: Results, corpus: list[str],
                  ceil: Ceiling, capacity: float) -> None:
    res.section = "d. latency under a steady open-loop load (mtq workers start, 1 replica)"
    qname = uniq("latency")
    q = mtq.Queue(qname, client=r)
    timings = tempfile.NamedTemporaryFile(prefix="mtq-bench-", suffix=".json", delete=False)
    timings.close()
    sup = start_supervisor(server, r, qname, 1, target="benchmarks.children.timed:TimedMiniLM",
                           env=worker_env(server.url, MTQ_BENCH_TIMINGS=timings.name))
    rate = capacity / 2
    rng = random.Random(11)
    arrivals: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= s.load_s:
            break
        arrivals.append(t)
    submitted: list[mtq.Task] = []
    late: list[float] = []
    window = (0.0, 0.0)
    share, retaken = 0.0, 0
    try:
        warm = q.submit_many(corpus[:3 * BATCH] + corpus[:16])
        wait_for("the warm-up tasks", lambda: q.stats()["succeeded"] >= len(warm), 60, [sup])
        producer_q = mtq.Queue(qname, server.url)
        while True:
            submitted, late = [], []
            done = q.stats()["succeeded"]

            def produce() -> None:
                t0 = time.perf_counter()
                for i, at in enumerate(arrivals):
                    delay = t0 + at - time.perf_counter()
                    if delay > 0:
                        time.sleep(delay)
                    else:
                        late.append(-delay)  # noqa: B023
                    submitted.append(producer_q.submit(corpus[i % len(corpus)]))  # noqa: B023

            mark = cpu_mark()
            th = threading.Thread(target=produce, name="producer")
            th.start()
            th.join()
            wait_for("the load's results",
                     lambda: q.stats()["succeeded"] >= done + len(arrivals), 60, [sup])  # noqa: B023
            window = (mark[0], time.perf_counter())
            share = foreign(mark)[1]
            if share <= MAX_FOREIGN or retaken >= s.latency_retakes:
                break
            retaken += 1  # other processes took too much of the machine: again
            wait_quiet(10)
        sup.stop()
    finally:
        sup.close()
    text = Path(timings.name).read_text()
    os.unlink(timings.name)
    # perf_counter is CLOCK_MONOTONIC on Linux: the worker's log and this window agree
    calls = [(float(a), float(b), int(k)) for a, b, k in json.loads(text)] if text else []
    calls = [c for c in calls if window[0] <= c[0] <= window[1]]
    rows = task_fields(r, q, submitted, "created", "started", "finished")
    lat = [float(f - c) for c, _, f in rows if c is not None and f is not None]
    wait = [float(st - c) for c, st, _ in rows if c is not None and st is not None]
    inside = [float(f - st) for _, st, f in rows if st is not None and f is not None]
    r.flushdb()
    target_ms = MAX_WAIT_MS + 2 * ceil.batch_ms
    p50, p99 = pct(lat, 50), pct(lat, 99)
    res.add(f"offered load: Poisson, {rate:.0f} tasks/s for {s.load_s:g} s", len(lat), "tasks",
            f"half of (b)'s {capacity:.0f}/s; submitted one by one from a producer thread; "
            f"{sum(1 for x in late if x > 0.005)} submits were >5 ms behind schedule; other "
            f"processes used {share:.0%} of the machine"
            + (f" ({retaken} run(s) taken again: over {MAX_FOREIGN:.0%})" if retaken else ""))
    res.add("  latency p50 (created -> finished, server clock)", p50, "ms",
            f"max_wait_ms {MAX_WAIT_MS:g}")
    res.add("  latency p90", pct(lat, 90), "ms", "")
    res.add("  latency p99", p99, "ms",
            res.target(f"p99 <= max_wait_ms + 2 x one 32-batch's compute "
                       f"({MAX_WAIT_MS:g} + 2 x {ceil.batch_ms:.0f} = {target_ms:.0f} ms)",
                       p99 <= target_ms, f"p99 {p99:.0f} ms, p50 {p50:.0f} ms, "
                       f"max {max(lat):.0f} ms over {len(lat)} tasks"))
    res.add("  latency max", max(lat), "ms", "")
    res.add("  of which waiting to be claimed (created -> started), p99", pct(wait, 99),
            "ms", f"p50 {pct(wait, 50):.0f} ms: the claim waits while the model runs the "
            "batch before")
    res.add("  of which in the worker (started -> finished), p99", pct(inside, 99), "ms",
            f"p50 {pct(inside, 50):.0f} ms: batching window, predict, ack")
    if calls:
        sizes = [k for _, _, k in calls]
        times = [(b - a) * 1000 for a, b, _ in calls]
        res.add("  predict calls during the load, p99", pct(times, 99), "ms",
                f"p50 {pct(times, 50):.1f} ms, max {max(times):.0f} ms; {len(calls)} "
                f"batches, mean size {sum(sizes) / len(sizes):.2f}, largest {max(sizes)}")


# -- e. the queue's own cost per batch -------------------------------------------------
def bench_overhead(server: Server, r: redis.Redis, s: Sizes, res: Results,
                   flood: Paired) -> None:
    res.section = "e. the queue's own cost per batch (no-op model, batch 32, 1 worker)"
    n = s.noop_batches * BATCH
    runs = [drain(server, r, "benchmarks.children.timed:TimedNoop", [{"i": i} for i in range(n)], BATCH)
            for _ in range(s.noop_reps)]
    burst = drain(server, r, "benchmarks.children.timed:TimedNoop", [{"i": i} for i in range(n)], BATCH,
                  burst=True)
    per_batch = [d.drain_s / (n / BATCH) * 1000 for d in runs]
    cycle = [d.cycle_ms() for d in runs]
    wall = median(per_batch)
    res.add(f"wall time per batch of 32, server clock ({s.noop_reps} x {n:,} tasks)", wall, "ms",
            f"{BATCH / wall * 1000:,.0f} tasks/s; first started -> last finished / batches; "
            + res.target(f"< {targets.OVERHEAD_MS:g} ms per batch (claim, publish, ack)",
                         wall < targets.OVERHEAD_MS,
                         f"{wall:.2f} ms per 32-task batch with a no-op model")
            + (f"; runs {', '.join(f'{x:.2f}' for x in per_batch)}" if len(runs) > 1 else ""))
    res.add("  model thread cycle per batch (worker's own clock)", median(cycle), "ms",
            "predict start -> next predict start, mean over the run")
    d = runs[len(runs) // 2]
    nb = n / BATCH
    ev = d.commands.get("evalsha", {})
    res.add("  Redis time per batch in the Lua scripts (EVALSHA usec)",
            float(ev.get("usec", 0)) / nb / 1000, "ms",
            f"{float(ev.get('calls', 0)) / nb:.2f} EVALSHA calls per batch (claim + ack); "
            f"redis-server CPU {d.redis_cpu_s / nb * 1000:.2f} ms per batch")
    res.add("  the same with --burst (drain mode), 1 run", burst.drain_s / (n / BATCH) * 1000,
            "ms", f"{burst.drain_s / d.drain_s:.2f}x the figure above; `mtq worker run "
            "--burst` exits once the queue is empty")
    st = flood.log_stats()
    if st:
        res.add("  with MiniLM: the model thread outside predict per batch", st["gap_mean_ms"],
                "ms", f"mean, from (b): the model idles this long per batch (median "
                f"{st['gap_ms']:.2f} ms); claim and ack overlap with predict")


# -- f. recovery -----------------------------------------------------------------------
class Events:
    """Collects a queue's event channel (server timestamps) in a thread."""

    def __init__(self, server: Server, q: mtq.Queue) -> None:
        self.client = redis.Redis.from_url(server.url)
        self.pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        self.pubsub.subscribe(q.broker.keys.events)
        self.items: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="events", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            msg = self.pubsub.get_message(timeout=0.1)
            if msg and msg.get("type") == "message":
                with self.lock:
                    self.items.append(json.loads(msg["data"]))

    def since(self, ts: int, name: str) -> list[dict[str, Any]]:
        with self.lock:
            return [e for e in self.items if e.get("event") == name and int(e["ts"]) >= ts]

    def first(self, ts: int, name: str, ids: set[str]) -> int | None:
        """Server ms of the first ``name`` event at or after ts that names one of ids."""
        for e in self.since(ts, name):
            if ids & set(e.get("ids") or ()):
                return int(e["ts"])
        return None

    def close(self) -> None:
        self._stop.set()
        self.thread.join(2)
        self.pubsub.close()
        self.client.close()


@dataclass
class Kill:
    held: int            # tasks the victim held (running + claimed ahead)
    requeued: int        # given back with the delivery counted
    released: int        # claimed ahead, given back uncounted
    back_ms: float       # kill -> given back (first 'restarted' or 'released' event)
    first_ms: float      # kill -> the first task of the killed batch claimed again
    batch_ms: float      # kill -> the last task of the killed batch claimed again
    ahead_ms: float      # kill -> the last of the claimed-ahead tasks claimed again
    all_ms: float        # kill -> the last of everything it held claimed again
    stalled: list[str]   # workers that stopped claiming afterwards (unstuck with 'resume')
    early: bool = False  # they stalled before everything was claimed again


def stalled_workers(r: redis.Redis, q: mtq.Queue, skip: set[int]) -> list[str]:
    """Live workers whose task counter does not move over 2 s while tasks wait: they
    stopped claiming (the registry is written every heartbeat, every lease/3 here)."""
    def counts() -> dict[str, int]:
        return {str(w["id"]): int(w.get("tasks", 0)) for w in live_workers(r, q.name)
                if int(w["pid"]) not in skip}

    time.sleep(1.0)  # let the registry catch up with what just happened
    before = counts()
    time.sleep(2.0)
    after = counts()
    if q.stats()["waiting"] == 0:
        return []
    return [w for w, n in before.items() if after.get(w) == n]


def kill_one(r: redis.Redis, q: mtq.Queue, ev: Events, candidates: dict[str, int],
             rng: random.Random, skip: set[int], timeout: float = 15) -> tuple[int, Kill]:
    """SIGKILL one worker mid-batch, then wait until everything it held is claimed again.

    Times are server ms from the kill to the events the scripts publish ('restarted':
    requeued with the delivery counted, 'released': given back uncounted, 'started':
    claimed by a worker). Afterwards, checks that every live worker still claims; one
    that does not is reported and woken with a 'resume' control command, so that the
    run can go on."""
    mark = server_ms(r)
    # mid-batch: wait for a worker's next claim (made as its model takes the batch it
    # claimed before), then a moment into that predict call; that worker is the victim
    wait_for("a worker's next claim",
             lambda: any(e.get("worker") in candidates for e in ev.since(mark, "started")), 20)
    wid = next(str(e["worker"]) for e in ev.since(mark, "started")
               if e.get("worker") in candidates)
    pid = candidates[wid]
    time.sleep(rng.uniform(0.02, 0.08))
    held = [_text(i) for i in r.zrangebyscore(q.broker.keys.leases, "-inf", "(+inf")]
    pipe = r.pipeline(transaction=False)
    for i in held:
        pipe.hget(q.broker.keys.task(i), "worker")
    mine = {i for i, w in zip(held, pipe.execute()) if w is not None and _text(w) == wid}
    killed_at = server_ms(r)
    os.kill(pid, signal.SIGKILL)
    skip = skip | {pid}
    if not mine:
        raise SystemExit(f"worker {wid} held no task when it was killed")
    ahead = {i for e in ev.items[:] if e.get("event") == "started" and e.get("worker") == wid
             and mark <= int(e["ts"]) <= killed_at for i in e.get("ids") or ()} & mine
    batch = (mine - ahead) or mine

    def ids(name: str) -> set[str]:
        return {i for e in ev.since(killed_at, name) for i in e.get("ids") or ()}

    stalled: list[str] = []
    early = False
    try:
        wait_for("the killed worker's tasks to be claimed again",
                 lambda: mine <= ids("started"), timeout)
    except SystemExit:
        stalled = stalled_workers(r, q, skip)
        if not stalled:
            raise
        early = True
        control.send(r, q.name, "resume")
        wait_for("the killed worker's tasks to be claimed again (after 'resume')",
                 lambda: mine <= ids("started"), timeout)
    requeued, released = ids("restarted") & mine, ids("released") & mine
    back = [t for t in (ev.first(killed_at, "restarted", mine),
                        ev.first(killed_at, "released", mine)) if t is not None]
    started: dict[str, int] = {}
    for e in ev.since(killed_at, "started"):
        for i in e.get("ids") or ():
            started.setdefault(i, int(e["ts"]))
    if not stalled:  # everything came back: do the workers go on claiming?
        wait_for("the killed worker's tasks to finish", lambda: mine <= ids("succeeded"),
                 timeout)
        stalled = stalled_workers(r, q, skip)
        if stalled:
            control.send(r, q.name, "resume")
    return pid, Kill(len(mine), len(requeued), len(released),
                     (min(back) - killed_at) if back else float("nan"),
                     min(started[i] for i in batch) - killed_at,
                     max(started[i] for i in batch) - killed_at,
                     max(started[i] for i in (ahead or mine)) - killed_at,
                     max(started[i] for i in mine) - killed_at, stalled, early)


def keep_busy(q: mtq.Queue, corpus: list[str], at_least: int = 300) -> None:
    st = q.stats()
    if st["waiting"] < at_least:
        q.submit_many([corpus[i % len(corpus)] for i in range(2 * at_least)])


def recovery_variant(server: Server, r: redis.Redis, variant: str, kills: int,
                     corpus: list[str], rng: random.Random) -> list[Kill]:
    """Start the workers of one variant, kill one of them ``kills`` times."""
    qname = uniq("recover")
    q = mtq.Queue(qname, client=r)
    ev = Events(server, q)
    procs: list[Proc] = []
    results: list[Kill] = []
    need = 1 if variant == "supervised, 1 replica" else 2
    killed: set[int] = set()

    def alive() -> list[dict[str, Any]]:
        out = []
        for w in live_workers(r, qname):
            pid = int(w["pid"])
            if pid in killed:
                continue
            try:
                os.kill(pid, 0)
            except OSError:
                continue
            out.append(w)
        return out

    try:
        if variant.startswith("supervised"):
            procs.append(start_supervisor(server, r, qname, need, "--lease-ms", str(LEASE_MS)))
        else:
            for _ in range(need):
                procs.append(Proc(["worker", "run", "examples.embeddings:MiniLM",
                                   "--queue", qname, "--redis", server.url,
                                   "--lease-ms", str(LEASE_MS)], worker_env(server.url)))
        for _ in range(kills):
            wait_for(f"{need} live worker(s)", lambda: len(alive()) >= need, 120, procs)
            keep_busy(q, corpus)
            # every kill starts from claiming workers (a worker left stalled by the
            # previous recovery, see stalled_workers, is counted there, then woken here)
            control.send(r, qname, "resume")
            done = q.stats()["succeeded"]
            wait_for("progress", lambda: q.stats()["succeeded"] > done, 60, procs)  # noqa: B023
            pid, k = kill_one(r, q, ev, {str(w["id"]): int(w["pid"]) for w in alive()}, rng,
                              killed)
            killed.add(pid)
            results.append(k)
            print(f"[{variant}: killed pid {pid}: batch back after {k.first_ms:.0f} ms"
                  + (f", {len(k.stalled)} worker(s) stalled" if k.stalled else "") + "]",
                  end=" ", flush=True)
    finally:
        for p in procs:
            p.stop(30)
            p.close()
        ev.close()
        r.flushdb()
    return results


def bench_recovery(server: Server, r: redis.Redis, s: Sizes, res: Results,
                   corpus: list[str]) -> None:
    res.section = f"f. recovery: a worker killed (SIGKILL) mid-batch, lease {LEASE_MS} ms"
    rng = random.Random(5)
    target_ms = 2 * LEASE_MS
    stalled_total = [0, 0]
    for variant, kills in s.kills.items():
        results = recovery_variant(server, r, variant, kills, corpus, rng)
        first = median([k.first_ms for k in results])
        back = median([k.back_ms for k in results])
        every = median([k.all_ms for k in results])
        mid = sum(1 for k in results if k.requeued)
        how = {"supervised, 1 replica": "the supervisor gives the tasks back at once and "
                                        "restarts the process, which loads the model again",
               "supervised, 2 replicas": "the supervisor gives the tasks back at once; the "
                                         "other replica claims them",
               "no supervisor, 2 workers": "nobody gives them back: the other worker's claim "
                                           "reaps them once the lease expires"}[variant]
        res.add(f"{variant}: kill -> killed batch running again ({len(results)} kill(s))",
                first, "ms",
                res.target(f"back within 2 x lease ({target_ms} ms), {variant}",
                           first <= target_ms,
                           f"the batch being run when the worker was killed was claimed again "
                           f"{first:.0f} ms after the kill (its first task; median of "
                           f"{len(results)}); {how}"))
        res.add("  kill -> given back to the queue", back, "ms",
                f"{mid} of {len(results)} kill(s) hit a predict call; "
                + ", ".join(f"{k.held} held: {k.requeued} requeued + {k.released} released"
                            for k in results))
        res.add("  kill -> everything it held claimed again", every, "ms",
                "per kill, killed batch first / last task, claimed-ahead tasks last: "
                + "; ".join(f"{k.first_ms:.0f}/{k.batch_ms:.0f}/{k.ahead_ms:.0f}"
                            + (" (stalled; claimed after 'resume')" if k.early else "")
                            for k in results) + " ms; requeued tasks are suspects, run "
                "(and so claimed) one at a time")
        stalls = sum(1 for k in results if k.stalled)
        stalled_total[0] += stalls
        stalled_total[1] += len(results)
        res.add("  recoveries after which a worker stopped claiming", stalls,
                f"of {len(results)}", "a live worker sat idle while tasks waited; woken "
                "here with 'mtq workers resume' so that the run goes on (see targets)"
                if stalls else "none")
    res.target("every worker keeps claiming after a recovery", stalled_total[0] == 0,
               f"{stalled_total[0]} of {stalled_total[1]} recoveries left a worker idle with "
               "tasks waiting")


# -- output ----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    quick, docs = cli_args(argv, __doc__, "~1 minute")
    sizes = QUICK if quick else FULL
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    from examples.embeddings import MiniLM

    hf_logging.disable_progress_bar()
    if float(MiniLM.max_wait_ms) != MAX_WAIT_MS or MiniLM.max_batch_size != BATCH:
        raise SystemExit("examples.embeddings:MiniLM changed its batching; update MAX_WAIT_MS")

    compile_tree()
    server = Server()
    server.start()
    started = time.perf_counter()
    try:
        r = server.client()
        r.flushall()
        res = Results()
        corpus = sentences(sizes.corpus)
        state: dict[str, Any] = {}

        def run_throughput() -> None:
            state["ceil"], state["b32"], state["b1"] = bench_throughput(server, r, sizes, res,
                                                                        corpus)

        steps: list[tuple[str, Callable[[], Any]]] = [
            ("throughput", run_throughput),
            ("latency", lambda: bench_latency(server, r, sizes, res, corpus, state["ceil"],
                                              median(state["b32"].worker))),
            ("overhead", lambda: bench_overhead(server, r, sizes, res, state["b32"])),
            ("recovery", lambda: bench_recovery(server, r, sizes, res, corpus)),
        ]
        meter = CpuMeter()
        meter.run(steps, sizes.quiet_s)
        seconds = time.perf_counter() - started
        machine = machine_info(r, torch_info(), f"other processes {meter.share():.0%} of the CPU")
        res.print(f"mtq batching ({'quick' if quick else 'full'} run, {seconds:.0f} s), {machine}")
        if docs is not None:
            command = "python -m benchmarks.batching" + (" --quick" if quick else "")
            write_block("batching", res.markdown(), command, machine, seconds, docs)
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
