"""A chain's hand-off survives the death of the worker that acked: a real ``mtq worker
run`` process is SIGKILLed once the ack that ended a chained task succeeded has
recorded the hand-off (observed in Redis), before the next step went in (the next queue
is full, so it cannot have); another worker's reaper completes the recorded hand-off
once it is a lease old, and the next step is submitted exactly once."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import redis

import mtq
from mtq.broker import chains
from mtq.broker.keys import QueueKeys
from tests.support.processes import kill_process, worker_process
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(60)


def test_a_worker_killed_between_the_ack_and_the_next_submit(
        redis_url: str, client: redis.Redis, subprocess_env: dict[str, str],
        tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:10]
    a, b = f"ka-{tag}", f"kb-{tag}"
    mtq.Queue(a, client=client).configure(lease_ms=1000)  # recovered after 1 s
    qb = mtq.Queue(b, client=client)
    qb.configure(max_length=1)
    blocker = qb.submit("first")  # b is full: the worker's hand-off cannot go in
    log = (tmp_path / "w.log").open("ab")
    dying = worker_process(["tests.handlers:identity", "-q", a], subprocess_env, log)
    procs = [dying]
    try:
        task = mtq.Queue(a, client=client).submit({"x": 1}, then=[mtq.Step(b, pick="x", field="x")])
        wait_for(lambda: client.zrange(QueueKeys(a).handoffs, 0, -1) == [task.id.encode()],
                 30, "the ack to record the hand-off")
        kill_process(dying)
        assert task.status() == "succeeded"
        assert client.zrange(QueueKeys(a).handoffs, 0, -1) == [task.id.encode()]
        nxt = chains.step_id(task.id, 1)
        assert not client.exists(QueueKeys(b).task(nxt)), "the next step was not submitted"
        blocker.cancel()  # room in b
        procs.append(worker_process(["tests.handlers:double", "-q", b], subprocess_env, log))
        procs.append(worker_process(["tests.handlers:identity", "-q", a], subprocess_env, log))
        chain = task.chain()
        assert chain.result(timeout=30) == 2  # double({"x": 1})
    finally:
        for p in procs:
            kill_process(p)
    assert qb.stats()["submitted"] == 2  # the blocker and the step, once
    assert [s.status for s in chain.steps()] == ["succeeded", "succeeded"]
    wait_for(lambda: client.zcard(QueueKeys(a).handoffs) == 0, 5, "the record removed")
