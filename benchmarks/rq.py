#!/usr/bin/env python
"""RQ interoperability: jobs enqueued by plain RQ, drained by ``rq worker`` and by
``mtq rq worker`` in the same run.

    python -m benchmarks.rq            # ~4 minutes on 2 cores, writes the rq block
    python -m benchmarks.rq --quick    # ~1 minute, prints only (add --docs to write)
    python -m benchmarks.rq --no-pin   # let Linux place the processes

Run it as a module: as a file, its name would hide the ``rq`` package. Jobs are
enqueued by RQ itself (``enqueue_many`` on pipelines, RQ's JSON serializer, default
``result_ttl``); redis-server is pinned to CPU 0, this script and the workers to CPU 1.
(1) no-op jobs drained by ``rq worker --burst`` (SimpleWorker) and ``mtq rq worker
--burst``, results kept: jobs/s, Redis commands and CPU per job, every job finished; (2) MiniLM on
single-sentence jobs (``benchmarks.children.rq_jobs.embed``) against the model's own
batch-32 rate in this process, in turns.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if not __package__:
    sys.exit("run it as a module: python -m benchmarks.rq (as a file it hides the rq package)")

import redis
import rq
from rq.job import Job
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer
from rq.utils import utcparse

from benchmarks import targets
from benchmarks.batching import sentences
from benchmarks.harness.meters import CpuMeter, machine_info, median, spread
from benchmarks.harness.procs import Proc, worker_env
from benchmarks.harness.report import Results, cli_parser, docs_of, write_block
from benchmarks.harness.server import Server, compile_tree

BATCH = 32                    # benchmarks.children.rq_jobs.embed's max_batch_size
NOOP = "benchmarks.children.rq_jobs.noop"
EMBED = "benchmarks.children.rq_jobs.embed"
CHUNK = 1000                  # jobs per enqueue_many pipeline


@dataclass(frozen=True)
class Sizes:
    noop_rq: int       # no-op jobs per rq drain (~300/s: several seconds)
    noop_mtq: int      # no-op jobs per mtq drain
    noop_reps: int     # interleaved rq / mtq drains (median reported)
    corpus: int        # sentences of the direct pass
    mini_rq: int       # single-sentence jobs per rq chunk
    mini_mtq: int      # per mtq chunk
    mini_reps: int     # turns of direct pass, rq chunk, mtq chunk
    quiet_s: float     # longest wait for a quiet machine before each step


FULL = Sizes(noop_rq=2_000, noop_mtq=20_000, noop_reps=3, corpus=640, mini_rq=320,
             mini_mtq=640, mini_reps=3, quiet_s=20)
QUICK = Sizes(noop_rq=1_000, noop_mtq=10_000, noop_reps=1, corpus=320, mini_rq=160,
              mini_mtq=320, mini_reps=1, quiet_s=3)


# -- processes -----------------------------------------------------------------------
def rq_worker(side: str, queue: str, url: str, env: dict[str, str], burst: bool,
              extra: Sequence[str] = ()) -> Proc:
    """``rq worker`` (SimpleWorker) or ``mtq rq worker`` on ``queue``, RQ's JSON serializer."""
    if side == "rq":
        program = [str(Path(sys.executable).parent / "rq"), "worker", "--url", url,
                   "--worker-class", "rq.worker.SimpleWorker", "--serializer",
                   "rq.serializers.JSONSerializer", "--logging_level", "WARNING"]
    else:
        program = [sys.executable, "-m", "mtq", "rq", "worker", "--url", url, "--serializer",
                   "json", *extra]
    return Proc([*(["--burst"] if burst else []), queue], env, program)


# -- RQ jobs -------------------------------------------------------------------------
def rq_queue(r: redis.Redis, name: str) -> rq.Queue:
    return rq.Queue(name, connection=r, serializer=JSONSerializer)


