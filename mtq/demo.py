"""The demo behind ``mtq demo``: real worker processes, many streams, one crash.

It starts two worker processes (``mtq worker run mtq.demo:handle``), submits
tasks over several streams, kills one worker with SIGKILL while it holds a batch,
and checks the guarantees on the outcome: every task succeeded exactly once, and
within each stream the tasks ran one after another in submit order.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from mtq.client import Queue, Request, Task

DEMO_QUEUE = "mtq-demo"


def handle(payload: dict[str, Any]) -> dict[str, Any]:
    """The demo's handler: a stand-in for a model call (a few ms of CPU work)."""
    text = str(payload.get("text", ""))
    deadline = time.perf_counter() + payload.get("work_ms", 2) / 1000
    n = 0
    while time.perf_counter() < deadline:
        n += 1
    return {"stream": payload.get("stream"), "seq": payload.get("seq"),
            "upper": text.upper(), "spins": n, "pid": os.getpid()}


@dataclass
class DemoReport:
    """What the demo measured and checked."""

    tasks: int = 0
    streams: int = 0
    workers: int = 0
    seconds: float = 0.0
    succeeded: int = 0
    other: dict[str, int] = field(default_factory=dict)
    order_ok: bool = False
    order_errors: list[str] = field(default_factory=list)
    killed_pid: int | None = None
    lease_ms: int = 0
    redelivered: int = 0
    by_worker: dict[str, int] = field(default_factory=dict)
    latency_ms_p50: float = 0.0
    latency_ms_p99: float = 0.0

    @property
    def ok(self) -> bool:
        return self.succeeded == self.tasks and self.order_ok


def _spawn_worker(url: str, queue: str, lease_ms: int) -> subprocess.Popen[bytes]:
    env = dict(os.environ, MTQ_REDIS_URL=url)
    return subprocess.Popen(
        [sys.executable, "-m", "mtq", "worker", "run", "mtq.demo:handle", "--queue", queue,
         "--batch-size", "16", "--lease-ms", str(lease_ms)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run_demo(url: str, *, tasks: int = 400, streams: int = 20, workers: int = 2,
             kill_one: bool = True, lease_ms: int = 1500,
             progress: Callable[[str], None] = lambda _: None) -> DemoReport:
    """Run the demo against ``url`` and return the report (workers are always stopped)."""
    queue = Queue(DEMO_QUEUE, url, lease_ms=lease_ms, retention_s=600)
    queue.redis.delete(*queue.broker.keys.script_keys[2:])  # a clean slate for the demo queue
    report = DemoReport(tasks=tasks, streams=streams, workers=workers, lease_ms=lease_ms)
    procs = [_spawn_worker(url, DEMO_QUEUE, lease_ms) for _ in range(workers)]
    try:
        progress(f"started {workers} worker processes (pids {', '.join(str(p.pid) for p in procs)})")
        events = queue.redis.pubsub(ignore_subscribe_messages=True)
        events.subscribe(queue.broker.keys.events)
        started = time.perf_counter()
        payloads = [{"stream": f"user-{i % streams}", "seq": i // streams, "text": f"hello {i}",
                     "work_ms": 2} for i in range(tasks)]
        handles: list[Task] = queue.submit_many(
            [Request(p, stream=str(p["stream"])) for p in payloads])
        progress(f"submitted {tasks} tasks over {streams} streams in one call per 1000")
        if kill_one:
            # The first "started" event names a worker that holds a batch right now.
            victim_pid = _first_claimer(events, {p.pid for p in procs}, timeout=20)
            if victim_pid is not None:
                i = next(i for i, p in enumerate(procs) if p.pid == victim_pid)
                procs[i].send_signal(signal.SIGKILL)
                procs[i].wait()
                report.killed_pid = victim_pid
                progress(f"killed worker {victim_pid} with SIGKILL while it held a batch; "
                         "its tasks come back after the lease expires")
                procs[i] = _spawn_worker(url, DEMO_QUEUE, lease_ms)
                progress(f"started a replacement worker (pid {procs[i].pid})")
        events.close()
        outcomes: dict[str, int] = {}
        for t in handles:
            try:
                t.result(timeout=60)
                report.succeeded += 1
            except Exception as exc:
                name = type(exc).__name__
                outcomes[name] = outcomes.get(name, 0) + 1
        report.seconds = time.perf_counter() - started
        report.other = outcomes
        _check(queue, handles, payloads, report)
        report.redelivered = queue.stats()["redelivered"]
        progress("all tasks finished; checked order per stream")
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return report


def _first_claimer(events: Any, pids: set[int], timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        message = events.get_message(timeout=left)
        if not message:
            continue
        event = json.loads(message["data"])
        if event.get("event") == "started":
            pid = int(str(event.get("worker", "::")).split(":")[1] or 0)
            if pid in pids:
                return pid
    return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _check(queue: Queue, handles: list[Task], payloads: list[dict[str, Any]],
           report: DemoReport) -> None:
    per_stream: dict[str, list[tuple[int, int, int]]] = {}
    latencies = []
    for t, p in zip(handles, payloads):
        info = t.info()
        if info.status != "succeeded" or info.started is None or info.finished is None:
            continue
        worker = (info.worker or "?").split(":")[1] if info.worker else "?"
        report.by_worker[worker] = report.by_worker.get(worker, 0) + 1
        per_stream.setdefault(p["stream"], []).append((p["seq"], info.started, info.finished))
        latencies.append(info.finished - (info.created or info.finished))
    errors = []
    for stream, rows in per_stream.items():
        rows.sort()
        for (s1, _, f1), (s2, st2, _) in pairwise(rows):
            if st2 < f1:
                errors.append(f"{stream}: task {s2} started before task {s1} finished")
    report.order_errors = errors[:10]
    report.order_ok = not errors and sum(len(r) for r in per_stream.values()) == report.tasks
    latencies.sort()
    if latencies:
        report.latency_ms_p50 = float(latencies[len(latencies) // 2])
        report.latency_ms_p99 = float(latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))])
