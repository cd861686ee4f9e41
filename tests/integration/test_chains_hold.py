"""A held stream (a chain step's pending hand-off, docs/streaming.md "Chains") is never
left held with nothing to release it, nor released twice: the paths around the hold
that tests/integration/test_chains_order.py does not drive. Driven through the scripts,
fast; a real worker where the worker's own loop is what is tested."""

from __future__ import annotations

import uuid

import pytest
import redis

import mtq
from mtq import serialization
from mtq.broker import chains
from mtq.broker.consumer import Consumer
from mtq.broker.keys import QueueKeys

pytestmark = pytest.mark.timeout(60)


def names(n: int) -> list[str]:
    tag = uuid.uuid4().hex[:10]
    return [f"h{i}-{tag}" for i in range(n)]


def held(client: redis.Redis, queue: str, stream: str) -> bool:
    return bool(client.sismember(QueueKeys(queue).busy, stream))


def test_a_record_removed_behind_the_hand_off_s_back_is_swept_by_recovery(
        redis_url: str, client: redis.Redis) -> None:
    """A record removed by anything but handed.lua (an operator's ZREM or DEL of the
    records) leaves its stream held with nothing to release it, so every later task of
    the stream would stall. Recovery finds the hold whose record is gone and releases
    it, once; a hold whose record is there is left alone."""
    a, b = names(2)
    qa = mtq.Queue(a, client=client)
    first = qa.submit("x", stream="u", then=[b])
    other = qa.submit("o", stream="v", then=[b])
    after = qa.submit("y", stream="u")
    behind_other = qa.submit("z", stream="v")
    ca = Consumer(a, redis_url)
    got = {t.id: t for t in ca.claim(4)}
    assert set(got) == {first.id, other.id}
    for t in (first, other):
        codes = ca.broker.ack([(t.id, got[t.id].token, serialization.dumps("r"))])
        assert codes[0] == chains.CHAINED
    keys = QueueKeys(a)
    client.zrem(keys.handoffs, first.id)  # behind handed.lua's back
    h = chains.HandOff(client, a)
    # the other record is not a lease old: not recovered, its stream stays held
    assert chains.recover(h, 60_000) == 0
    assert not held(client, a, "u"), "the hold whose record is gone is released"
    assert held(client, a, "v"), "a hold whose record is there stays"
    assert client.hkeys(keys.handoffs + ":streams") == [other.id.encode()]
    assert [t.id for t in ca.claim(4)] == [after.id]
    assert chains.recover(h, 60_000) == 0
    assert held(client, a, "u"), "released once: after runs, its stream stays busy"
    assert behind_other.status() == "queued"


def test_a_chain_from_a_queue_to_itself_on_one_stream(redis_url: str,
                                                      client: redis.Redis) -> None:
    """A -> A on one stream: the next step goes behind the hold its own submission
    releases (no deadlock), and two such chains keep the stream's order."""
    from tests.integration.test_chains import workers

    (a,) = names(1)
    order: list[str] = []
    qa = mtq.Queue(a, client=client)

    def step(p: str) -> str:
        order.append(p)
        return p + "+"

    tasks = [qa.submit(p, stream="u", then=[mtq.Step(a, stream="u")]) for p in ("1", "2")]
    with workers(redis_url, (a, step)):
        assert [t.chain().result(timeout=15) for t in tasks] == ["1++", "2++"]
    assert order in (["1", "2", "1+", "2+"], ["1", "1+", "2", "2+"])
    assert order.index("1+") < order.index("2+")
    assert not held(client, a, "u")
    assert client.hlen(QueueKeys(a).handoffs + ":streams") == 0


def test_an_id_reused_while_its_old_record_waits_releases_the_old_hold(
        redis_url: str, client: redis.Redis) -> None:
    """A step's hand-off is refused (next queue full) until its task's retention runs
    out; before the reaper drops the record, the id is submitted again (a client that
    names its tasks) on another stream, as a chain, and acked: its hold replaces the
    old one in the hash. The ack releases the old hold it replaces, so the old stream
    is not left held with nothing to release it."""
    a, b = names(2)
    qb = mtq.Queue(b, client=client)
    qb.configure(max_length=1)
    blocker = qb.submit("first")  # b is full
    qa = mtq.Queue(a, client=client)
    old = qa.submit("x", stream="u", then=[b], id=f"req-{uuid.uuid4().hex[:8]}")
    behind = qa.submit("y", stream="u")
    ca = Consumer(a, redis_url)
    (got,) = ca.claim(4)
    assert ca.broker.ack([(old.id, got.token, serialization.dumps("r"))]) == [chains.CHAINED]
    h = chains.HandOff(client, a)
    assert h.run([old.id]) == 0  # refused: the record and the hold stay
    client.delete(QueueKeys(a).task(old.id))  # its retention ran out
    again = qa.submit("x2", stream="w", then=[b], id=old.id)
    (got,) = ca.claim(4)
    assert got.id == again.id
    assert ca.broker.ack([(again.id, got.token, serialization.dumps("r2"))]) \
        == [chains.CHAINED]
    assert not held(client, a, "u"), "the hold the ack replaced is released"
    assert [t.id for t in ca.claim(4)] == [behind.id]
    blocker.cancel()
    assert chains.recover(h, 0) == 1  # the new step goes in; its own hold released
    assert not held(client, a, "w")
    assert client.hlen(QueueKeys(a).held) == 0