def enqueue(q: rq.Queue, func: str, args: Sequence[tuple[Any, ...]]
            ) -> tuple[list[str], float]:
    """RQ's bulk path, ``CHUNK`` jobs per pipeline, RQ's default ``result_ttl``: (job ids
    in order, seconds)."""
    ids: list[str] = []
    t0 = time.perf_counter()
    for i in range(0, len(args), CHUNK):
        datas = [rq.Queue.prepare_data(func, args=a) for a in args[i:i + CHUNK]]
        with q.connection.pipeline() as pipe:
            ids += [j.id for j in q.enqueue_many(datas, pipeline=pipe)]
            pipe.execute()
    return ids, time.perf_counter() - t0


@dataclass
class Jobs:
    """What RQ's job hashes say about a set of jobs."""

    n: int
    finished: int
    failed: int                        # in the queue's FailedJobRegistry
    statuses: dict[str, int]
    started: list[float]               # epoch seconds (the worker's clock, us resolution)
    ended: list[float]


def read_jobs(r: redis.Redis, queue: str, ids: Sequence[str]) -> Jobs:
    """The jobs' hashes (and ``queue``'s FailedJobRegistry, unless it is empty)."""
    pipe = r.pipeline(transaction=False)
    for i in ids:
        pipe.hmget(f"rq:job:{i}", "status", "started_at", "ended_at")
    statuses: dict[str, int] = {}
    started: list[float] = []
    ended: list[float] = []
    for status, s, e in pipe.execute():
        key = status.decode() if status else "missing"
        statuses[key] = statuses.get(key, 0) + 1
        if s:
            started.append(utcparse(s.decode()).timestamp())
        if e:
            ended.append(utcparse(e.decode()).timestamp())
    failed = len(FailedJobRegistry(queue, connection=r)) if queue else 0
    return Jobs(len(ids), statuses.get("finished", 0), failed, statuses, started, ended)


def wait_finished(r: redis.Redis, w: Proc, ids: Sequence[str], timeout: float) -> None:
    """Until the last job (FIFO: the last to run on both sides) and then all are done."""
    deadline = time.monotonic() + timeout
    last = f"rq:job:{ids[-1]}"
    while True:
        if r.hget(last, "status") in (b"finished", b"failed"):
            st = read_jobs(r, "", ids).statuses
            if st.get("finished", 0) + st.get("failed", 0) == len(ids):
                return
        if w.proc.poll() is not None:
            raise w.fail(f"worker exited ({w.proc.returncode}) before its jobs were done")
        if time.monotonic() > deadline:
            raise w.fail(f"jobs not done after {timeout:.0f} s")
        time.sleep(0.02)


def redis_usage(r: redis.Redis) -> tuple[dict[str, int], float]:
    """(calls per command, INFO commandstats: commands run by Lua scripts included;
    redis-server user+sys CPU seconds)."""
    stats = r.info("commandstats")
    cpu = r.info("cpu")
    calls = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}
    return calls, float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


# -- 1. no-op drain ------------------------------------------------------------------
@dataclass
class Drain:
    n: int
    rate: float            # jobs/s, the warm-up job's end -> the last job's end (ended_at)
    enqueue_rate: float
    cmds: float            # Redis commands per job (over the worker's whole life)
    cpu_us: float          # redis-server CPU per job
    top: dict[str, float]  # the most frequent commands, per job
    jobs: Jobs
    left: int              # jobs still in the queue after the burst worker exited

    def ok(self) -> bool:
        """Every job finished, none failed, none left in the queue."""
        return self.jobs.finished == self.n and self.jobs.failed == 0 and self.left == 0


