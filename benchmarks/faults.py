#!/usr/bin/env python
"""Fault benchmarks: how fast tasks come back after a worker process is killed.

    python -m benchmarks.faults            # full run (a few minutes), writes docs
    python -m benchmarks.faults --quick    # smaller run, prints only (add --docs to write)

It starts its own redis-server on a free loopback port and measures:

1. **recovery under a supervisor**: ``mtq workers start`` (2 processes) serves
   20 000 tasks over 200 streams while a random worker process is SIGKILLed 50
   times at random moments; for every task a killed process held, the time from
   the kill to the task being claimed again (from the task's trace in Redis);
2. **recovery without a supervisor**: a bare ``mtq worker run`` holding tasks is
   SIGKILLed (default lease and heartbeat) while another worker serves the queue;
   its tasks come back when their leases expire.

It prints a table and rewrites the "## Faults" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

import mtq
from mtq.broker.embedded import find_redis_server
from mtq.broker.protocol import read_traces
from mtq.settings import QueueSettings
from mtq.workers.registry import list_workers

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable

TARGET_SUPERVISED_P99_S = 1.0
TARGET_BARE_P99_S = 10.0


# -- measuring ---------------------------------------------------------------------------
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


def pct(values: Sequence[float], p: float) -> float:
    """The p-th percentile (nearest rank) of ``values``."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = max(0, min(len(ordered) - 1, round(p / 100 * len(ordered) + 0.5) - 1))
    return ordered[k]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


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
class Server:
    """A private redis-server on a free loopback port, persistence off."""

    def __init__(self, *extra: str) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.dir = tempfile.mkdtemp(prefix="mtq-bench-")
        self.proc = subprocess.Popen(
            [find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", self.dir, *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        client = redis.Redis.from_url(self.url)
        for _ in range(500):
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                time.sleep(0.01)
        client.close()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def _env(url: str) -> dict[str, str]:
    env = dict(os.environ)
    env["MTQ_REDIS_URL"] = url
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _start(args: list[str], url: str, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen([PY, "-m", "mtq", *args], env=_env(url), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.02)


def supervised_recovery(url: str, tasks: int, streams: int, kills: int, seed: int,
                        workdir: Path, item_s: float = 0.001) -> dict[str, Any]:
    """Figure 1 (see the module docstring), with the default settings."""
    client = redis.Redis.from_url(url)
    queue = f"rec-{seed}"
    q = mtq.Queue(queue, url)
    sup = _start(["workers", "start", "benchmarks.faults_targets:Busy", "--queue", queue,
                  "--replicas", "2"], url, workdir / "supervised.log")
    try:
        _wait(lambda: len(list_workers(client, queue)) == 2, 60, "2 workers")
        reqs = [mtq.Request({"i": i, "sleep": item_s}, stream=f"s{i % streams}")
                for i in range(tasks)]
        submitted = q.submit_many(reqs)
        rng = random.Random(seed)
        done = lambda: q.stats()["waiting"] < 200  # noqa: E731
        killed = kill_workers(client, queue, kills, rng, timeout=600, done=done)
        _wait(lambda: q.stats()["succeeded"] >= tasks, 600, "every task to succeed")
        stats = q.stats()
        times = recovery_times(client, queue, [t.id for t in submitted], killed)
    finally:
        _stop(sup)
    return {"kills": len(killed), "tasks": tasks, "streams": streams, "times": times,
            "stats": stats}


def bare_recovery(url: str, rounds: int, seed: int, workdir: Path) -> dict[str, Any]:
    """Figure 2: a bare worker killed while it holds tasks; another one serves on."""
    client = redis.Redis.from_url(url)
    queue = f"bare-{seed}"
    q = mtq.Queue(queue, url)
    helper = _start(["worker", "run", "benchmarks.faults_targets:Busy", "--queue", queue],
                    url, workdir / "bare-helper.log")
    times: list[float] = []
    lease_s = QueueSettings().lease_ms / 1000
    try:
        _wait(lambda: len(list_workers(client, queue)) == 1, 60, "the helper worker")
        rng = random.Random(seed)
        for n in range(rounds):
            victim = _start(["worker", "run", "benchmarks.faults_targets:Busy", "--queue",
                             queue], url, workdir / "bare-victim.log")
            _wait(lambda: len(list_workers(client, queue)) == 2, 60, "the victim worker")
            # 16 tasks of 0.25 s each: either worker holds 4 running and 4 claimed ahead
            submitted = q.submit_many([mtq.Request({"i": i, "sleep": 0.25},
                                                   stream=f"r{n}-{i}") for i in range(16)])
            time.sleep(rng.uniform(0.3, 1.3))  # a random moment, any phase of the heartbeat
            ws = [w for w in list_workers(client, queue) if int(w["pid"]) != helper.pid]
            assert ws, "the victim is not registered"
            kill = Kill(time.time(), ws[0]["id"])
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait(10)
            _wait(lambda ts=submitted: all(t.status() == "succeeded" for t in ts), 120,
                  "the round's tasks to succeed")
            times += recovery_times(client, queue, [t.id for t in submitted], [kill])
    finally:
        _stop(helper)
    return {"rounds": rounds, "times": times, "lease_s": lease_s}


def poison_turn(url: str, good: int, poison: bool, seed: int, workdir: Path) -> float:
    """Seconds for ``good`` tasks to succeed under one supervisor (default settings),
    with or without two poison tasks among them (one os._exit, one segfault), from
    the submit to the last success; the start-up is not counted."""
    client = redis.Redis.from_url(url)
    queue = f"poison-{seed}-{int(poison)}"
    q = mtq.Queue(queue, url)
    log = workdir / f"{queue}.log"
    sup = _start(["workers", "start", "benchmarks.faults_targets:Busy", "--queue", queue],
                 url, log)
    try:
        _wait(lambda: len(list_workers(client, queue)) == 1 and
              "standby ready" in log.read_text(), 60, "the worker and its standby")
        items: list[Any] = [{"i": i} for i in range(good)]
        if poison:
            items.insert(good // 10, {"i": -1, "exit": True})
            items.insert(good // 2, {"i": -2, "segv": True})
        start = time.monotonic()
        q.submit_many(items)
        _wait(lambda: q.stats()["succeeded"] >= good, 300, "the good tasks")
        took = time.monotonic() - start
        if poison:
            _wait(lambda: q.stats()["dead"] == 2, 60, "the poison tasks to end dead")
    finally:
        _stop(sup)
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
    replica = Server("--replicaof", "127.0.0.1", str(primary.port))
    try:
        link = redis.Redis(port=replica.port)
        _wait(lambda: link.info("replication").get("master_link_status") == "up", 10,
              "the replica")
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller run; prints only")
    ap.add_argument("--docs", action="store_true", help="write docs even with --quick")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    # items of 6 ms in the full run: the load outlasts 50 kills and their restarts
    tasks, kills, rounds, item_s = (4000, 10, 2, 0.001) if args.quick else \
        (20_000, 50, 8, 0.006)
    server = Server()
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
             TARGET_SUPERVISED_P99_S, f"{sup['kills']} kills, {sup['tasks']} tasks of "
             f"{item_s * 1000:g} ms over {sup['streams']} streams, 2 processes"),
        _row("bare `mtq worker run`: kill -9, default lease", bare["times"], TARGET_BARE_P99_S,
             f"{bare['rounds']} kills, lease {bare['lease_s']:g} s, heartbeat 1 s"),
    ]
    header = ["case", "tasks held", "p50 s", "p99 s", "max s", "target p99", "", "setup"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    clean, poisoned = statistics.median(poison["clean"]), statistics.median(poison["poisoned"])
    ratio = clean / poisoned
    lines += ["", "| good tasks | without poison (s) | with one os._exit and one segfault poison "
              "(s) | good-task throughput kept | target |", "|---|---|---|---|---|",
              f"| {poison['good']} | {clean:.2f} (turns: "
              f"{', '.join(f'{t:.2f}' for t in poison['clean'])}) | {poisoned:.2f} (turns: "
              f"{', '.join(f'{t:.2f}' for t in poison['poisoned'])}) | {ratio:.0%} | >= 90 % "
              f"{'met' if ratio >= 0.9 else 'NOT MET'} |"]
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
    if not args.quick or args.docs:
        write_docs(table, args)
    return 0


def write_docs(table: str, args: argparse.Namespace) -> None:
    path = ROOT / "docs" / "benchmarks.md"
    text = path.read_text()
    section = (
        "## Faults\n\n"
        f"`python -m benchmarks.faults{' --quick' if args.quick else ''}` on "
        f"{platform.node() or 'this machine'} ({os.cpu_count()} cores), "
        f"{dt.date.today().isoformat()}. Recovery is the time from a worker process's "
        "SIGKILL to the next claim of each task it held, read from the tasks' traces "
        "(Redis server time).\n\n" + table + "\n")
    pattern = re.compile(r"## Faults\n.*?(?=\n## |\Z)", re.S)
    text = pattern.sub(section, text) if pattern.search(text) else \
        text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
