"""Delayed submits (``submit(delay=S)`` / ``at=datetime``): the task waits in Redis's
delayed set, is queued at the tail of its stream when due, wakes an idle worker then,
can be cancelled while it waits, survives a worker kill and a Redis restart (AOF), and
counts in ``delayed``, not ``waiting``. Bad input is refused before anything is
written."""

from __future__ import annotations

import math
import signal
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

import mtq
from mtq.broker.consumer import Consumer
from mtq.broker.keys import QueueKeys
from mtq.broker.outcomes import Outcome
from mtq.cli.main import cli
from mtq.errors import InvalidArgument
from mtq.observe.prometheus import MtqCollector
from mtq.settings import QueueSettings
from tests.support.commands import commands_per_task
from tests.support.processes import kill_process, worker_process
from tests.support.servers import RedisServer
from tests.support.waits import wait_for
from tests.support.workers import Recorder, make_worker, serving

pytestmark = pytest.mark.timeout(60)


def claim_one(c: Consumer, timeout: float = 5.0) -> list:
    """Claim (sleeping on the wake list between claims) until a task comes."""
    got = wait_for(lambda: c.claim(4) or (c.wait(0.2) and False), timeout,
                   "a claim that returns a task")
    return list(got)


def done(c: Consumer, tasks: list) -> None:
    c.settle([Outcome(t, True, t.id) for t in tasks])


def test_an_idle_worker_starts_a_delayed_task_at_its_due_time(qname: str,
                                                               redis_url: str) -> None:
    """The worker sleeps in its claim wait with no timer (its longest sleep is 10 s; a
    long lease, so its idle registration lasts as long): the submit wakes it to read
    the new timer, and it starts the task when due."""
    rec = Recorder()
    w = make_worker(rec, qname, redis_url, QueueSettings(lease_ms=60_000))
    q = mtq.Queue(qname, redis_url)
    with serving(w):
        warm = q.submit({"warm": 1})
        assert warm.result(timeout=10) == {"warm": 1}
        task = q.submit({"x": 1}, delay=0.6)
        assert task.status() == "delayed"
        assert task.result(timeout=5) == {"x": 1}
    info = task.info()
    assert info.created is not None and info.started is not None
    late = info.started - (info.created + 600)
    assert late >= 0, f"started {-late} ms before its due time"
    assert late < 400, f"started {late} ms after its due time (the worker slept on)"


def test_a_delayed_task_joins_the_tail_of_its_stream_when_due(qname: str, client: redis.Redis,
                                                               redis_url: str) -> None:
    """Stream s: A (delay 0.6 s), then B (none), then C (delay 0.2 s): B runs at once (A
    holds nothing up), C becomes due first and runs before A."""
    q = mtq.Queue(qname, client=client)
    a = q.submit("a", stream="s", delay=0.6)
    b = q.submit("b", stream="s")
    c_ = q.submit("c", stream="s", delay=0.2)
    c = Consumer(qname, redis_url)
    order = []
    for _ in range(3):
        got = claim_one(c)
        assert len(got) == 1, "one task of a stream at a time"
        order.append(got[0].id)
        done(c, got)
    assert order == [b.id, c_.id, a.id]
    assert q.stats()["streams"] == 0 and q.stats()["delayed"] == 0


def test_a_due_task_waits_for_its_streams_running_task(qname: str, client: redis.Redis,
                                                        redis_url: str) -> None:
    q = mtq.Queue(qname, client=client)
    first = q.submit("first", stream="s")
    c = Consumer(qname, redis_url)
    (running,) = c.claim(4)
    assert running.id == first.id
    later = q.submit("later", stream="s", delay=0.05)
    # each claim promotes what is due; none takes it while its stream runs a task
    wait_for(lambda: c.claim(4) == [] and later.status() == "queued", 5,
             "the delayed task queued when due, not claimed")
    done(c, [running])
    (nxt,) = claim_one(c)
    assert nxt.id == later.id


def test_cancel_while_delayed_leaves_nothing_in_the_delayed_set(qname: str,
                                                                client: redis.Redis,
                                                                redis_url: str) -> None:
    """A delayed task of a stream whose other task runs: cancelled, it leaves the set,
    and the running task's stream stays busy (the cancel frees no stream)."""
    q = mtq.Queue(qname, client=client)
    keys = QueueKeys(qname)
    q.submit("running", stream="s")
    c = Consumer(qname, redis_url)
    (running,) = c.claim(4)
    queued = q.submit("queued", stream="s")
    task = q.submit("later", stream="s", delay=30)
    assert q.stats()["delayed"] == 1
    assert task.cancel()
    assert task.status() == "cancelled"
    assert client.zscore(keys.delayed, task.id) is None
    assert q.stats()["delayed"] == 0 and q.stats()["cancelled"] == 1
    assert client.sismember(keys.busy, "s"), "the running task's stream stays busy"
    assert c.claim(4) == [], "nothing claimable while its stream runs"
    done(c, [running])
    (nxt,) = claim_one(c)
    assert nxt.id == queued.id