def noop_drain(r: redis.Redis, url: str, env: dict[str, str], side: str, n: int) -> Drain:
    """Enqueue one warm-up job then ``n`` no-op jobs, run one burst worker until it
    exits: jobs/s from the warm-up job's end to the last job's end (``ended_at``)."""
    r.flushall()
    q = rq_queue(r, "noop")
    (warm,), _ = enqueue(q, NOOP, [()])
    ids, enq_s = enqueue(q, NOOP, [()] * n)
    r.config_resetstat()
    _, cpu0 = redis_usage(r)
    w = rq_worker(side, "noop", url, env, burst=True)
    try:
        if w.wait(60 + n / 20) != 0:
            raise w.fail(f"worker exited with {w.proc.returncode}")
    finally:
        w.close()
    calls, cpu1 = redis_usage(r)
    for k in ("info", "config", "config|resetstat"):
        calls.pop(k, None)
    jobs = read_jobs(r, "noop", ids)
    (t0,) = read_jobs(r, "", [warm]).ended or [math.nan]
    rate = n / (max(jobs.ended) - t0) if len(jobs.ended) == n else math.nan
    top = dict(sorted(((k, v / (n + 1)) for k, v in calls.items()), key=lambda kv: -kv[1])[:6])
    left = len(q)
    r.flushall()
    return Drain(n, rate, n / enq_s, sum(calls.values()) / (n + 1),
                 1e6 * (cpu1 - cpu0) / (n + 1), top, jobs, left)


LABELS = {"rq": "rq worker (SimpleWorker)", "mtq": "mtq rq worker"}


def bench_noop(r: redis.Redis, url: str, env: dict[str, str], s: Sizes, res: Results
               ) -> None:
    res.section = "1. no-op jobs enqueued by RQ, one worker process (burst)"
    sides = {"rq": s.noop_rq, "mtq": s.noop_mtq}
    runs: dict[str, list[Drain]] = {k: [] for k in sides}
    for _ in range(s.noop_reps):  # interleaved: a change in the machine hits both
        for side, n in sides.items():
            runs[side].append(noop_drain(r, url, env, side, n))
    rates: dict[str, float] = {}
    for side, drains in runs.items():
        rates[side] = rate = median([d.rate for d in drains])
        vs = f"{rate / rates['rq']:.1f}x rq" if side == "mtq" else "rq = 1.00x"
        res.add(f"{LABELS[side]}, results kept ({len(drains)} x {drains[0].n:,} jobs)", rate,
                "jobs/s", vs + "; warm-up job's end -> last job's end (ended_at)"
                + spread([d.rate for d in drains]))
        res.add("  Redis commands / CPU per job", median([d.cmds for d in drains]), "cmds/job",
                f"{median([d.cpu_us for d in drains]):,.0f} us of Redis CPU per job; most "
                "commands: " + ", ".join(f"{k} {x:.1f}" for k, x in drains[0].top.items()))
        bad = [d for d in drains if not d.ok()]
        res.target(f"every job done, none failed ({LABELS[side]}, no-op)", not bad,
                   f"{sum(d.n for d in drains):,} jobs; " + ("; ".join(
                       f"statuses {d.jobs.statuses}, {d.jobs.failed} failed, {d.left} left "
                       "in the queue" for d in bad) or "all finished"), comparable=True)
    res.add("RQ enqueue_many (JSON serializer, pipelines of 1,000)",
            median([d.enqueue_rate for d in runs["rq"]]), "jobs/s",
            "the producer side, the same for both workers")
    what = f">= {targets.RQ_NOOP_RATIO:.0f}x rq SimpleWorker's no-op throughput (results kept)"
    ratio = rates["mtq"] / rates["rq"]
    res.target(what, ratio >= targets.RQ_NOOP_RATIO,
               f"{rates['mtq']:,.0f} vs {rates['rq']:,.0f} jobs/s: {ratio:.1f}x")


# -- 2. MiniLM -----------------------------------------------------------------------
def direct_pass(texts: Sequence[str]) -> float:
    """The model called in this process in batches of 32: sentences/s."""
    from benchmarks.children.rq_jobs import encode

    t0 = time.perf_counter()
    for i in range(0, len(texts), BATCH):
        encode(texts[i:i + BATCH])
    return len(texts) / (time.perf_counter() - t0)


