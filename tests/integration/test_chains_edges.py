"""Chains at their edges (docs/streaming.md, "Chains"): a hand-off the next queue
refuses for now (its record stays, is retried a lease later and holds up no other
record), a record the hand-off cannot read (the chain fails, named, the record goes),
an ack sent twice, a dead-lettered step retried, the waits' time limits, ``aresult``
(and its cancel), and the order of a stream across steps. Workers run in this
process (threads); hand-offs a dead worker left are made with the script alone."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any

import pytest
import redis

import mtq
from mtq import serialization
from mtq.broker import chains
from mtq.broker.codes import Code
from mtq.broker.consumer import Consumer
from mtq.broker.keys import QueueKeys
from mtq.errors import ChainFailed, ResultTimeout, TaskNotFound
from tests.integration.test_chains import ack_without_hand_off, workers
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(60)


def names(n: int) -> list[str]:
    tag = uuid.uuid4().hex[:10]
    return [f"e{i}-{tag}" for i in range(n)]


def test_a_full_next_queue_keeps_the_record_and_it_is_retried(
        redis_url: str, client: redis.Redis) -> None:
    a, b = names(2)
    qb = mtq.Queue(b, client=client)
    qb.configure(max_length=1)
    blocker = qb.submit("first")  # b is full
    task = mtq.Queue(a, client=client).submit("x", then=[b])
    tid = ack_without_hand_off(redis_url, a)
    h = chains.HandOff(client, a)
    assert h.run([tid]) == 0  # refused for now: not done, not lost
    assert client.zrange(QueueKeys(a).handoffs, 0, -1) == [tid.encode()]
    assert chains.recover(h, 0) == 0  # and again: no error, still kept
    assert client.zcard(QueueKeys(a).handoffs) == 1
    assert not client.exists(QueueKeys(b).task(chains.step_id(task.id, 1)))
    blocker.cancel()  # room again
    assert chains.recover(h, 0) == 1
    assert client.zcard(QueueKeys(a).handoffs) == 0
    with workers(redis_url, (b, lambda p: p + "!")):
        assert task.chain().result(timeout=10) == "done!"


def test_one_tenant_over_its_limit_keeps_only_its_own_step_back(
        redis_url: str, client: redis.Redis) -> None:
    """Two chains' steps handed off in one round to a queue where one tenant is over
    its rate limit: the next queue refuses the whole call, so the steps are tried one
    by one, and only that tenant's waits."""
    a, b = names(2)
    qb = mtq.Queue(b, client=client)
    qb.configure(tenant_rpm="acme=60")  # a burst of one
    qb.submit("first", tenant="acme")  # acme is at its limit on b
    q = mtq.Queue(a, client=client)
    limited = q.submit("x", tenant="acme", then=[b])
    free = [q.submit(p, tenant=t, then=[b]) for p, t in (("y", "beta"), ("z", "gamma"))]
    ids = [ack_without_hand_off(redis_url, a) for _ in range(3)]
    assert set(ids) == {limited.id, *(t.id for t in free)}
    watcher = redis.Redis.from_url(redis_url)
    try:
        with watcher.monitor() as m:
            h = chains.HandOff(client, a)
            assert h.run(ids) == 2  # beta's and gamma's steps went in, in the same round
            marker = uuid.uuid4().hex
            client.echo(marker)
            calls = []
            for cmd in m.listen():
                if marker in str(cmd["command"]):
                    break
                calls.append(str(cmd["command"]))
    finally:
        watcher.close()
    for t in free:
        assert client.exists(QueueKeys(b).task(chains.step_id(t.id, 1)))
    assert not client.exists(QueueKeys(b).task(chains.step_id(limited.id, 1)))
    assert client.zrange(QueueKeys(a).handoffs, 0, -1) == [limited.id.encode()]
    # the call made again once, without acme's step: not one call per step
    steps = [chains.step_id(t.id, 1) for t in (limited, *free)]
    submits = [c for c in calls if c.startswith("EVALSHA") and any(i in c for i in steps)]
    assert len(submits) == 2, submits


