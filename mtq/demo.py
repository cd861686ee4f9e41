"""The demo behind ``mtq demo``: the whole product in about half a minute.

It starts two supervisors (``mtq workers start``), one serving the reference
generator (:class:`mtq.reference.gpt.TinyGPT`, continuous batching, tokens
streamed) and one serving the reference sentence encoder
(:class:`mtq.reference.embedder.TinyEmbedder`, dynamic batching, two processes).
A crowd of simulated users then arrives over ``duration_s`` seconds: each user
chats in a FIFO stream of their own and has their messages embedded in another.
Midway, one embedding worker is killed with SIGKILL; its supervisor puts its
tasks back at once and starts a new process.

At the end it checks what mtq promises: every task succeeded exactly once
(nothing lost, no task finished twice), within each user's stream the tasks ran
one after another in submit order, every chat's streamed tokens spell its result;
and that no process it started is left behind. :func:`run` reports it all; the
CLI draws the dashboard while it runs (``on_tick``).
"""

from __future__ import annotations

import os
import queue as queue_mod
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

from mtq.client import Queue, Request, Task
from mtq.errors import MtqError
from mtq.workers.localproc import alive, wait_exit

CHAT_QUEUE = "mtq-demo-chat"
EMBED_QUEUE = "mtq-demo-embed"
PROMPTS = ["Hello there", "Tell me a story", "What is a queue?", "Why Redis?",
           "How do GPUs batch?", "Say something nice"]


@dataclass
class QueueReport:
    """One queue's part of the demo."""

    tasks: int = 0
    succeeded: int = 0
    other: dict[str, int] = field(default_factory=dict)
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    redelivered: int = 0   # tasks that ran more than once (their worker was killed)
    finished_twice: int = 0


@dataclass
class DemoReport:
    """What the demo measured and checked."""

    users: int = 0
    seconds: float = 0.0
    chat: QueueReport = field(default_factory=QueueReport)
    embed: QueueReport = field(default_factory=QueueReport)
    tokens: int = 0
    order_ok: bool = False
    order_errors: list[str] = field(default_factory=list)
    streamed_matches_result: bool = False
    streamed_differ: int = 0        # chats whose streamed tokens do not spell their result
    killed_pid: int | None = None
    killed_worker: str = ""         # its worker id (as its tasks' traces name it)
    killed_held: int = 0            # tasks it held when it was killed (given back, run again)
    killed_held_done: int = 0       # of those, how many then succeeded
    processes: int = 0              # processes the demo started (supervisors, workers, outlets)
    processes_left: list[int] = field(default_factory=list)
    skipped: str = ""               # why it could not run (torch missing)
    log: str = ""                   # the supervisors' output, for a failure report

    @property
    def tasks(self) -> int:
        return self.chat.tasks + self.embed.tasks

    @property
    def succeeded(self) -> int:
        return self.chat.succeeded + self.embed.succeeded

    @property
    def finished_twice(self) -> int:
        return self.chat.finished_twice + self.embed.finished_twice

    def checks(self) -> dict[str, bool]:
        """What the demo checks, each with whether it held."""
        return {"nothing lost": self.succeeded == self.tasks,
                "nothing finished twice": self.finished_twice == 0,
                "order per user stream": self.order_ok,
                "streamed tokens = results": self.streamed_matches_result,
                "no process left behind": not self.processes_left}

    @property
    def ok(self) -> bool:
        return not self.skipped and all(self.checks().values())


@dataclass
class Tick:
    """Progress, handed to ``on_tick`` about once a second."""

    elapsed_s: float
    submitted: int
    finished: int
    total: int
    live_user: str
    live_text: str
    events: list[str]


