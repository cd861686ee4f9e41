"""The ``spread`` section of ``python -m benchmarks.control``: slow plain functions
spread over idle workers (mtq.workers.claims).

The seed case: ``mtq workers start benchmarks.children.nap:nap --replicas 5`` with
default settings, all five idle; 20 stream-less tasks that each sleep 0.5 s submitted
in one ``submit_many``; timed from the submit to the last task's end (the function's
own clock: the same host). Run ``rounds`` times on the same workers; the median is the
figure. Evenly spread it takes 4 x 0.5 = 2.0 s; one worker running all 20 takes 10 s.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from typing import Any

import redis

import mtq
from benchmarks.harness.procs import Proc, wait_for, worker_env
from benchmarks.harness.server import Server, uniq
from mtq.workers.registry import list_workers

#: the seed case's target: submit to last result (s)
SPREAD_TARGET_S = 2.5
NAP = "benchmarks.children.nap:nap"


def seed_round(q: mtq.Queue, tasks: int, task_s: float) -> tuple[float, Counter[int]]:
    """One burst: (seconds from submit to the last end, tasks per worker process)."""
    t0 = time.time()
    handles = q.submit_many([{"i": i, "s": task_s} for i in range(tasks)])
    results: list[dict[str, Any]] = [t.result(timeout=120) for t in handles]
    took = max(r["end"] for r in results) - t0
    return took, Counter(r["pid"] for r in results)


def measure_spread(quick: bool = False, *, replicas: int = 5, tasks: int = 20,
                   task_s: float = 0.5, rounds: int | None = None,
                   target_s: float = SPREAD_TARGET_S) -> dict[str, Any]:
    """The seed case (see the module's docstring): rows and the target."""
    rounds = rounds or (1 if quick else 3)
    server = Server()
    server.start()
    name = uniq("spread")
    r = redis.Redis.from_url(server.url)
    p = Proc(["workers", "start", NAP, "--queue", name, "--redis", server.url,
              "--replicas", str(replicas)], worker_env(server.url))
    try:
        wait_for(f"{replicas} idle workers", lambda: sum(
            w.get("state") == "idle" for w in list_workers(r, name)) >= replicas, 120, [p],
            every=0.2)
        q = mtq.Queue(name, client=r)
        runs = [seed_round(q, tasks, task_s) for _ in range(rounds)]
    finally:
        p.stop()
        p.close()
        mtq.replies.hub_of(r).close_all()
        r.close()
        server.stop()
    took = [t for t, _ in runs]
    used = [len(c) for _, c in runs]
    most = [max(c.values()) for _, c in runs]
    figure = statistics.median(took)
    ideal = -(-tasks // replicas) * task_s
    rows: list[tuple[str, float | None, str, str]] = [
        (f"{tasks} tasks of {task_s} s over {replicas} replicas, submit to last result",
         figure, "s", f"median of {rounds}: {', '.join(f'{t:.2f}' for t in took)}; "
                      f"{ideal:.1f} s spread evenly, {tasks * task_s:.0f} s on one worker"),
        ("  workers that ran some of them", min(used), "workers",
         f"least of {rounds} rounds (of {replicas})"),
        ("  most tasks on one worker", max(most), "tasks",
         f"most of {rounds} rounds ({-(-tasks // replicas)} spread evenly)"),
    ]
    return {"rows": rows, "seconds": figure, "workers": min(used),
            "targets": [(f"{tasks} tasks of {task_s} s over {replicas} replicas in at most "
                         f"{target_s} s (default settings)", figure <= target_s,
                         f"{figure:.2f} s, median of {rounds}", True)]}