def test_submit_many_with_mixed_delays_counts_them_delayed_not_waiting(
        qname: str, client: redis.Redis, redis_url: str) -> None:
    q = mtq.Queue(qname, client=client)
    soon = datetime.now(timezone.utc) + timedelta(seconds=0.3)
    tasks = q.submit_many([mtq.Request("d", delay=0.2), "now",
                           mtq.Request("at", at=soon), mtq.Request("zero", delay=0)],
                          delay=None)
    st = q.stats()
    assert (st["waiting"], st["delayed"], st["submitted"]) == (2, 2, 4), st
    assert [t.status() for t in tasks] == ["delayed", "queued", "delayed", "queued"]
    text = MtqCollector(client, [qname], workers=None).render().decode()
    assert f'mtq_queue_delayed_tasks{{queue="{qname}"}} 2' in text
    assert f'mtq_queue_waiting_tasks{{queue="{qname}"}} 2' in text
    # submit_many's own delay applies to the items that give none
    later = q.submit_many(["x", "y"], delay=30)
    assert [t.status() for t in later] == ["delayed", "delayed"]
    c = Consumer(qname, redis_url)
    seen: set[str] = set()

    def drain() -> bool:
        got = c.claim(8)
        done(c, got)
        seen.update(t.id for t in got)
        return {t.id for t in tasks} <= seen

    wait_for(lambda: drain() or (c.wait(0.2) and False), 5, "the four tasks run")
    st = q.stats()
    assert (st["waiting"], st["delayed"], st["succeeded"]) == (0, 2, 4), st


@pytest.mark.parametrize("kw", [
    {"delay": -1}, {"delay": math.nan}, {"delay": math.inf}, {"delay": True},
    {"delay": 2e9}, {"delay": "5"},
    {"at": datetime(2030, 1, 1, 9)},
    {"at": "2030-01-01T09:00:00+00:00"},
    {"delay": 1, "at": datetime.now(timezone.utc)},
    {"delay": 1, "deadline": 5},
], ids=lambda kw: ",".join(f"{k}={v!r}" for k, v in kw.items()))
def test_bad_delays_are_refused_and_nothing_is_written(qname: str, client: redis.Redis,
                                                       kw: dict) -> None:
    q = mtq.Queue(qname, client=client)
    with pytest.raises(InvalidArgument) as exc:
        q.submit("x", **kw)
    if "at" in kw and isinstance(kw["at"], datetime) and "delay" not in kw:
        assert "time zone" in str(exc.value)
    with pytest.raises(InvalidArgument):
        q.submit_many([mtq.Request("x", **kw)] if "deadline" not in kw else
                      [mtq.Request("x", deadline=5, delay=1)])
    assert client.keys(f"*{qname}*") == [], "nothing written"


@pytest.mark.parametrize("args", [
    ["--delay", "-1"], ["--delay", "nan"], ["--delay", "inf"],
    ["--at", "2030-01-01T09:00:00"], ["--at", "tomorrow"],
    ["--delay", "1", "--at", "2030-01-01T09:00:00Z"],
])
def test_cli_bad_delays_exit_2(qname: str, redis_url: str, client: redis.Redis,
                               args: list[str]) -> None:
    res = CliRunner().invoke(cli, ["submit", qname, '{"x": 1}', "--redis", redis_url, *args])
    assert res.exit_code == 2, res.output
    assert client.keys(f"*{qname}*") == [], "nothing written"


def test_cli_submit_delay_and_at(qname: str, redis_url: str, client: redis.Redis) -> None:
    res = CliRunner().invoke(cli, ["submit", qname, '{"x": 1}', "--redis", redis_url,
                                   "--delay", "30"])
    assert res.exit_code == 0, res.output
    q = mtq.Queue(qname, client=client)
    assert q.task(res.output.strip()).status() == "delayed"
    at = (datetime.now(timezone.utc) + timedelta(hours=1)).isoformat()
    res = CliRunner().invoke(cli, ["submit", qname, '{"x": 2}', "--redis", redis_url,
                                   "--at", at])
    assert res.exit_code == 0, res.output
    task = q.task(res.output.strip())
    due = task.info().due
    assert due is not None
    assert abs(due / 1000 - datetime.fromisoformat(at).timestamp()) < 2
    assert q.stats()["delayed"] == 2
    res = CliRunner().invoke(cli, ["task", task.id, "--redis", redis_url])
    assert res.exit_code == 0, res.output
    assert "due (delayed)" in res.output and "delayed" in res.output