@pytest.mark.parametrize("access", ["none", "read"])
def test_a_next_queue_that_cannot_be_reached_holds_up_only_its_own_steps(
        access: str, redis_url: str, client: redis.Redis) -> None:
    """One round hands off to two queues; one of them fails (here a Redis user denied
    its keys, as a node away would: its settings cannot be read, or its submit cannot
    write): the other's step goes in, the failing one's record stays for a later
    round, and nothing raises out of the hand-off."""
    a, b, c = names(3)
    q = mtq.Queue(a, client=client)
    to_b, to_c = q.submit("x", then=[b]), q.submit("y", then=[c])
    ids = [ack_without_hand_off(redis_url, a) for _ in range(2)]
    assert set(ids) == {to_b.id, to_c.id}
    user = "handoff-" + uuid.uuid4().hex[:8]
    rules = ["on", ">pw", "+@all", "&*", f"~mtq:{{{a}}}*", f"~mtq:{{{c}}}*", "~mtq:[^{]*"]
    if access == "read":  # its settings are read, its submit script is refused
        rules.append("~" + QueueKeys(b).config)
    client.execute_command("ACL", "SETUSER", user, *rules)
    denied = redis.Redis.from_url(redis_url, username=user, password="pw")
    try:
        assert chains.HandOff(denied, a).run(ids) == 1  # c's step; b's is kept
    finally:
        denied.close()
        client.acl_deluser(user)
    assert client.exists(QueueKeys(c).task(chains.step_id(to_c.id, 1)))
    assert not client.exists(QueueKeys(b).task(chains.step_id(to_b.id, 1)))
    assert client.zrange(QueueKeys(a).handoffs, 0, -1) == [to_b.id.encode()]
    assert chains.recover(chains.HandOff(client, a), 0) == 1  # reachable again
    assert client.exists(QueueKeys(b).task(chains.step_id(to_b.id, 1)))


