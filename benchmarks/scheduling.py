"""Scheduling: priority bands and tenants' cost-weighted fair share, each against today's
round robin in the same run.

One worker slot per queue: ``mtq worker run benchmarks.children.costed:work --max-batch-size 1``,
whose work sleeps 0.1 ms per cost unit and logs when each task ran (the worker's own
clock). Round robin is the same load submitted without tenant and priority, so that the
queue's scheduling stays off. The queues of one phase run at once, each with its own
worker (their work is a sleep; one core idles meanwhile).

* fair share: tenant A 100 streams of cost 2,000, tenant B 5 streams of cost 50, both
  backlogged from the start; the served cost A:B in each window after a warm-up (a task's
  cost counted pro rata over the time it ran), weights 1:1 and 3:1; and the largest
  difference between the two tenants' served cost over their weights over any interval,
  against the bound of start-time fair queueing;
* priority: interactive tasks (cost 50) every 50 ms while the batch band (cost 1,000) has
  a deep backlog: their wait from submit to the start of their run, against one batch
  time plus one claim round trip; what the batch band loses beyond the interactive
  work, against the batch band alone in the same phase;
* Redis: redis-server instructions per drained task with tenants and priorities on
  against a plain drain (callgrind, as benchmarks.instructions counts them), and the
  round trip p50 through an idle worker, the two queues in alternating blocks (and the
  same drain of tasks in 400 streams);

* rate limit and deadlines (benchmarks/limits.py): a tenant's limit held across 8
  producers in 2 processes, and the refusals' latency; at twice a worker's rate, the
  admitted tasks with a deadline that start before it.

    python -m benchmarks.scheduling           # full run (~4 min), writes its block
    python -m benchmarks.scheduling --quick   # shorter windows (~45 s), prints only
    python -m benchmarks.scheduling --quick --only fair --only priority   # ~15 s, the tests'
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redis

import mtq
from benchmarks import instructions, limits, targets
from benchmarks.children.costed import PER_COST_S
from benchmarks.harness.drain import task_fields
from benchmarks.harness.meters import CpuMeter, commandstats, machine_info, pct
from benchmarks.harness.procs import Proc, wait_for, worker_env
from benchmarks.harness.report import Results, cli_parser, docs_of, write_block
from benchmarks.harness.server import ROOT, Server, compile_tree, uniq
from benchmarks.harness.streams import wait_ready
from mtq.broker.consumer import Consumer, Outcome

TARGET = "benchmarks.children.costed:work"
NOOP = "benchmarks.children.noop:handle"


@dataclass(frozen=True)
class Sizes:
    warm_s: float          # fair share: not counted at the start of a run
    window_s: float        # ... the window the ratio is taken over
    windows: int           # ... how many
    prio_s: float          # priority: interactive tasks submitted for this long
    every_s: float         # ... one every
    slack_s: float         # ... the batch backlog holds this much more work
    rt_blocks: int         # round trips: blocks per queue, in turns
    rt_n: int              # ... round trips per block
    cg_n: int              # drained tasks counted under callgrind
    rate_s: float          # rate limit: how long the producers try
    deadline_s: float      # deadlines: the measured span, after a warm-up of 4 s


FULL = Sizes(2.0, 10.0, 3, 15.0, 0.05, 4.0, 5, 200, 3200, 60.0, 20.0)
QUICK = Sizes(1.0, 2.0, 2, 3.0, 0.05, 2.0, 2, 100, 320, 5.0, 4.0)

# the fair-share load (the issue's): (group, streams, cost)
A, B = ("A", 100, 2000.0), ("B", 5, 50.0)
BATCH_COST, INTERACTIVE_COST = 1000.0, 50.0


# -- one queue and its worker ----------------------------------------------------------------
@dataclass(frozen=True)
class Ran:
    """One line of the worker's log: a task's run."""

    start: float
    end: float
    group: str
    cost: float
    submitted: float
    k: int                 # the task's index in its group


class Lane:
    """A queue served by one ``mtq worker run`` of :data:`TARGET`, batch size 1, whose
    runs are read from its log."""

    def __init__(self, server: Server, r: redis.Redis, label: str,
                 weights: str | None = None) -> None:
        self.label = label
        self.server = server
        self.q = mtq.Queue(uniq(label), client=r)
        if weights:
            self.q.configure(tenant_weights=weights)
        fd, path = tempfile.mkstemp(prefix="mtq-bench-sched-", suffix=".log")
        os.close(fd)
        self.log = Path(path)
        self.proc: Proc | None = None

    def start(self) -> Proc:
        self.proc = Proc(["worker", "run", TARGET, "--queue", self.q.name, "--redis",
                          self.server.url, "--max-batch-size", "1", "--max-wait-ms", "0"],
                         worker_env(self.server.url, MTQ_BENCH_LOG=str(self.log)))
        return self.proc

    def runs(self) -> list[Ran]:
        out = []
        for line in self.log.read_text().splitlines():
            s, e, g, c, sub, k = line.split()
            out.append(Ran(float(s), float(e), g, float(c), float(sub), int(k)))
        return out

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stop(30)
            self.proc.close()
        self.log.unlink(missing_ok=True)


def served(runs: Sequence[Ran], group: str, a: float, b: float) -> float:
    """Cost served to ``group`` from ``a`` to ``b``: each run's cost pro rata over the
    part of its run inside."""
    total = 0.0
    for x in runs:
        if x.group == group and x.end > a and x.start < b:
            span = x.end - x.start
            total += x.cost if span <= 0 else x.cost * (min(x.end, b) - max(x.start, a)) / span
    return total


def busy(runs: Sequence[Ran], group: str, a: float, b: float) -> float:
    """Seconds the worker ran ``group``'s tasks from ``a`` to ``b``."""
    return sum(max(0.0, min(x.end, b) - max(x.start, a)) for x in runs if x.group == group)


