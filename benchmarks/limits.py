"""Scheduling's limits, measured: a tenant's rate limit held by every producer, and
deadline admission under overload. Run by ``python -m benchmarks.scheduling`` (its rows
"rate limit" and "deadlines"), or alone:

    python -m benchmarks.limits [--quick]

* **Rate limit**: a queue with ``tenant_rpm`` N for one tenant (reject mode); 8 producer
  threads in 2 processes (``children/rate_producer.py``) submit its tasks every 20 ms each
  (about 400 tries a second against a limit of N / 60) for 60 s. The observed rate is the
  accepted tasks over the span of their submit times (a limit of N per minute lets N / 60
  more through at once at the start: its burst), against N; each refused submit's
  latency, as its producer saw it.
* **Deadlines**: one worker slot whose work takes 0.1 ms per unit of cost
  (``children/costed.py``) (tasks of cost
  50: 200 a second); producers submit at twice that, each task with ``deadline=1.0``. A
  warm-up of 4 s lets the claims measure the service rate; then, for the measured span,
  every admitted task's start (its hash's ``started``) is checked against its deadline;
  one that expired unrun counts as late.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import redis

import mtq
from benchmarks.children.costed import PER_COST_S
from benchmarks.harness.meters import pct
from benchmarks.harness.procs import wait_for, worker_env
from benchmarks.harness.server import ROOT, RedisServer, uniq
from mtq.broker.keys import QueueKeys


def producers(url: str, queue: str, procs: int, threads: int, seconds: float
              ) -> list[dict[str, Any]]:
    """``procs`` processes of ``threads`` producer threads each; their reports."""
    env = worker_env(url)
    running = [subprocess.Popen([sys.executable, "-m", "benchmarks.children.rate_producer", url,
                                 queue, "t", str(threads), str(seconds), "20"], env=env,
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
               for _ in range(procs)]
    outs = []
    for p in running:
        out, _ = p.communicate(timeout=seconds + 60)
        if p.returncode != 0:
            raise SystemExit(f"a producer failed ({p.returncode})")
        outs.append(json.loads(out.decode().strip().splitlines()[-1]))
    return outs


def rate_limit(url: str, per_minute: int, seconds: float) -> dict[str, float]:
    """Observed accepted rate (per minute) against the limit, and refusal latencies: of
    the 8 producers, and of one producer thread alone (the floor of a Python client on
    this machine, without the others' contention for its cores)."""
    queue = uniq("rate")
    q = mtq.Queue(queue, url)
    q.configure(tenant_rpm={"t": per_minute})
    outs = producers(url, queue, 2, 4, seconds)
    accepted = sum(o["accepted"] for o in outs)
    refused = [ms for o in outs for ms in o["refused_ms"]]
    r = redis.Redis.from_url(url)
    k = QueueKeys(queue)
    # the tenant's stream-less tasks wait in its lane's list (none ran: no worker)
    ids = [i.decode() if isinstance(i, bytes) else i for i in r.lrange(k.sched + "free:s:t", 0, -1)]
    pipe = r.pipeline()
    for i in ids:
        pipe.hget(k.task(i), "created")
    created = sorted(int(c) for c in pipe.execute() if c)
    span_s = (created[-1] - created[0]) / 1000 if len(created) > 1 else seconds
    burst = max(1, -(-per_minute // 60))
    q.delete(force=True)
    alone = uniq("rate-alone")
    mtq.Queue(alone, url).configure(tenant_rpm={"t": per_minute})
    floor = producers(url, alone, 1, 1, min(seconds, 10.0))[0]["refused_ms"]
    mtq.Queue(alone, url).delete(force=True)
    return {"accepted": accepted, "span_s": span_s,
            "alone_p99_ms": pct(floor, 99) if floor else 0.0,
            "rate": (len(created) - burst) / span_s * 60 if span_s else 0.0,
            "refusals": len(refused), "refused_p50_ms": pct(refused, 50) if refused else 0.0,
            "refused_p99_ms": pct(refused, 99) if refused else 0.0}


def deadlines(url: str, warmup_s: float, seconds: float, cost: int = 50,
              deadline_s: float = 1.0) -> dict[str, float]:
    """Admitted tasks that started before their deadline, at twice the worker's rate."""
    queue = uniq("deadline")
    r = redis.Redis.from_url(url)
    q = mtq.Queue(queue, url)
    worker = subprocess.Popen([sys.executable, "-m", "mtq", "worker", "run",
                               "benchmarks.children.costed:work", "--queue", queue,
                               "--max-batch-size", "1"],
                              env=worker_env(url), cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        from mtq.workers import registry
        wait_for("the worker", lambda: registry.list_workers(r, queue), 60)
        capacity = 1 / (cost * PER_COST_S)  # tasks a second
        every = 1 / (2 * capacity)
        admitted: list[str] = []
        refused = 0
        start = time.monotonic()
        nxt = start
        while time.monotonic() - start < warmup_s + seconds:
            measured = time.monotonic() - start >= warmup_s
            try:
                t = q.submit({"c": cost, "g": "t"}, tenant="t", cost=cost, deadline=deadline_s)
                if measured:
                    admitted.append(t.id)
            except mtq.WouldMissDeadline:
                if measured:
                    refused += 1
            nxt += every
            time.sleep(max(0.0, nxt - time.monotonic()))  # the producers' pace
        wait_for("the admitted tasks to end", lambda: q.stats()["waiting"] == 0
                 and q.stats()["running"] == 0, 120)
        k = QueueKeys(queue)
        pipe = r.pipeline()
        for i in admitted:
            pipe.hmget(k.task(i), "started", "deadline")
        on_time = late = 0
        for started, dl in pipe.execute():
            if started and dl and int(started) <= int(dl):
                on_time += 1
            else:
                late += 1  # started after its deadline, or expired unrun
        rate = float(r.hget(k.sched + "vt", "~rate") or 0)
        q.delete(force=True)
        return {"admitted": len(admitted), "refused": refused, "on_time": on_time,
                "late": late, "share": on_time / len(admitted) if admitted else 0.0,
                "rate_cost_s": rate, "capacity_cost_s": capacity * cost}
    finally:
        worker.terminate()
        worker.wait(30)


def main() -> None:
    quick = "--quick" in sys.argv
    server = RedisServer()
    server.start()
    try:
        print(rate_limit(server.url, 1200, 10 if quick else 60))
        print(deadlines(server.url, 4, 6 if quick else 20))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