def test_a_delayed_task_survives_a_worker_kill(qname: str, redis_url: str,
                                               subprocess_env: dict[str, str],
                                               tmp_path: Path) -> None:
    """The worker that slept with the task's timer is killed before it is due; another
    runs it."""
    q = mtq.Queue(qname, redis_url)
    log = (tmp_path / "w.log").open("ab")
    first = worker_process(["tests.handlers:identity", "-q", qname], subprocess_env, log)
    try:
        assert q.submit("warm").result(timeout=20) == "warm"
        task = q.submit("late", delay=1.0)
        kill_process(first)
        assert task.status() == "delayed"
        second = worker_process(["tests.handlers:identity", "-q", qname], subprocess_env, log)
        try:
            assert task.result(timeout=20) == "late"
        finally:
            second.terminate()
            second.wait(10)
    finally:
        kill_process(first)
    assert task.info().deliveries == 1


def test_a_delayed_task_survives_a_redis_restart_with_aof(qname: str,
                                                          tmp_path: Path) -> None:
    server = RedisServer(tmp_path, appendonly=True)
    server.start()
    try:
        c = redis.Redis.from_url(server.url)
        q = mtq.Queue(qname, client=c)
        task = q.submit("kept", stream="s", delay=0.8)
        c.close()
        assert server.proc is not None
        server.proc.send_signal(signal.SIGTERM)  # a clean shutdown: AOF written
        server.proc.wait(10)
        server.start()
        c = redis.Redis.from_url(server.url)
        q = mtq.Queue(qname, client=c)
        assert q.task(task.id).status() == "delayed"
        assert q.stats()["delayed"] == 1
        w = make_worker(Recorder(), qname, server.url)
        with serving(w):
            assert q.task(task.id).result(timeout=10) == "kept"
        c.close()
    finally:
        server.stop()


def test_a_waiting_delayed_task_adds_no_redis_command_to_the_hot_path(tmp_path: Path) -> None:
    """Submit, claim and ack cost the same commands per task whether a delayed task
    waits in the queue or none ever did (the claim reads the delayed set's first entry
    for retries anyway)."""
    server = RedisServer(tmp_path)
    server.start()
    try:
        plain = commands_per_task(server.url, "plain", lambda q: None)
        with_one = commands_per_task(server.url, "with-delayed",
                                     lambda q: q.submit("later", delay=3600))
    finally:
        server.stop()
    assert plain == with_one, (plain, with_one)


def test_a_delayed_task_of_a_tenant_joins_its_lane_when_due(qname: str, client: redis.Redis,
                                                             redis_url: str) -> None:
    """Scheduling on: a delayed task of a tenant and band is queued in its lane when due,
    counted there, and claimed; its lane's counts go back to zero when it is done."""
    q = mtq.Queue(qname, client=client)
    task = q.submit("t", tenant="acme", priority="interactive", delay=0.2, cost=3)
    free = q.submit("f", tenant="acme", priority="interactive", stream="s", delay=0.1)
    keys = QueueKeys(qname)
    count = f"{keys.base}sched:count"
    assert client.hget(count, "i:acme|w") in (None, b"0"), "not counted waiting yet"
    c = Consumer(qname, redis_url)
    seen: list[str] = []

    def drain() -> bool:
        got = c.claim(8)
        seen.extend(t.id for t in got)
        done(c, got)
        return len(seen) == 2

    wait_for(lambda: drain() or (c.wait(0.2) and False), 5, "both delayed tasks run")
    assert seen == [free.id, task.id], "in due order"
    assert client.hget(count, "i:acme|w") in (None, b"0")
    assert q.stats()["waiting"] == 0 and q.stats()["delayed"] == 0


@pytest.mark.parametrize("limit", [100, 7])
def test_delayed_tasks_of_a_stream_due_at_the_same_time_keep_their_submit_order(
        qname: str, client: redis.Redis, redis_url: str, limit: int) -> None:
    """Due at the same ms (one submit_many): the delayed set orders ties by member, and
    ids are random, so promotion must not follow the set's order; nor may a claim's
    promotion limit (reap_limit 7) cut the tie."""
    q = mtq.Queue(qname, client=client)
    s = q.submit_many([mtq.Request(f"s{i}", stream="s") for i in range(40)]
                      + [mtq.Request(f"t{i}", stream="t") for i in range(40)], delay=0.2)
    c = Consumer(qname, redis_url, settings=QueueSettings(reap_limit=limit))
    order: dict[str, list[str]] = {"s": [], "t": []}

    def drain() -> bool:
        got = c.claim(8)
        for t in got:
            order[t.stream].append(t.id)
        done(c, got)
        return len(order["s"]) + len(order["t"]) == 80

    wait_for(lambda: drain() or (c.wait(0.2) and False), 10, "the 80 tasks run")
    assert order["s"] == [t.id for t in s[:40]]
    assert order["t"] == [t.id for t in s[40:]]