def started_by(lanes: Sequence[Lane], until: Callable[[Lane], bool], timeout: float,
               what: str) -> None:
    procs = [lane.proc for lane in lanes if lane.proc is not None]
    wait_for(what, lambda: all(until(lane) for lane in lanes), timeout, procs, every=0.1)


# -- fair share --------------------------------------------------------------------------------
def fair_load(q: mtq.Queue, scheduled: bool, seconds: float) -> dict[str, int]:
    """Submit the fair-share load, enough of both tenants to keep each backlogged for
    ``seconds`` at any share (B's at half the worker); returns the tasks per group."""
    depth = {A[0]: math.ceil(1.5 * seconds / (A[2] * PER_COST_S) / A[1]) + 1,
             B[0]: math.ceil(1.5 * seconds * 0.5 / (B[2] * PER_COST_S) / B[1]) + 1}
    items: list[mtq.Request] = []
    k = 0
    for i in range(max(depth.values())):
        for j in range(A[1]):
            for g, streams, cost in (A, B):
                if j < streams and i < depth[g]:
                    k += 1
                    items.append(mtq.Request({"c": cost, "g": g, "k": k}, stream=f"{g}{j}",
                                             tenant=g if scheduled else None, cost=cost))
    q.submit_many(items)
    return {g: depth[g] * streams for g, streams, _ in (A, B)}


@dataclass
class Fair:
    label: str
    weights: tuple[float, float]
    ratios: list[float]        # served A / served B per window
    overall: float             # ... over all the windows together
    lag: float                 # max - min of (S_A/w_A - S_B/w_B) over the run: any interval
    lag_cum: float             # the largest |S_A/w_A - S_B/w_B| since the start
    left: dict[str, int]       # tasks still waiting at the end, per group
    ran: dict[str, int]


def fair_of(lane: Lane, weights: tuple[float, float], s: Sizes, submitted: dict[str, int],
            t_end: float) -> Fair:
    runs = [x for x in lane.runs() if x.start < t_end]
    t0 = min(x.start for x in runs)
    ratios = []
    for w in range(s.windows):
        a = t0 + s.warm_s + w * s.window_s
        sa, sb = served(runs, "A", a, a + s.window_s), served(runs, "B", a, a + s.window_s)
        ratios.append(sa / sb if sb > 0 else math.inf)
    a, b = t0 + s.warm_s, t0 + s.warm_s + s.windows * s.window_s
    sa, sb = served(runs, "A", a, b), served(runs, "B", a, b)
    # the difference after each run (it moves linearly within one: extremes at the ends)
    d, ds = 0.0, [0.0]
    for x in sorted(runs, key=lambda x: x.start):
        d += x.cost / (weights[0] if x.group == "A" else weights[1]) * (1 if x.group == "A"
                                                                       else -1)
        ds.append(d)
    ran = {g: sum(1 for x in runs if x.group == g) for g in submitted}
    return Fair(lane.label, weights, ratios, sa / sb if sb > 0 else math.inf,
                max(ds) - min(ds), max(abs(v) for v in ds),
                {g: submitted[g] - ran[g] for g in submitted}, ran)


