"""Durable submits: a queue with ``durable_replicas=1`` acknowledges a submit only once a
replica has it, so killing the primary right after cannot lose it. Real servers: a
primary and a replica of it (``--replicaof``), the primary killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

import mtq
from mtq.workers.model import FunctionModel
from mtq.workers.worker import Worker
from tests.support.servers import RedisServer
from tests.support.waits import wait_for


class Pair:
    """A primary and one replica of it, both on free loopback ports."""

    def __init__(self, tmp: Path) -> None:
        self.primary = RedisServer(tmp / "primary")
        self.replica = RedisServer(tmp / "replica")
        for s in (self.primary, self.replica):
            s.dir.mkdir()

    def start(self) -> None:
        self.primary.start()
        r = self.replica
        r.proc = subprocess.Popen(
            [r.binary, "--port", str(r.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(r.dir),
             "--replicaof", "127.0.0.1", str(self.primary.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        primary = redis.Redis(port=self.primary.port)
        wait_for(lambda: primary.info("replication").get("connected_slaves") == 1, 10,
                 "the replica did not connect")
        replica = redis.Redis(port=r.port)
        wait_for(lambda: replica.info("replication").get("master_link_status") == "up", 10,
                 "the replica's link did not come up")

    def stop(self) -> None:
        for s in (self.primary, self.replica):
            if s.proc and s.proc.poll() is None:
                os.kill(s.proc.pid, signal.SIGCONT)
                s.proc.kill()
                s.proc.wait(10)


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    p = Pair(tmp_path)
    p.start()
    yield p
    p.stop()


def test_a_durable_submit_survives_the_primarys_death(pair: Pair, qname: str) -> None:
    q = mtq.Queue(qname, pair.primary.url, durable_replicas=1, durable_timeout_ms=2000)
    tasks = [*q.submit_many([{"x": i} for i in range(50)]), q.submit({"x": 50})]
    assert pair.primary.proc is not None
    pair.primary.proc.kill()  # at once, before anything else could copy the data
    pair.primary.proc.wait(10)
    replica = redis.Redis.from_url(pair.replica.url)
    replica.execute_command("REPLICAOF", "NO", "ONE")  # promoted
    promoted = mtq.Queue(qname, pair.replica.url, client=replica)
    assert promoted.stats()["waiting"] == 51
    w = Worker(FunctionModel(lambda p: p["x"]), qname, url=pair.replica.url)
    runner = threading.Thread(target=w.run, daemon=True)
    runner.start()
    try:
        assert [promoted.task(t.id).result(timeout=15) for t in tasks] == list(range(51))
    finally:
        w.stop()
        runner.join(15)


def test_an_unconfirmed_durable_submit_says_so_and_is_queued(pair: Pair, qname: str) -> None:
    q = mtq.Queue(qname, pair.primary.url, durable_replicas=1, durable_timeout_ms=300)
    assert pair.replica.proc is not None
    os.kill(pair.replica.proc.pid, signal.SIGSTOP)  # a replica that does not answer
    try:
        start = time.monotonic()
        with pytest.raises(mtq.NotDurable, match="do not submit them again") as caught:
            q.submit_many([{"x": 1}, {"x": 2}])
        assert 0.25 < time.monotonic() - start < 3, "it waited for the replica, boundedly"
        assert (caught.value.acks, caught.value.wanted) == (0, 1)
        assert [t.status() for t in caught.value.created] == ["queued", "queued"]
        assert q.stats()["submitted"] == 2
    finally:
        os.kill(pair.replica.proc.pid, signal.SIGCONT)
    # a queue that does not ask for replicas is not slowed by them
    plain = mtq.Queue(qname, pair.primary.url)
    os.kill(pair.replica.proc.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        plain.submit({"x": 3})
        assert time.monotonic() - start < 0.25
    finally:
        os.kill(pair.replica.proc.pid, signal.SIGCONT)


def test_durable_settings_are_checked(redis_url: str, qname: str) -> None:
    with pytest.raises(mtq.ConfigError, match=r"durable_replicas must be in \[0, 100\]"):
        mtq.Queue(qname, redis_url, durable_replicas=-1)
    with pytest.raises(mtq.ConfigError, match=r"durable_timeout_ms must be in \[1, "):
        mtq.Queue(qname, redis_url, durable_timeout_ms=0)
    # no replica at all: a durable submit cannot be confirmed, and says so
    q = mtq.Queue(qname, redis_url, durable_replicas=1, durable_timeout_ms=50)
    with pytest.raises(mtq.NotDurable) as caught:
        q.submit({"x": 1})
    assert caught.value.acks == 0 and len(caught.value.created) == 1


def test_without_durability_an_acknowledged_submit_can_be_lost(pair: Pair, qname: str) -> None:
    """The trade-off a durable queue removes: a plain submit is acknowledged by the
    primary alone; if the primary dies before its replica has the write, the promoted
    replica never saw the task."""
    assert pair.replica.proc is not None and pair.primary.proc is not None
    # the replica lags behind: stopped, and its link cut on the primary's side (a stopped
    # process's kernel would still take the bytes in, and apply them once resumed)
    os.kill(pair.replica.proc.pid, signal.SIGSTOP)
    primary = redis.Redis.from_url(pair.primary.url)
    assert primary.execute_command("CLIENT", "KILL", "TYPE", "replica") == 1
    wait_for(lambda: primary.info("replication").get("connected_slaves") == 0, 10,
             "the primary still counts its replica")
    plain = mtq.Queue(qname, pair.primary.url)
    task = plain.submit({"x": 1})  # acknowledged
    pair.primary.proc.kill()
    pair.primary.proc.wait(10)
    os.kill(pair.replica.proc.pid, signal.SIGCONT)
    replica = redis.Redis.from_url(pair.replica.url)
    replica.execute_command("REPLICAOF", "NO", "ONE")
    with pytest.raises(mtq.TaskNotFound):
        mtq.Queue(qname, pair.replica.url, client=replica).task(task.id).status()
