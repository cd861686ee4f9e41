"""Fairness, many consumer processes, and kill -9 of a consumer mid-batch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

import mtq
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(180)


def test_one_task_streams_finish_in_the_first_round(qname: str, redis_url: str) -> None:
    q = mtq.Queue(qname, redis_url)
    c = mtq.Consumer(qname, redis_url)
    q.submit_many([{"big": i} for i in range(10_000)], stream="heavy")
    small = q.submit_many([mtq.Request({"small": i}, stream=f"light-{i}") for i in range(50)])
    # One round of claims = one pass over the ring: 51 streams with batch 64.
    got = c.claim(64)
    assert len(got) == 51
    c.settle([mtq.Outcome(t, ok=True) for t in got])
    assert all(t.status() == "succeeded" for t in small)
    # With a smaller batch, a round is ceil(51 / 8) = 7 claims.
    q2 = mtq.Queue(qname + "-b", redis_url)
    c2 = mtq.Consumer(qname + "-b", redis_url)
    q2.submit_many([{"big": i} for i in range(10_000)], stream="heavy")
    small2 = q2.submit_many([mtq.Request({}, stream=f"light-{i}") for i in range(50)])
    heavy_runs = 0
    for _ in range(7):  # one pass over the ring: 51 streams in claims of 8
        got = c2.claim(8)
        heavy_runs += sum(1 for t in got if t.stream == "heavy")
        c2.settle([mtq.Outcome(t, ok=True) for t in got])
    assert all(t.status() == "succeeded" for t in small2)
    # The heavy stream ran in the first claim, went to the back of the ring, and
    # came round again only in the 7th: two of its tasks in a whole round.
    assert heavy_runs == 2


CONSUMER = r"""
import os, sys, mtq, redis
url, queue, log_key = sys.argv[1], sys.argv[2], sys.argv[3]
r = redis.Redis.from_url(url)
c = mtq.Consumer(queue, url)
while True:
    tasks = c.claim(32)
    if not tasks:
        if c.next_timer_ms < 0 and r.llen(log_key.replace(":log", ":stop")):
            break
        c.wait(timeout=0.5)
        continue
    outcomes = []
    pipe = r.pipeline(transaction=False)
    for t in tasks:
        pipe.rpush(log_key, f"{t.stream}|{t.id}|{os.getpid()}")
        outcomes.append(mtq.Outcome(t, ok=True, value=os.getpid()))
    pipe.execute()
    c.settle(outcomes)