def bench_fair(server: Server, r: redis.Redis, s: Sizes, res: Results) -> list[Fair]:
    seconds = s.warm_s + s.windows * s.window_s
    cases = (("sched-fair", "A=1,B=1", (1.0, 1.0)),
             ("sched-w31", "A=3,B=1", targets.WEIGHTS_31),
             ("sched-rr", None, (1.0, 1.0)))
    lanes = [Lane(server, r, label, weights) for label, weights, _ in cases]
    try:
        submitted = [fair_load(lane.q, lane.label != "sched-rr", seconds + 5) for lane in lanes]
        for lane in lanes:
            lane.start()
        started_by(lanes, lambda lane: lane.log.stat().st_size > 0, 60, "the first runs")
        def long_enough(lane: Lane) -> bool:
            runs = lane.runs()
            return runs[-1].end >= runs[0].start + seconds + 0.5

        started_by(lanes, long_enough, seconds + 60, f"{seconds:.0f} s of runs")
        out = [fair_of(lane, w, s, sub, lane.runs()[0].start + seconds + 1)
               for lane, (_, _, w), sub in zip(lanes, cases, submitted)]
    finally:
        for lane in lanes:
            lane.close()
    report_fair(out, s, res)
    return out


def report_fair(out: list[Fair], s: Sizes, res: Results) -> None:
    fair, w31, rr = out
    res.section = (f"1./2./3. fair share: tenant A {A[1]} streams of cost {A[2]:,.0f}, tenant "
                   f"B {B[1]} streams of cost {B[2]:,.0f}, both backlogged; one worker slot "
                   f"(0.1 ms per cost unit); {s.windows} windows of {s.window_s:g} s after "
                   f"{s.warm_s:g} s")

    def ratios(f: Fair) -> str:
        return ", ".join(f"{v:.3f}" if v < 100 else "no B" if v == math.inf else f"{v:,.0f}"
                         for v in f.ratios)

    def backlog(f: Fair) -> str:
        return (f"ran A {f.ran['A']}, B {f.ran['B']} tasks; waiting at the end: A "
                f"{f.left['A']}, B {f.left['B']}")

    for f, name in ((fair, "weights 1:1"), (w31, "weights 3:1 (tenant_weights A=3,B=1)")):
        want = f.weights[0] / f.weights[1]
        worst = max(abs(v / want - 1) for v in f.ratios)
        note = res.target(f"served cost A:B within {targets.FAIR_SHARE:.0%} of "
                          f"{want:g}:1 in every window ({name})",
                          worst <= targets.FAIR_SHARE, f"worst window {worst:.1%} off")
        res.add(f"{name}: served cost A:B, the window furthest from {want:g}:1", max(
            f.ratios, key=lambda v: abs(v / want - 1)), "A/B",
            f"windows {ratios(f)}; all of them together {f.overall:.3f}; {note}; "
            f"{backlog(f)}")
    res.add("round robin (the same load, no tenant): served cost A:B, all the windows",
            rr.overall, "A/B",
            f"windows {ratios(rr)}; scheduling off: one task per stream in turn, "
            f"{A[1]} of A's to {B[1]} of B's ({A[1] * A[2] / (B[1] * B[2]):,.0f}:1); "
            f"{backlog(rr)}")
    for f, name in ((fair, "1:1"), (w31, "3:1")):
        bound = A[2] / f.weights[0] + B[2] / f.weights[1]
        note = res.target(f"largest lag within c_A/w_A + c_B/w_B ({name})", f.lag <= bound + 1e-6,
                          f"{f.lag:,.0f} against {bound:,.0f}")
        res.add(f"weights {name}: largest |S_A/w_A - S_B/w_B| over any interval", f.lag,
                "cost", f"bound of start-time fair queueing with claims of one task "
                f"{A[2]:,.0f}/{f.weights[0]:g} + {B[2]:,.0f}/{f.weights[1]:g} = {bound:,.0f}; "
                f"since the start: {f.lag_cum:,.0f}; served cost taken as it ran (the "
                f"worker's log): the claimed-ahead task is served in claim order, so it "
                f"adds nothing to this bound; {note}")
    res.add("round robin: largest |S_A - S_B| over any interval", rr.lag, "cost",
            "the same load, scheduling off")


