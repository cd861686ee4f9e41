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
from mtq.workers.registry import list_workers
from tests.support.supervisors import StartFn
from tests.support.waits import wait_for

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