"""


@pytest.mark.slow
def test_many_consumer_processes_every_task_once_in_order(qname: str, redis_url: str,
                                                          r: redis.Redis,
                                                          subprocess_env: dict[str, str]) -> None:
    q = mtq.Queue(qname, redis_url)
    expected: dict[str, list[str]] = defaultdict(list)
    requests = [mtq.Request({"s": s, "i": i}, stream=f"user-{s}")
                for i in range(50) for s in range(200)]
    for req, task in zip(requests, q.submit_many(requests)):
        expected[req.stream].append(task.id)  # type: ignore[index]
    log_key = f"test:{qname}:log"
    procs = [subprocess.Popen([sys.executable, "-c", CONSUMER, redis_url, qname, log_key],
                              env=subprocess_env) for _ in range(4)]
    try:
        wait_for(lambda: q.stats()["succeeded"] == 10_000, 120,
                 f"10 000 tasks did not all succeed: {q.stats()}")
        r.rpush(f"test:{qname}:stop", 1)
        for p in procs:
            assert p.wait(30) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    log = [x.decode().split("|") for x in r.lrange(log_key, 0, -1)]
    assert len(log) == 10_000 and len({task_id for _, task_id, _ in log}) == 10_000
    ran: dict[str, list[str]] = defaultdict(list)
    for stream, task_id, _pid in log:
        ran[stream].append(task_id)
    assert ran == expected                      # per-stream order intact
    assert len({pid for _, _, pid in log}) > 1  # the work really was shared
    s = q.stats()
    assert (s["waiting"], s["running"], s["redelivered"]) == (0, 0, 0)


HOLDER = r"""
import sys, mtq
url, queue = sys.argv[1], sys.argv[2]
c = mtq.Consumer(queue, url, settings=mtq.QueueSettings(lease_ms=int(sys.argv[3])))
tasks = c.claim(10)
print(",".join(t.id for t in tasks), flush=True)
sys.stdin.read()   # hold the batch until killed
"""


@pytest.mark.slow
def test_kill_9_mid_batch_tasks_come_back_at_head(qname: str, redis_url: str,
                                                  subprocess_env: dict[str, str]) -> None:
    lease_ms = 600
    q = mtq.Queue(qname, redis_url, lease_ms=lease_ms)
    streams = {f"u{s}": q.submit_many([{"s": s, "i": i} for i in range(3)], stream=f"u{s}")
               for s in range(10)}
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, redis_url, qname, str(lease_ms)],
                            env=subprocess_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    held = set(proc.stdout.readline().strip().split(","))  # type: ignore[union-attr]
    assert held == {tasks[0].id for tasks in streams.values()}
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    # A live worker blocks until the dead worker's lease runs out, then reclaims.
    c = mtq.Consumer(qname, redis_url, settings=q.settings)
    order: dict[str, list[str]] = defaultdict(list)
    redelivered_at = None
    t0 = time.monotonic()
    while q.stats()["succeeded"] < 30:
        assert time.monotonic() - t0 < 2 * lease_ms / 1000 + 5, \
            f"the killed consumer's tasks did not all complete: {q.stats()}"
        tasks = c.claim(10)
        if not tasks:
            c.wait(timeout=5)
            continue
        if redelivered_at is None:
            redelivered_at = time.monotonic() - t0
            assert {t.id for t in tasks} == held and all(t.deliveries == 2 for t in tasks)
        for t in tasks:
            order[t.stream or ""].append(t.id)
        c.settle([mtq.Outcome(t, ok=True) for t in tasks])
    assert redelivered_at is not None and redelivered_at < 2 * lease_ms / 1000 + 0.5
    assert order == {s: [t.id for t in tasks] for s, tasks in streams.items()}
    assert q.stats()["redelivered"] == 10


def starter(env: dict[str, str], procs: list[subprocess.Popen[bytes]]
            ) -> Callable[..., subprocess.Popen[bytes]]:
    """``start(*args, hang=False)``: a Python process with ``args`` and ``env``
    (``MTQ_TEST_HANG`` set with ``hang``: tests.models' victim), added to ``procs``."""

    def start(*args: str, hang: bool = False) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([sys.executable, *args],
                                env={**env, "MTQ_TEST_HANG": "1"} if hang else env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        procs.append(proc)
        return proc

    return start


#: ``mtq worker run tests.models:Probe`` (batches of 4) with every batch counted as fast
#: (FAST_BATCH_S raised, however slow this machine is at the moment) and no more than two
#: batches fitting in AHEAD_WORK_S of its work: on a deep queue it keeps two batches
#: claimed ahead of the one it runs (Fetcher.claim_ahead)
FAST_WORKER = r"""
import sys
from mtq.workers import fetcher
fetcher.FAST_BATCH_S = 60.0
fetcher.AHEAD_WORK_S = 0.0
from mtq.cli.main import cli
cli(["worker", "run", "tests.models:Probe", "--queue", sys.argv[1], "--lease-ms", sys.argv[2]],
    prog_name="mtq")
"""


def test_kill_9_of_a_worker_holding_two_batches_ahead_loses_nothing_and_keeps_order(
        qname: str, redis_url: str, subprocess_env: dict[str, str], tmp_path: Path) -> None:
    lease_ms = 1500
    q = mtq.Queue(qname, redis_url, lease_ms=lease_ms)
    # 24 streams of 2: a claim takes the heads of 4 of them, and the heads alone fill the
    # first six claims. The first task of s8 (third batch) hangs in the victim, which then
    # holds that batch and two more claimed ahead, its first two batches acked.
    streams = {s: q.submit_many([{"s": s, "i": i, "hang_here": (s, i) == (8, 0)}
                                 for i in range(2)], stream=f"s{s}") for s in range(24)}
    log = tmp_path / "calls.log"
    env = {**subprocess_env, "MTQ_TEST_LOG": str(log)}
    procs: list[subprocess.Popen[bytes]] = []
    start = starter(env, procs)

    try:
        victim = start("-c", FAST_WORKER, qname, str(lease_ms), hang=True)
        wait_for(lambda: (q.stats()["succeeded"], q.stats()["running"]) == (8, 12), 60,
                 "the worker does not hold its hanging batch and two claimed ahead: "
                 f"{q.stats()}")
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(10)
        # another worker takes them back once their leases run out
        start("-m", "mtq", "worker", "run", "tests.models:Probe", "--queue", qname,
              "--lease-ms", str(lease_ms))
        wait_for(lambda: q.stats()["succeeded"] == 48, 60,
                 f"the killed worker's tasks did not all complete: {q.stats()}")
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)
    # each task ran to completion once (the victim's hanging call never returned), each
    # stream in order
    done = [key for line in log.read_text().splitlines() if line[0] == "D"
            for key in line.split()[3:]]
    assert sorted(done) == sorted(f"{s}:{i}" for s in streams for i in range(2))
    order: dict[str, list[int]] = defaultdict(list)
    for key in done:
        s, i = key.split(":")
        order[s].append(int(i))
    assert order == {str(s): [0, 1] for s in streams}
    assert [t.result(timeout=1)["i"] for ts in streams.values() for t in ts] == [0, 1] * 24
    # the twelve it held (the heads of s8 to s19) were delivered again; the others once
    twice = {(s, i) for s, ts in streams.items() for i, t in enumerate(ts)
             if t.info().deliveries == 2}
    assert twice == {(s, 0) for s in range(8, 20)}, twice
    assert q.stats()["redelivered"] == 12


#: ``mtq worker run tests.models:Probe --batch-size 1`` with every batch counted as fast
#: and AHEAD_MOST tasks of its work fitting in AHEAD_WORK_S: on a deep queue it keeps
#: AHEAD_MOST batches of one claimed ahead, claimed many at a time (Fetcher.claim_ahead)
DEEP_WORKER = r"""
import sys
from mtq.workers import fetcher
fetcher.FAST_BATCH_S = 60.0
fetcher.AHEAD_WORK_S = 60.0
from mtq.cli.main import cli
cli(["worker", "run", "tests.models:Probe", "--batch-size", "1", "--queue", sys.argv[1],
     "--lease-ms", sys.argv[2]], prog_name="mtq")
"""


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_a_worker_holding_many_batches_of_one_ahead_that_dies_or_freezes_loses_nothing(
        qname: str, redis_url: str, subprocess_env: dict[str, str], tmp_path: Path,
        fault: str) -> None:
    """A worker of batches of one that claims many at a time, SIGKILLed or SIGSTOPped
    while its model is in the 11th task with more than AHEAD_MOST / 2 claimed ahead of
    it (it claims again only once it has room for half of AHEAD_MOST): every task it
    held runs to completion once, on another worker, once their leases run out; the
    others once. Frozen, then resumed once the other worker is done and gone, it
    starts none of the tasks it held (its call in the 11th runs on to its end, its
    result refused), and runs the next task submitted, which it found behind them."""
    from mtq.workers.fetcher import AHEAD_MOST

    lease_ms = 1500
    q = mtq.Queue(qname, redis_url, lease_ms=lease_ms)
    n = 120
    # the 11th hangs in the victim (killed), or sleeps 4 s (frozen mid-way)
    hold = {"hang_here": True} if fault == "kill" else {"sleep": 4}
    tasks = q.submit_many([{"s": "-", "i": i, **(hold if i == 10 else {})} for i in range(n)])
    log = tmp_path / "calls.log"
    env = {**subprocess_env, "MTQ_TEST_LOG": str(log)}
    procs: list[subprocess.Popen[bytes]] = []
    start = starter(env, procs)

    def lines(tag: str, pid: int, after: float = 0.0) -> list[str]:
        return [key for line in log.read_text().splitlines()
                for t, when, who, *keys in [line.split()]
                if t == tag and int(who) == pid and float(when) > after for key in keys]

    def in_the_11th() -> bool:
        s = q.stats()
        return s["succeeded"] == 10 and s["running"] > 1 + AHEAD_MOST // 2 and \
            "-:10" in lines("B", victim.pid)

    try:
        victim = start("-c", DEEP_WORKER, qname, str(lease_ms), hang=True)
        # the first ten ran one at a time, in order; the slot is full behind the 11th
        wait_for(in_the_11th, 60, f"the worker is not in its 11th task with more than "
                 f"{AHEAD_MOST // 2} claimed ahead")
        os.kill(victim.pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        if fault == "kill":
            victim.wait(10)
        # what it held: nothing moves until their leases run out, and nobody else runs
        held = [i for i, t in enumerate(tasks) if t.status() == "running"]
        assert held == list(range(10, 10 + len(held))) and len(held) > 1 + AHEAD_MOST // 2
        other = start("-m", "mtq", "worker", "run", "tests.models:Probe", "--queue", qname,
                      "--lease-ms", str(lease_ms))
        wait_for(lambda: q.stats()["succeeded"] == n, 60,
                 "the tasks it held did not all complete")
        if fault == "freeze":
            other.send_signal(signal.SIGTERM)
            assert other.wait(20) == 0
            resumed = time.time()
            os.kill(victim.pid, signal.SIGCONT)
            # the only worker left: it runs this once it took (and dropped) what it held
            marker = q.submit({"s": "m", "i": 0})
            assert marker.result(timeout=30)["pid"] == victim.pid
            assert lines("B", victim.pid, resumed) == ["m:0"]
            assert lines("D", victim.pid, resumed) == ["-:10", "m:0"]
            assert tasks[10].result(timeout=1)["pid"] == other.pid  # its own refused
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait(10)
    done = [key for line in log.read_text().splitlines() if line[0] == "D"
            for key in line.split()[3:] if key != "m:0"]
    twice_done = ["-:10"] if fault == "freeze" else []  # the call it was in, and the rerun
    assert sorted(done) == sorted([f"-:{i}" for i in range(n)] + twice_done)
    assert [t.result(timeout=1)["i"] for t in tasks] == list(range(n))
    twice = [i for i, t in enumerate(tasks) if t.info().deliveries == 2]
    assert twice == held
    assert q.stats()["redelivered"] == len(held)


def test_kill_9_of_an_idle_worker_with_its_model_threads_ack_in_flight_ends_the_task_once(
        qname: str, redis_url: str, r: redis.Redis, subprocess_env: dict[str, str],
        tmp_path: Path) -> None:
    """An idle worker's model thread sends a task's ack itself (Publisher.settle_here).
    Killed with that ack held in Redis (CLIENT PAUSE WRITE holds every script call),
    the task still ends once: the ack ran, or it was dropped with the connection and
    another worker runs the task again when its lease runs out. Never both."""
    lease_ms = 2000
    q = mtq.Queue(qname, redis_url, lease_ms=lease_ms)
    log = tmp_path / "calls.log"
    env = {**subprocess_env, "MTQ_TEST_LOG": str(log)}
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([sys.executable, "-m", "mtq", "worker", "run",
                                 "tests.models:Probe", "--queue", qname,
                                 "--lease-ms", str(lease_ms)],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        procs.append(proc)
        return proc

    def lines(tag: str) -> list[list[str]]:
        text = log.read_text() if log.exists() else ""
        return [ln.split() for ln in text.splitlines() if ln.startswith(tag + " ")]

    def held_scripts() -> list[dict[str, object]]:
        return [c for c in r.client_list() if "b" in str(c["flags"]) and c["cmd"] == "evalsha"]

    try:
        victim = start()
        wait_for(lambda: lines("S"), 60, "the worker did not set its model up")
        warm = q.submit({"i": -1})  # the worker is up, and idle again after it
        assert warm.result(timeout=30)["pid"] == victim.pid
        t = q.submit({"i": 0, "sleep": 0.3})
        wait_for(lambda: len(lines("B")) == 2, 10, "the task did not start")
        r.execute_command("CLIENT", "PAUSE", str(10 * lease_ms), "WRITE")
        try:
            wait_for(lambda: len(lines("D")) == 2 and held_scripts(), 10,
                     "the worker's ack was not held in Redis")
            os.kill(victim.pid, signal.SIGKILL)
            victim.wait(10)
        finally:
            r.execute_command("CLIENT", "UNPAUSE")
        second = start()
        wait_for(lambda: t.status() == "succeeded", 60, f"the task did not end: {t.info()}")
        # the second worker serves the queue: a later task runs once, on it
        assert q.submit({"i": 1}).result(timeout=30)["pid"] == second.pid
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)
    runs = [ln[2] for ln in lines("D") if ln[3:] == ["-:0"]]
    result, deliveries = t.result(timeout=1), t.info().deliveries
    if deliveries == 1:  # the held ack ran: the victim's result, and no second run
        assert runs == [str(victim.pid)] and result["pid"] == victim.pid
    else:  # dropped with the connection: run again once, on the second worker
        assert deliveries == 2 and runs == [str(victim.pid), str(second.pid)]
        assert result["pid"] == second.pid
    assert q.stats()["succeeded"] == 3