def test_a_refused_record_is_retried_a_lease_later_and_holds_up_no_other(
        redis_url: str, client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """A record the next queue refuses goes to the back (scored now): the next round
    takes the others first, and the refused one is not tried again before a lease."""
    a, b, c = names(3)
    monkeypatch.setattr(chains, "RECOVER_BATCH", 1)
    mtq.Queue(b, client=client).configure(max_length=1)
    mtq.Queue(b, client=client).submit("first")  # b is full
    q = mtq.Queue(a, client=client)
    stuck = q.submit("x", then=[b])
    ack_without_hand_off(redis_url, a)
    free = q.submit("y", then=[c])
    ack_without_hand_off(redis_url, a)
    keys = QueueKeys(a)
    client.zadd(keys.handoffs, {stuck.id: 1, free.id: 2})  # both long due, stuck first
    h = chains.HandOff(client, a)
    assert chains.recover(h, 1000) == 0  # the stuck one, refused
    assert chains.recover(h, 1000) == 1  # then the other, not the stuck one again
    assert client.exists(QueueKeys(c).task(chains.step_id(free.id, 1)))
    assert client.zrange(keys.handoffs, 0, -1) == [stuck.id.encode()]
    assert chains.recover(h, 1000) == 0, "not due again before a lease"


def test_a_record_the_hand_off_cannot_read_fails_the_chain_and_goes(
        redis_url: str, client: redis.Redis) -> None:
    """A corrupt or foreign ``then`` (a spec this version cannot read) ends the chain at
    that step with a named error, and the other records of the round go on."""
    a, b, c = names(3)
    q = mtq.Queue(a, client=client)
    bad = q.submit("x", then=[b])
    ack_without_hand_off(redis_url, a)
    good = q.submit("y", then=[c])
    ack_without_hand_off(redis_url, a)
    keys = QueueKeys(a)
    client.hset(keys.task(bad.id), "then", serialization.dumps([{"queue": b}]))
    h = chains.HandOff(client, a)
    assert chains.recover(h, 0) == 2
    assert client.zcard(keys.handoffs) == 0, "no record left to be retried forever"
    assert client.exists(QueueKeys(c).task(chains.step_id(good.id, 1)))
    with pytest.raises(ChainFailed) as e:
        bad.chain().result(timeout=5)
    assert e.value.step == 1 and e.value.status == "failed"
    assert "cannot be read" in str(e.value)
    assert bad.chain().status() == "failed"


def test_an_ack_sent_twice_records_one_hand_off(redis_url: str, client: redis.Redis) -> None:
    """An ack whose reply was lost and is sent again finds the task finished (lease
    lost): no second record, no second step; the first record is completed once."""
    a, b = names(2)
    task = mtq.Queue(a, client=client).submit("x", then=[b])
    c = Consumer(a, redis_url)
    got = wait_for(lambda: c.claim(1), 5, "the first task to claim")
    ack = [(got[0].id, got[0].token, serialization.dumps("r"))]
    assert c.broker.ack(ack) == [chains.CHAINED]
    assert c.broker.ack(ack) == [Code.LEASE_LOST]
    assert client.zcard(QueueKeys(a).handoffs) == 1
    h = chains.HandOff(client, a)
    assert chains.recover(h, 0) == 1 and chains.recover(h, 0) == 0
    assert mtq.Queue(b, client=client).stats()["submitted"] == 1
    assert task.chain().steps()[1].status == "queued"


def test_a_dead_lettered_step_retried_goes_on_with_the_chain(redis_url: str,
                                                             client: redis.Redis) -> None:
    a, b, c = names(3)
    failing = threading.Event()
    failing.set()

    def flaky(p: str) -> str:
        if failing.is_set():
            raise RuntimeError("down")
        return p + "-b"

    task = mtq.Queue(a, client=client).submit("x", then=[mtq.Step(b, retries=0), c])
    qb = mtq.Queue(b, client=client)
    qb.configure(dead_letter=True)
    with workers(redis_url, (a, lambda p: p), (b, flaky), (c, lambda p: p + "-c")):
        with pytest.raises(ChainFailed) as e:
            task.chain().result(timeout=10)
        assert e.value.step == 1 and e.value.status == "dead"
        assert task.chain().status() == "dead"
        failing.clear()
        assert qb.retry_dead([chains.step_id(task.id, 1)]) == 1
        assert task.chain().result(timeout=10) == "x-b-c"
    assert [s.status for s in task.chain().steps()] == ["succeeded"] * 3
    assert mtq.Queue(c, client=client).stats()["submitted"] == 1


def test_result_keeps_its_time_limit_while_a_hand_off_is_pending(
        redis_url: str, client: redis.Redis) -> None:
    a, b = names(2)
    task = mtq.Queue(a, client=client).submit("x", then=[b])
    ack_without_hand_off(redis_url, a)  # its worker "died": nobody recovers it
    chain = task.chain()
    t0 = time.monotonic()
    with pytest.raises(ResultTimeout) as timed_out:
        chain.result(timeout=0.3)
    assert time.monotonic() - t0 < 2.0
    assert timed_out.value.timeout == 0.3, "it names the time given, not what was left"


def test_aresult(redis_url: str, client: redis.Redis) -> None:
    a, b = names(2)
    ok = mtq.Queue(a, client=client).submit({"t": "hi"}, then=[mtq.Step(b, pick="t")])
    bad = mtq.Queue(a, client=client).submit({"u": 1}, then=[mtq.Step(b, pick="t")])

    async def main() -> tuple[Any, BaseException]:
        value = await ok.chain().aresult(timeout=10)
        try:
            await bad.chain().aresult(timeout=10)
        except ChainFailed as exc:
            return value, exc
        raise AssertionError("no ChainFailed")

    with workers(redis_url, (a, lambda p: p), (b, lambda p: p.upper())):
        value, exc = asyncio.run(main())
    assert value == "HI"
    assert isinstance(exc, ChainFailed) and exc.step == 1


def test_a_cancelled_aresult_leaves_no_wait_behind(redis_url: str, client: redis.Redis) -> None:
    """A cancelled ``aresult`` (asyncio.wait_for's timeout) stops waiting: asyncio.run
    ends at once, holding no thread in a wait until the result's own time limit."""
    a, b = names(2)
    task = mtq.Queue(a, client=client).submit("x", then=[b])  # no worker: it waits
    chain = task.chain()

    async def main() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(chain.aresult(timeout=5), 0.2)

    errors: list[BaseException] = []

    def go() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:  # (reported below: a thread's own is only a warning)
            errors.append(exc)

    t0 = time.monotonic()
    runner = threading.Thread(target=go, daemon=True)
    runner.start()
    runner.join(10)
    assert not runner.is_alive() and not errors, errors
    assert time.monotonic() - t0 < 4.0, "asyncio.run waited for a thread still waiting"


def test_aresult_of_a_late_follower_waits_through_a_pending_hand_off(
        redis_url: str, client: redis.Redis) -> None:
    """A reader that did not submit the chain (another client) finds step 1 not yet
    submitted: it waits for it (and keeps its time limit), then for its result."""
    a, b = names(2)
    task = mtq.Queue(a, client=client).submit("x", then=[b])
    tid = ack_without_hand_off(redis_url, a, "r")
    other = redis.Redis.from_url(redis_url)
    chain = mtq.Queue(a, client=other).task(task.id).chain()

    async def main() -> Any:
        with pytest.raises(ResultTimeout):
            await chain.aresult(timeout=0.2)
        waiting = asyncio.ensure_future(chain.aresult(timeout=10))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await asyncio.to_thread(chains.HandOff(client, a).run, [tid])
        return await waiting

    with workers(redis_url, (b, lambda p: p * 2)):
        assert asyncio.run(main()) == "rr"


def test_a_step_submitted_and_then_gone_ends_the_wait(redis_url: str,
                                                      client: redis.Redis) -> None:
    """Step 1 was submitted (its record removed) and is gone (its queue deleted, its
    retention over): a reader raises TaskNotFound at once, not waits until its time
    limit for a step that will never come."""
    a, b = names(2)
    task = mtq.Queue(a, client=client).submit("x", then=[b])
    tid = ack_without_hand_off(redis_url, a)
    assert chains.HandOff(client, a).run([tid]) == 1
    mtq.Queue(b, client=client).delete()
    chain = mtq.Queue(a, client=redis.Redis.from_url(redis_url)).task(task.id).chain()
    t0 = time.monotonic()  # (a reader of its own chain hears no end first: 10 s at most)
    with pytest.raises(TaskNotFound, match="gone"):
        chain.result(timeout=5)
    assert time.monotonic() - t0 < 3.0  # at once, not at its 5 s limit


def test_cancel_after_the_chain_failed_at_a_hand_off_changes_nothing(
        redis_url: str, client: redis.Redis) -> None:
    a, b = names(2)
    task = mtq.Queue(a, client=client).submit({"u": 1}, then=[mtq.Step(b, pick="t")])
    tid = ack_without_hand_off(redis_url, a, {"u": 1})
    chains.HandOff(client, a).run([tid])  # the pick fails: the chain ends failed
    chain = task.chain()
    assert chain.status() == "failed"
    assert chain.cancel() is None, "nothing was left to cancel"
    assert chain.status() == "failed"


def test_a_hand_off_to_a_durable_queue_waits_for_its_replicas(redis_url: str,
                                                              client: redis.Redis) -> None:
    """The next queue has ``durable_replicas``: the step's submit waits for them, and a
    submit they did not confirm keeps the record (a failover may have lost the step);
    the next try finds the step there (a duplicate id) and removes it."""
    a, b = names(2)
    mtq.Queue(b, client=client).configure(durable_replicas=1, durable_timeout_ms=20)
    task = mtq.Queue(a, client=client).submit("x", then=[b])
    tid = ack_without_hand_off(redis_url, a)
    h = chains.HandOff(client, a)
    assert h.run([tid]) == 0  # this server has no replica: not confirmed
    assert client.exists(QueueKeys(b).task(chains.step_id(task.id, 1)))
    assert client.zcard(QueueKeys(a).handoffs) == 1, "kept until the step is durable"
    assert chains.recover(h, 0) == 1
    assert client.zcard(QueueKeys(a).handoffs) == 0
    assert mtq.Queue(b, client=client).stats()["submitted"] == 1


def test_a_step_that_succeeds_as_the_chain_is_cancelled_does_not_carry_it_on(
        redis_url: str, client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """cancel() reads a step running, and the step succeeds (its hand-off made) before
    its cancel lands: the step after it is stopped, not left to run."""
    a, b = names(2)
    task = mtq.Queue(a, client=client).submit("x", then=[b])
    c = Consumer(a, redis_url)
    (got,) = wait_for(lambda: c.claim(1), 5, "the first step to claim")
    chain = task.chain()
    read = chain._fields
    acked: list[Any] = []

    def racing(i: int, *fields: str) -> list[Any]:
        out = read(i, *fields)
        if i == 0 and not acked:  # the worker acks between the read and the cancel
            acked.append(c.broker.ack([(got.id, got.token, serialization.dumps("done"))]))
            chains.HandOff(client, a).run([got.id])
        return out

    monkeypatch.setattr(chain, "_fields", racing)
    assert chain.cancel() == 1
    assert acked == [[chains.CHAINED]]
    step = client.hget(QueueKeys(b).task(chains.step_id(task.id, 1)), "status")
    assert step in (None, b"cancelled"), step
