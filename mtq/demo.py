"""The demo behind ``mtq demo``: real worker processes, many streams, one crash,
then chats streamed token by token.

It starts two worker processes (``mtq worker run mtq.demo:handle``), submits
tasks over several streams, kills one worker with SIGKILL while it holds a batch,
and checks the guarantees on the outcome: every task succeeded exactly once, and
within each stream the tasks ran one after another in submit order.

Then, when torch is installed, :func:`run_chat` serves the reference generator
(``mtq.reference.gpt:TinyGPT``, continuous batching) and streams simulated users'
chats: tokens arrive live, each stream's chats in order.
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
CHAT_QUEUE = "mtq-demo-chat"


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


@dataclass
class ChatReport:
    """What the chat part of the demo measured and checked."""

    chats: int = 0
    users: int = 0
    succeeded: int = 0
    tokens: int = 0
    seconds: float = 0.0
    streamed_matches_result: bool = False
    order_ok: bool = False
    skipped: str = ""

    @property
    def ok(self) -> bool:
        return bool(self.skipped) or (self.succeeded == self.chats and self.order_ok
                                      and self.streamed_matches_result)


def run_chat(url: str, *, users: int = 6, chats_per_user: int = 4, max_tokens: int = 40,
             echo: Callable[[str], None] = lambda _: None,
             progress: Callable[[str], None] = lambda _: None) -> ChatReport:
    """Serve the reference generator and stream chats of ``users`` users (each its own
    FIFO stream); ``echo`` receives the first user's tokens live."""
    import importlib.util

    report = ChatReport(chats=users * chats_per_user, users=users)
    if importlib.util.find_spec("torch") is None:
        report.skipped = "torch is not installed (pip install 'mtq[workers]')"
        return report
    queue = Queue(CHAT_QUEUE, url, retention_s=600)
    queue.redis.delete(*queue.broker.keys.script_keys[2:])
    env = dict(os.environ, MTQ_REDIS_URL=url, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mtq", "worker", "run", "mtq.reference.gpt:TinyGPT",
         "--queue", CHAT_QUEUE], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        progress(f"started a TinyGPT worker (pid {proc.pid}): continuous batching, KV cache")
        prompts = ["Hello there", "Tell me a story", "What is a queue?", "Why Redis?"]
        started = time.perf_counter()
        chats = [Request({"prompt": prompts[c % len(prompts)], "max_tokens": max_tokens,
                          "seed": u * 100 + c, "stop_at_eos": False}, stream=f"user-{u}")
                 for c in range(chats_per_user) for u in range(users)]
        tasks = queue.submit_many(chats)
        progress(f"{users} users sent {len(tasks)} chats; user-0's replies stream below")
        streamed_ok = True
        for i, t in enumerate(tasks):
            pieces: list[str] = []
            live = i % users == 0
            for ev in t.events(timeout=120):
                if ev.kind == "token":
                    pieces.append(ev.data)
                    if live:
                        echo(ev.data)
                elif ev.kind == "succeeded":
                    report.succeeded += 1
                    report.tokens += len(ev.data["tokens"])
                    streamed_ok &= "".join(pieces) == ev.data["text"]
            if live:
                echo("\n")
        report.seconds = time.perf_counter() - started
        report.streamed_matches_result = streamed_ok
        infos = [(t.info(), c.stream) for t, c in zip(tasks, chats)]
        report.order_ok = all(
            (a.finished or 0) <= (b.started or 0)
            for u in range(users)
            for a, b in pairwise([i for i, s in infos if s == f"user-{u}"]))
        progress("all chats finished; checked order per user and that the streamed "
                 "text is the result")
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return report