def _descendants(pid: int) -> set[int]:
    """``pid``'s live descendant processes (from /proc; empty where there is none)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(d.name))
    out: set[int] = set()
    todo = [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


class _Supervisors:
    """The demo's ``mtq workers start`` processes, and everything under them."""

    def __init__(self, url: str, log: Path) -> None:
        self.url = url
        self.log_path = log
        self.log = open(log, "wb")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.seen: set[int] = set()

    def start(self, target: str, queue: str, replicas: int) -> None:
        env = dict(os.environ, MTQ_REDIS_URL=self.url, OMP_NUM_THREADS="1")
        self.procs.append(subprocess.Popen(
            [sys.executable, "-m", "mtq", "workers", "start", target, "--queue", queue,
             "--devices", "cpu", "--replicas", str(replicas), "--lease-ms", "5000"],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True))

    def track(self) -> None:
        """Remember every process under the supervisors (checked at the end)."""
        for p in self.procs:
            self.seen.add(p.pid)
            self.seen |= _descendants(p.pid)

    def check_running(self) -> None:
        for p in self.procs:
            if p.poll() is not None:
                raise MtqError(f"a demo supervisor exited with code {p.returncode}; its "
                               f"output is in {self.log_path}")

    def stop(self) -> list[int]:
        """SIGTERM (a graceful drain), then SIGKILL after 20 s; returns the pids of
        the processes it started that are still alive."""
        self.track()
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
        # the workers' outlets exit once their worker has: give them a moment
        wait_exit([pid for pid in self.seen if alive(pid)], 10)
        self.log.close()
        return sorted(pid for pid in self.seen if alive(pid))


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q / 100))]


def run(url: str, *, users: int = 24, chats_per_user: int = 3, embeds_per_user: int = 6,
        max_tokens: int = 40, duration_s: float = 20.0, kill_one: bool = True,
        on_tick: Callable[[Tick], None] = lambda _: None,
        progress: Callable[[str], None] = lambda _: None) -> DemoReport:
    """Run the demo against ``url`` (see the module docstring) and return the
    report. Every process it starts is stopped before it returns."""
    import importlib.util

    report = DemoReport(users=users)
    if importlib.util.find_spec("torch") is None:
        report.skipped = ("torch is not installed: pip install 'mtq[demo]' (or "
                          "torch==2.13.0 on these machines)")
        return report
    chat_q = Queue(CHAT_QUEUE, url, retention_s=900)
    embed_q = Queue(EMBED_QUEUE, url, retention_s=900)
    for q in (chat_q, embed_q):  # a clean slate: counters and lists of an earlier run
        q.purge()
        # (with the streams held for chain hand-offs: a hold left after its record and
        # busy set were deleted would be swept later, releasing a stream then running)
        q.redis.delete(*q.broker.keys.script_keys[2:], q.broker.keys.held)
    log = Path(tempfile.mkstemp(prefix="mtq-demo-", suffix=".log")[1])
    sups = _Supervisors(url, log)
    events: list[str] = []

    def note(message: str) -> None:
        events.append(f"{time.strftime('%H:%M:%S')} {message}")
        progress(message)

    try:
        sups.start("mtq.reference.gpt:TinyGPT", CHAT_QUEUE, 1)
        sups.start("mtq.reference.embedder:TinyEmbedder", EMBED_QUEUE, 2)
        note("started two supervisors: TinyGPT (continuous batching) x 1, "
             "TinyEmbedder (dynamic batching) x 2")
        _wait_for_workers(url, sups, {CHAT_QUEUE: 1, EMBED_QUEUE: 2}, timeout=90)
        sups.track()
        note("workers ready; users arrive")
        _crowd(report, chat_q, embed_q, sups, users, chats_per_user, embeds_per_user,
               max_tokens, duration_s, kill_one, on_tick, note, events)
    finally:
        report.processes_left = sups.stop()
        report.processes = len(sups.seen)
        report.log = log.read_text(errors="replace")[-4000:]
        log.unlink(missing_ok=True)
    note(f"stopped the supervisors; {len(report.processes_left)} process(es) left behind")
    return report


def _wait_for_workers(url: str, sups: _Supervisors, want: dict[str, int],
                      timeout: float) -> None:
    from mtq.broker.connection import connect
    from mtq.broker.registry import list_workers

    client = connect(url)
    deadline = time.monotonic() + timeout
    while True:
        sups.check_running()
        ready = list_workers(client)
        counts = {q: sum(1 for w in ready if w.get("queue") == q and w.get("state") in
                         ("idle", "running")) for q in want}
        if all(counts[q] >= n for q, n in want.items()):
            return
        if time.monotonic() > deadline:
            raise MtqError(f"the demo workers did not start within {timeout:.0f} s "
                           f"(ready: {counts}); see {sups.log_path}")
        time.sleep(0.1)  # registry entries appear once a second; nothing to block on


