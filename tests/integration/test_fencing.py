"""Frozen children fenced off: the supervisor kills a child whose beat stops for half
its lease (mtq.workers.fencing), before another worker can take its tasks, and gives
them back at once; a Redis freeze or a CPU-bound predict does not get a child killed.

Real processes (``mtq workers start``), a real redis-server; the test model
(tests/models.py Probe) logs each predict call's start (B) and return (D) with the
stream keys of its batch, from which the overlaps per stream are read.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

import mtq
from benchmarks.control_frozen import Wait, freeze_one, gone, stop_in_call
from mtq.workers.fencing import fence_s
from tests.support.servers import RedisServer
from tests.support.supervisors import StartFn, Sup, pid_exists, read_log, wait_workers
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(120)


def waiter(sup: Sup) -> Wait:
    """benchmarks.control_frozen's waits, as this harness's (a message with the output)."""
    def wait(what: str, cond: Callable[[], Any], timeout: float) -> Any:
        return wait_for(cond, timeout, f"{what}\n{sup.output()[-4000:]}")
    return wait


def wait_dead(pid: int, timeout: float, what: str, sup: Sup) -> float:
    """Wait until ``pid`` is gone (polled every 5 ms); returns when it was seen gone."""
    wait_for(lambda: gone(pid), timeout, f"{what}\n{sup.output()[-4000:]}", interval=0.005)
    return time.time()


# -- the fast one: one child, one stream, a short lease -------------------------------
def test_a_frozen_child_is_fenced_before_its_lease_runs_out_and_a_busy_one_is_not(
        supervise: StartFn, qname: str, redis_url: str, r: redis.Redis,
        tmp_path: Path) -> None:
    lease_ms = 1500
    log = tmp_path / "calls.log"
    sup = supervise("tests.models:Probe", qname, "--replicas", "1", "--standby", "0",
                    "--lease-ms", str(lease_ms), env={"MTQ_TEST_LOG": str(log)})
    (w,) = wait_workers(r, qname, 1, sup)
    q = mtq.Queue(qname, redis_url, lease_ms=lease_ms)
    # CPU-bound Python for twice the fence: the beat thread still runs, nothing killed
    busy = q.submit({"s": "a", "i": 0, "spin": 2 * fence_s(lease_ms / 1000)})
    assert busy.result(timeout=30)["pid"] == w["pid"]
    assert busy.info().deliveries == 1

    task = q.submit({"s": "a", "i": 1, "sleep": 1.0}, stream="a")
    pid, _, stopped = stop_in_call(log, waiter(sup), {w["pid"]})
    killed = wait_dead(pid, 10, "the frozen child killed", sup)
    # fenced at half the lease (plus a beat): before Redis could give its task to
    # another worker (2/3 of a lease after the last extend at the earliest)
    assert killed - stopped < lease_ms / 1000, (killed - stopped, sup.output())
    res = task.result(timeout=30)
    assert res["i"] == 1 and res["pid"] != pid
    info = task.info()
    assert info.deliveries == 2, info  # the frozen call counted, as a death's
    wait_for(lambda: "frozen: no sign of life" in sup.output(), 10, sup.output())
    assert sup.output().count("frozen: no sign of life") == 1, sup.output()
    # it ran to the end once, in another process; the frozen call never returned
    done = [c for c in read_log(log) if c.tag == "D" and "a:1" in c.keys]
    assert len(done) == 1 and done[0].pid != pid, done
    wait_workers(r, qname, 1, sup, check=lambda x: x["pid"] != pid)


# -- the whole case: a batched worker under load on 8 streams, frozen for 3 leases ---
@pytest.mark.slow
def test_a_frozen_child_under_load_is_fenced_no_call_overlaps_nothing_lost(
        supervise: StartFn, qname: str, redis_url: str, r: redis.Redis,
        tmp_path: Path) -> None:
    lease_ms = 1500
    log = tmp_path / "calls.log"
    sup = supervise("tests.models:Probe", qname, "--replicas", "2",
                    "--lease-ms", str(lease_ms), env={"MTQ_TEST_LOG": str(log)})
    wait_workers(r, qname, 2, sup)
    q = mtq.Queue(qname, redis_url, lease_ms=lease_ms)
    fig = freeze_one(log, q, lease_ms, waiter(sup))
    print({k: v for k, v in fig.items() if k != "tasks"})
    assert fig["overlaps"] and set(fig["overlaps"].values()) == {0}, fig["overlaps"]
    assert fig["lost"] == 0 and fig["twice"] == 0, fig
    for req, t in fig["tasks"]:
        res = t.result(timeout=5)
        assert (res["s"], res["i"]) == (req.payload["s"], req.payload["i"])
    assert (fig["stats"]["waiting"], fig["stats"]["running"], fig["stats"]["dead"]) == \
        (0, 0, 0), fig["stats"]
    assert fig["fence_s"] is not None and fig["fence_s"] < lease_ms / 1000, fig
    assert fig["recovery_s"] is not None and fig["recovery_s"] < 1.0, fig
    wait_for(lambda: "frozen: no sign of life" in sup.output(), 10, sup.output())
    assert sup.output().count("frozen: no sign of life") == 1, sup.output()
    wait_workers(r, qname, 2, sup, check=lambda w: w["pid"] != fig["pid"])


# -- Redis frozen longer than the fence: no child is killed ---------------------------
@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[RedisServer]:
    (tmp_path / "redis").mkdir()
    s = RedisServer(tmp_path / "redis")
    s.start()
    yield s
    if s.proc is not None and s.proc.poll() is None:
        s.proc.send_signal(signal.SIGCONT)
    s.stop()


@pytest.mark.slow
def test_redis_frozen_past_the_fence_kills_no_child(
        supervise: StartFn, qname: str, own_server: RedisServer, tmp_path: Path) -> None:
    lease_ms = 1000
    log = tmp_path / "calls.log"
    sup = supervise("tests.models:Probe", qname, "--replicas", "2", "--standby", "0",
                    "--lease-ms", str(lease_ms), "--redis", own_server.url,
                    env={"MTQ_TEST_LOG": str(log), "MTQ_REDIS_URL": own_server.url})
    r = redis.Redis.from_url(own_server.url)
    pids = {w["pid"] for w in wait_workers(r, qname, 2, sup)}
    q = mtq.Queue(qname, own_server.url, lease_ms=lease_ms)
    tasks = q.submit_many([{"s": "x", "i": i, "sleep": 0.05} for i in range(40)])
    wait_for(lambda: any(c.tag == "B" for c in read_log(log)), 30,
             f"a call started\n{sup.output()}")
    assert own_server.proc is not None
    own_server.proc.send_signal(signal.SIGSTOP)
    frozen_for = 3 * fence_s(lease_ms / 1000)
    time.sleep(frozen_for)  # Redis frozen for three fences: what is tested is that
    own_server.proc.send_signal(signal.SIGCONT)  # nothing happens meanwhile
    wait_for(lambda: q.stats()["succeeded"] + q.stats()["dead"] >= len(tasks), 60,
             f"every task settled: {q.stats()}\n{sup.output()[-4000:]}")
    assert "frozen: no sign of life" not in sup.output(), sup.output()
    assert all(pid_exists(p) for p in pids), sup.output()
    assert {w["pid"] for w in wait_workers(r, qname, 2, sup)} == pids
    assert q.stats()["succeeded"] == len(tasks), q.stats()


# -- a whole host frozen (supervisor included) for less than a lease: no child is killed
@pytest.mark.slow
def test_a_supervisor_frozen_with_its_children_kills_none_of_them(
        supervise: StartFn, qname: str, redis_url: str, r: redis.Redis,
        tmp_path: Path) -> None:
    # extends every 1 s: its lease is live for 3 s or more after the freeze
    lease_ms = 4000
    log = tmp_path / "calls.log"
    sup = supervise("tests.models:Probe", qname, "--replicas", "1", "--standby", "0",
                    "--lease-ms", str(lease_ms), env={"MTQ_TEST_LOG": str(log)})
    (w,) = wait_workers(r, qname, 1, sup)
    q = mtq.Queue(qname, redis_url, lease_ms=lease_ms)
    task = q.submit({"s": "a", "i": 0, "sleep": 0.5})
    wait_for(lambda: any(c.tag == "B" for c in read_log(log)), 30,
             f"the call started\n{sup.output()}")
    os.killpg(sup.pid, signal.SIGSTOP)  # the supervisor, its children, its fork server
    time.sleep(1.25 * fence_s(lease_ms / 1000))  # past the fence (2 s), within the lease
    # the supervisor resumes first (the worst order): its children a beat later
    os.kill(sup.pid, signal.SIGCONT)
    time.sleep(0.1)
    os.killpg(sup.pid, signal.SIGCONT)
    res = task.result(timeout=30)
    assert res["pid"] == w["pid"] and task.info().deliveries == 1, (res, task.info())
    assert "frozen: no sign of life" not in sup.output(), sup.output()
    assert pid_exists(w["pid"])


# -- an abandoned call: every task of it cancelled or timed out, and it runs on ---------
@pytest.mark.parametrize("how", ["cancel", pytest.param("timeout", marks=pytest.mark.slow)])
def test_a_call_that_ignores_its_stop_is_killed_after_the_grace(
        how: str, supervise: StartFn, qname: str, redis_url: str, r: redis.Redis,
        tmp_path: Path) -> None:
    grace = 0.5
    log = tmp_path / "calls.log"
    settings: dict[str, Any] = {"lease_ms": 2000, "cancel_grace_s": grace, "dead_letter": False,
                                "max_retries": 1 if how == "timeout" else 0}
    q = mtq.Queue(qname, redis_url, **settings)
    # a plain function that ignores cancel (time.sleep), first of a batch of 4 claimed
    # at once (submitted before the worker starts)
    slow = q.submit({"s": "x", "i": 0, "sleep": 60}, timeout=0.3 if how == "timeout" else None)
    rest = q.submit_many([{"s": "x", "i": i, "sleep": 0.01} for i in (1, 2, 3)])
    sup = supervise("tests.handlers:logged", qname, settings=settings, replicas=1,
                    max_batch_size=4, env={"MTQ_TEST_LOG": str(log)})
    first = wait_for(lambda: next((c.pid for c in read_log(log) if c.tag == "B"), None), 30,
                     f"the slow call started\n{sup.output()}")
    assert r.hget(f"mtq:{{{qname}}}:task:{rest[0].id}", "status") == b"running", \
        "the other tasks were not claimed with it"
    if how == "cancel":
        slow.cancel()
    stopped_at = time.time()
    wait_for(lambda: slow.status() in ("cancelled", "failed", "dead"), 30,
             f"the slow task ended: {slow.info()}\n{sup.output()[-4000:]}")
    info = slow.info()
    if how == "cancel":
        assert info.status == "cancelled", info
        # killed after the grace, not before (and not much after)
        assert grace <= time.time() - stopped_at < grace + 5, info
    else:  # TaskTimeout, retried once under its policy (killed again), then failed
        assert info.status == "failed" and (info.error or "").startswith("TaskTimeout: "), info
        assert info.attempts == 2, info
    for i, t in enumerate(rest, start=1):
        res = t.result(timeout=30)
        assert res["i"] == i and res["pid"] != first, res
        assert t.info().deliveries == 1, t.info()  # given back uncounted
    kills = 2 if how == "timeout" else 1
    what = "timed out" if how == "timeout" else "cancelled"
    line = f"all {what}, still ran {grace:g} s later; killed"
    # (the supervisor says it once the tasks are given back: it may come just after)
    wait_for(lambda: sup.output().count(line) >= kills, 10, f"{kills} kill(s): {sup.output()}")
    assert sup.output().count(line) == kills, sup.output()
    assert gone(first)
    # a new process serves
    assert q.submit({"s": "y", "i": 9}).result(timeout=30)["pid"] != first


def test_kills_that_stop_cancelled_calls_do_not_back_the_restarts_off(
        supervise: StartFn, qname: str, redis_url: str, tmp_path: Path) -> None:
    """Three non-cooperative calls cancelled one after another, each killed after the
    grace in a process that settled nothing else: each restart comes after the base
    delay, not 0.1, 0.2, 0.4 s as crashes in a row would."""
    grace = 0.3
    log = tmp_path / "calls.log"
    settings: dict[str, Any] = {"lease_ms": 2000, "cancel_grace_s": grace,
                                "dead_letter": False, "max_retries": 0}
    q = mtq.Queue(qname, redis_url, **settings)
    sup = supervise("tests.handlers:logged", qname, settings=settings, replicas=1,
                    standby=0, env={"MTQ_TEST_LOG": str(log)})
    for n in range(1, 4):
        slow = q.submit({"s": "x", "i": n, "sleep": 60})
        # its call started (a cancel before the call would drop it unrun: no kill)
        wait_for(lambda n=n: sum(c.tag == "B" for c in read_log(log)) == n, 30,
                 f"call {n} started\n{sup.output()[-3000:]}")
        slow.cancel()
        wait_for(lambda n=n: sup.output().count("restarting in") >= n, 30,
                 f"kill {n} and its restart\n{sup.output()[-3000:]}")
        assert slow.status() == "cancelled", slow.info()
    delays = re.findall(r"restarting in ([0-9.]+) s", sup.output())
    assert delays == ["0.1"] * 3, sup.output()[-3000:]


@pytest.mark.slow
def test_a_stopped_call_that_returns_within_the_grace_is_not_killed(
        supervise: StartFn, qname: str, redis_url: str, tmp_path: Path) -> None:
    grace = 1.5
    log = tmp_path / "calls.log"
    settings: dict[str, Any] = {"lease_ms": 2000, "cancel_grace_s": grace}
    q = mtq.Queue(qname, redis_url, **settings)
    task = q.submit({"s": "x", "i": 0, "sleep": 0.5})  # ignores the cancel, returns in time
    sup = supervise("tests.handlers:logged", qname, settings=settings, replicas=1,
                    standby=0, env={"MTQ_TEST_LOG": str(log)})
    pid = wait_for(lambda: next((c.pid for c in read_log(log) if c.tag == "B"), None), 30,
                   f"the call started\n{sup.output()}")
    task.cancel()
    cancelled_at = time.monotonic()
    wait_for(lambda: task.status() == "cancelled", 10, f"cancelled: {task.info()}")
    # the next call, and idle, ended that aborted call: nothing happens when its grace
    # would have ended (what is tested is that nothing happens: hence the wait)
    assert q.submit({"s": "y", "i": 1}).result(timeout=10)["pid"] == pid
    time.sleep(max(0.0, cancelled_at + grace + 0.5 - time.monotonic()))
    assert q.submit({"s": "y", "i": 2}).result(timeout=10)["pid"] == pid
    assert "killed" not in sup.output(), sup.output()
