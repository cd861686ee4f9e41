"""A chain's hand-off survives the death of the worker that acked: a real ``mtq worker
run`` process is SIGKILLed once the ack that ended a chained task succeeded has
recorded the hand-off (observed in Redis), before the next step went in (the next queue
is full, so it cannot have); another worker's reaper completes the recorded hand-off
once it is a lease old, and the next step is submitted exactly once. A second chain on
the same stream, submitted right after, does not start before that hand-off went in
(the ack holds the stream until then), so the next queue gets the stream's steps in
order."""

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
        qa = mtq.Queue(a, client=client)
        step = mtq.Step(b, pick="x", field="x")
        task = qa.submit({"x": 1}, stream="u", then=[step])
        later = qa.submit({"x": 2}, stream="u", then=[step])  # the same stream, after it
        wait_for(lambda: client.zrange(QueueKeys(a).handoffs, 0, -1) == [task.id.encode()],
                 30, "the ack to record the hand-off")
        kill_process(dying)
        assert task.status() == "succeeded"
        assert client.zrange(QueueKeys(a).handoffs, 0, -1) == [task.id.encode()]
        nxt = chains.step_id(task.id, 1)
        assert not client.exists(QueueKeys(b).task(nxt)), "the next step was not submitted"
        assert later.status() == "queued", "the stream is held until the hand-off"
        assert client.sismember(QueueKeys(a).busy, "u")
        blocker.cancel()  # room in b
        qb.configure(max_length=0)  # (for the later step too; read by the new workers)
        procs.append(worker_process(["tests.handlers:double", "-q", b], subprocess_env, log))
        procs.append(worker_process(["tests.handlers:identity", "-q", a], subprocess_env, log))
        chain, chain2 = task.chain(), later.chain()
        assert chain.result(timeout=30) == 2  # double({"x": 1})
        assert chain2.result(timeout=30) == 4
    finally:
        for p in procs:
            kill_process(p)
    assert qb.stats()["submitted"] == 3  # the blocker and each step, once
    assert [s.status for s in chain.steps()] == ["succeeded", "succeeded"]
    # the later chain's first step started once the hand-off had put the step in
    step_a, step_b = qb.task(nxt).info(), qb.task(chains.step_id(later.id, 1)).info()
    assert later.info().started >= step_a.created
    assert task.info().deliveries == 1, "the reaper re-ran nothing (no lease left at the ack)"
    assert step_a.finished <= step_b.started  # in submit order on the next queue
    wait_for(lambda: client.zcard(QueueKeys(a).handoffs) == 0, 5, "the records removed")
    assert not client.sismember(QueueKeys(a).busy, "u")
