"""Stops that stop: ``mtq workers start`` ends within its bound whatever Redis does.

Each test runs a redis-server of its own (AOF on, so its data survives the kill and
the restart on the same port), starts ``mtq workers start ... --replicas 5`` against
it with tasks running, stops that server, and signals the supervisor: a forced stop
(two signals) returns within about 2 s, a graceful one (one signal) within its
documented bound (one lease, then as a forced stop), and no process is left. Redis
then restarts on the same port and data, and a new supervisor does every task:
those left to their leases come back as the leases expire; nothing is lost.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

import mtq
from mtq.broker.keys import QueueKeys
from mtq.workers.stops import CHECK_EVERY_S, FORCED_STOP_S, Stops
from tests.support.paths import PY
from tests.support.servers import RedisServer
from tests.support.supervisors import Sup, read_log, wait_workers
from tests.support.waits import wait_for

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

LEASE_MS = 2000
#: the loaded test machine's margin over a bound (2 cores shared with other runs);
#: the old forced stop took about 12 s per worker (a minute with 5)
MARGIN_S = 3.0


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    s = RedisServer(tmp_path / "redis", appendonly=True)
    (tmp_path / "redis").mkdir()
    s.start()
    yield s
    if s.proc is not None and s.proc.poll() is None:
        s.proc.send_signal(signal.SIGCONT)  # a test that hung it
    s.stop()


@pytest.fixture
def start(server: RedisServer, subprocess_env: dict[str, str],
          tmp_path: Path) -> Iterator[Any]:
    """``start(queue, *cli options, hang=False)``: ``mtq workers start
    tests.models:Probe`` on the test's own server (``hang``: its processes hang on a
    ``hang_here`` task, others run it at once), its process group killed at teardown."""
    started: list[Sup] = []

    def run(queue: str, *args: str, hang: bool = False) -> Sup:
        log = tmp_path / f"supervisor-{len(started)}.log"
        cmd = [PY, "-m", "mtq", "workers", "start", "tests.models:Probe", "--queue", queue,
               "--redis", server.url, "--lease-ms", str(LEASE_MS), *args]
        env = {**subprocess_env, "MTQ_REDIS_URL": server.url,
               "MTQ_TEST_LOG": str(tmp_path / "calls.log"), "MTQ_TEST_HANG": "1" if hang else ""}
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        sup = Sup(proc, log)
        started.append(sup)
        return sup

    yield run
    for sup in started:
        sup.kill()


def running_with_redis_gone(start: Any, server: RedisServer, qname: str, tmp_path: Path,
                            kind: str) -> tuple[Sup, list[mtq.Task], mtq.Queue]:
    """5 workers each running a task that hangs in them (10 submitted, one per
    batch; another supervisor runs them at once), then the server stopped (its AOF
    written: ``kind`` "gone") or frozen (SIGSTOP: "hung", answering nothing)."""
    sup = start(qname, "--replicas", "5", "--max-batch-size", "1", hang=True)
    r = redis.Redis.from_url(server.url)
    wait_workers(r, qname, 5, sup)
    q = mtq.Queue(qname, server.url, lease_ms=LEASE_MS)
    tasks = q.submit_many([mtq.Request({"s": "t", "i": i, "hang_here": True})
                           for i in range(10)])
    log = tmp_path / "calls.log"
    wait_for(lambda: len({c.pid for c in read_log(log) if c.tag == "B"}) == 5, 30,
             f"5 workers running a task\n{sup.output()}")
    r.close()
    if kind == "gone":
        server.stop()
    else:
        assert server.proc is not None
        server.proc.send_signal(signal.SIGSTOP)
    return sup, tasks, q


def all_done_after_restart(start: Any, server: RedisServer, qname: str,
                           tasks: list[mtq.Task], q: mtq.Queue, kind: str) -> None:
    """Redis back (restarted on the same port and data, or resumed), a new
    supervisor: every task succeeds, once, with its own payload; nothing lost or
    dead."""
    if kind == "gone":
        server.start()
    else:
        assert server.proc is not None
        server.proc.send_signal(signal.SIGCONT)
    sup = start(qname, "--replicas", "2")
    wait_for(lambda: q.stats()["succeeded"] >= len(tasks), 60,
             f"every task done after the restart: {q.stats()}\n{sup.output()[-4000:]}")
    for i, t in enumerate(tasks):
        assert t.result(timeout=5)["i"] == i
    stats = q.stats()
    assert stats["succeeded"] == len(tasks), stats
    assert (stats["waiting"], stats["running"], stats["dead"]) == (0, 0, 0), stats


KINDS = pytest.mark.parametrize("kind", ["gone", "hung"])


@KINDS
def test_a_forced_stop_with_redis_gone_returns_within_2_s(
        start: Any, server: RedisServer, qname: str, tmp_path: Path, kind: str) -> None:
    sup, tasks, q = running_with_redis_gone(start, server, qname, tmp_path, kind)
    sup.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: "stopping" in sup.output(), 10, f"the first signal seen\n{sup.output()}")
    t0 = time.monotonic()
    sup.proc.send_signal(signal.SIGTERM)
    sup.wait_exit(FORCED_STOP_S + 1 + MARGIN_S, "after the second SIGTERM with Redis gone")
    took = time.monotonic() - t0
    out = sup.output()
    assert took < FORCED_STOP_S + 1 + MARGIN_S, (took, out)
    assert "forced stop" in out, out
    # one line for every task left: at least the 5 running ones
    lines = re.findall(r"(\d+) task\(s\) of (\d+) process\(es\) left to their leases", out)
    assert len(lines) == 1 and int(lines[0][0]) >= 5, out
    assert "could not give back the tasks of worker" not in out, out  # none per worker
    wait_for(lambda: not sup.group_alive(), 5, f"processes left after the supervisor\n{out}")
    all_done_after_restart(start, server, qname, tasks, q, kind)


@KINDS
def test_a_graceful_stop_with_redis_gone_says_so_and_ends_within_its_bound(
        start: Any, server: RedisServer, qname: str, tmp_path: Path, kind: str) -> None:
    # the running tasks never end: a stop that waited for them would blow the bound
    sup, tasks, q = running_with_redis_gone(start, server, qname, tmp_path, kind)
    t0 = time.monotonic()
    sup.proc.send_signal(signal.SIGTERM)
    # the bound: found away within a check, one lease, then as a forced stop
    bound = CHECK_EVERY_S + LEASE_MS / 1000 + FORCED_STOP_S + 1
    sup.wait_exit(bound + MARGIN_S, "after SIGTERM with Redis gone")
    took = time.monotonic() - t0
    out = sup.output()
    assert took < bound + MARGIN_S, (took, out)
    assert re.search(r"stopping with Redis at \S+ unreachable .* waiting at most 2 s", out), out
    assert "forcing the stop" in out, out
    assert len(re.findall(r"left to their leases", out)) == 1, out
    wait_for(lambda: not sup.group_alive(), 5, f"processes left after the supervisor\n{out}")
    all_done_after_restart(start, server, qname, tasks, q, kind)


def test_a_give_back_redis_refuses_is_named_as_refused_in_the_closing_line(
        server: RedisServer, qname: str) -> None:
    """Redis answered the stop's give-back with an error (here its user may no longer
    run scripts): the closing line says what Redis answered, not that it did not
    answer in time."""
    q = mtq.Queue(qname, server.url, lease_ms=LEASE_MS)
    q.submit({"i": 1})
    c = mtq.Consumer(qname, server.url)
    [task] = c.claim(1)
    r = redis.Redis.from_url(server.url)
    r.execute_command("ACL", "SETUSER", "default", "-@scripting")  # NOPERM, answered
    lines: list[str] = []
    stops = Stops([c], on_event=lines.append, poke=lambda: None)
    stops.begin(force=True)
    stops.release(c, [(task.id, task.token)])
    wait_for(lambda: stops.settled(time.monotonic()) and stops.left, 10,
             "the give-back refused")
    stops.finish()
    assert len(lines) == 1, lines
    assert "1 task(s) of 1 process(es) left to their leases" in lines[0], lines
    assert "Redis refused: " in lines[0] and "evalsha" in lines[0], lines
    assert "did not answer" not in lines[0], lines
    r.execute_command("ACL", "SETUSER", "default", "+@all")
    assert r.hget(QueueKeys(qname).task(task.id), "status") == b"running"


def test_a_graceful_stop_waits_for_its_batches_once_redis_is_back(
        start: Any, server: RedisServer, qname: str, tmp_path: Path) -> None:
    """Redis away at the signal, back a moment later: the running batch's lease is kept
    again, so the stop waits for it as a graceful stop does (it is not forced one lease
    after Redis went away, which would kill it and count a delivery)."""
    sup = start(qname, "--replicas", "1", "--max-batch-size", "1", "--lease-ms", "6000")
    r = redis.Redis.from_url(server.url)
    wait_workers(r, qname, 1, sup)
    q = mtq.Queue(qname, server.url)
    t = q.submit({"s": "t", "i": 0, "sleep": 12})
    wait_for(lambda: any(c.tag == "B" for c in read_log(tmp_path / "calls.log")), 30,
             f"the task running\n{sup.output()}")
    assert server.proc is not None
    server.proc.send_signal(signal.SIGSTOP)
    try:
        sup.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "unreachable" in sup.output(), 10,
                 f"Redis found away\n{sup.output()}")
    finally:
        server.proc.send_signal(signal.SIGCONT)
    assert sup.wait_exit(30, "after its batch ended") == 0
    out = sup.output()
    assert "answers again" in out, out
    assert "still unreachable" not in out and "left to their leases" not in out, out
    assert t.result(timeout=5)["i"] == 0
    assert (t.status(), t.info().deliveries) == ("succeeded", 1), out


def test_a_bare_worker_stopped_with_redis_gone_says_so_once_and_ends_within_a_lease(
        server: RedisServer, subprocess_env: dict[str, str], qname: str,
        tmp_path: Path) -> None:
    """``mtq worker run`` (no supervisor): one SIGTERM with Redis gone ends the running
    call, then waits at most one lease to record its result, then exits, in one line
    and no traceback; the task comes back from its lease once Redis is back."""
    q = mtq.Queue(qname, server.url)
    log = (tmp_path / "worker.log").open("w+")
    proc = subprocess.Popen([PY, "-m", "mtq", "worker", "run", "tests.models:Probe", "-q",
                             qname, "--redis", server.url, "--lease-ms", str(LEASE_MS),
                             "--max-batch-size", "1"],
                            env=subprocess_env, stdout=log, stderr=subprocess.STDOUT)
    try:
        task = q.submit({"s": "a", "i": 0, "sleep": 1.0})
        wait_for(lambda: task.status() == "running", 30, "the task never started")
        q.hub.close_all()
        server.stop()
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        bound = 1.0 + LEASE_MS / 1000 + 2.0  # the call, the lease, the listener's close
        proc.wait(bound + MARGIN_S)
        took = time.monotonic() - t0
        log.seek(0)
        out = log.read()
        assert took < bound + MARGIN_S, (took, out)
        assert len(re.findall(r"stopping with Redis at \S+ unreachable .* waiting at most "
                              r"2 s \(the lease\)", out)) == 1, out
        assert "Traceback" not in out, out
        server.start()
        w = subprocess.Popen([PY, "-m", "mtq", "worker", "run", "tests.models:Probe", "-q",
                              qname, "--redis", server.url, "--burst"], env=subprocess_env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            back = mtq.Queue(qname, server.url).task(task.id)
            assert back.result(timeout=30)["i"] == 0  # its lease expired: run again
        finally:
            w.kill()
            w.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
