"""Claims sized to the work (mtq.workers.claims): slow plain functions spread over the
idle workers of ``mtq workers start`` with default settings; fast ones still claim
full batches."""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from itertools import pairwise
from typing import Any

import redis

import mtq
from benchmarks.children.nap import nap
from mtq.workers.model import FunctionModel
from mtq.workers.registry import list_workers
from tests.support.supervisors import StartFn
from tests.support.waits import wait_for
from tests.support.workers import FAST, make_worker, serving

NAP = "benchmarks.children.nap:nap"
REPLICAS = 5
#: the seed case: 20 tasks of 0.5 s over 5 workers is 2.0 s spread evenly; one worker
#: holding them all (a claim of a whole batch) takes 10 s: the bound fails for that
BOUND_S = 5.0


def test_slow_plain_function_spreads_over_idle_workers_in_order(
        qname: str, redis_url: str, r: redis.Redis, supervise: StartFn) -> None:
    sup = supervise(NAP, qname, "--replicas", str(REPLICAS))
    wait_for(lambda: len([w for w in list_workers(r, qname) if w["state"] == "idle"])
             >= REPLICAS, 90, f"{REPLICAS} idle workers did not register:\n{sup.output()}")
    q = mtq.Queue(qname, redis_url)
    # the seed case: a burst of stream-less tasks, submitted at once
    t0 = time.time()
    tasks = q.submit_many([{"i": i, "s": 0.5} for i in range(20)])
    results: list[dict[str, Any]] = [t.result(timeout=60) for t in tasks]
    took = max(res["end"] for res in results) - t0
    per_pid = Counter(res["pid"] for res in results)
    assert len(per_pid) == REPLICAS, f"ran on {len(per_pid)} workers only: {per_pid}"
    assert took <= BOUND_S, f"20 tasks of 0.5 s over {REPLICAS} workers took {took:.2f} s"
    assert sorted(res["i"] for res in results) == list(range(20))
    # order per stream: 5 streams of 4, each started in submit order, one at a time
    streamed = q.submit_many([mtq.Request({"i": i, "s": 0.2}, stream=f"s{i % 5}")
                              for i in range(20)])
    runs = [t.result(timeout=60) for t in streamed]
    by_stream: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for res in runs:
        by_stream[res["i"] % 5].append(res)
    for s, rs in by_stream.items():
        # (in submit order) each started after the one before it ended
        assert all(a["end"] <= b["start"] for a, b in pairwise(rs)), \
            f"stream s{s} ran out of order or overlapped: {rs}"
    # nothing lost, nothing run twice: each task started once
    for t in tasks + streamed:
        info = t.info()
        assert info.status == "succeeded" and info.deliveries == 1, info


def test_a_fast_function_grows_to_full_claims_and_a_slow_one_claims_one(
        qname: str, redis_url: str) -> None:
    """A fresh worker of a plain function claims one task, then claims sized by its
    measured time per task: a function that returns in microseconds reaches full
    batches of 64 on a deep backlog (most of its tasks run in them); one that takes
    50 ms claims one task at a time (CLAIM_AHEAD_S holds less than one)."""
    q = mtq.Queue(qname, redis_url, settings=FAST)
    n = 3000
    q.submit_many([{"i": i} for i in range(n)])
    w = make_worker(FunctionModel(lambda p: p["i"]), qname, redis_url)
    assert w.slot.unit() == 1  # not measured yet
    with serving(w) as run:
        wait_for(lambda: q.stats()["succeeded"] == n, 60, "the backlog did not drain")
        run.stop()
    assert w.hist[64] * 64 >= n * 0.8, f"few full batches: {dict(w.hist)}"
    assert min(w.hist) == 1  # its first claim
    assert w.slot.unit() == 64

    slow_q = mtq.Queue(qname + "-slow", redis_url, settings=FAST)
    tasks = slow_q.submit_many([{"i": i} for i in range(6)])
    slow = make_worker(FunctionModel(lambda p: time.sleep(0.05) or p["i"]),
                       qname + "-slow", redis_url)
    with serving(slow) as run:
        wait_for(lambda: slow_q.stats()["succeeded"] == 6, 30, "6 slow tasks did not run")
        run.stop()
    assert [t.result(timeout=1) for t in tasks] == list(range(6))
    assert dict(slow.hist) == {1: 6}, "a slow function ran more than one task a batch"
    assert slow.slot.unit() == 1 and slow.dynamic.claims.task_s is not None \
        and slow.dynamic.claims.task_s >= 0.04


def test_a_worker_that_took_a_burst_while_fast_gives_back_the_rest_after_a_slow_task(
        qname: str, redis_url: str) -> None:
    """A worker whose function looked fast claims (or is handed) a whole burst; after
    its first slow task it ends that batch and gives back what is beyond its claims
    now sized to the work: a worker started after the burst runs most of it. Each task
    runs once (no delivery counted for a give-back)."""
    q = mtq.Queue(qname, redis_url, settings=FAST)

    def handle(p: dict[str, Any]) -> Any:
        return nap(p) if p["s"] else p["i"]

    first = make_worker(FunctionModel(handle), qname, redis_url)
    second = make_worker(FunctionModel(handle), qname, redis_url)
    with serving(first) as run:
        warm = q.submit_many([{"i": i, "s": 0} for i in range(200)])
        assert [t.result(timeout=30) for t in warm] == list(range(200))
        assert first.slot.unit() == 64
        burst = q.submit_many([{"i": i, "s": 0.2} for i in range(20)])
        wait_for(lambda: first.dynamic.claims.task_s is not None
                 and first.dynamic.claims.task_s > 0.1, 10, "no slow task ran")
        with serving(second) as run2:
            done = [t.result(timeout=60) for t in burst]
            run2.stop()
        run.stop()
    pids = Counter(res["pid"] for res in done)
    assert len(pids) == 1  # (both in this process: counted by the workers below)
    ran_first = sum(1 for t in burst if t.info().worker == first.worker_id)
    # two workers: about 10 each (keeping the burst: all 20 on the first)
    assert ran_first <= 14, f"the first worker kept {ran_first} of 20"
    for t in burst:
        info = t.info()
        assert info.status == "succeeded" and info.deliveries == 1, info
