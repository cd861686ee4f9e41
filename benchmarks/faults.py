#!/usr/bin/env python
"""Faults: how fast tasks come back after a worker process is killed.

    python -m benchmarks.faults            # full run (a few minutes), writes the faults block
    python -m benchmarks.faults --quick    # smaller run, prints only (add --docs to write)

1. recovery under a supervisor: ``mtq workers start`` (2 processes) serves 20,000
   tasks over 200 streams while a random worker process is SIGKILLed 50 times; for
   every task a killed process held, the time from the kill to its next claim (from
   the task's trace in Redis);
2. recovery without a supervisor: a bare ``mtq worker run`` holding tasks is SIGKILLed
   (default lease and heartbeat) while another worker serves the queue;
3. good-task throughput with two poison tasks (``os._exit``, a segfault) among them;
4. the latency of a one-by-one submit with ``durable_replicas=1`` against without.

The test suite imports :func:`kill_workers`, :func:`recovery_times` and :func:`pct`.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

import mtq
from benchmarks import targets
from benchmarks.harness.meters import machine_info, median, pct
from benchmarks.harness.procs import alive, kill_group, spawn, wait_for, worker_env
from benchmarks.harness.report import cli_parser, docs_of, write_block
from benchmarks.harness.server import Server
from mtq.broker.protocol import read_traces
from mtq.settings import QueueSettings
from mtq.workers.registry import list_workers

# -- measuring ---------------------------------------------------------------------------
#: the worker target: small batches that take a little time, or crash on demand
BUSY = "benchmarks.children.busy:Busy"


@dataclass(frozen=True)
class Kill:
    """One SIGKILL: when (wall clock, s) and which worker it killed."""

    t: float
    worker: str


def _trace(raw: Iterable[bytes]) -> list[tuple[float, str, str]]:
    out = []
    for line in raw:
        ms, kind, detail = line.decode().split("|", 2)
        out.append((int(ms) / 1000, kind, detail))
    return out


def recovery_times(client: redis.Redis, queue: str, task_ids: Sequence[str],
                   kills: Sequence[Kill]) -> list[float]:
    """For every task a killed worker held when it was killed: seconds from the kill to
    the task's next claim (its next 'started' step). Read from the tasks' traces,
    which the scripts write in Redis server time (the same host's clock)."""
    by_worker = {k.worker: k.t for k in kills}
    out: list[float] = []
    for start in range(0, len(task_ids), 1000):
        for raw in read_traces(client, queue, task_ids[start:start + 1000]):
            steps = _trace(raw)
            for n, (t, kind, detail) in enumerate(steps):
                if kind != "started":
                    continue
                worker = detail.rsplit(" on ", 1)[-1]
                killed = by_worker.get(worker)
                if killed is None or t > killed:
                    continue
                after = steps[n + 1:]
                if not after or after[0][1] in ("succeeded", "failed", "dead", "cancelled"):
                    continue  # it finished before the kill
                again = next((s[0] for s in after if s[1] == "started"), None)
                if again is not None:
                    out.append(again - killed)
    return out


def kill_workers(client: redis.Redis, queue: str, times: int, rng: random.Random,
                 gap_s: tuple[float, float] = (0.1, 0.4), timeout: float = 60.0,
                 done: Any = None, spare: int = 1) -> list[Kill]:
    """SIGKILL a random live worker process of ``queue`` ``times`` times, at random
    moments ``gap_s`` apart (the fault's timing, not a wait for anything), only while
    more than ``spare`` are live (so one is there to claim what comes back while the
    killed one restarts). Stops early once ``done()`` is true."""
    kills: list[Kill] = []
    deadline = time.monotonic() + timeout
    while len(kills) < times and time.monotonic() < deadline:
        if done is not None and done():
            break
        time.sleep(rng.uniform(*gap_s))
        live = [w for w in list_workers(client, queue) if alive(int(w["pid"]))
                and w.get("state") in ("idle", "running") and w.get("role") != "quarantine"]
        if len(live) <= spare:
            continue
        w = rng.choice(live)
        try:
            os.kill(int(w["pid"]), signal.SIGKILL)
        except ProcessLookupError:
            continue
        kills.append(Kill(time.time(), w["id"]))
    return kills


# -- running ------------------------------------------------------------------------------


def supervised_recovery(url: str, tasks: int, streams: int, kills: int, seed: int,
                        workdir: Path, item_s: float = 0.001) -> dict[str, Any]:
    """Figure 1 (see the module docstring), with the default settings."""
    client = redis.Redis.from_url(url)
    queue = f"rec-{seed}"
    q = mtq.Queue(queue, url)
    sup = spawn(["workers", "start", BUSY, "--queue", queue, "--replicas", "2"],
                worker_env(url), log=workdir / "supervised.log")
    try:
        wait_for("2 workers", lambda: len(list_workers(client, queue)) == 2, 60)
        reqs = [mtq.Request({"i": i, "sleep": item_s}, stream=f"s{i % streams}")
                for i in range(tasks)]
        submitted = q.submit_many(reqs)
        rng = random.Random(seed)
        done = lambda: q.stats()["waiting"] < 200  # noqa: E731
        killed = kill_workers(client, queue, kills, rng, timeout=600, done=done)
        wait_for("every task to succeed", lambda: q.stats()["succeeded"] >= tasks, 600)
        stats = q.stats()
        times = recovery_times(client, queue, [t.id for t in submitted], killed)
    finally:
        kill_group(sup)
    return {"kills": len(killed), "tasks": tasks, "streams": streams, "times": times,
            "stats": stats}


def bare_recovery(url: str, rounds: int, seed: int, workdir: Path) -> dict[str, Any]:
    """Figure 2: a bare worker killed while it holds tasks; another one serves on."""
    client = redis.Redis.from_url(url)
    queue = f"bare-{seed}"
    q = mtq.Queue(queue, url)
    helper = spawn(["worker", "run", BUSY, "--queue", queue], worker_env(url),
                   log=workdir / "bare-helper.log")
    times: list[float] = []
    lease_s = QueueSettings().lease_ms / 1000
    try:
        wait_for("the helper worker", lambda: len(list_workers(client, queue)) == 1, 60)
        rng = random.Random(seed)
        for n in range(rounds):
            victim = spawn(["worker", "run", BUSY, "--queue", queue], worker_env(url),
                           log=workdir / "bare-victim.log")
            wait_for("the victim worker", lambda: len(list_workers(client, queue)) == 2, 60)
            # 16 tasks of 0.25 s each: either worker holds 4 running and 4 claimed ahead
            submitted = q.submit_many([mtq.Request({"i": i, "sleep": 0.25},
                                                   stream=f"r{n}-{i}") for i in range(16)])
            time.sleep(rng.uniform(0.3, 1.3))  # a random moment, any phase of the heartbeat
            ws = [w for w in list_workers(client, queue) if int(w["pid"]) != helper.pid]
            assert ws, "the victim is not registered"
            kill = Kill(time.time(), ws[0]["id"])
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait(10)
            wait_for("the round's tasks to succeed",
                     lambda: all(t.status() == "succeeded" for t in submitted), 120)  # noqa: B023
            times += recovery_times(client, queue, [t.id for t in submitted], [kill])
    finally:
        kill_group(helper)
    return {"rounds": rounds, "times": times, "lease_s": lease_s}


def poison_turn(url: str, good: int, poison: bool, seed: int, workdir: Path) -> float:
    """Seconds for ``good`` tasks to succeed under one supervisor (default settings),
    with or without two poison tasks among them (one os._exit, one segfault), from
    the submit to the last success; the start-up is not counted."""
    client = redis.Redis.from_url(url)
    queue = f"poison-{seed}-{int(poison)}"
    q = mtq.Queue(queue, url)
    log = workdir / f"{queue}.log"
    sup = spawn(["workers", "start", BUSY, "--queue", queue], worker_env(url), log=log)
    try:
        wait_for("the worker and its standby", lambda: len(list_workers(client, queue)) == 1
                 and "standby ready" in log.read_text(), 60)
        items: list[Any] = [{"i": i} for i in range(good)]
        if poison:
            items.insert(good // 10, {"i": -1, "exit": True})
            items.insert(good // 2, {"i": -2, "segv": True})
        start = time.monotonic()
        q.submit_many(items)
        wait_for("the good tasks", lambda: q.stats()["succeeded"] >= good, 300)
        took = time.monotonic() - start
        if poison:
            wait_for("the poison tasks to end dead", lambda: q.stats()["dead"] == 2, 60)
    finally:
        kill_group(sup)
    return took


def poison_throughput(url: str, good: int, turns: int, seed: int, workdir: Path
                      ) -> dict[str, Any]:
    """Good-task throughput with and without poison, in alternating turns."""
    clean, poisoned = [], []
    for n in range(turns):
        clean.append(poison_turn(url, good, False, seed * 100 + n, workdir))
        poisoned.append(poison_turn(url, good, True, seed * 100 + n, workdir))
    return {"good": good, "turns": turns, "clean": clean, "poisoned": poisoned}


def durable_cost(submits: int, turns: int) -> dict[str, list[float]]:
    """Latency of one-by-one submits to a primary with one replica, plain and with
    ``durable_replicas=1`` (WAIT 1 in the same round trip), in alternating turns."""
    primary = Server()
    primary.start()
    replica = Server(args=("--replicaof", "127.0.0.1", str(primary.port)))
    replica.start()
    try:
        link = redis.Redis(port=replica.port)
        wait_for("the replica",
                 lambda: link.info("replication").get("master_link_status") == "up", 10)
        plain = mtq.Queue("dur-plain", primary.url)
        durable = mtq.Queue("dur-durable", primary.url, durable_replicas=1)
        out: dict[str, list[float]] = {"plain": [], "durable": []}
        for _ in range(turns):
            for name, q in (("plain", plain), ("durable", durable)):
                q.submit({"warm": True})
                for i in range(submits):
                    t0 = time.perf_counter()
                    q.submit({"i": i})
                    out[name].append(time.perf_counter() - t0)
    finally:
        replica.stop()
        primary.stop()
    return out


def _row(name: str, times: Sequence[float], target: float, extra: str) -> list[str]:
    p50, p99 = pct(times, 50), pct(times, 99)
    return [name, str(len(times)), f"{p50:.3f}", f"{p99:.3f}", f"{max(times):.3f}",
            f"<= {target:g}", "met" if p99 <= target else "NOT MET", extra]


def main(argv: Sequence[str] | None = None) -> int:
    ap = cli_parser(__doc__, "~1 minute")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    docs = docs_of(args)
    # items of 6 ms in the full run: the load outlasts 50 kills and their restarts
    tasks, kills, rounds, item_s = (4000, 10, 2, 0.001) if args.quick else \
        (20_000, 50, 8, 0.006)
    server = Server()
    server.start()
    workdir = Path(tempfile.mkdtemp(prefix="mtq-faults-"))
    try:
        durable = durable_cost(500 if args.quick else 2000, 2 if args.quick else 3)
        poison = poison_throughput(server.url, 2000, 2 if args.quick else 5, args.seed, workdir)
        sup = supervised_recovery(server.url, tasks, 200, kills, args.seed, workdir, item_s)
        bare = bare_recovery(server.url, rounds, args.seed, workdir)
    finally:
        server.stop()
    rows = [
        _row("supervised: kill -9 of a worker process, default settings", sup["times"],
             targets.SUPERVISED_P99_S, f"{sup['kills']} kills, {sup['tasks']} tasks of "
             f"{item_s * 1000:g} ms over {sup['streams']} streams, 2 processes"),
        _row("bare `mtq worker run`: kill -9, default lease", bare["times"], targets.BARE_P99_S,
             f"{bare['rounds']} kills, lease {bare['lease_s']:g} s, heartbeat 1 s"),
    ]
    header = ["case", "tasks held", "p50 s", "p99 s", "max s", "target p99", "", "setup"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    clean, poisoned = median(poison["clean"]), median(poison["poisoned"])
    ratio = clean / poisoned
    lines += ["", "| good tasks | without poison (s) | with one os._exit and one segfault poison "
              "(s) | good-task throughput kept | target |", "|---|---|---|---|---|",
              f"| {poison['good']} | {clean:.2f} (turns: "
              f"{', '.join(f'{t:.2f}' for t in poison['clean'])}) | {poisoned:.2f} (turns: "
              f"{', '.join(f'{t:.2f}' for t in poison['poisoned'])}) | {ratio:.0%} | >= "
              f"{targets.POISON_KEPT:.0%} {'met' if ratio >= targets.POISON_KEPT else 'NOT MET'} |"]
    lat = {k: (pct(v, 50) * 1000, pct(v, 99) * 1000, len(v) / sum(v))
           for k, v in durable.items()}
    lines += ["", "| one-by-one submit, primary + 1 replica on loopback | p50 ms | p99 ms | "
              "submits/s |", "|---|---|---|---|"]
    for name, label in (("plain", "plain (acknowledged by the primary)"),
                        ("durable", "`durable_replicas=1` (WAIT 1, same round trip)")):
        p50, p99, rate = lat[name]
        lines.append(f"| {label} | {p50:.3f} | {p99:.3f} | {rate:,.0f} |")
    table = "\n".join(lines)
    print(table)
    print("supervised stats:", sup["stats"])
    if docs is not None:
        write_block("faults", lines, "python -m benchmarks.faults" + (" --quick" if args.quick
                                                                      else ""), machine_info(),
                    path=docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