# -- priority --------------------------------------------------------------------------------
@dataclass
class Prio:
    waits: list[float]         # interactive: submit -> start of its run (s)
    to_claim: list[float]      # ... of which submit -> its claim (the scheduler's part)
    held: list[float]          # ... and its claim -> the start of its run (held claimed)
    rr_waits: list[float]      # the same, round robin
    batch_max_s: float         # the longest batch task's run
    batch_p50_s: float
    claim_rtt_s: float         # one claim round trip (p50)
    alone: float               # batch band alone: cost/s over the window
    mixed: float               # with the interactive tasks: batch cost/s
    share: float               # interactive tasks' share of the worker's time
    inversions: int            # batch claims made while an interactive task waited
    ahead: list[int]           # per interactive task: batch tasks claimed before it and
                               # run after its claim (held claimed ahead)
    interactive: int


def claim_rtt(r: redis.Redis, n: int = 30) -> float:
    """The p50 of a claim call (an empty scheduled queue: the script's fixed cost and one
    round trip), from this process."""
    name = uniq("sched-claim")
    q, c = mtq.Queue(name, client=r), Consumer(name, client=r)
    q.submit(None, priority="interactive")  # scheduling on
    c.settle([Outcome(t, True, None) for t in c.claim(1)])
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        c.claim(1)
        times.append(time.perf_counter() - t0)
    c.retire()
    return pct(times, 50)


def inversions(r: redis.Redis, q: mtq.Queue, interactive: list[mtq.Task],
               batch: list[mtq.Task]) -> int:
    """Batch tasks claimed while an interactive task waited (created before, claimed
    after: server ms)."""
    waits = [(c, s) for c, s in task_fields(r, q, interactive, "created", "started")
             if c is not None and s is not None]
    claims = [s for (s,) in task_fields(r, q, batch, "started") if s is not None]
    return sum(1 for b in claims if any(c < b < s for c, s in waits))


def held_ahead(r: redis.Redis, q: mtq.Queue, batch: list[mtq.Task], runs: Sequence[Ran],
               claims: Sequence[float]) -> list[int]:
    """For each claim time (s): the batch tasks claimed before it whose run started after
    it, i.e. held by the worker, claimed ahead (claims in server ms, runs from the log)."""
    start = {x.k: x.start for x in runs if x.group == "b"}
    b = [(c / 1000, start[k]) for k, (c,) in enumerate(task_fields(r, q, batch, "started"))
         if c is not None and k in start]
    return [sum(1 for c, st in b if c < ci and st > ci + 0.001) for ci in claims]


