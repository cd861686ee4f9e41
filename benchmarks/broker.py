#!/usr/bin/env python
"""Broker core: mtq's hot paths against raw Redis, on a private redis-server.

    python benchmarks/broker.py            # full run (~1-2 minutes on 2 cores), writes docs
    python benchmarks/broker.py --quick    # ~20 s, prints only (add --docs to write)

In one run: raw LPUSH / LPOP (the baseline); ``Queue.submit`` and ``submit_many``;
claim+ack with ``Consumer.settle_and_claim`` at batch 1, 16 and 64, with and without
streams, and their round trips (counted on the client's socket writes); Redis memory
per waiting task; claim+ack with 10 against 100,000 streams. A quick run judges only the targets its sizes do not change
(round trips, memory per task). Writes the ``broker`` block of docs/benchmarks.md.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import redis

import mtq
from benchmarks import targets
from benchmarks.harness.meters import machine_info, median, rate, spread
from benchmarks.harness.report import Results, cli_args, write_block
from benchmarks.harness.server import ROOT, Counting, Server, compile_tree, uniq
from mtq import serialization
from mtq.broker import scripts

__all__ = ["ROOT", "Server", "compile_tree", "main"]  # Server: benchmarks.against's child

# -- sizes -----------------------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    raw_single: int          # LPUSH / LPOP one per round trip
    raw_pipelined: int       # LPUSH / LPOP pipelined by 1 000
    submit_single: int       # Queue.submit one by one
    submit_many: int         # Queue.submit_many
    submit_streams: int      # streams submit_many spreads over
    claim: dict[int, int]    # batch size -> tasks drained
    claim_streams: int       # streams of the many-streams claim variant
    memory_tasks: int        # memory per waiting task
    memory_streams: int
    scale_batches: int       # claim+ack calls per timed round (5 rounds per stream count)
    scale_big_streams: int   # the large stream count
    scale_per_stream: int    # waiting tasks per stream in the large case
    reps: int                # repetitions of each throughput measurement (median reported)
    raw_reps: int            # repetitions of each raw baseline


FULL = Sizes(raw_single=20_000, raw_pipelined=100_000, submit_single=5_000,
             submit_many=100_000, submit_streams=1_000,
             claim={1: 4_000, 16: 20_000, 64: 40_000}, claim_streams=1_000,
             memory_tasks=100_000, memory_streams=1_000,
             scale_batches=60, scale_big_streams=100_000, scale_per_stream=3,
             reps=3, raw_reps=5)
QUICK = Sizes(raw_single=3_000, raw_pipelined=20_000, submit_single=1_000,
              submit_many=20_000, submit_streams=1_000,
              claim={1: 1_000, 16: 5_000, 64: 10_000}, claim_streams=1_000,
              memory_tasks=20_000, memory_streams=1_000,
              scale_batches=20, scale_big_streams=20_000, scale_per_stream=2,
              reps=1, raw_reps=2)


# -- results ---------------------------------------------------------------------


def ratio(value: float, base: float, label: str) -> str:
    return f"{value / base:.2f}x {label}"


@dataclass
class Sample:
    """One timed run: wall seconds, round trips sent, EVALSHA usec inside Redis."""

    seconds: float
    rts: int
    usec: int
    value: Any = None


def measure(r: redis.Redis, fn: Callable[[], Any]) -> Sample:
    """Time ``fn`` and count its round trips and the EVALSHA time Redis spent on it
    (INFO commandstats, reset first; neither call is inside the timed part)."""
    r.config_resetstat()
    sent = Counting.sent
    t0 = time.perf_counter()
    value = fn()
    seconds = time.perf_counter() - t0
    rts = Counting.sent - sent
    stats = r.info("commandstats").get("cmdstat_evalsha", {})
    return Sample(seconds, rts, int(stats.get("usec", 0)), value)


def payload(i: int) -> dict[str, Any]:
    return {"text": "hello world", "i": i}


def presubmit(q: mtq.Queue, n: int, streams: int = 0,
              make: Callable[[int], Any] = payload) -> list[mtq.Task]:
    if streams:
        items: list[Any] = [mtq.Request(make(i), stream=f"s{i % streams}") for i in range(n)]
    else:
        items = [make(i) for i in range(n)]
    return q.submit_many(items)


# -- 1. baseline -----------------------------------------------------------------
def bench_baseline(r: redis.Redis, s: Sizes, res: Results) -> dict[str, float]:
    res.section = "1. raw Redis baseline"
    msg = serialization.dumps(payload(12345))
    key = uniq("raw")
    chunk = 1000

    def single(cmd: Callable[..., Any], args: tuple[Any, ...], n: int) -> None:
        for _ in range(n):
            cmd(*args)

    def pipelined(name: str, args: tuple[Any, ...], n: int) -> None:
        for start in range(0, n, chunk):
            pipe = r.pipeline(transaction=False)
            method = getattr(pipe, name)
            for _ in range(min(chunk, n - start)):
                method(*args)
            pipe.execute()

    single(r.lpush, (key, msg), 2000)  # warm-up
    single(r.lpop, (key,), 2000)
    runs: dict[str, list[Sample]] = {"push1": [], "pop1": [], "pushP": [], "popP": []}
    n1 = s.raw_single // s.raw_reps
    nP = s.raw_pipelined // s.raw_reps
    for _ in range(s.raw_reps):
        runs["push1"].append(measure(r, partial(single, r.lpush, (key, msg), n1)))
        runs["pop1"].append(measure(r, partial(single, r.lpop, (key,), n1)))
        runs["pushP"].append(measure(r, partial(pipelined, "lpush", (key, msg), nP)))
        runs["popP"].append(measure(r, partial(pipelined, "lpop", (key,), nP)))
    assert r.llen(key) == 0
    r.delete(key)
    out: dict[str, float] = {}
    labels = {
        "push1": (f"raw LPUSH, 1 per round trip ({s.raw_reps} x {n1:,} x {len(msg)} B)", n1, 1),
        "pop1": (f"raw LPOP, 1 per round trip ({s.raw_reps} x {n1:,})", n1, 1),
        "pushP": (f"raw LPUSH, pipelined by {chunk:,} ({s.raw_reps} x {nP:,})", nP, chunk),
        "popP": (f"raw LPOP, pipelined by {chunk:,} ({s.raw_reps} x {nP:,})", nP, chunk),
    }
    for name, (label, n, per_rt) in labels.items():
        rates = [rate(n, x.seconds) for x in runs[name]]
        out[name] = median(rates)
        rts = median([x.rts for x in runs[name]])
        unit = "msg" if per_rt == 1 else "pipeline"
        res.add(label, out[name], "msgs/s",
                f"baseline; {rts / (n / per_rt):.2f} RT per {unit}" + spread(rates))
    return out


# -- 2. submit -------------------------------------------------------------------
def submit_each(q: mtq.Queue, items: Sequence[Any]) -> None:
    for p in items:
        q.submit(p)


def bench_submit(r: redis.Redis, s: Sizes, res: Results, base: dict[str, float]) -> None:
    res.section = "2. submit"
    n = s.submit_single
    runs: list[Sample] = []
    for _ in range(s.reps):
        q = mtq.Queue(uniq("submit1"), client=r)
        q.submit(payload(-1))  # registers the queue (one SADD), outside the timing
        items = [payload(i) for i in range(n)]
        runs.append(measure(r, partial(submit_each, q, items)))
        r.flushdb()
    rates = [rate(n, x.seconds) for x in runs]
    per_s, rts, usec = median(rates), median([x.rts for x in runs]), median([x.usec for x in runs])
    res.add(f"Queue.submit one by one ({s.reps} x {n:,})", per_s, "tasks/s",
            ratio(per_s, base["push1"], "raw LPUSH 1/RT") + f"; {rts / n:.2f} RT/task; Redis "
            f"{usec / n:.1f} us/task" + spread(rates))

    n = s.submit_many
    chunks = -(-n // mtq.client.SUBMIT_CHUNK)
    # A Queue's first submit also reads the queue's stored settings (HGETALL, once per
    # process and queue), registers the queue (SADD) and subscribes this client to
    # the queue's reply channel (a PUBLISH to the client's listener, whose SUBSCRIBE
    # the submit waits for): paid once per Queue, inside the timed call below. Counted here on a fresh Queue's one-task submit_many (minus its chunk).
    first = mtq.Queue(uniq("first"), client=r)
    setup = measure(r, partial(first.submit_many, [payload(0)])).rts - 1
    r.flushdb()
    for streams in (s.submit_streams, 0):
        runs = []
        label = f"over {streams:,} streams" if streams else "stream-less"
        for _ in range(s.reps):
            q = mtq.Queue(uniq("submitN"), client=r)
            many: list[Any]
            if streams:
                many = [mtq.Request(payload(i), stream=f"s{i % streams}") for i in range(n)]
            else:
                many = [payload(i) for i in range(n)]
            runs.append(measure(r, partial(q.submit_many, many)))
            assert len(runs[-1].value) == n
            r.flushdb()
        rates = [rate(n, x.seconds) for x in runs]
        per_s = median(rates)
        rts = int(median([x.rts for x in runs]))
        usec = median([x.usec for x in runs])
        seconds = median([x.seconds for x in runs])
        note = (ratio(per_s, base["pushP"], "raw LPUSH pipelined") + f"; Redis {usec / n:.1f} "
                f"us/task ({usec / seconds / 1e6:.0%} of wall); "
                + res.target(f">= {targets.SUBMIT_MANY:,} tasks/s (submit_many {label})",
                             per_s >= targets.SUBMIT_MANY, f"{per_s:,.0f} tasks/s")
                + spread(rates))
        res.add(f"Queue.submit_many {label} ({s.reps} x {n:,})", per_s, "tasks/s", note)
        res.add(f"  round trips, submit_many {label}", rts / chunks, "RT/1000 tasks",
                f"{rts / n:.4f} RT/task; "
                + res.target(f"1 RT per {mtq.client.SUBMIT_CHUNK:,}-task chunk "
                             f"(submit_many {label})", rts == chunks + setup,
                             f"{rts} RT for {chunks} chunks, incl. a Queue's one-time "
                             f"set-up on its first submit ({setup} RT: the queue's stored "
                             "settings, SADD to the queue registry, subscription to its "
                             "reply channel)", comparable=True))


# -- 3./4. claim + ack -----------------------------------------------------------
def drain(c: mtq.Consumer, batch: int, max_batches: int | None = None
          ) -> tuple[int, int]:
    """Claim and ack until the queue is empty (or after ``max_batches`` claims).

    Returns (tasks, calls): one claim, then one settle_and_claim per batch.
    """
    done, calls = 0, 0
    tasks = c.claim(batch)
    calls += 1
    while tasks:
        done += len(tasks)
        last = max_batches is not None and calls >= max_batches
        _, tasks = c.settle_and_claim([mtq.Outcome(t, ok=True, value=None) for t in tasks],
                                      0 if last else batch)
        calls += 1
        if last:
            break
    return done, calls


def bench_claim(r: redis.Redis, s: Sizes, res: Results, base: dict[str, float]) -> None:
    res.section = "3./4. claim+ack (Consumer.settle_and_claim) and round trips"
    rt_checks: list[tuple[int, str, bool, float]] = []
    for streams in (0, s.claim_streams):
        label = "stream-less" if not streams else f"{streams:,} streams"
        for batch, n in s.claim.items():
            runs: list[Sample] = []
            for _ in range(s.reps):
                qname = uniq(f"claim{batch}")
                q = mtq.Queue(qname, client=r)
                presubmit(q, n, streams)
                c = mtq.Consumer(qname, client=r)
                # its first call reads the queue's stored settings (one HGETALL, once
                # per process and queue, then every 10 s): not a per-batch cost
                _ = c.settings
                runs.append(measure(r, partial(drain, c, batch)))
                done, _calls = runs[-1].value
                assert done == n, (done, n)
                st = q.stats()
                assert (st["succeeded"], st["waiting"], st["running"], st["streams"]) == \
                    (n, 0, 0, 0), st
                r.flushdb()
            rates = [rate(n, x.seconds) for x in runs]
            per_s = median(rates)
            usec = median([x.usec for x in runs])
            seconds = median([x.seconds for x in runs])
            rts, calls = runs[0].rts, runs[0].value[1]
            basekey, baselabel = (("pop1", "raw LPOP 1/RT") if batch == 1
                                  else ("popP", "raw LPOP pipelined"))
            res.add(f"claim+ack batch {batch}, {label} ({s.reps} x {n:,})", per_s, "tasks/s",
                    ratio(per_s, base[basekey], baselabel)
                    + f"; Redis {usec / n:.1f} us/task ({usec / seconds / 1e6:.0%} of wall)"
                    + spread(rates))
            rt_checks.append((batch, label, all(x.rts == x.value[1] for x in runs),
                              rts / calls))
    # the fixed part of a claim call: what it costs Redis when there is nothing to claim
    c = mtq.Consumer(uniq("empty"), client=r)
    k = 2000
    empty = measure(r, lambda: [c.claim(1) for _ in range(k)])
    res.add("  fixed Redis cost of one claim call (empty queue)", empty.usec / k, "us/call",
            f"reap + promote + timers + wake bookkeeping, paid once per batch; "
            f"{empty.seconds / k * 1e6:.0f} us/call wall")
    sizes = sorted({b for b, _, _, _ in rt_checks})
    res.target("constant round trips per batch whatever the batch size (settle_and_claim = 1)",
               all(ok for _, _, ok, _ in rt_checks),
               f"{', '.join(f'{v:.2f}' for _, _, _, v in rt_checks)} RT/batch at batch "
               f"{', '.join(map(str, sizes))}, stream-less and over {s.claim_streams:,} streams",
               comparable=True)
    r.flushdb()


# -- 5. memory -------------------------------------------------------------------
def bench_memory(r: redis.Redis, s: Sizes, res: Results) -> str:
    res.section = "5. Redis memory per waiting task"
    allocator = str(r.info("memory").get("mem_allocator", "?"))
    n = s.memory_tasks
    for streams in (s.memory_streams, 0):
        r.flushdb()
        qname = uniq("mem")
        q = mtq.Queue(qname, client=r)
        q.submit_many([{"i": -1}])  # the queue's one-time set-up, before the measurement
        if streams:
            items: list[Any] = [mtq.Request({"i": i}, stream=f"s{i % streams}") for i in range(n)]
        else:
            items = [{"i": i} for i in range(n)]
        payload_bytes = sum(len(serialization.dumps({"i": i})) for i in range(n))
        time.sleep(0.05)
        before = int(r.info("memory")["used_memory"])
        tasks = q.submit_many(items)
        after = int(r.info("memory")["used_memory"])
        per_task = (after - before) / n
        beyond = per_task - payload_bytes / n
        label = f"over {streams:,} streams" if streams else "stream-less"
        sample = r.memory_usage(q.broker.keys.task(tasks[n // 2].id)) or 0
        res.add(f"used_memory per waiting task, {label} ({n:,} x {{'i': i}})", per_task,
                "bytes/task", f"payload {payload_bytes / n:.1f} B/task on average; "
                f"MEMORY USAGE of one task hash: {sample} B")
        res.add(f"  beyond the encoded payload, {label}", beyond, "bytes/task",
                res.target(f"<= {targets.MEMORY_BEYOND} B/task beyond the payload ({label})",
                           beyond <= targets.MEMORY_BEYOND,
                           f"{beyond:.0f} B/task beyond the payload, allocator {allocator}",
                           comparable=True))
    r.flushdb()
    return allocator


# -- 6. claim stays O(batch) -----------------------------------------------------
def bench_scale(r: redis.Redis, s: Sizes, res: Results) -> None:
    res.section = "6. claim+ack vs number of streams (batch 64)"
    batch = 64
    rounds = 5
    tasks_needed = batch * (s.scale_batches * rounds + 4)
    cases = [(10, -(-tasks_needed // 10)), (100, -(-tasks_needed // 100)),
             (s.scale_big_streams, s.scale_per_stream)]
    # All three queues live in the server at once and are measured in interleaved
    # rounds (median per case), so heap state and machine noise hit them alike.
    consumers: dict[int, mtq.Consumer] = {}
    for streams, per_stream in cases:
        qname = uniq(f"scale{streams}")
        q = mtq.Queue(qname, client=r)
        presubmit(q, streams * per_stream, streams, make=lambda i: {"i": i})
        consumers[streams] = c = mtq.Consumer(qname, client=r)
        drain(c, batch, max_batches=2)  # untimed warm-up
    samples: dict[int, list[tuple[float, float, float]]] = {st: [] for st, _ in cases}
    for _ in range(rounds):
        for streams, _per in cases:
            c = consumers[streams]
            m = measure(r, partial(drain, c, batch, max_batches=s.scale_batches))
            done, calls = m.value
            samples[streams].append((m.seconds / done * 1e6, m.usec / done, done / (calls - 1)))

    per_task: dict[int, float] = {}
    redis_per_task: dict[int, float] = {}
    for streams, per_stream in cases:
        walls = [w for w, _, _ in samples[streams]]
        per_task[streams] = median(walls)
        redis_per_task[streams] = median([u for _, u, _ in samples[streams]])
        per_claim = median([k for _, _, k in samples[streams]])
        res.add(f"claim+ack batch 64, {streams:,} streams x {per_stream:,} waiting",
                per_task[streams], "us/task",
                f"{per_claim:.1f} tasks per claim; {1e6 / per_task[streams]:,.0f} tasks/s; "
                f"Redis {redis_per_task[streams]:.1f} us/task; median of {rounds} rounds "
                f"(wall {min(walls):.1f}-{max(walls):.1f})")
    big = s.scale_big_streams
    for small in (10, 100):
        k = per_task[big] / per_task[small]
        kr = redis_per_task[big] / redis_per_task[small]
        if small == 10:
            # With 10 streams a claim can return only 10 tasks (one per stream: a
            # stream's next task waits for the ack), so the per-round-trip client cost
            # is spread over 10 tasks instead of 64; compare the Redis-side cost.
            judged, what = kr, "Redis-side (EVALSHA usec) per task"
        else:
            judged, what = k, "wall time per task"
        ok = 1 / targets.SCALE_RATIO <= judged <= targets.SCALE_RATIO
        res.add(f"  ratio {big:,} streams / {small} streams (per task)", k, "x",
                f"Redis-side {kr:.2f}x; "
                + res.target(f"about the same per task, {big:,} vs {small} streams "
                             f"(within {targets.SCALE_RATIO}x, {what})", ok,
                             f"wall {k:.2f}x, Redis-side {kr:.2f}x"))
    r.flushdb()


# -- output ----------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    quick, docs = cli_args(argv, __doc__, "~20 s")
    sizes = QUICK if quick else FULL
    compile_tree()
    server = Server()
    server.start()
    started = time.perf_counter()
    try:
        r = server.client()
        scripts.load_all(r)
        r.flushall()
        res = Results(unjudged=quick)
        base: dict[str, float] = {}
        steps: list[tuple[str, Callable[[], Any]]] = [
            ("baseline", lambda: base.update(bench_baseline(r, sizes, res))),
            ("submit", lambda: bench_submit(r, sizes, res, base)),
            ("claim+ack", lambda: bench_claim(r, sizes, res, base)),
            ("memory", lambda: bench_memory(r, sizes, res)),
            ("streams scale", lambda: bench_scale(r, sizes, res)),
        ]
        for name, step in steps:
            t0 = time.perf_counter()
            print(f"running {name}...", end=" ", flush=True)
            step()
            print(f"{time.perf_counter() - t0:.1f} s", flush=True)
        seconds = time.perf_counter() - started
        machine = machine_info(r)
        res.print(f"mtq broker core ({'quick' if quick else 'full'} run, {seconds:.0f} s), {machine}")
        if docs is not None:
            command = "python benchmarks/broker.py" + (" --quick" if quick else "")
            write_block("broker", res.markdown(), command, machine, seconds, docs)
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
