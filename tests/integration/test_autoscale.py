"""The backlog figure (mtq_queue_backlog_tasks) and ``mtq workers start --autoscale``:
real redis-server, real supervisor and worker processes (docs/scaling.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import redis

import mtq
from mtq.broker.keys import QueueKeys
from mtq.observe.prometheus import MtqCollector
from tests.support.supervisors import StartFn, wait_workers, workers_of
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(90)


def figure(r: redis.Redis, queue: str) -> tuple[int, float]:
    st = MtqCollector(r, [queue], workers=None).read().stats[queue]
    return int(st["backlog"]), float(st["backlog_cost"])


def true_backlog(r: redis.Redis, queue: str, tasks: list[mtq.Task]) -> int:
    """Tasks not yet finished, from each task's own status."""
    pipe = r.pipeline(transaction=False)
    for t in tasks:
        pipe.hget(QueueKeys(queue).task(t.id), "status")
    return sum(s in (b"queued", b"running", b"delayed") for s in pipe.execute())


def test_the_backlog_is_exact_at_rest_under_cancels_and_counts_due_delayed(
        r: redis.Redis, qname: str, redis_url: str) -> None:
    q = mtq.Queue(qname, redis_url)
    tasks = q.submit_many([{"i": i} for i in range(30)])
    assert figure(r, qname) == (30, 30.0)
    for t in tasks[:7]:
        assert t.cancel()
    assert figure(r, qname) == (23, 23.0)
    later = q.submit({"late": 1}, delay=0.3)
    assert figure(r, qname)[0] == 23  # not due: not yet backlog
    wait_for(lambda: figure(r, qname)[0] == 24, 5,
             f"a due delayed task counts with no worker up: {figure(r, qname)}")
    assert later.cancel()
    # with costs (scheduling on): the waiting cost is exact
    q2 = mtq.Queue(qname + "c", redis_url)
    q2.submit_many([mtq.Request({"i": i}, tenant="a", cost=2.5) for i in range(4)])
    assert figure(r, qname + "c") == (4, 10.0)


def test_the_backlog_follows_a_load_through_a_kill_and_cancels(
        supervise: StartFn, r: redis.Redis, qname: str, redis_url: str) -> None:
    q = mtq.Queue(qname, redis_url)
    sup = supervise("tests.models:Probe", qname, "--replicas", "2", "--standby", "0",
                    "--lease-ms", "1000")
    wait_workers(r, qname, 2, sup)
    tasks = q.submit_many([{"i": i, "sleep": 0.02} for i in range(150)])
    cancelled = [t for t in tasks[-20:] if t.cancel()]
    assert cancelled, "some of the last tasks were still waiting"
    killed = False
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline, f"the backlog never drained: {sup.output()[-3000:]}"
        before = figure(r, qname)[0]
        truth = true_backlog(r, qname, tasks)
        after = figure(r, qname)[0]
        # the backlog only falls while nothing is submitted: the truth read between
        # two figures lies between them
        assert after <= truth <= before, (before, truth, after)
        if truth == 0:
            break
        if not killed and truth < 100:
            os.kill(int(workers_of(r, qname, live_only=True)[0]["pid"]), signal.SIGKILL)
            killed = True
        time.sleep(0.05)
    assert killed
    wait_for(lambda: figure(r, qname) == (0, 0.0), 10,
             f"the figure settles to 0: {figure(r, qname)}")
    st = q.stats()
    assert st["succeeded"] == 150 - len(cancelled), st


def test_autoscale_from_zero_wakes_on_the_first_task_and_returns_to_zero(
        supervise: StartFn, r: redis.Redis, qname: str, redis_url: str) -> None:
    q = mtq.Queue(qname, redis_url)
    sup = supervise("tests.models:Probe", qname, "--autoscale", "0:2,drain=1,cooldown=1",
                    "--standby", "0")
    wait_for(lambda: "supervisor" in sup.output(), 20, f"started: {sup.output()}")
    assert workers_of(r, qname, live_only=True) == []
    t0 = time.monotonic()
    assert q.submit({"i": 1}).result(timeout=30)["i"] == 1
    first_wait = time.monotonic() - t0
    wait_for(lambda: "claimed" in sup.output(), 10, f"the first wait logged: {sup.output()}")
    cold_ms = int(r.hget(QueueKeys(qname).stats, "cold_start_ms") or -1)
    assert 0 <= cold_ms <= first_wait * 1000 + 50, (cold_ms, first_wait)
    st = MtqCollector(r, [qname], workers=None).read().stats[qname]
    assert st["cold_start"] == cold_ms / 1000
    # idle for the cool-down: back to zero processes
    wait_for(lambda: "-> 0 process" in sup.output() and
             not workers_of(r, qname, live_only=True), 20,
             f"scaled back to zero: {sup.output()[-3000:]}")
    # and woken again
    assert q.submit({"i": 2}).result(timeout=30)["i"] == 2
    assert sup.output().count("woken from zero") == 2, sup.output()
    # asleep at zero, it was woken by the submit's marker on the wake list (no ticks)
    assert "woken from zero by a submit" in sup.output(), sup.output()
    wait_for(lambda: sup.output().count("was claimed") == 2, 10,
             f"each wake's first wait logged: {sup.output()}")