def bench_prio(server: Server, r: redis.Redis, s: Sizes, res: Results) -> Prio:
    alone = Lane(server, r, "sched-batch")
    mixed = Lane(server, r, "sched-prio")
    rr = Lane(server, r, "sched-prio-rr")
    lanes = (alone, mixed, rr)
    n_batch = math.ceil(1.1 * (s.prio_s + s.slack_s) / (BATCH_COST * PER_COST_S))
    n_int = int(s.prio_s / s.every_s)
    try:
        batch: dict[str, list[mtq.Task]] = {}
        for lane in lanes:
            batch[lane.label] = lane.q.submit_many(
                [mtq.Request({"c": BATCH_COST, "g": "b", "k": k}, cost=BATCH_COST,
                             priority=None if lane is rr else "batch") for k in range(n_batch)])
        for lane in lanes:
            lane.start()
        started_by(lanes, lambda lane: lane.log.stat().st_size > 0, 60, "the first runs")
        sent: list[mtq.Task] = []
        sent_rr: list[mtq.Task] = []
        stamps: list[float] = []

        def submit() -> None:
            nxt = time.perf_counter()
            for k in range(n_int):
                nxt += s.every_s
                time.sleep(max(0.0, nxt - time.perf_counter()))
                stamps.append(round(time.time(), 6))
                p = {"c": INTERACTIVE_COST, "g": "i", "k": k, "s": stamps[-1]}
                sent.append(mixed.q.submit(p, priority="interactive", cost=INTERACTIVE_COST))
                sent_rr.append(rr.q.submit(p, cost=INTERACTIVE_COST))

        w0 = time.time()
        th = threading.Thread(target=submit, daemon=True)
        th.start()
        th.join(s.prio_s * 3 + 30)
        w1 = time.time()
        if th.is_alive():
            raise SystemExit("the interactive submitter did not finish")

        def all_ran(lane: Lane) -> bool:
            return lane is alone or sum(1 for x in lane.runs() if x.group == "i") >= n_int

        started_by(lanes, all_ran, n_batch * BATCH_COST * PER_COST_S + 60,
                   "every interactive task's run")
        got = {lane.label: lane.runs() for lane in lanes}
        for lane in (alone, mixed):
            if sum(1 for x in got[lane.label] if x.group == "b" and x.start < w1) > n_batch - 3:
                raise SystemExit(f"{lane.label}: the batch band's backlog ran out")
        inv = inversions(r, mixed.q, sent, batch[mixed.label])
        m = got[mixed.label]
        # the claim (server ms) of each interactive task, by when it was submitted
        claimed = {st: c / 1000 for st, (c,) in
                   zip(stamps, task_fields(r, mixed.q, sent, "started")) if c is not None}
        mi = [x for x in m if x.group == "i" and round(x.submitted, 6) in claimed]
        runs_b = [x.end - x.start for x in m if x.group == "b"]
        ahead = held_ahead(r, mixed.q, batch[mixed.label], m, [claimed[round(x.submitted, 6)]
                                                               for x in mi])
        out = Prio([x.start - x.submitted for x in m if x.group == "i"],
                   [claimed[round(x.submitted, 6)] - x.submitted for x in mi],
                   [x.start - claimed[round(x.submitted, 6)] for x in mi],
                   [x.start - x.submitted for x in got[rr.label] if x.group == "i"],
                   max(runs_b), pct(runs_b, 50), claim_rtt(r),
                   served(got[alone.label], "b", w0, w1) / (w1 - w0),
                   served(m, "b", w0, w1) / (w1 - w0), busy(m, "i", w0, w1) / (w1 - w0), inv,
                   ahead, n_int)
    finally:
        for lane in lanes:
            lane.close()
    report_prio(out, s, res)
    return out


