"""Failovers under load: a primary of a real Redis Cluster (3 primaries with 2 replicas
each, tests/support/clusters.py),
or the primary a set of three sentinels watches, killed with SIGKILL while producers
submit and workers run; a replica is promoted, and everything rides through.

What is checked: every submit that returned (durable: a replica had it) is served;
no task ran to completion twice; the tasks of each stream started in the order they
were submitted; and the time from the primary's death to the first task completed
again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

import mtq
from mtq.broker.keys import QueueKeys
from tests.support.clusters import Cluster, SentinelSet
from tests.support.paths import ROOT
from tests.support.processes import kill_process, worker_process
from tests.support.supervisors import read_log
from tests.support.waits import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STREAMS = 4


class Load:
    """A producer thread: durable submits, one by one, each in one of STREAMS streams,
    with ``i`` counting up; what returned, what raised, and when."""

    def __init__(self, q: mtq.Queue) -> None:
        self.q = q
        self.acked: dict[int, mtq.Task] = {}
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        while not self.stop.is_set():
            s = f"s{i % STREAMS}"
            try:
                self.acked[i] = self.q.submit({"s": s, "i": i}, stream=s)
            except mtq.MtqError as exc:  # not acknowledged: allowed to be lost
                self.errors.append(f"{i}: {type(exc).__name__}: {exc}")
            i += 1
            time.sleep(0.002)  # about 300 submits a second, as a web app's would come


def check_log(log: Path, acked: dict[int, mtq.Task]) -> dict[str, float]:
    """No task completed twice; per stream, first starts in submit order; returns the
    times of the D lines (completions) by task."""
    ends: dict[str, list[float]] = defaultdict(list)
    firsts: dict[str, list[int]] = defaultdict(list)
    started: set[str] = set()
    for c in read_log(log):
        for k in c.keys:
            if c.tag == "D":
                ends[k].append(c.t)
            elif c.tag == "B" and k not in started:
                started.add(k)
                s, i = k.split(":")
                firsts[s].append(int(i))
    twice = {k: len(v) for k, v in ends.items() if len(v) > 1}
    assert not twice, f"tasks completed more than once: {twice}"
    for s, order in firsts.items():
        assert order == sorted(order), f"stream {s} started out of order: {order}"
    for i, t in acked.items():
        assert f"s{i % STREAMS}:{i}" in ends, f"acknowledged task {i} ({t.id}) never completed"
    return {k: v[0] for k, v in ends.items()}


def worker_env(url: str) -> dict[str, str]:
    """The environment of a worker process on ``url`` (tests' handlers importable)."""
    env = dict(os.environ)
    env["MTQ_REDIS_URL"] = url
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    return env


def run_failover(url: str, kill: object, tmp: Path, queue: str) -> float:
    """Load the queue, kill its primary (``kill()``), go on, check; returns the seconds
    from the kill to the first task completed after it."""
    env = worker_env(url)
    log = tmp / "calls.log"
    env["MTQ_TEST_LOG"] = str(log)
    procs: list[subprocess.Popen[bytes]] = []
    q = mtq.Queue(queue, url)
    # durable: a submit returns, and a worker's ack counts, once a replica has it
    q.configure(durable_replicas=1, durable_timeout_ms=2000, lease_ms=5000)
    try:
        for n in range(2):
            out = open(tmp / f"worker-{n}.log", "wb")
            procs.append(worker_process(["tests.handlers:logged", "--queue", queue,
                                         "--batch-size", "8"], env, out))
        load = Load(q)
        load.thread.start()
        wait_for(lambda: len(read_log(log)) > 200, 60, "the workers did not get going")
        killed_at, before = time.time(), len(load.acked)
        kill()  # type: ignore[operator]
        wait_for(lambda: len(load.acked) >= before + 100
                 and any(c.tag == "D" and c.t > killed_at for c in read_log(log)),
                 60, f"the load did not go on after the failover ({len(load.acked) - before} "
                 f"submits since; {load.errors[-3:]})")
        load.stop.set()
        load.thread.join(30)
        for t in load.acked.values():
            t.result(timeout=60)
        ends = check_log(log, load.acked)
        after = [t for t in ends.values() if t > killed_at]
        assert after, "nothing completed after the kill"
        assert len(load.acked) > 150
        return min(after) - killed_at
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                kill_process(p)


@pytest.fixture
def fresh_cluster(tmp_path: Path) -> Iterator[Cluster]:
    # two replicas a primary: the promoted one still has a replica to confirm
    # durable submits (with one, it has none until the dead node comes back)
    c = Cluster(tmp_path / "cluster", replicas=2)
    c.start()
    yield c
    c.stop()


def test_a_primary_killed_under_load_loses_no_durable_submit_and_runs_nothing_twice(
        fresh_cluster: Cluster, tmp_path: Path) -> None:
    queue = "f-" + uuid.uuid4().hex[:10]
    victim = fresh_cluster.owner(QueueKeys(queue).ready)
    took = run_failover(fresh_cluster.url, victim.kill, tmp_path, queue)
    new_owner = fresh_cluster.owner(QueueKeys(queue).ready)
    assert new_owner.port != victim.port and new_owner.alive
    assert took < 15, f"{took:.1f} s from the kill to the first task completed again"


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[SentinelSet]:
    s = SentinelSet(tmp_path / "sentinel")
    s.start()
    yield s
    s.stop()


def test_clients_follow_the_new_primary_after_a_sentinel_failover(
        sentinels: SentinelSet, tmp_path: Path) -> None:
    queue = "s-" + uuid.uuid4().hex[:10]
    old = sentinels.primary.port
    took = run_failover(sentinels.url, sentinels.primary.kill, tmp_path, queue)
    new = sentinels.current_primary_port()
    assert new in [r.port for r in sentinels.replicas] and new != old
    assert took < 15, f"{took:.1f} s from the kill to the first task completed again"


@pytest.fixture
def one_replica(tmp_path: Path) -> Iterator[SentinelSet]:
    s = SentinelSet(tmp_path / "sentinel1", replicas=1)
    s.start()
    yield s
    s.stop()


def test_a_sentinel_failover_with_one_replica_producers_workers_and_readers_follow(
        one_replica: SentinelSet, tmp_path: Path) -> None:
    # the set-up of the issue: a primary, one replica, three sentinels; a plain queue
    s = one_replica
    queue = "s1-" + uuid.uuid4().hex[:10]
    env = worker_env(s.url)
    out = open(tmp_path / "worker.log", "wb")
    worker = worker_process(["tests.models:Counter", "--queue", queue], env, out)
    try:
        q = mtq.Queue(queue, s.url)
        assert q.submit({"n": 3}).result(timeout=30)["tokens"] == [0, 1, 2]
        # a generation streaming while the primary dies: its reader goes on
        long = q.submit({"n": 200, "step_ms": 25})
        tokens = long.tokens(timeout=60)
        assert next(tokens) == 0
        old = s.primary.port
        s.primary.kill()
        wait_for(lambda: s.current_primary_port() not in (None, old), 30,
                 "the sentinels did not promote the replica")
        assert q.submit({"n": 2}).result(timeout=60)["tokens"] == [0, 1]
        rest = list(tokens)
        assert rest == list(range(1, 200)), "the reader went on, in order, without gaps"
        assert long.result(timeout=30)["tokens"] == list(range(200))
    finally:
        kill_process(worker)
