"""A queue's settings live in Redis (``mtq queue config``): every producer and
worker of the queue reads them (again within REFRESH_S), overrides in code or on a
worker's command line win for that process, and a bad key or value changes
nothing. Real worker processes, one killed mid-task."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

import mtq
from mtq.broker import config
from mtq.cli.main import cli
from mtq.errors import ConfigError, InvalidName
from mtq.settings import QueueSettings
from tests.support.waits import wait_for

PY = sys.executable


def run(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(cli, list(args))
    return res.exit_code, res.output


def test_set_show_reset_and_refuse(redis_url: str, qname: str, r: redis.Redis) -> None:
    code, out = run("queue", "config", qname, "max_retries", "5", "dead_letter", "no",
                    "--redis", redis_url)
    assert code == 0 and "max_retries*" in out, out
    code, out = run("queue", "config", qname, "--json", "--redis", redis_url)
    data = json.loads(out)
    assert data["stored"] == {"max_retries": 5, "dead_letter": False}, data
    assert data["settings"]["lease_ms"] == QueueSettings().lease_ms
    status = run("status", "--json", "--redis", redis_url)[1]
    assert qname in status, "a configured queue is listed"
    before = r.hgetall(f"mtq:{{{qname}}}:config")
    for bad in (["max_retries", "x"], ["nope", "1"], ["lease_ms", "0"],
                ["idempotency_window_s", str(10**20)], ["max_retries"],
                ["max_retries", "2", "dead_letter", "maybe"]):
        code, out = run("queue", "config", qname, *bad, "--redis", redis_url)
        assert code == 2 and "Traceback" not in out, (bad, out)
    assert r.hgetall(f"mtq:{{{qname}}}:config") == before, "a refused change wrote something"
    code, out = run("queue", "config", qname, "--reset", "max_retries", "--json",
                    "--redis", redis_url)
    assert json.loads(out)["stored"] == {"dead_letter": False}, out


def test_producers_read_it_and_see_changes(redis_url: str, qname: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "REFRESH_S", 0.2)
    q = mtq.Queue(qname, redis_url)
    q.submit({"i": 0})
    q.configure(max_length=2)          # this object sees it at once
    q.submit({"i": 1})
    with pytest.raises(mtq.QueueFull):
        q.submit({"i": 2})
    other = mtq.Queue(qname, redis_url)  # another producer reads it from Redis
    with pytest.raises(mtq.QueueFull):
        other.submit({"i": 2})
    assert mtq.Queue(qname, redis_url, max_length=5).submit({"i": 2})  # code wins
    assert mtq.Queue(qname, redis_url, settings=QueueSettings()).submit({"i": 3})  # fixed
    # a change made elsewhere reaches a running producer within REFRESH_S
    assert run("queue", "config", qname, "max_length", "100", "--redis", redis_url)[0] == 0
    wait_for(lambda: other.settings.max_length == 100, 5, "the change did not arrive")
    other.submit({"i": 4})


def test_workers_use_it_a_killed_worker_under_a_short_stored_lease(
        redis_url: str, qname: str, tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    """The stored lease_ms reaches a bare worker process: killed with SIGKILL while it
    holds a task, the task runs again after about that lease, not the default 8 s.
    The stored max_retries reaches supervised worker processes."""
    q = mtq.Queue(qname, redis_url)
    q.configure(lease_ms=1000, max_retries=0)
    t = q.submit({"sleep": 30, "s": "a", "i": 0})

    def worker() -> subprocess.Popen[bytes]:
        return subprocess.Popen([PY, "-m", "mtq", "worker", "run", "tests.handlers:logged",
                                 "--queue", qname], env=subprocess_env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    first = worker()
    second = None
    try:
        wait_for(lambda: t.status() == "running", 30, "the first worker did not start it")
        second = worker()  # idle: it takes the task back once the lease has run out
        wait_for(lambda: mtq.Queue(qname, redis_url).stats()["running"] == 1, 5, "stats")
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        killed = time.monotonic()
        wait_for(lambda: t.info().deliveries >= 2, 20, "the task was not run again")
        took = time.monotonic() - killed
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)
    assert took < 4, f"run again {took:.1f} s after the kill: the stored 1 s lease was not used"

    failing = q.submit({"x": 1})
    log = tmp_path / "sup.log"
    with open(log, "wb") as out:
        sup = subprocess.Popen([PY, "-m", "mtq", "workers", "start", "tests.handlers:boom",
                                "--queue", qname, "--standby", "0"], env=subprocess_env,
                               stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with pytest.raises(mtq.TaskFailed):
            failing.result(timeout=60)
        info = failing.info()
        assert info.status == "dead" and info.attempts == 1, (info, log.read_text())
    finally:
        sup.terminate()
        sup.wait(30)


def test_a_lease_shortened_under_a_running_task_is_kept(redis_url: str, qname: str,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """The heartbeat follows the queue's lease: cut from 8 s to 0.7 s while a 3 s task
    runs (and another worker waits to take over expired leases), the task is not
    taken from its worker and runs once."""
    import threading

    from mtq.workers.model import FunctionModel
    from mtq.workers.worker import Worker
    from tests.support.workers import serving

    monkeypatch.setattr(config, "REFRESH_S", 0.2)
    q = mtq.Queue(qname, redis_url)
    started = threading.Event()

    def slow(p: dict[str, int]) -> int:
        started.set()
        time.sleep(3)  # the work itself, while the lease changes under it
        return p["x"]

    t = q.submit({"x": 7})
    with serving(Worker(FunctionModel(slow), qname, url=redis_url)):
        assert started.wait(20), "the task did not start"
        q.configure(lease_ms=700)
        with serving(Worker(FunctionModel(lambda p: -1), qname, url=redis_url)):
            assert t.result(timeout=20) == 7
    info = t.info()
    assert info.deliveries == 1, f"taken from its worker: {info}"


def test_a_bad_stored_value_is_skipped_not_fatal(redis_url: str, qname: str,
                                                 r: redis.Redis) -> None:
    r.hset(f"mtq:{{{qname}}}:config", mapping={"lease_ms": "0", "max_retries": "2",
                                                "future_key": "1"})
    q = mtq.Queue(qname, redis_url)
    assert q.submit({"x": 1})                      # producers go on
    assert (q.settings.lease_ms, q.settings.max_retries) == (QueueSettings().lease_ms, 2)
    code, out = run("queue", "config", qname, "--json", "--redis", redis_url)
    assert code == 0 and json.loads(out)["stored"] == {"max_retries": 2}, out
    code, out = run("queue", "config", qname, "lease_ms", "9000", "--redis", redis_url)
    assert code == 0 and "9,000" in out, out       # fixed by setting it again


# -- Queue construction ----------------------------------------------------------
def test_queue_rejects_unknown_setting(redis_url):
    with pytest.raises(ConfigError, match="bogus"):
        mtq.Queue("q", url=redis_url, bogus=1)


def test_queue_rejects_out_of_range_setting(redis_url):
    with pytest.raises(ConfigError, match="lease_ms"):
        mtq.Queue("q", url=redis_url, lease_ms=0)


def test_queue_rejects_bad_name(redis_url):
    with pytest.raises(InvalidName):
        mtq.Queue("bad name", url=redis_url)


def test_queue_accepts_overrides(redis_url):
    q = mtq.Queue("q", url=redis_url, max_length=7)
    assert q.settings.max_length == 7
    q2 = mtq.Queue("q", url=redis_url, settings=QueueSettings(lease_ms=99), max_length=3)
    assert (q2.settings.lease_ms, q2.settings.max_length) == (99, 3)
