"""A task's trace names the process that called the model, on every path a start can
take: a suspect run alone in the quarantine process (a serving process claimed it and
handed it over), a warm standby promoted in a dead worker's place, a task a submit
handed directly to a sleeping worker. Real processes (``mtq workers start``), the
session's redis-server; the test model logs the pid of every predict call, and a
worker id is ``host:pid:random``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import redis

import mtq
from mtq.broker.keys import QueueKeys
from tests.support.paths import PY
from tests.support.supervisors import StartFn, read_log, wait_workers
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(120)


def ran_on(log: Path, key: str) -> int:
    """The pid of the last predict call that returned ``key`` (``s:i``)."""
    pids = [c.pid for c in read_log(log) if c.tag == "D" and key in c.keys]
    assert pids, f"{key} never returned"
    return pids[-1]


def started_on(t: mtq.Task) -> list[int]:
    """The pid of the worker each 'started' line of its trace names."""
    return [int(e.detail.rsplit(" on ", 1)[1].split(":")[1])
            for e in t.trace() if e.kind == "started"]


def shown_by_cli(task: mtq.Task, qname: str, redis_url: str,
                 env: dict[str, str]) -> dict[str, object]:
    out = subprocess.run([PY, "-m", "mtq", "task", task.id, "-q", qname, "--redis", redis_url,
                          "--json"], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.slow
def test_a_suspect_in_quarantine_and_a_promoted_standby_are_traced_where_they_ran(
        supervise: StartFn, qname: str, redis_url: str, r: redis.Redis, tmp_path: Path,
        subprocess_env: dict[str, str]) -> None:
    log = tmp_path / "calls.log"
    sup = supervise("tests.models:Probe", qname, "--replicas", "1", "--lease-ms", "2000",
                    "--max-batch-size", "1", env={"MTQ_TEST_LOG": str(log)})
    (serving,) = wait_workers(r, qname, 1, sup)
    wait_for(lambda: "standby ready" in sup.output(), 30, f"a standby\n{sup.output()}")
    q = mtq.Queue(qname, redis_url, lease_ms=2000)
    tasks = q.submit_many([{"s": "k", "i": i, "sleep": 1.0} for i in range(3)])
    wait_for(lambda: any(c.tag == "B" and c.keys == ("k:0",) for c in read_log(log)), 20,
             f"k:0 started\n{sup.output()}")
    os.kill(serving["pid"], signal.SIGKILL)  # k:0 is now a suspect; the standby takes over
    for i, t in enumerate(tasks):
        assert t.result(timeout=30)["i"] == i
    out = sup.output()
    assert "its standby" in out and "took over" in out, out
    promoted = ran_on(log, "k:1")
    quarantine = ran_on(log, "k:0")
    assert len({serving["pid"], promoted, quarantine}) == 3
    # the suspect: claimed by the promoted standby, run in the quarantine process
    assert started_on(tasks[0]) == [serving["pid"], quarantine], \
        [(e.kind, e.detail) for e in tasks[0].trace()]
    assert tasks[0].info().worker is not None and \
        f":{quarantine}:" in tasks[0].info().worker
    # the others: given back unrun, then run by the promoted standby
    for t in tasks[1:]:
        assert started_on(t)[-1] == promoted == ran_on(log, f"k:{t.result()['i']}")
    shown = shown_by_cli(tasks[0], qname, redis_url, subprocess_env)
    assert f":{quarantine}:" in json.dumps(shown), shown


def test_a_task_handed_directly_to_a_sleeping_worker_is_traced_where_it_ran(
        supervise: StartFn, qname: str, redis_url: str, r: redis.Redis, tmp_path: Path,
        subprocess_env: dict[str, str]) -> None:
    log = tmp_path / "calls.log"
    sup = supervise("tests.models:Probe", qname, "--replicas", "1", "--standby", "0",
                    env={"MTQ_TEST_LOG": str(log)})
    (w,) = wait_workers(r, qname, 1, sup)
    keys = QueueKeys(qname)
    wait_for(lambda: r.hexists(keys.idle, w["id"]), 20, "the worker registered asleep")
    q = mtq.Queue(qname, redis_url)
    answer = q.broker.submit(q.prepare([{"s": "d", "i": 0}]))
    assert answer.handed == 1, "handed straight to the sleeping worker"
    task = q.task(answer[0])
    assert task.result(timeout=20)["pid"] == w["pid"]
    assert started_on(task) == [w["pid"]] == [ran_on(log, "d:0")]
    assert task.info().worker == w["id"]
    assert w["id"] in json.dumps(shown_by_cli(task, qname, redis_url, subprocess_env))


def test_a_handover_under_a_lost_lease_changes_nothing(r: redis.Redis, qname: str,
                                                        redis_url: str) -> None:
    """A quarantine run whose lease was lost (the task reaped and claimed by another
    worker since) does not rename the new owner's start: handover.lua is fenced by the
    lease token; under the owner's token it names the runner."""
    q = mtq.Queue(qname, redis_url)
    t = q.submit({"i": 0}, stream="s")
    first = mtq.Consumer(qname, redis_url, worker_id="h:1:first")
    [old] = first.claim(1, lease_ms=50)
    # its lease expires: reaped, then claimed by another worker
    wait_for(lambda: first.broker.reap()[0] == 1, 10, "the lease reaped")
    second = mtq.Consumer(qname, redis_url, worker_id="h:2:second")
    [new] = wait_for(lambda: second.claim(1), 10, "the task claimed again")
    assert new.id == old.id and new.token != old.token
    key = QueueKeys(qname).task(t.id)
    before = r.hmget(key, "worker", "started", "token")
    trace_before = [(e.kind, e.detail) for e in t.trace()]
    assert trace_before[-1] == ("started", "delivery 2 on h:2:second"), trace_before
    assert first.broker.handover("h:3:quarantine", old.id, old.token) is False
    assert r.hmget(key, "worker", "started", "token") == before
    assert [(e.kind, e.detail) for e in t.trace()] == trace_before
    # under the owner's token: the runner is named, the lease stays the claimer's
    assert second.broker.handover("h:3:quarantine", new.id, new.token) is True
    assert r.hmget(key, "worker", "token") == [b"h:3:quarantine", new.token.encode()]
    after = [(e.kind, e.detail) for e in t.trace()]
    assert after[:-1] == trace_before[:-1]
    assert after[-1] == ("started", "delivery 2 on h:3:quarantine"), after