def test_at_zero_a_delayed_task_wakes_the_autoscaler_when_it_falls_due(
        supervise: StartFn, r: redis.Redis, qname: str, redis_url: str) -> None:
    # the delayed submit pushes a wake marker (its due time is the set's first): the
    # autoscaler wakes, finds nothing to do yet, and must sleep only until the task is
    # due, not its whole idle wait (5 s)
    q = mtq.Queue(qname, redis_url)
    sup = supervise("tests.models:Probe", qname, "--autoscale", "0:1,drain=1,cooldown=1",
                    "--standby", "0")
    wait_for(lambda: "supervisor" in sup.output(), 20, f"started: {sup.output()}")
    t0 = time.monotonic()
    task = q.submit({"i": 7}, delay=1.0)
    # the wake itself is timed: the process's start-up (a model's imports) is not
    wait_for(lambda: "woken from zero" in sup.output(), 30, f"woken: {sup.output()}")
    woke = time.monotonic() - t0
    assert 1.0 <= woke < 4.0, (woke, sup.output()[-2000:])
    assert task.result(timeout=30)["i"] == 7


@pytest.mark.slow
def test_autoscale_adds_capacity_for_a_step_of_load_then_scales_down(
        supervise: StartFn, r: redis.Redis, qname: str, redis_url: str) -> None:
    q = mtq.Queue(qname, redis_url)
    sup = supervise("tests.models:Probe", qname, "--autoscale", "1:3,drain=1,cooldown=2",
                    "--standby", "0")
    wait_workers(r, qname, 1, sup)
    q.submit({"i": 0, "sleep": 0.05}).result(timeout=20)  # a measured rate
    t0 = time.monotonic()
    tasks = q.submit_many([{"i": i, "sleep": 0.05} for i in range(200)])
    wait_workers(r, qname, 3, sup, timeout=40)
    added = time.monotonic() - t0
    for t in tasks:
        t.result(timeout=60)
    wait_for(lambda: len(workers_of(r, qname, live_only=True)) == 1, 30,
             f"back to MIN after the cool-down: {sup.output()[-3000:]}")
    ups = [ln for ln in sup.output().splitlines() if "autoscale:" in ln and "-> " in ln]
    assert len(ups) <= 4, ups  # up (maybe in two steps) and down once: no flapping
    assert added < 30, added


def test_a_bad_autoscale_exits_2_naming_it(redis_url: str,
                                          subprocess_env: dict[str, str]) -> None:
    for value, says in (("3:1", "MIN <= MAX"), ("0:4,speed=2", "drain=SECONDS")):
        out = subprocess.run(
            [sys.executable, "-m", "mtq", "workers", "start", "tests.models:Probe", "-q",
             "x", "--redis", redis_url, "--autoscale", value],
            env=subprocess_env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and says in out.stderr, (out.returncode, out.stderr)


def test_the_autoscaler_thread_outlives_a_broker_error_in_its_tick(
        client: redis.Redis, r: redis.Redis, qname: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """The registry read (measured_rate) wraps redis-py's errors in mtq's BrokerError
    (RedisUnavailable for Redis gone mid-tick): the thread logs it and ticks on, as it
    does for the backlog's read, instead of ending and leaving the host unscaled. The
    registry is made unreadable here by a worker entry of the wrong type."""
    from types import SimpleNamespace

    from mtq.broker import keys
    from mtq.workers.autoscale import Autoscaler, Policy

    asked: list[int] = []
    sup = SimpleNamespace(queue=qname, consumer=SimpleNamespace(redis=client),
                          devices=["cpu"], replicas=0, stopping=False, draining=False,
                          on_event=lambda line: None,
                          request=lambda msg: asked.append(msg["replicas"]))
    r.zadd(keys.WORKERS, {"bogus": time.time()})
    r.set(keys.worker("bogus"), "not a hash")
    mtq.Queue(qname, client=client).submit("x")
    scaler = Autoscaler(sup, Policy(0, 2, tick_s=0.05))
    scaler.start()
    try:
        wait_for(lambda: "worker registry" in caplog.text or not scaler._thread.is_alive(),
                 5, "a tick into the registry's error")
        assert scaler._thread.is_alive(), "the autoscaler thread ended on a BrokerError"
        r.delete(keys.worker("bogus"))
        r.zrem(keys.WORKERS, "bogus")
        wait_for(lambda: asked, 5, "a scale up once the registry reads again")
        assert asked[0] == 1
    finally:
        scaler.close()