def _crowd(report: DemoReport, chat_q: Queue, embed_q: Queue, sups: _Supervisors,
           users: int, chats_per_user: int, embeds_per_user: int, max_tokens: int,
           duration_s: float, kill_one: bool, on_tick: Callable[[Tick], None],
           note: Callable[[str], None], events: list[str]) -> None:
    rng = random.Random(7)
    # the schedule: each request at a random time within duration_s, a user's own
    # requests in the order they are numbered (their streams keep that order)
    plan: list[tuple[float, str, int, int]] = []
    for u in range(users):
        for kind, n in (("chat", chats_per_user), ("embed", embeds_per_user)):
            times = sorted(rng.uniform(0, duration_s) for _ in range(n))
            plan += [(t, kind, u, i) for i, t in enumerate(times)]
    plan.sort()
    n_plan = len(plan)
    total = n_plan  # requests expected to finish (the kill's burst adds some)
    chats: list[tuple[Task, int, int]] = []
    embeds: list[tuple[Task, int, int]] = []
    done = threading.Event()
    lock = threading.Lock()
    finished = [0]

    def on_done(_task: Task, _ev: Any) -> None:
        with lock:
            finished[0] += 1
            if finished[0] == total:
                done.set()

    live = {"user": "user-0", "text": ""}
    user0: queue_mod.SimpleQueue[tuple[Task, str] | None] = queue_mod.SimpleQueue()

    def follow() -> None:  # user-0's chats, token by token, for the screen
        while (item := user0.get()) is not None:
            task, prompt = item
            live["text"] = (live["text"] + f"\n> {prompt}\n")[-400:]
            try:
                for tok in task.tokens(timeout=120):
                    live["text"] = (live["text"] + str(tok))[-400:]
            except MtqError:
                pass

    watcher = threading.Thread(target=follow, name="mtq-demo-follow", daemon=True)
    watcher.start()

    start = time.monotonic()
    last_tick = 0.0
    killed = False
    k = 0
    while not done.is_set():
        now = time.monotonic() - start
        while k < n_plan and plan[k][0] <= now:  # everything due goes in one call per queue
            due = []
            while k < n_plan and plan[k][0] <= now:
                due.append(plan[k])
                k += 1
            for kind, queue, out in (("chat", chat_q, chats), ("embed", embed_q, embeds)):
                mine = [(u, i) for _, kd, u, i in due if kd == kind]
                if not mine:
                    continue
                payloads = [{"prompt": PROMPTS[(u + i) % len(PROMPTS)], "max_tokens": max_tokens,
                             "seed": u * 1000 + i, "stop_at_eos": False} if kind == "chat"
                            else {"text": f"user {u} says message {i}"} for u, i in mine]
                tasks = queue.submit_many([Request(p, stream=f"user-{u}")
                                           for p, (u, _) in zip(payloads, mine)])
                for t, (u, i) in zip(tasks, mine):
                    t.add_done_callback(on_done)
                    out.append((t, u, i))
                    if kind == "chat" and u == 0:
                        user0.put((t, PROMPTS[i % len(PROMPTS)]))
        if kill_one and not killed and k >= n_plan * 0.4:
            killed = True
            with lock:
                total += users  # the burst below
            report.killed_pid, report.killed_worker = _kill_an_embedder(
                embed_q, users, embeds, on_done, note)
        if now - last_tick >= 1.0 or done.is_set():
            last_tick = now
            sups.track()
            sups.check_running()
            with lock:
                f = finished[0]
            on_tick(Tick(now, k + (users if killed else 0), f, total, live["user"],
                         live["text"], events[-6:]))
        if now > duration_s + 120:
            raise MtqError(f"the demo's tasks did not finish within {duration_s + 120:.0f} s "
                           f"({finished[0]} of {total}); see {sups.log_path}")
        next_due = plan[k][0] - now if k < n_plan else 1.0
        done.wait(max(0.01, min(0.25, next_due)))
    report.seconds = time.monotonic() - start
    user0.put(None)
    watcher.join(10)
    on_tick(Tick(report.seconds, n_plan + (users if killed else 0), finished[0], total,
                 live["user"], live["text"], events[-6:]))
    note(f"all {total} requests finished; checking")
    _check(report, chats, embeds)


