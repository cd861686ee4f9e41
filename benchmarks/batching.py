#!/usr/bin/env python
"""Batching: mtq workers serving a real model (all-MiniLM-L6-v2 on the CPU).

    python -m benchmarks.batching            # ~3 minutes on 2 cores, writes the batching block
    python -m benchmarks.batching --quick    # ~1 minute, prints only (add --docs to write)

With the same sentences, in one run: (a) the ceiling, the model called directly in this
process at batch 32 and 1; (b) one ``mtq worker run`` at batch 32 serving chunks of
single-sentence tasks submitted at once, in turns with (a); (c) the same at batch 1;
(d) latency under an open-loop Poisson load at half of (b), served by ``mtq workers
start``; (e) the queue's own cost per batch, a no-op model at batch 32.
"""

from __future__ import annotations

import json
import os
import random
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
from benchmarks.harness.drain import drain, task_fields
from benchmarks.harness.meters import (
    MAX_FOREIGN,
    CpuMeter,
    cpu_mark,
    foreign,
    machine_info,
    median,
    pct,
    torch_info,
    wait_quiet,
)
from benchmarks.harness.procs import Proc, wait_for, worker_env
from benchmarks.harness.report import Results, cli_args, write_block
from benchmarks.harness.server import Server, compile_tree, uniq
from mtq.workers.registry import list_workers

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
    quiet_s: float         # longest wait for a quiet machine before each step
    latency_retakes: int   # latency runs taken again at most when the machine was busy
    retakes: int           # pairs taken again at most, per pair, when the machine was busy


FULL = Sizes(corpus=320, pairs32=6, n1=160, pairs1=4, load_s=15.0, noop_batches=500,
             noop_reps=3, quiet_s=20,
             latency_retakes=1, retakes=1)
QUICK = Sizes(corpus=320, pairs32=2, n1=160, pairs1=1, load_s=6.0, noop_batches=300,
              noop_reps=1, quiet_s=3, latency_retakes=0, retakes=0)


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
                 "--redis", server.url, "--max-batch-size", str(batch)],
                worker_env(server.url, MTQ_BENCH_TIMINGS=timings.name))
    try:
        wait_for("the worker to load the model", lambda: len(list_workers(r, qname)) >= 1,
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
    wait_for(f"{replicas} worker(s) ready", lambda: len(list_workers(r, qname)) >= replicas,
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
    res.add("  latency p99", p99, "ms",
            res.target(f"p99 <= max_wait_ms + 2 x one 32-batch's compute "
                       f"({MAX_WAIT_MS:g} + 2 x {ceil.batch_ms:.0f} = {target_ms:.0f} ms)",
                       p99 <= target_ms, f"p99 {p99:.0f} ms, p50 {p50:.0f} ms, "
                       f"max {max(lat):.0f} ms over {len(lat)} tasks"))
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
