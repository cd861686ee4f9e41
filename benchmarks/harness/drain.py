"""One worker draining pre-submitted tasks: the drain every benchmark that needs one runs
(batching, cache, observability, gpu)."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

import mtq
from benchmarks.harness.meters import proc_cpu
from benchmarks.harness.procs import Proc, wait_for, worker_env
from benchmarks.harness.server import Server, uniq


def task_fields(r: redis.Redis, q: mtq.Queue, tasks: Sequence[mtq.Task],
                *names: str) -> list[list[int | None]]:
    """The integer fields ``names`` of each task's hash (None where unset)."""
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
          burst: bool = False, timeout: float = 180, args: Sequence[str] = (),
          prepare: Callable[[mtq.Queue], object] | None = None) -> Drain:
    """Pre-submit the payloads as single tasks to a fresh queue (``prepare`` configures
    it first), then drain them with one ``mtq worker run`` process (``args`` added to
    its command line: ``--device cuda:0``, say), stopped with SIGTERM once everything
    succeeded (or, with ``burst``, run with --burst so that it exits by itself)."""
    qname = uniq("drain")
    q = mtq.Queue(qname, client=r)
    if prepare is not None:
        prepare(q)
    tasks = q.submit_many(payloads)
    timings = tempfile.NamedTemporaryFile(prefix="mtq-bench-", suffix=".json", delete=False)
    timings.close()
    r.config_resetstat()
    redis_pid = server.proc.pid if server.proc else 0
    redis_cpu = proc_cpu(redis_pid)
    t0 = time.perf_counter()
    p = Proc(["worker", "run", target, "--queue", qname, "--redis", server.url,
              "--max-batch-size", str(batch), *(["--burst"] if burst else []), *args],
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