def report_prio(p: Prio, s: Sizes, res: Results) -> None:
    res.section = (f"4./5. priority: an interactive task (cost {INTERACTIVE_COST:g}) every "
                   f"{s.every_s * 1000:g} ms for {s.prio_s:g} s while the batch band (cost "
                   f"{BATCH_COST:,.0f}, stream-less) has a deep backlog; one worker slot")
    bound = p.batch_max_s + targets.INTERACTIVE_RTT * p.claim_rtt_s
    p99 = pct(p.waits, 99)
    note = res.target("interactive p99 wait <= one batch time + one claim round trip",
                      p99 <= bound, f"{p99 * 1000:.1f} ms against {bound * 1000:.1f} ms "
                      f"(the worker's own hand-off, claim -> run, p50 "
                      f"{pct(p.held, 50) * 1000:.1f} ms, is not in the bound)")
    res.add("interactive queue wait (submit -> its run starts), p99", p99 * 1000, "ms",
            f"p50 {pct(p.waits, 50) * 1000:.1f}, p90 {pct(p.waits, 90) * 1000:.1f}, max "
            f"{max(p.waits) * 1000:.1f} ms over {len(p.waits)}; bound: the longest batch run "
            f"{p.batch_max_s * 1000:.1f} ms + a claim round trip {p.claim_rtt_s * 1000:.2f} ms "
            f"= {bound * 1000:.1f} ms; {note}")
    res.add("  of which submit -> its claim (the scheduler's part), p99",
            pct(p.to_claim, 99) * 1000, "ms",
            f"p50 {pct(p.to_claim, 50) * 1000:.1f}, max {max(p.to_claim) * 1000:.1f} ms (its "
            "claim time, server ms): a slow model's worker on a queue that schedules claims "
            "as a batch ends, none ahead (mtq/workers/dynamic.py)")
    res.add("  and its claim -> its run (held behind the running task), p99",
            pct(p.held, 99) * 1000, "ms",
            f"p50 {pct(p.held, 50) * 1000:.1f}, max {max(p.held) * 1000:.1f} ms: behind the "
            "running task and those claimed before it")
    behind = sum(1 for a in p.ahead if a >= 1)
    res.add("  interactive tasks claimed behind a batch task claimed ahead", behind, "tasks",
            f"of {len(p.ahead)} (most held ahead at once: {max(p.ahead, default=0)}): a "
            "task claimed ahead of the running one would hold the next urgent task behind it")
    res.add("  waited more than one batch time", sum(
        1 for w in p.waits if w > p.batch_max_s), "tasks",
            f"of {len(p.waits)}; batch runs p50 {p.batch_p50_s * 1000:.1f} ms, longest "
            f"{p.batch_max_s * 1000:.1f} ms")
    res.add("  batch tasks claimed while an interactive task waited", p.inversions, "tasks",
            "sent first by the batch band's credit against starvation (band_min_share 5 %; "
            "claimed after the interactive task's submit, before its claim)")
    res.add("round robin (the same load, no priority): interactive wait p99",
            pct(p.rr_waits, 99) * 1000, "ms", f"p50 {pct(p.rr_waits, 50) * 1000:,.0f} ms: "
            "behind the batch backlog, first in first out")
    expect = p.alone * (1 - p.share)
    lost = 1 - p.mixed / expect
    note = res.target(f"batch throughput lost beyond the interactive work <= "
                      f"{targets.BATCH_LOST:.0%}", lost <= targets.BATCH_LOST,
                      f"{lost:.1%}")
    res.add("batch band's throughput with the interactive tasks", p.mixed, "cost/s",
            f"alone (the same phase, its own queue and worker): {p.alone:,.0f} cost/s; "
            f"interactive runs took {p.share:.1%} of the worker's time: expected "
            f"{expect:,.0f} cost/s")
    res.add("  lost beyond the interactive work itself", lost * 100, "%", note)


# -- Redis -------------------------------------------------------------------------------------
LANES = [(f"t{i}", p) for i in range(4) for p in ("interactive", "standard", "batch")]