def _kill_an_embedder(q: Queue, users: int, out: list[tuple[Task, int, int]],
                      on_done: Callable[[Task, Any], None], note: Callable[[str], None]
                      ) -> tuple[int | None, str]:
    """Submit a burst of embeddings (one more per user, in their streams) and SIGKILL
    the first worker process the queue's events say took a batch of it. Returns its
    pid and worker id (None and "" if no batch big enough started within 10 s)."""
    import json

    from mtq.broker.cluster import sharded

    events = q.redis.pubsub(ignore_subscribe_messages=True)
    if sharded(q.redis):  # a cluster's shard publishes the queue's events (SPUBLISH)
        events.ssubscribe(q.broker.keys.events)
    else:
        events.subscribe(q.broker.keys.events)
    try:
        burst = [(u, 1000) for u in range(users)]
        long = "a longer message, so that the batch is still running when the kill lands " * 2
        tasks = q.submit_many([Request({"text": f"user {u}: {long}"}, stream=f"user-{u}")
                               for u, _ in burst])
        for t, (u, i) in zip(tasks, burst):
            t.add_done_callback(on_done)
            out.append((t, u, i))
        deadline = time.monotonic() + 10
        while (left := deadline - time.monotonic()) > 0:
            message = events.get_message(timeout=left)
            if not message:
                continue
            event = json.loads(message["data"])
            if event.get("event") != "started" or len(event.get("ids", [])) < min(4, users):
                continue  # a batch big enough to be still running when the kill lands
            worker = str(event.get("worker", "::"))
            pid = int(worker.split(":")[1] or 0)
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                continue
            note(f"killed embedding worker {pid} with SIGKILL while it held a batch of "
                 f"{len(event.get('ids', []))}; its supervisor requeues them and starts a "
                 "new process")
            return pid, worker
    finally:
        events.close()
    return None, ""


def _check(report: DemoReport, chats: list[tuple[Task, int, int]],
           embeds: list[tuple[Task, int, int]]) -> None:
    errors: list[str] = []
    for name, items, part in (("chat", chats, report.chat), ("embed", embeds, report.embed)):
        part.tasks = len(items)
        per_user: dict[int, list[tuple[int, Any]]] = {}
        latencies = []
        for t, u, i in items:
            info = t.info()
            if info.status == "succeeded":
                part.succeeded += 1
            else:
                part.other[info.status] = part.other.get(info.status, 0) + 1
            if info.deliveries > 1:
                part.redelivered += 1
            trace = t.trace()
            ends = [e for e in trace if e.kind in ("succeeded", "failed", "dead")]
            if len(ends) > 1:
                part.finished_twice += 1
            if report.killed_worker and _held_at_kill(trace, report.killed_worker,
                                                      info.status):
                report.killed_held += 1
                report.killed_held_done += info.status == "succeeded"
            if info.finished and info.created:
                latencies.append(float(info.finished - info.created))
            per_user.setdefault(u, []).append((i, info))
        part.p50_ms, part.p99_ms = _pct(latencies, 50), _pct(latencies, 99)
        for u, rows in per_user.items():  # in submission order: the list's order
            for (i1, a), (i2, b) in pairwise(rows):
                if not (a.finished and b.started and a.finished <= b.started):
                    errors.append(f"{name} user-{u}: request {i2} started before {i1} ended")
    report.order_errors = errors[:10]
    report.order_ok = not errors
    for t, _, _ in chats:
        result = t.result(timeout=10)
        report.tokens += len(result["tokens"])
        report.streamed_differ += "".join(t.tokens(timeout=10)) != result["text"]
    report.streamed_matches_result = report.streamed_differ == 0


def _held_at_kill(trace: list[Any], worker: str, status: str) -> bool:
    """Whether the task whose trace this is was held by ``worker`` when it was killed:
    it was started there, and did not succeed there (it was started again after, or
    did not succeed at all). Claimed-ahead tasks count: each claim is a start."""
    starts = [e for e in trace if e.kind == "started"]
    there = [e.detail.endswith(f" on {worker}") for e in starts]
    if not any(there):
        return False
    return not there[-1] or status != "succeeded"
