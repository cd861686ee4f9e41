"""Frozen children fenced off: the supervisor kills a child whose beat stops for half
its lease (mtq.workers.fencing), before another worker can take its tasks, and gives
them back at once; a Redis freeze or a CPU-bound predict does not get a child killed.

Real processes (``mtq workers start``), a real redis-server; the test model
(tests/models.py Probe) logs each predict call's start (B) and return (D) with the
stream keys of its batch, from which the overlaps per stream are read.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

import mtq
from mtq.workers.fencing import fence_s
from tests.support.servers import RedisServer
from tests.support.supervisors import Call, StartFn, Sup, pid_exists, read_log, wait_workers
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(120)


def calls_of(log: Path) -> list[tuple[int, float, float | None, tuple[str, ...]]]:
    """Each predict call as (pid, start, end or None if it never returned, keys)."""
    out: list[tuple[int, float, float | None, tuple[str, ...]]] = []
    open_: dict[int, Call] = {}
    for c in read_log(log):
        if c.tag == "B":
            open_[c.pid] = c
        elif c.tag == "D":
            b = open_.pop(c.pid)
            out.append((c.pid, b.t, c.t, b.keys))
    out += [(pid, b.t, None, b.keys) for pid, b in open_.items()]
    return out


def overlaps_per_stream(log: Path, frozen: dict[int, float]) -> dict[str, int]:
    """stream -> its predict calls that started while an earlier one still ran. A call that never
    returned ran until its process was stopped (``frozen``: pid -> SIGSTOP time; the
    process was killed before it could run again)."""
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for pid, start, end, keys in calls_of(log):
        if end is None:
            assert pid in frozen, f"process {pid} left a call open but was not frozen"
            end = frozen[pid]
        for s in {k.split(":")[0] for k in keys}:
            spans[s].append((start, end))
    out: dict[str, int] = {}
    for s, xs in spans.items():
        n, until = 0, float("-inf")
        for start, end in sorted(xs):
            n += start < until  # it started before an earlier call of the stream ended
            until = max(until, end)
        out[s] = n
    return out


def stop_in_call(log: Path, sup: Sup, pids: set[int] | None = None) -> tuple[int, Call, float]:
    """SIGSTOP a worker process inside a predict call (one of ``pids``); returns its pid,
    that call and the time it was stopped."""
    def open_call() -> tuple[int, Call] | None:
        last: dict[int, Call] = {}
        for c in read_log(log):
            if c.tag in "BD" and (pids is None or c.pid in pids):
                last[c.pid] = c
        return next(((p, c) for p, c in last.items() if c.tag == "B"), None)

    pid, call = wait_for(open_call, 30, f"a predict call started\n{sup.output()}")
    os.kill(pid, signal.SIGSTOP)
    return pid, call, time.time()


def wait_dead(pid: int, timeout: float, what: str, sup: Sup) -> float:
    """Wait until ``pid`` is gone (polled every 5 ms); returns when it was seen gone."""
    wait_for(lambda: _gone(pid), timeout, f"{what}\n{sup.output()[-4000:]}", interval=0.005)
    return time.time()


def _gone(pid: int) -> bool:
    """``pid`` exited (or was killed), reaped or not yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] in "ZX"
    except OSError:
        return True


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
    pid, _, stopped = stop_in_call(log, sup, {w["pid"]})
    killed = wait_dead(pid, 10, "the frozen child killed", sup)
    # fenced at half the lease (plus a beat): before Redis could give its task to
    # another worker (2/3 of a lease after the last extend at the earliest)
    assert killed - stopped < lease_ms / 1000, (killed - stopped, sup.output())
    res = task.result(timeout=30)
    assert res["i"] == 1 and res["pid"] != pid
    info = task.info()
    assert info.deliveries == 2, info  # the frozen call counted, as a death's
    out = sup.output()
    assert out.count("frozen: no sign of life") == 1, out
    # it ran to the end once, in another process; the frozen call never returned
    done = [c for c in read_log(log) if c.tag == "D" and "a:1" in c.keys]
    assert len(done) == 1 and done[0].pid != pid, done
    wait_workers(r, qname, 1, sup, check=lambda x: x["pid"] != pid)


# -- the whole case: a batched worker under load on 8 streams, frozen for 3 leases ---
def measure_frozen_child(sup: Sup, log: Path, q: mtq.Queue, r: redis.Redis, qname: str,
                         lease_ms: int, streams: int = 8, per_stream: int = 12
                         ) -> dict[str, Any]:
    """Submit ``per_stream`` tasks to each of ``streams`` streams, SIGSTOP one worker
    process inside a predict call for three leases, SIGCONT it; wait for every task.
    Returns the figures (shared with benchmarks.control's ``frozen`` section)."""
    reqs = [mtq.Request({"s": f"s{s}", "i": i, "sleep": 0.03}, stream=f"s{s}")
            for i in range(per_stream) for s in range(streams)]
    tasks = q.submit_many(reqs)
    pid, call, stopped = stop_in_call(log, sup)
    resume_at = stopped + 3 * lease_ms / 1000
    killed: float | None = None
    while time.time() < resume_at:  # three leases (polled every 5 ms: it may be killed)
        if killed is None and _gone(pid):
            killed = time.time()
        time.sleep(0.005)
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
    wait_for(lambda: q.stats()["succeeded"] >= len(tasks), 60,
             f"every task done: {q.stats()}\n{sup.output()[-4000:]}")
    calls = calls_of(log)
    if killed is None:  # not fenced (a supervisor without it): the call ran on
        return {"overlaps": overlaps_per_stream(log, {pid: time.time()}), "fence_s": None,
                "recovery_s": None, "pid": pid, "tasks": list(zip(reqs, tasks)),
                **_tally(q, calls, len(tasks))}
    rerun = [start for p, start, _, keys in calls if p != pid and start > stopped
             and set(keys) & set(call.keys)]
    return {
        "overlaps": overlaps_per_stream(log, {pid: stopped}),
        "fence_s": killed - stopped,
        "recovery_s": (min(rerun) - killed) if rerun else None,
        "pid": pid, "tasks": list(zip(reqs, tasks)), **_tally(q, calls, len(tasks)),
    }


def _tally(q: mtq.Queue, calls: list[tuple[int, float, float | None, tuple[str, ...]]],
           n: int) -> dict[str, Any]:
    done = Counter(k for _, _, end, keys in calls if end is not None for k in keys)
    stats = q.stats()
    return {"lost": n - stats["succeeded"], "twice": sum(1 for c in done.values() if c > 1),
            "stats": stats}


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
    fig = measure_frozen_child(sup, log, q, r, qname, lease_ms)
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