def round_trips(server: Server, r: redis.Redis, s: Sizes) -> tuple[list[float], list[float]]:
    """Round trips (submit -> result) through an idle no-op worker, plain and with a tenant
    and a priority (each of :data:`LANES` in turn), in alternating blocks."""
    qs = [mtq.Queue(uniq("sched-rt-plain"), client=r), mtq.Queue(uniq("sched-rt"), client=r)]
    procs = [Proc(["worker", "run", NOOP, "--queue", q.name, "--redis", server.url],
                  worker_env(server.url)) for q in qs]
    times: list[list[float]] = [[], []]
    try:
        wait_ready(r, list(zip(procs, [q.name for q in qs])))
        for q in qs:  # warm: the scripts, the reply channel; turns scheduling on
            for t, p in LANES:
                if q is qs[0]:
                    q.submit(None).result(timeout=30)
                else:
                    q.submit(None, tenant=t, priority=p).result(timeout=30)
        for b in range(2 * s.rt_blocks):
            which = b % 2 if (b // 2) % 2 == 0 else 1 - b % 2
            q = qs[which]
            for i in range(s.rt_n):
                tenant, prio = (None, None) if which == 0 else LANES[i % len(LANES)]
                t0 = time.perf_counter()
                q.submit(None, tenant=tenant, priority=prio).result(timeout=30)
                times[which].append(time.perf_counter() - t0)
        if r.hget(qs[1].broker.keys.stats, "sched") != b"1" or \
                r.hget(qs[0].broker.keys.stats, "sched") == b"1":
            raise SystemExit("scheduling is not on for the scheduled queue alone")
    finally:
        for proc in procs:
            proc.stop(30)
            proc.close()
    return times[0], times[1]


def drain_commands(r: redis.Redis, scheduled: bool, n: int) -> dict[str, float]:
    """Redis commands per task (INFO commandstats) of a drain of ``n`` stream-less tasks
    in claims of 64 by a Consumer in this process: scripts' own commands included, the
    EVALSHA calls not."""
    name = uniq("sched-cmds")
    q, c = mtq.Queue(name, client=r), Consumer(name, client=r)
    q.submit_many([mtq.Request(None, tenant=t, priority=p) if scheduled else None
                   for t, p in (LANES[i % len(LANES)] for i in range(n))])
    r.config_resetstat()
    held = c.claim(64)
    while held:
        _, held = c.settle_and_claim([Outcome(t, True, None) for t in held], 64)
    calls = commandstats(r)
    c.retire()
    return {k: v / n for k, v in calls.items() if k not in ("evalsha", "info", "config")}


def bench_redis(server: Server, r: redis.Redis, s: Sizes, res: Results) -> dict[str, float]:
    res.section = (f"6. Redis: tasks with a tenant (one of {len(LANES) // 3}) and a priority "
                   "(each band in turn) against plain tasks")
    out: dict[str, float] = {}
    if instructions.have_valgrind():
        plain = instructions.count(ROOT, "drain", s.cg_n)
        sched = instructions.count(ROOT, "drain_sched", s.cg_n)
        ratio = sched / plain
        out.update(cg_plain=plain, cg_sched=sched)
        note = res.target(f"instructions per drained task, on / off <= "
                          f"{targets.SCHED_INSTRUCTIONS:g}x", ratio <= targets.SCHED_INSTRUCTIONS,
                          f"{ratio:.2f}x", comparable=True)
        res.add("redis-server instructions per drained task (claim + ack, batch 64), "
                "scheduling on", sched, "instr", f"plain tasks: {plain:,.0f}; "
                f"{s.cg_n:,} stream-less tasks, callgrind (benchmarks.instructions)")
        res.add("  on / off", ratio, "x", note)
        plain_s = instructions.count(ROOT, "drain_streams", s.cg_n)
        sched_s = instructions.count(ROOT, "drain_sched_streams", s.cg_n)
        out.update(cg_plain_streams=plain_s, cg_sched_streams=sched_s)
        res.add("  the same of tasks in 400 streams (each a tenant's, in a band)", sched_s,
                "instr", f"plain: {plain_s:,.0f}; on / off {sched_s / plain_s:.2f}x")
    else:
        res.add("redis-server instructions per drained task", None, "instr",
                "valgrind is not installed")
    cmds = [drain_commands(r, on, s.cg_n) for on in (False, True)]
    more = sorted(((k, cmds[1].get(k, 0) - cmds[0].get(k, 0)) for k in cmds[1]),
                  key=lambda kv: -kv[1])
    res.add("Redis commands per drained task, scheduling on", sum(cmds[1].values()), "calls",
            f"plain tasks: {sum(cmds[0].values()):.2f}; more with it on: " + ", ".join(
                f"{k.upper()} +{v:.2f}" for k, v in more if v >= 0.05) + " (INFO "
            "commandstats: the scripts' commands)")
    out.update(cmds_plain=sum(cmds[0].values()), cmds_sched=sum(cmds[1].values()))
    plain_rt, sched_rt = round_trips(server, r, s)
    p50s = (pct(plain_rt, 50) * 1000, pct(sched_rt, 50) * 1000)
    ratio = p50s[1] / p50s[0]
    out.update(rt_plain_ms=p50s[0], rt_sched_ms=p50s[1])
    note = res.target(f"round trip p50, on / off <= {targets.SCHED_ROUND_TRIP:g}x",
                      ratio <= targets.SCHED_ROUND_TRIP, f"{ratio:.2f}x")
    res.add("round trip p50 (submit -> result, idle no-op worker), scheduling on", p50s[1],
            "ms", f"plain: {p50s[0]:.3f} ms; p99 {pct(sched_rt, 99) * 1000:.3f} against "
            f"{pct(plain_rt, 99) * 1000:.3f} ms; {len(sched_rt)} each, {2 * s.rt_blocks} "
            "blocks in turns")
    res.add("  on / off", ratio, "x", note)
    return out


# -- rate limits and deadlines (benchmarks/limits.py) --------------------------------------------
def bench_rate(server: Server, s: Sizes, res: Results) -> dict[str, float]:
    res.section = ("7. Rate limit: one tenant limited to 1,200 requests a minute (reject), 8 "
                   "producer threads in 2 processes trying every 20 ms each")
    out = limits.rate_limit(server.url, 1200, s.rate_s)
    err = abs(out["rate"] / 1200 - 1)
    note = res.target(f"within {targets.SCHED_RATE:.0%} of the limit", err <= targets.SCHED_RATE,
                      f"{out['rate']:,.0f} / min ({err:.1%} off)")
    res.add("observed rate of accepted submits", out["rate"], "/min",
            f"{out['accepted']:,} accepted over {out['span_s']:.1f} s, less the limit's burst "
            f"of one second; {note}")
    note = res.target(f"refusal p99 <= {targets.SCHED_REFUSAL_P99_MS:g} ms",
                      out["refused_p99_ms"] <= targets.SCHED_REFUSAL_P99_MS,
                      f"{out['refused_p99_ms']:.2f} ms")
    res.add("a refused submit (RateLimited), p99", out["refused_p99_ms"], "ms",
            f"p50 {out['refused_p50_ms']:.2f} ms; {out['refusals']:,} refusals, as the "
            f"producers timed them; {note}")
    res.add("  the same, one producer thread alone", out["alone_p99_ms"], "ms",
            "p99: the floor of a Python client here, without 7 other threads contending "
            "for its process's GIL and the machine's 2 cores (Redis answers the refusal in "
            "one script call either way)")
    return out


def bench_deadlines(server: Server, s: Sizes, res: Results) -> dict[str, float]:
    res.section = ("8. Deadlines at 2x overload: one worker slot serving 200 tasks of cost 50 a "
                   "second, 400 submitted a second, each with deadline=1.0")
    out = limits.deadlines(server.url, 4.0, s.deadline_s)
    note = res.target(f"at least {targets.SCHED_ON_TIME:.0%} of admitted tasks start in time",
                      out["share"] >= targets.SCHED_ON_TIME, f"{out['share']:.2%}")
    res.add("admitted tasks that started before their deadline", out["share"] * 100, "%",
            f"{out['on_time']:,} of {out['admitted']:,} admitted ({out['late']} late or "
            f"expired); {out['refused']:,} refused with WouldMissDeadline; measured rate "
            f"{out['rate_cost_s']:,.0f} cost/s of a {out['capacity_cost_s']:,.0f} capacity; "
            f"{note}")
    return out


# -- the run -------------------------------------------------------------------------------------
#: the steps, as ``--only`` names them
STEPS = ("fair", "priority", "redis", "rate", "deadlines")


def main(argv: list[str] | None = None) -> int:
    ap = cli_parser(__doc__, "~30 s")
    ap.add_argument("--json", type=Path, default=None, help="write the figures there")
    ap.add_argument("--only", choices=STEPS, action="append",
                    help="run only this step (repeatable); writes no docs")
    args = ap.parse_args(argv)
    docs = None if args.only else docs_of(args)
    s = QUICK if args.quick else FULL
    started = time.perf_counter()
    compile_tree()
    server = Server()
    server.start()
    res = Results(unjudged=args.quick)
    data: dict[str, Any] = {}
    try:
        r = server.client()
        steps: list[tuple[str, Callable[[], Any]]] = [
            ("fair share", lambda: data.update(fair=[asdict(f) for f in
                                                     bench_fair(server, r, s, res)])),
            ("priority", lambda: data.update(prio=asdict(bench_prio(server, r, s, res)))),
            ("redis", lambda: data.update(redis=bench_redis(server, r, s, res))),
            ("rate limit", lambda: data.update(rate=bench_rate(server, s, res))),
            ("deadlines", lambda: data.update(deadlines=bench_deadlines(server, s, res))),
        ]
        assert [name.split()[0] for name, _ in steps] == list(STEPS)
        if args.only:
            steps = [step for step in steps if step[0].split()[0] in args.only]
        meter = CpuMeter()
        meter.run(steps)
        machine = machine_info(r, f"other processes {meter.share():.0%} of the CPU")
    finally:
        server.stop()
    seconds = time.perf_counter() - started
    res.print(f"mtq scheduling ({'quick' if args.quick else 'full'} run, {seconds:.0f} s), "
              f"{machine}")
    if args.json:
        data["rows"] = [asdict(row) for row in res.rows]
        data["targets"] = res.targets
        args.json.write_text(json.dumps(data, indent=1, default=str))
    if docs is not None:
        command = "python -m benchmarks.scheduling" + (" --quick" if args.quick else "")
        write_block("scheduling", res.markdown(), command, machine, seconds, docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