def chunk(r: redis.Redis, w: Proc, queue: str, texts: Sequence[str]
          ) -> tuple[float, float, Jobs]:
    """Enqueue ``texts`` as single-sentence jobs at once to a warm, idle worker:
    (sentences/s from the jobs' first ``started_at`` to their last ``ended_at``, NaN if
    a job has none; sentences/s from the enqueue to this script seeing them all done,
    polled every 20 ms; the jobs)."""
    t0 = time.perf_counter()
    ids, _ = enqueue(rq_queue(r, queue), EMBED, [(t,) for t in texts])
    wait_finished(r, w, ids, 60 + len(texts) / 5)
    seen = len(texts) / (time.perf_counter() - t0)
    jobs = read_jobs(r, queue, ids)
    n = len(texts)
    ts = (n / (max(jobs.ended) - min(jobs.started))
          if len(jobs.ended) == n and len(jobs.started) == n else math.nan)
    check_results(r, ids, texts, w)
    return ts, seen, jobs


def check_results(r: redis.Redis, ids: Sequence[str], texts: Sequence[str], w: Proc) -> None:
    """A few results, read through RQ's API, match the model called here."""
    from benchmarks.children.rq_jobs import encode

    for k in (0, len(ids) // 2, len(ids) - 1):
        job = Job.fetch(ids[k], connection=r, serializer=JSONSerializer)
        got = job.return_value()
        want = encode([texts[k]])[0]
        if not isinstance(got, list) or len(got) != len(want):
            raise w.fail(f"job {k}: result is not a {len(want)}-float list: {str(got)[:80]}")
        cos = sum(a * b for a, b in zip(got, want))
        if cos < 0.999:
            raise w.fail(f"job {k}: embedding differs from the model's (cosine {cos:.4f})")


def bench_minilm(r: redis.Redis, url: str, env: dict[str, str], s: Sizes, res: Results,
                 threads: int) -> None:
    res.section = (f"2. all-MiniLM-L6-v2 on the CPU ({threads} torch thread(s)), "
                   "single-sentence RQ jobs")
    corpus = sentences(s.corpus)
    direct_pass(corpus[:2 * BATCH])  # load + warm-up in this process
    workers: dict[str, Proc] = {}
    runs: dict[str, list[float]] = {"direct": [], "rq": [], "mtq": []}
    seen: dict[str, list[float]] = {"rq": [], "mtq": []}
    jobs: dict[str, list[Jobs]] = {"rq": [], "mtq": []}
    sizes = {"rq": s.mini_rq, "mtq": s.mini_mtq}
    r.flushall()
    try:
        for side in sizes:
            workers[side] = rq_worker(side, f"mini-{side}", url, env, burst=False,
                                      extra=("--devices", "cpu"))
        for side, w in workers.items():  # model load + warm-up, not timed
            chunk(r, w, f"mini-{side}", corpus[:2 * BATCH])
        for _ in range(s.mini_reps):  # in turns: a change in the machine hits all three
            runs["direct"].append(direct_pass(corpus))
            for side, w in workers.items():
                texts = [corpus[i % len(corpus)] for i in range(sizes[side])]
                rate, seen_rate, js = chunk(r, w, f"mini-{side}", texts)
                runs[side].append(rate)
                seen[side].append(seen_rate)
                jobs[side].append(js)
        for w in workers.values():
            w.stop()
            if w.proc.returncode not in (0, -signal.SIGTERM, 128 + signal.SIGTERM):
                raise w.fail(f"worker exited with {w.proc.returncode} on SIGTERM")
    finally:
        for w in workers.values():
            w.close()
        r.flushall()
    by_ts = all(not math.isnan(x) for side in sizes for x in runs[side])
    if not by_ts:  # a side wrote no timestamps: the same polled method for both sides
        for side in sizes:
            runs[side] = seen[side]
    direct = median(runs["direct"])
    res.add(f"the model itself, batch 32, in this process ({s.mini_reps} x {len(corpus)})",
            direct, "sentences/s", "ceiling (= 100%)" + spread(runs["direct"]))
    labels = {"rq": "rq worker (SimpleWorker), a batch of one per job",
              "mtq": "mtq rq worker, batched (<= 32, max_wait 5 ms)"}
    for side in sizes:
        rate = median(runs[side])
        n_all = sum(j.n for j in jobs[side])
        bad = n_all - sum(j.finished for j in jobs[side]) + sum(j.failed for j in jobs[side])
        note = f"{rate / direct:.0%} of the model's batch-32 rate"
        if side == "mtq":
            note += f"; {rate / median(runs['rq']):.2f}x rq"
        res.add(f"{labels[side]} ({s.mini_reps} x {sizes[side]} jobs)", rate, "sentences/s",
                note + ("; first start -> last end of each chunk" if by_ts else
                        "; enqueue -> all seen done") + spread(runs[side]))
        res.target(f"every job finished, none failed ({side}, MiniLM)", bad == 0,
                   f"{bad} of {n_all} not finished or failed", comparable=True)
    ratio = median(runs["mtq"]) / direct
    res.target(f"mtq rq worker >= {targets.RQ_CEILING:.0%} of the model's own batch-32 rate",
               ratio >= targets.RQ_CEILING,
               f"{median(runs['mtq']):.0f} vs {direct:.0f} sentences/s: {ratio:.0%}; "
               f"{median(runs['mtq']) / median(runs['rq']):.2f}x rq worker")


# -- main ----------------------------------------------------------------------------


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = cli_parser(__doc__, "~1 minute")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="redis-server on CPU 0, this script and the workers on CPU 1 "
                         "(default; --no-pin lets Linux place them)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads in every process running the model (default: the "
                         "CPUs this script may use, 1 when pinned)")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse(argv)
    docs = docs_of(a)
    s = QUICK if a.quick else FULL
    if a.pin and len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("--pin needs 2 CPUs; use --no-pin")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    cpus = sorted(os.sched_getaffinity(0))
    compile_tree()
    server = Server()
    if a.pin:  # redis-server inherits CPU 0; then this script, and every worker, CPU 1
        os.sched_setaffinity(0, {cpus[0]})
    server.start()
    if a.pin:
        os.sched_setaffinity(0, {cpus[1]})
    threads = a.threads or len(os.sched_getaffinity(0))
    os.environ["MTQ_BENCH_TORCH_THREADS"] = str(threads)
    started = time.perf_counter()
    try:
        r = redis.Redis.from_url(server.url)
        t = time.perf_counter()
        for _ in range(1000):
            r.ping()
        rtt_us = (time.perf_counter() - t) * 1000
        env = worker_env(server.url, MTQ_BENCH_TORCH_THREADS=str(threads), PYTHONUNBUFFERED="1")
        res = Results()
        steps: list[tuple[str, Callable[[], Any]]] = [
            ("no-op drain", lambda: bench_noop(r, server.url, env, s, res)),
            ("MiniLM", lambda: bench_minilm(r, server.url, env, s, res, threads)),
        ]
        meter = CpuMeter()
        meter.run(steps, s.quiet_s)
        seconds = time.perf_counter() - started
        import torch

        machine = machine_info(r, f"rq {rq.__version__}, torch {torch.__version__} ({threads} "
                               "thread(s))", f"redis-server pinned to CPU {cpus[0]}, the rest "
                               f"to CPU {cpus[1]}" if a.pin else "not pinned",
                               f"PING {rtt_us:.0f} us",
                               f"other processes {meter.share():.0%} of the CPU")
        res.print(f"RQ interoperability ({'quick' if a.quick else 'full'} run, {seconds:.0f} s), "
                  f"{machine}")
        if docs is None:
            return 0
        command = "python -m benchmarks.rq" + (" --quick" if a.quick else "") + (
            "" if a.pin else " --no-pin")
        write_block("rq", res.markdown(), command, machine, seconds, docs)
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
