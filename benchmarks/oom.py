#!/usr/bin/env python
"""Out of memory: good-task throughput while one task in every 50 runs out of memory,
against the same run without.

    python -m benchmarks.oom            # 3 turns of each, 8,000 good tasks a turn
    python -m benchmarks.oom --quick    # 2 turns of each, 3,000 good tasks a turn

A ``mtq worker run`` process serves ``benchmarks.children.oom:Mlp`` (a torch MLP in
batches of 32, about 4 ms a batch on one core), on a queue with the default settings
but a retry backoff of 20 ms (at most 100 ms): a poison task's three retries run within
the turn, so their cost is counted. Turns alternate between a clean run (the good tasks
alone) and a poisoned one (the same good tasks, and after every 49 of them a task whose
batch runs out of memory: ``torch.OutOfMemoryError``, as CUDA raises it), each with a
fresh queue and worker, started before the clock. A turn's figure is its good tasks
over the seconds from the first submit to the last good task's success; the poison
tasks end dead with DeviceOutOfMemory after their retries. Target: the poisoned runs'
median at least 80 % of the clean runs'.

:func:`run` returns the figures (``benchmarks/models.py`` reports them).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

import redis

import mtq
from benchmarks.harness.meters import machine_info, median, proc_cpu
from benchmarks.harness.procs import Proc, wait_for, worker_env
from benchmarks.harness.server import Server, compile_tree, uniq
from mtq.workers.registry import list_workers

#: the worker target
MLP = "benchmarks.children.oom:Mlp"
#: one task in this many runs out of memory
EVERY = 50
#: the target: poisoned throughput over clean throughput
TARGET = 0.8
#: the queue's first retry delay: the poison tasks' retries run within the turn
BACKOFF_MS = 20


def turn(url: str, good: int, poisoned: bool, every: int = EVERY) -> dict[str, Any]:
    """One turn: a fresh queue and worker; ``good`` tasks (and, ``poisoned``, one that
    runs out of memory after every ``every - 1`` of them) submitted at once. Returns
    its throughput and what the worker did."""
    queue = uniq("oom")
    q = mtq.Queue(queue, url)
    q.configure(retry_backoff_ms=BACKOFF_MS, retry_backoff_max_ms=5 * BACKOFF_MS)
    client = redis.Redis.from_url(url)
    worker = Proc(["worker", "run", MLP, "--queue", queue], worker_env(url))
    try:
        wait_for("the worker", lambda: list_workers(client, queue), 60, [worker])
        items: list[dict[str, Any]] = []
        for i in range(good):
            items.append({"i": i})
            if poisoned and i % (every - 1) == every - 2:
                items.append({"i": -i, "oom": True})
        poison = len(items) - good
        cpu0 = proc_cpu(worker.proc.pid)
        start = time.monotonic()
        q.submit_many(items)
        wait_for("the good tasks", lambda: q.stats()["succeeded"] >= good, 300, [worker])
        took = time.monotonic() - start
        cpu = proc_cpu(worker.proc.pid) - cpu0
        beat = time.time()  # the worker's entry from a heartbeat after the last success

        def entry_now() -> dict[str, Any] | None:
            ws = list_workers(client, queue)
            return ws[0] if ws and float(ws[0].get("beat", 0)) > beat else None

        entry = wait_for("a heartbeat", entry_now, 10, [worker])
        dead = 0
        if poison:  # they end dead after their retries, each run alone
            dead = wait_for("the poison tasks to end", lambda: q.stats()["dead"] >= poison
                            and q.stats()["dead"], 60, [worker])
        # retries of any task: the poison tasks' own (3 each) and no other's
        retried = q.stats()["retried"]
        return {"poisoned": poisoned, "good": good, "poison": poison, "seconds": took,
                "tasks_per_s": good / took, "dead": dead, "retried": retried,
                "worker_cpu_s": cpu,
                "batch_cap": entry.get("batch_cap"), "batches": entry.get("batches"),
                "predict_s": entry.get("predict_s"),
                "overhead_ms_per_batch": entry.get("overhead_ms_per_batch")}
    finally:
        worker.stop()
        worker.close()
        client.close()


def run(good: int = 8000, turns: int = 3, every: int = EVERY,
        url: str | None = None) -> dict[str, Any]:
    """Alternate clean and poisoned turns (``turns`` of each) on ``url`` (a fresh
    redis-server when None). Returns the turns, each kind's median throughput (good
    tasks/s) and their ratio."""
    server = None
    if url is None:
        compile_tree()
        server = Server()
        server.start()
        url = server.url
    try:
        rows = []
        for _ in range(turns):
            rows.append(turn(url, good, False, every))
            rows.append(turn(url, good, True, every))
    finally:
        if server is not None:
            server.stop()
    clean = median([r["tasks_per_s"] for r in rows if not r["poisoned"]])
    poisoned = median([r["tasks_per_s"] for r in rows if r["poisoned"]])
    # the worker's CPU per good task, the other way round: a figure the load of other
    # processes on the machine moves less than wall-clock throughput
    cpu = median([r["worker_cpu_s"] for r in rows if not r["poisoned"]]) / \
        median([r["worker_cpu_s"] for r in rows if r["poisoned"]])
    return {"every": every, "good": good, "turns": rows, "clean_per_s": clean,
            "poisoned_per_s": poisoned, "ratio": poisoned / clean, "cpu_ratio": cpu,
            "target": TARGET, "met": poisoned / clean >= TARGET}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 turns of 3,000 good tasks")
    ap.add_argument("--turns", type=int, help="turns of each kind (default 3; --quick 2)")
    args = ap.parse_args(argv)
    good, turns = (3000, 2) if args.quick else (8000, 3)
    turns = args.turns or turns
    out = run(good=good, turns=turns)
    print(machine_info())
    for r in out["turns"]:
        print(f"{'poisoned' if r['poisoned'] else 'clean':9} {r['good']} good "
              f"{r['poison']:4} poison  {r['seconds']:.3f} s  {r['tasks_per_s']:8.0f} tasks/s  "
              f"{r['batches']} batches, {r['predict_s']:.3f} s in predict, "
              f"{r['overhead_ms_per_batch']:.3f} ms more a batch, worker CPU "
              f"{r['worker_cpu_s']:.2f} s  batch cap {r['batch_cap']}  poison dead {r['dead']}, "
              f"retries {r['retried']}")
    print(f"good-task throughput, one task in {out['every']} out of memory: "
          f"{out['poisoned_per_s']:.0f}/s against {out['clean_per_s']:.0f}/s clean: "
          f"{100 * out['ratio']:.1f} % (target >= {100 * TARGET:.0f} %: "
          f"{'met' if out['met'] else 'NOT MET'}); the worker's CPU per good task, clean "
          f"over poisoned: {100 * out['cpu_ratio']:.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
