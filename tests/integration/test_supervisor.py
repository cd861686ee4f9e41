"""Fault tests of the worker supervisor: real processes, the session's real Redis.

Each supervisor runs in a subprocess in a session of its own (``mtq workers start``,
or a small launcher for the :class:`~mtq.workers.supervisor.Supervisor` settings the
CLI does not expose), so signals reach it on its main thread and the teardown can
SIGKILL the whole process group: no worker process outlives its test. The models
(``tests/models.py``) log every predict call to a file, which is how the tests
see which process ran which batch and in what order.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import redis

import mtq
from mtq.workers import control, devices, registry
from mtq.workers.registry import list_workers
from mtq.workers.restarts import MAX_SETUP_FAILURES
from tests.support.supervisors import (
    Call,
    StartFn,
    Sup,
    pid_exists,
    read_log,
    wait_workers,
    workers_of,
)
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(120)

PY = sys.executable


# -- helpers -----------------------------------------------------------------------
def open_batches(calls: list[Call]) -> dict[int, Call]:
    """pid -> its predict call in progress (a B line with no D line after it)."""
    last: dict[int, Call] = {}
    for c in calls:
        if c.tag in "BD":
            last[c.pid] = c
    return {pid: c for pid, c in last.items() if c.tag == "B"}


def done_order(calls: list[Call]) -> dict[str, list[int]]:
    """stream -> indexes in the order their predict calls returned."""
    order: dict[str, list[int]] = defaultdict(list)
    for c in calls:
        if c.tag == "D":
            for k in c.keys:
                s, i = k.split(":")
                order[s].append(int(i))
    return dict(order)


def streamed(q: mtq.Queue, streams: int, per_stream: int, start: int = 0,
             **fields: Any) -> dict[str, list[mtq.Task]]:
    """Submit ``per_stream`` tasks to each of ``streams`` streams, interleaved; returns
    stream -> tasks in submit order. Payloads: {"s": stream, "i": index, **fields},
    indexes from ``start``."""
    reqs = [mtq.Request({"s": f"s{s}", "i": i, **fields}, stream=f"s{s}")
            for i in range(start, start + per_stream) for s in range(streams)]
    out: dict[str, list[mtq.Task]] = defaultdict(list)
    for req, task in zip(reqs, q.submit_many(reqs)):
        out[req.stream].append(task)  # type: ignore[index]
    return dict(out)


def wait_succeeded(q: mtq.Queue, n: int, sup: Sup, timeout: float = 40) -> None:
    wait_for(lambda: q.stats()["succeeded"] >= n, timeout,
             f"{n} tasks succeeded: {q.stats()}\n{sup.output()[-6000:]}")


def assert_each_succeeded_once(q: mtq.Queue, by_stream: dict[str, list[mtq.Task]]) -> None:
    """Every task succeeded with its own payload echoed back, and no task was acked twice."""
    total = sum(len(ts) for ts in by_stream.values())
    for s, tasks in by_stream.items():
        for i, task in enumerate(tasks):
            res = task.result(timeout=5)
            assert (res["s"], res["i"]) == (s, i), (task, res)
    stats = q.stats()
    assert stats["succeeded"] == total, stats
    assert (stats["waiting"], stats["running"], stats["dead"]) == (0, 0, 0), stats


# -- 1. kill -9 mid-batch -----------------------------------------------------------
@pytest.mark.slow
def test_kill_9_of_a_worker_mid_batch_loses_nothing_and_keeps_order(
        supervise: StartFn, qname: str, redis_url: str, r: redis.Redis,
        tmp_path: Path) -> None:
    lease_ms = 2000
    log = tmp_path / "calls.log"
    sup = supervise("tests.models:Probe", qname, "--replicas", "2",
                    "--lease-ms", str(lease_ms), env={"MTQ_TEST_LOG": str(log)})
    first = wait_workers(r, qname, 2, sup)
    q = mtq.Queue(qname, redis_url, lease_ms=lease_ms)
    by_stream = streamed(q, streams=8, per_stream=6, sleep=0.1)  # a batch of 4 takes 0.4 s

    victim = wait_for(lambda: open_batches(read_log(log)), 20,
                      f"a predict call started\n{sup.output()}")
    pid, batch = next(iter(victim.items()))
    os.kill(pid, signal.SIGKILL)
    killed_at = time.time()
    # it really died inside predict: its last call never returned
    assert open_batches([c for c in read_log(log) if c.pid == pid]) == {pid: batch}

    wait_succeeded(q, 48, sup)
    assert_each_succeeded_once(q, by_stream)
    calls = read_log(log)
    # per stream, predict calls returned in submit order, each task exactly once
    assert done_order(calls) == {s: list(range(6)) for s in by_stream}
    # the killed call's tasks ran again promptly (given back at once, not at lease expiry)
    rerun = [c for c in calls if c.tag == "B" and c.t > killed_at and set(c.keys) & set(batch.keys)]
    assert rerun, calls
    assert rerun[0].t - killed_at < 2 * lease_ms / 1000, (rerun[0], killed_at)
    # ...and each alone, as suspects
    assert all(len(c.keys) == 1 for c in rerun), rerun
    # the running call's deliveries were counted; everything else ran on its first
    tasks = {f"{s}:{i}": t for s, ts in by_stream.items() for i, t in enumerate(ts)}
    deliveries = {k: t.info().deliveries for k, t in tasks.items()}
    assert {k for k, d in deliveries.items() if d != 1} == set(batch.keys), deliveries
    assert all(deliveries[k] == 2 for k in batch.keys), deliveries
    # the supervisor restarted the killed worker
    assert "died (exit code -9)" in sup.output()
    after = wait_workers(r, qname, 2, sup, check=lambda w: w["pid"] != pid)
    assert {w["pid"] for w in first} - {w["pid"] for w in after} == {pid}
    assert not pid_exists(pid)


def poison_runs(log: Path, key: str, max_deliveries: int) -> list[Call]:
    """The predict calls that ran the poison task ``key``: one per delivery, each in a
    process of its own (it killed each one), and alone after the first."""
    runs = [c for c in read_log(log) if c.tag == "B" and key in c.keys]
    assert len(runs) == max_deliveries, runs
    assert all(c.keys == (key,) for c in runs[1:]), runs
    assert len({c.pid for c in runs}) == max_deliveries, runs
    return runs


# -- 2. os._exit inside predict -----------------------------------------------------
@pytest.mark.slow
def test_a_task_that_kills_its_process_ends_dead_others_succeed(
        supervise: StartFn, qname: str, redis_url: str, r: redis.Redis,
        tmp_path: Path) -> None:
    max_deliveries = 3
    log = tmp_path / "calls.log"
    settings: dict[str, Any] = {"lease_ms": 2000, "max_deliveries": max_deliveries}
    sup = supervise("tests.models:Probe", qname, settings=settings, replicas=2,
                    env={"MTQ_TEST_LOG": str(log)})
    q = mtq.Queue(qname, redis_url, **settings)
    payloads: list[dict[str, Any]] = [{"s": "x", "i": i, "sleep": 0.02} for i in range(20)]
    payloads[5] = {"s": "x", "i": 5, "exit": True}
    tasks = q.submit_many(payloads)

    wait_for(lambda: q.stats()["succeeded"] == 19 and q.stats()["dead"] == 1, 60,
             f"19 succeeded and 1 dead: {q.stats()}\n{sup.output()[-6000:]}")
    for i, task in enumerate(tasks):
        if i == 5:
            continue
        assert task.result(timeout=5)["i"] == i
    poison = tasks[5].info()
    assert poison.status == "dead", poison
    assert poison.deliveries == max_deliveries, poison
    assert "PoisonTask" in (poison.error or "") and "worker process died" in (poison.error or "")
    with pytest.raises(mtq.TaskFailed) as failed:
        tasks[5].result(timeout=1)
    assert failed.value.status == "dead"
    # one process died per delivery of the poison task, and each time it ran alone after the
    # first: a serving process once (its standby took over), then the quarantine process
    runs = poison_runs(log, "x:5", max_deliveries)
    out = sup.output()
    assert out.count("died (exit code 1); its standby") == 1, out
    assert out.count("quarantine process") and out.count(
        "died (exit code 1) running a suspect") == max_deliveries - 1, out
    # and the supervisor keeps serving with two workers
    wait_workers(r, qname, 2, sup, check=lambda w: w["pid"] not in {c.pid for c in runs})
    assert sup.running()


# -- 3. a hung predict call ----------------------------------------------------------
@pytest.mark.slow
def test_a_hung_predict_is_killed_restarted_and_ends_dead(
        supervise: StartFn, qname: str, redis_url: str, r: redis.Redis,
        tmp_path: Path) -> None:
    max_deliveries = 3
    log = tmp_path / "calls.log"
    settings: dict[str, Any] = {"lease_ms": 2000, "max_deliveries": max_deliveries}
    sup = supervise("tests.models:Probe", qname, settings=settings, replicas=2,
                    timeout_s=1.5, env={"MTQ_TEST_LOG": str(log)})
    before = {w["pid"] for w in wait_workers(r, qname, 2, sup)}
    q = mtq.Queue(qname, redis_url, **settings)
    payloads: list[dict[str, Any]] = [{"s": "h", "i": i} for i in range(12)]
    payloads[2] = {"s": "h", "i": 2, "hang": True}
    tasks = q.submit_many(payloads)

    wait_for(lambda: q.stats()["dead"] == 1 and q.stats()["succeeded"] == 11, 60,
             f"the hung task dead, the rest succeeded: {q.stats()}\n{sup.output()[-6000:]}")
    hung = tasks[2].info()
    assert hung.status == "dead" and hung.deliveries == max_deliveries, hung
    assert "timeout" in (hung.error or ""), hung
    assert [t.result(timeout=5)["i"] for i, t in enumerate(tasks) if i != 2] == \
        [i for i in range(12) if i != 2]
    hung_pids = {c.pid for c in poison_runs(log, "h:2", max_deliveries)}
    out = sup.output()
    assert out.count("predict ran past its 1.5 s timeout; killing it") == max_deliveries, out
    # every hung process is gone, replaced by a new one
    after = wait_workers(r, qname, 2, sup, check=lambda w: w["pid"] not in hung_pids)
    assert not any(pid_exists(p) for p in hung_pids)
    assert {w["pid"] for w in after}.isdisjoint(before & hung_pids)


# -- 4. SIGTERM: graceful drain ------------------------------------------------------
def test_sigterm_stops_children_whose_main_thread_blocks_the_signal(
        supervise: StartFn, qname: str, redis_url: str, r: redis.Redis) -> None:
    # each child's setup blocks SIGTERM in its main thread (as a native library can):
    # the supervisor's SIGTERM to the child must stop it all the same
    sup = supervise("tests.models:SignalBlocker", qname, "--replicas", "2")
    wait_workers(r, qname, 2, sup)
    assert mtq.Queue(qname, redis_url).submit({"s": "a", "i": 0}).result(timeout=30)["i"] == 0
    sup.proc.send_signal(signal.SIGTERM)
    assert sup.wait_exit(20, "after SIGTERM") == 0, sup.output()
    wait_for(lambda: not sup.group_alive(), 10, "worker processes left after the supervisor")


@pytest.mark.slow
def test_sigterm_finishes_the_running_batch_and_gives_back_the_rest(
        supervise: StartFn, qname: str, redis_url: str, r: redis.Redis,
        tmp_path: Path) -> None:
    log = tmp_path / "calls.log"
    sup = supervise("tests.models:Probe", qname, "--replicas", "1", "--lease-ms", "5000",
                    env={"MTQ_TEST_LOG": str(log)})
    wait_workers(r, qname, 1, sup)
    q = mtq.Queue(qname, redis_url, lease_ms=5000)
    by_stream = streamed(q, streams=8, per_stream=2, sleep=0.5)  # a batch of 4 takes 2 s
    tasks = [t for ts in by_stream.values() for t in ts]

    def claimed() -> list[mtq.Task]:
        return [t for t in tasks if t.status() == "running"]

    batch = wait_for(lambda: open_batches(read_log(log)), 20, f"a batch started\n{sup.output()}")
    (running,) = batch.values()
    # a batch of 4 runs and 4 more are claimed ahead (one per other stream)
    wait_for(lambda: len(claimed()) == 8, 10, f"8 tasks claimed: {q.stats()}")
    assert open_batches(read_log(log)) == batch, "the batch ended before the signal"
    sup.proc.send_signal(signal.SIGTERM)
    code = sup.wait_exit(15, "after SIGTERM")
    out = sup.output()
    assert code == 0, out
    assert "stopping: finishing running batches" in out
    wait_for(lambda: not sup.group_alive(), 5, "worker processes left after the supervisor")

    ran = set(running.keys)
    assert len(ran) == 4
    for s, ts in by_stream.items():
        for i, task in enumerate(ts):
            info = task.info()
            if f"{s}:{i}" in ran:
                assert info.status == "succeeded", info
            else:  # claimed ahead or never claimed: back in the queue, no delivery counted
                assert (info.status, info.deliveries) == ("queued", 0), info
    stats = q.stats()
    assert (stats["succeeded"], stats["running"], stats["waiting"]) == (4, 0, 12), stats
    # the given-back tasks went to the head of their streams: the next claim of each
    # stream is its first unfinished task
    c = mtq.Consumer(qname, redis_url, settings=q.settings)
    heads = c.claim(32)
    expected = {ts[1].id if f"{s}:0" in ran else ts[0].id for s, ts in by_stream.items()}
    assert {t.id for t in heads} == expected
    c.release(heads)


@pytest.mark.slow
def test_a_second_signal_kills_and_gives_everything_back_uncounted(
        supervise: StartFn, qname: str, redis_url: str, r: redis.Redis,
        tmp_path: Path) -> None:
    """Forced stop: the workers die mid-predict, but the operator, not the tasks, killed
    them, so no delivery counts (nothing becomes a suspect or heads for poison)."""
    log = tmp_path / "calls.log"
    sup = supervise("tests.models:Probe", qname, "--replicas", "1", "--lease-ms", "30000",
                    env={"MTQ_TEST_LOG": str(log)})
    wait_workers(r, qname, 1, sup)
    q = mtq.Queue(qname, redis_url, lease_ms=30000)
    by_stream = streamed(q, streams=8, per_stream=1, sleep=5)
    tasks = [t for ts in by_stream.values() for t in ts]
    wait_for(lambda: open_batches(read_log(log)), 20, f"a batch started\n{sup.output()}")
    wait_for(lambda: sum(t.status() == "running" for t in tasks) == 8, 10,
             f"8 tasks claimed: {q.stats()}")
    sup.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: "stopping" in sup.output(), 10, "the first signal was not seen")
    sup.proc.send_signal(signal.SIGTERM)
    code = sup.wait_exit(15, "after the second SIGTERM")
    assert code == 0, sup.output()
    assert "forced stop" in sup.output()
    wait_for(lambda: not sup.group_alive(), 5, "worker processes left after the supervisor")
    # given back at once (no 30 s lease to wait out), none counted
    assert [(t.status(), t.info().deliveries) for t in tasks] == [("queued", 0)] * 8
    assert q.stats()["redelivered"] == 0


# -- 5. scale up and down under load -------------------------------------------------
@pytest.mark.slow
def test_scale_up_and_down_under_load_loses_nothing(
        supervise: StartFn, qname: str, redis_url: str, r: redis.Redis,
        tmp_path: Path) -> None:
    log = tmp_path / "calls.log"
    sup = supervise("tests.models:Probe", qname, "--replicas", "1", "--lease-ms", "2000",
                    env={"MTQ_TEST_LOG": str(log)})
    (w0,) = wait_workers(r, qname, 1, sup)
    q = mtq.Queue(qname, redis_url, lease_ms=2000)
    by_stream = streamed(q, streams=12, per_stream=15, sleep=0.02)
    wait_for(lambda: q.stats()["succeeded"] > 0, 10, "the first tasks succeeded")

    assert control.send(r, qname, "scale", replicas=3) == 1
    three = wait_workers(r, qname, 3, sup, live_only=False)
    assert w0["id"] in {w["id"] for w in three}
    # more work behind the same streams, then retire two workers while it flows
    for s, ts in streamed(q, streams=12, per_stream=15, start=15, sleep=0.02).items():
        by_stream[s] += ts
    total = 12 * 30
    assert control.send(r, qname, "scale", replicas=1) == 1
    (last,) = wait_workers(r, qname, 1, sup, live_only=False)
    assert last["id"] == w0["id"]  # the newest retire first
    assert "scaling to 3 replica(s)" in sup.output() and "scaling to 1 replica(s)" in sup.output()

    wait_succeeded(q, total, sup)
    assert_each_succeeded_once(q, by_stream)
    calls = read_log(log)
    assert done_order(calls) == {s: list(range(30)) for s in by_stream}
    assert len({c.pid for c in calls}) >= 2, "the added workers did no work"
    # retiring workers gave back what they had claimed ahead, uncounted
    assert all(t.info().deliveries == 1 for ts in by_stream.values() for t in ts)
    assert "died" not in sup.output()


# -- 6. reload under load ------------------------------------------------------------
@pytest.mark.slow
def test_reload_under_load_switches_version_and_loses_nothing(
        supervise: StartFn, qname: str, redis_url: str, r: redis.Redis,
        tmp_path: Path) -> None:
    log = tmp_path / "calls.log"
    version = tmp_path / "version.txt"
    version.write_text("v1")
    sup = supervise("tests.models:Versioned", qname, "--replicas", "2", "--lease-ms", "2000",
                    env={"MTQ_TEST_LOG": str(log), "MTQ_TEST_VERSION_FILE": str(version)})
    wait_workers(r, qname, 2, sup, check=lambda w: w["version"] == "v1")
    q = mtq.Queue(qname, redis_url, lease_ms=2000)
    by_stream = streamed(q, streams=10, per_stream=20, sleep=0.02)
    wait_for(lambda: q.stats()["succeeded"] >= 20, 10, f"some tasks done: {q.stats()}")

    version.write_text("v2")
    assert q.stats()["waiting"] > 0, f"the queue ran dry before the reload: {q.stats()}"
    assert control.send(r, qname, "reload") == 1
    old_pids = {w["pid"] for w in workers_of(r, qname)}
    reloaded = wait_workers(r, qname, 2, sup, check=lambda w: w["version"] == "v2")
    assert {w["pid"] for w in reloaded} == old_pids, "reload must not restart the processes"
    assert all(w["last_error"] == "" for w in reloaded), reloaded
    later = q.submit_many([{"s": "late", "i": i} for i in range(20)], stream="late")
    by_stream["late"] = later

    wait_succeeded(q, 220, sup)
    assert_each_succeeded_once(q, by_stream)
    versions = [t.result(timeout=5)["version"] for ts in by_stream.values() for t in ts]
    assert "v1" in versions and "v2" in versions
    assert {t.result(timeout=5)["version"] for t in later} == {"v2"}
    assert done_order(read_log(log)) == {s: list(range(len(ts))) for s, ts in by_stream.items()}
    assert all(t.info().deliveries == 1 for ts in by_stream.values() for t in ts)


# -- 7. pinning ----------------------------------------------------------------------
@pytest.mark.gpu_smoke
def test_child_env_pins_one_gpu_or_none() -> None:
    assert devices.child_env("cuda:3") == ({"CUDA_VISIBLE_DEVICES": "3"}, "cuda:0")
    assert devices.child_env("cuda:0") == ({"CUDA_VISIBLE_DEVICES": "0"}, "cuda:0")
    assert devices.child_env("cpu") == ({"CUDA_VISIBLE_DEVICES": ""}, "cpu")
    assert devices.parse_devices("cuda:1,cuda:0") == ["cuda:1", "cuda:0"]
    assert devices.parse_devices("cuda") == ["cuda:0"]


@pytest.mark.gpu_smoke
def test_a_cpu_worker_sees_no_gpu(supervise: StartFn, qname: str, redis_url: str,
                                  r: redis.Redis) -> None:
    # the supervisor's own environment names a GPU; its CPU child must not see it
    sup = supervise("tests.models:Probe", qname, "--devices", "cpu",
                    env={"CUDA_VISIBLE_DEVICES": "3"})
    (w,) = wait_workers(r, qname, 1, sup)
    assert w["device"] == "cpu" and w["visible_devices"] == "", w
    res = mtq.Queue(qname, redis_url).submit({"s": "p", "i": 0}).result(timeout=20)
    assert res["visible"] == "" and res["device"] == "cpu" and res["tensor_device"] == "cpu"
    assert res["pid"] == w["pid"]


@pytest.mark.cuda
@pytest.mark.skipif(devices.cuda_count() == 0, reason="needs a CUDA device")
def test_a_cuda_worker_is_pinned_to_its_gpu(supervise: StartFn, qname: str, redis_url: str,
                                            r: redis.Redis) -> None:
    sup = supervise("tests.models:Probe", qname, "--devices", "cuda:0")
    (w,) = wait_workers(r, qname, 1, sup, timeout=60)
    assert w["device"] == "cuda:0" and w["visible_devices"] == "0", w
    assert w["memory"]["total"] > 0, w
    res = mtq.Queue(qname, redis_url).submit({"s": "p", "i": 0}).result(timeout=30)
    assert res["visible"] == "0"
    assert res["device"] == "cuda:0" and res["tensor_device"] == "cuda:0", res


@pytest.mark.cuda
@pytest.mark.skipif(devices.cuda_count() == 0, reason="needs a CUDA device")
def test_devices_all_pins_a_worker_to_each_gpu_and_keeps_no_standby_there(
        supervise: StartFn, qname: str, redis_url: str, r: redis.Redis) -> None:
    n = devices.cuda_count()
    sup = supervise("tests.models:Probe", qname, "--devices", "all")
    ws = wait_workers(r, qname, n, sup, timeout=90)
    assert sorted(w["device"] for w in ws) == [f"cuda:{i}" for i in range(n)], ws
    assert sorted(w["visible_devices"] for w in ws) == [str(i) for i in range(n)], ws
    q = mtq.Queue(qname, redis_url)
    assert q.submit({"s": "p", "i": 0}).result(timeout=60)["tensor_device"] == "cuda:0"
    # no warm standby on a GPU (it would hold a second copy of the model in device
    # memory): a killed worker is replaced by a cold start, and nothing is lost
    victim = ws[0]
    os.kill(victim["pid"], signal.SIGKILL)
    again = wait_workers(r, qname, n, sup, timeout=90,
                         check=lambda w: w["pid"] != victim["pid"])
    assert victim["device"] in {w["device"] for w in again}
    out = sup.output()
    assert "died" in out and "its standby" not in out and "standby ready" not in out, out
    res = q.submit({"s": "p", "i": 1}).result(timeout=60)
    assert res["visible"] != "" and res["tensor_device"] == "cuda:0", res


def test_registry_keeps_string_fields_as_written(r: redis.Redis, qname: str) -> None:
    wid = f"test:{qname}"
    registry.beat(r, wid, {"queue": qname, "version": "1.10", "visible_devices": "0",
                           "model": "null"}, ttl_s=5)
    try:
        (w,) = list_workers(r, qname)
        assert (w["version"], w["visible_devices"], w["model"]) == ("1.10", "0", "null")
    finally:
        registry.remove(r, wid)


# -- 8. bad targets and failing setup ------------------------------------------------
@pytest.mark.parametrize("target,expected", [
    ("tests.models:Nope", "module 'tests.models' has no attribute 'Nope'"),
    ("nonexistent.module:X", "cannot import 'nonexistent.module'"),
])
def test_a_bad_target_stops_the_supervisor_at_once(supervise: StartFn, qname: str,
                                                   target: str, expected: str) -> None:
    sup = supervise(target, qname, "--replicas", "2")
    code = sup.wait_exit(20, "with a bad target")
    out = sup.output()
    assert code == 2, out
    assert expected in out, out
    if target.startswith("nonexistent"):  # found missing before anything starts
        assert "serving" not in out and len(out.strip().splitlines()) == 1, out
    else:  # the module loads only in the worker processes, which report it at once
        assert "stopped:" in out
    assert "restarting" not in out and "died" not in out, "a crash loop"
    assert "Traceback" not in out.split("stopped:")[-1]
    wait_for(lambda: not sup.group_alive(), 5, "worker processes left after the supervisor")


@pytest.mark.slow
def test_setup_that_always_fails_stops_after_max_setup_failures(
        supervise: StartFn, qname: str) -> None:
    sup = supervise("tests.models:SetupFails", qname)
    code = sup.wait_exit(60, "with a setup that always fails")
    out = sup.output()
    assert code == 1, out
    assert f"failed during setup {MAX_SETUP_FAILURES} times in a row" in out, out
    assert "RuntimeError: setup exploded: no weights at /nonexistent/weights.pt" in out, out
    assert out.count("restarting in") == MAX_SETUP_FAILURES - 1, out
    wait_for(lambda: not sup.group_alive(), 5, "worker processes left after the supervisor")


# -- 9. engines do not share a device loop ---------------------------------------------
@pytest.mark.slow
def test_a_slow_model_does_not_hold_up_a_fast_one(
        supervise: StartFn, qname: str, redis_url: str, r: redis.Redis,
        tmp_path: Path) -> None:
    slow_q, fast_q = f"{qname}-slow", f"{qname}-fast"
    slow_log = tmp_path / "slow.log"
    slow_sup = supervise("tests.models:Slow", slow_q, env={"MTQ_TEST_LOG": str(slow_log)})
    fast_sup = supervise("tests.models:Probe", fast_q)
    wait_workers(r, slow_q, 1, slow_sup)
    wait_workers(r, fast_q, 1, fast_sup)
    slow = mtq.Queue(slow_q, redis_url)
    fast = mtq.Queue(fast_q, redis_url)
    slow_tasks = slow.submit_many([{"s": "slow", "i": i} for i in range(4)])
    wait_for(lambda: open_batches(read_log(slow_log)), 20, "the slow batch started")

    fast_tasks = fast.submit_many([{"s": "fast", "i": i} for i in range(40)])
    assert [t.result(timeout=10)["i"] for t in fast_tasks] == list(range(40))
    # all done while the slow model is still inside its first predict call
    assert [t.status() for t in slow_tasks] == ["running"] * 4
    assert open_batches(read_log(slow_log)), "the slow batch returned first"
    assert all(t.result(timeout=20)["s"] == "slow" for t in slow_tasks)
    last_fast = max(t.info().finished or 0 for t in fast_tasks)
    first_slow = min(t.info().finished or 0 for t in slow_tasks)
    assert last_fast < first_slow


# -- 10. pause / resume / stop from the command line ------------------------------------
def mtq_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "mtq", *args], env=env, capture_output=True, text=True,
                          timeout=30)


@pytest.mark.slow
def test_pause_resume_stop_from_the_cli(supervise: StartFn, qname: str, redis_url: str,
                                        r: redis.Redis, subprocess_env: dict[str, str],
                                        tmp_path: Path) -> None:
    log = tmp_path / "calls.log"
    sup = supervise("tests.models:Probe", qname, "--replicas", "2", "--lease-ms", "2000",
                    env={"MTQ_TEST_LOG": str(log)})
    wait_workers(r, qname, 2, sup)
    opts = ("--queue", qname, "--redis", redis_url)

    res = mtq_cli("workers", "pause", *opts, env=subprocess_env)
    assert res.returncode == 0 and "sent to 1 supervisor" in res.stdout, res
    wait_workers(r, qname, 2, sup, check=lambda w: w["state"] == "paused")
    q = mtq.Queue(qname, redis_url, lease_ms=2000)
    tasks = q.submit_many([{"s": "p", "i": i} for i in range(10)])
    # give the paused workers two heartbeats' time to misbehave
    mark = time.time()
    wait_workers(r, qname, 2, sup, check=lambda w: w["beat"] > mark + 1.0)
    assert [t.status() for t in tasks] == ["queued"] * 10, \
        f"paused workers ran tasks: {[t.info() for t in tasks]}\n{read_log(log)}\n{sup.output()}"
    assert q.stats()["running"] == 0
    ws = workers_of(r, qname, live_only=True)
    assert all(w["state"] == "paused" and w["held"] == 0 for w in ws), ws
    assert not [c for c in read_log(log) if c.tag != "S"], "a paused worker ran predict"

    res = mtq_cli("workers", "resume", *opts, env=subprocess_env)
    assert res.returncode == 0, res
    assert [t.result(timeout=20)["i"] for t in tasks] == list(range(10))
    assert all(t.info().deliveries == 1 for t in tasks)

    res = mtq_cli("workers", "stop", *opts, env=subprocess_env)
    assert res.returncode == 0, res
    code = sup.wait_exit(20, "after 'mtq workers stop'")
    assert code == 0, sup.output()
    assert "stop requested" in sup.output()
    wait_for(lambda: not sup.group_alive(), 5, "worker processes left after the supervisor")
    wait_for(lambda: not workers_of(r, qname), 5, "stopped workers left the registry")
    res = mtq_cli("workers", "pause", *opts, env=subprocess_env)
    assert res.returncode == 4 and "no supervisor" in res.stderr, res


@pytest.mark.slow
def test_a_replacement_for_a_paused_worker_claims_nothing(
        supervise: StartFn, qname: str, redis_url: str, r: redis.Redis,
        tmp_path: Path) -> None:
    log = tmp_path / "calls.log"
    # a cold replacement (a standby is set up before the kill: see test_standby.py)
    sup = supervise("tests.models:Probe", qname, "--lease-ms", "2000", "--standby", "0",
                    env={"MTQ_TEST_LOG": str(log), "MTQ_TEST_SETUP_DELAY": "1"})
    (old,) = wait_workers(r, qname, 1, sup)
    assert control.send(r, qname, "pause") == 1
    wait_workers(r, qname, 1, sup, check=lambda w: w["state"] == "paused")
    q = mtq.Queue(qname, redis_url, lease_ms=2000)
    tasks = q.submit_many([{"s": "p", "i": i} for i in range(4)])
    os.kill(old["pid"], signal.SIGKILL)
    # The supervisor answers a replacement's "ready" with "pause". Stopping the supervisor
    # while the replacement is in its (1 s) setup makes "slow to answer" (busy,
    # descheduled) certain instead of a rare race; a paused replacement must claim
    # nothing meanwhile.
    wait_for(lambda: [c for c in read_log(log) if c.tag == "S" and c.pid != old["pid"]], 20,
             f"the replacement's setup started\n{sup.output()}")
    os.kill(sup.pid, signal.SIGSTOP)
    try:
        wait_workers(r, qname, 1, sup, check=lambda w: w["pid"] != old["pid"])
        mark = time.time()
        wait_workers(r, qname, 1, sup, check=lambda w: w["beat"] > mark + 1.0)
        statuses = [t.status() for t in tasks]
    finally:
        os.kill(sup.pid, signal.SIGCONT)
    assert statuses == ["queued"] * 4, read_log(log)


@pytest.mark.slow
def test_reload_keeps_paused_workers_paused(supervise: StartFn, qname: str, redis_url: str,
                                            r: redis.Redis) -> None:
    sup = supervise("tests.models:Probe", qname, "--lease-ms", "2000")
    wait_workers(r, qname, 1, sup)
    assert control.send(r, qname, "pause") == 1
    wait_workers(r, qname, 1, sup, check=lambda w: w["state"] == "paused")
    q = mtq.Queue(qname, redis_url, lease_ms=2000)
    tasks = q.submit_many([{"s": "p", "i": i} for i in range(5)])
    assert control.send(r, qname, "reload") == 1
    mark = time.time()
    # two heartbeats after the reload: time enough for it to have been applied
    wait_workers(r, qname, 1, sup, check=lambda w: w["beat"] > mark + 1.0)
    assert [t.status() for t in tasks] == ["queued"] * 5, "a reload resumed a paused worker"
    assert [w["state"] for w in workers_of(r, qname)] == ["paused"]


@pytest.mark.slow
def test_a_reload_that_changes_the_timeout_is_enforced(
        supervise: StartFn, qname: str, redis_url: str, r: redis.Redis,
        tmp_path: Path) -> None:
    tuning = tmp_path / "tuning.txt"
    tuning.write_text("v1 600")
    sup = supervise("tests.models:Retimed", qname, "--lease-ms", "2000",
                    env={"MTQ_TEST_VERSION_FILE": str(tuning)})
    wait_workers(r, qname, 1, sup, check=lambda w: w["version"] == "v1")
    tuning.write_text("v2 1")
    assert control.send(r, qname, "reload") == 1
    (w,) = wait_workers(r, qname, 1, sup, check=lambda w: w["version"] == "v2")
    q = mtq.Queue(qname, redis_url, lease_ms=2000)
    q.submit({"s": "h", "i": 0, "hang": True})
    # the new model's 1 s timeout applies: killed within 1 s + the supervisor's check
    # interval (a quarter of the timeout) + start-up slack
    wait_for(lambda: "predict ran past its 1 s timeout" in sup.output(), 5,
             f"the hung call was not killed after the reload set a 1 s timeout\n{sup.output()}")
    wait_for(lambda: not pid_exists(w["pid"]), 5, "the hung process is gone")
