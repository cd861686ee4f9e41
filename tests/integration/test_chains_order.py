"""A chain's hand-off keeps each stream's order (docs/streaming.md, "Chains"): the ack
of a chained step does not release its stream; it stays held (busy, not claimable)
until the hand-off's record is removed (handed.lua), which releases it exactly once,
whoever removes it (the worker after its submit, a recoverer, or the paths that end the
chain at the hand-off). The steps are driven through the scripts (claim, ack, the
hand-off) so that each state is observed, not waited for; a real worker killed between
the ack and the hand-off is tests/integration/test_chains_kill.py."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis

import mtq
from mtq import serialization
from mtq.broker import chains
from mtq.broker.consumer import Consumer
from mtq.broker.keys import QueueKeys
from tests.support.threads import run_together
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(60)


def names(n: int) -> list[str]:
    tag = uuid.uuid4().hex[:10]
    return [f"o{i}-{tag}" for i in range(n)]


def claim_ids(c: Consumer, n: int = 4) -> list[str]:
    return [t.id for t in c.claim(n)]


def ack(c: Consumer, tid: str, token: str, result: Any = "r") -> list[int]:
    return c.broker.ack([(tid, token, serialization.dumps(result))])


def held(client: redis.Redis, queue: str, stream: str) -> bool:
    return bool(client.sismember(QueueKeys(queue).busy, stream))


def test_a_refused_hand_off_holds_the_stream_and_the_next_queue_gets_it_in_order(
        redis_url: str, client: redis.Redis) -> None:
    """Chains A then B on one stream; A's next queue is full at A's ack: B's first step
    does not start until A's hand-off went in, and the next queue runs A's step first."""
    a, b = names(2)
    qb = mtq.Queue(b, client=client)
    qb.configure(max_length=1)
    blocker = qb.submit("first")  # b is full
    qa = mtq.Queue(a, client=client)
    ta = qa.submit("A", stream="u", then=[b])
    tb = qa.submit("B", stream="u", then=[b])
    ca, cb = Consumer(a, redis_url), Consumer(b, redis_url)
    got = ca.claim(4)
    assert [t.id for t in got] == [ta.id]  # one task of the stream at a time
    assert ack(ca, ta.id, got[0].token, "A") == [chains.CHAINED]
    assert held(client, a, "u"), "the stream is held while A's hand-off is pending"
    assert claim_ids(ca) == [], "B must not start before A's hand-off"
    h = chains.HandOff(client, a)
    assert h.run([ta.id]) == 0  # refused (b full): the record stays, and the hold
    assert claim_ids(ca) == [] and tb.status() == "queued"
    assert chains.recover(h, 0) == 0 and claim_ids(ca) == []  # refused again
    blocker.cancel()  # room in b
    assert chains.recover(h, 0) == 1  # A's step goes in; the stream is released
    assert not held(client, a, "u")
    step_a = chains.step_id(ta.id, 1)
    got = ca.claim(4)
    assert [t.id for t in got] == [tb.id]
    assert tb.info().started >= qb.task(step_a).info().created
    # b: A's step is taken (so b has room), then B's hand-off goes in behind it
    got_b = cb.claim(4)
    assert [t.id for t in got_b] == [step_a]
    assert ack(ca, tb.id, got[0].token, "B") == [chains.CHAINED]
    assert h.run([tb.id]) == 1
    assert claim_ids(cb) == [], "one task of the stream at a time on b too"
    assert ack(cb, step_a, got_b[0].token) == [1]  # the last step: no hand-off
    assert claim_ids(cb) == [chains.step_id(tb.id, 1)]
    assert client.hlen(QueueKeys(a).handoffs + ":streams") == 0


def test_racing_completers_release_the_stream_once(redis_url: str,
                                                    client: redis.Redis) -> None:
    """Four recoverers complete one record at once (one submits the step, the others
    find it there), then a removal is sent again and the record put back: the stream is
    released once, so the task behind it runs alone (a second release while it ran
    would let the one after it start beside it)."""
    a, b = names(2)
    qa = mtq.Queue(a, client=client)
    first = qa.submit("x", stream="u", then=[b])
    second, third = qa.submit("y", stream="u"), qa.submit("z", stream="u")
    ca = Consumer(a, redis_url)
    got = ca.claim(4)
    assert ack(ca, first.id, got[0].token) == [chains.CHAINED]
    hand_offs = [chains.HandOff(redis.Redis.from_url(redis_url), a) for _ in range(4)]
    run_together(4, lambda: chains.recover(hand_offs.pop(), 0))
    assert claim_ids(ca) == [second.id]  # released: the next task of the stream runs
    h = chains.HandOff(client, a)
    h.complete([first.id])  # a removal sent again
    client.zadd(QueueKeys(a).handoffs, {first.id: 0})  # a record put back
    assert chains.recover(h, 0) == 1  # its step is there already: done, and gone
    assert held(client, a, "u"), "second still runs: its stream stays busy"
    assert claim_ids(ca) == [], "third must wait for second"
    assert third.status() == "queued"
    assert mtq.Queue(b, client=client).stats()["submitted"] == 1


@pytest.mark.parametrize("end", ["pick", "gone", "cancelled"])
def test_a_chain_that_ends_at_its_hand_off_releases_its_stream(
        redis_url: str, client: redis.Redis, end: str) -> None:
    """The hand-off ends the chain (a pick the result lacks, the task gone with its
    retention, the chain cancelled while the record waited): the record goes and the
    stream is released, the next task of the stream runs."""
    a, b = names(2)
    qa = mtq.Queue(a, client=client)
    first = qa.submit("x", stream="u", then=[mtq.Step(b, pick="text")])
    after = qa.submit("y", stream="u")
    ca = Consumer(a, redis_url)
    got = ca.claim(4)
    assert ack(ca, first.id, got[0].token, {"other": 1}) == [chains.CHAINED]
    assert claim_ids(ca) == []
    if end == "gone":
        client.delete(QueueKeys(a).task(first.id))  # its retention ran out
    elif end == "cancelled":
        assert first.chain().cancel() == 1
    assert chains.recover(chains.HandOff(client, a), 0) == 1
    assert client.zcard(QueueKeys(a).handoffs) == 0
    assert claim_ids(ca) == [after.id]
    assert not client.exists(QueueKeys(b).task(chains.step_id(first.id, 1)))


def test_the_worker_s_own_hand_off_releases_the_stream(redis_url: str,
                                                       client: redis.Redis) -> None:
    """Workers running the stream's chains one after another: each step on the next
    queue in submit order, every record and hold gone at the end; a chained task
    without a stream holds nothing."""
    from tests.integration.test_chains import workers

    a, b = names(2)
    order: list[int] = []
    qa = mtq.Queue(a, client=client)
    tasks = [qa.submit(i, stream="u", then=[b]) for i in range(5)]
    loose = qa.submit(9, then=[b])

    def record(p: int) -> int:
        order.append(p)
        return p

    with workers(redis_url, (a, lambda p: p), (b, record)):
        assert [t.chain().result(timeout=15) for t in tasks] == list(range(5))
        assert loose.chain().result(timeout=15) == 9
    assert [p for p in order if p != 9] == list(range(5))
    keys = QueueKeys(a)
    wait_for(lambda: client.zcard(keys.handoffs) == 0, 5, "the records removed")
    assert client.hlen(keys.handoffs + ":streams") == 0
    assert not held(client, a, "u")


def test_with_scheduling_the_charge_is_settled_at_the_ack_and_only_the_stream_held(
        redis_url: str, client: redis.Redis) -> None:
    """A tenant's chained task: its lane counts it out of running at its ack (as any
    task), while its stream stays held until the hand-off; then the stream's next task
    (of its lane) is claimable again."""
    a, b = names(2)
    qa = mtq.Queue(a, client=client)
    first = qa.submit("x", stream="u", tenant="t1", then=[b])
    after = qa.submit("y", stream="u", tenant="t1")
    ca = Consumer(a, redis_url)
    got = ca.claim(4)
    assert [t.id for t in got] == [first.id]
    count = QueueKeys(a).sched_count
    assert client.hget(count, "s:t1|r") == b"1"
    assert ack(ca, first.id, got[0].token) == [chains.CHAINED]
    assert client.hget(count, "s:t1|r") == b"0", "settled at the ack"
    assert client.hget(count, "s:t1|w") == b"1"  # the one behind it still waits
    assert held(client, a, "u") and claim_ids(ca) == []
    assert chains.HandOff(client, a).run([first.id]) == 1
    assert claim_ids(ca) == [after.id]
    assert client.hget(count, "s:t1|r") == b"1"


def test_a_purge_while_the_stream_is_held(redis_url: str, client: redis.Redis) -> None:
    """A purge drops the tasks waiting behind a held stream and leaves the hold; the
    hand-off then releases an empty stream, and the stream's next submit runs."""
    a, b = names(2)
    qa = mtq.Queue(a, client=client)
    first = qa.submit("x", stream="u", then=[b])
    behind = qa.submit("y", stream="u")
    ca = Consumer(a, redis_url)
    got = ca.claim(4)
    assert ack(ca, first.id, got[0].token) == [chains.CHAINED]
    assert qa.purge() == 1 and behind.status() == "cancelled"
    assert held(client, a, "u") and qa.stats()["busy_streams"] == 1
    assert chains.recover(chains.HandOff(client, a), 0) == 1
    assert not held(client, a, "u") and qa.stats()["busy_streams"] == 0
    again = qa.submit("z", stream="u")
    assert claim_ids(ca) == [again.id]
