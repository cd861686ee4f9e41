"""Task.events() / aevents() options for a web stream: ``start`` (resume after the token
a client already has), ``idle`` (keep-alive ticks) and ``fail_fast`` (end at once when
Redis is away, so a client reconnects later), against a real redis-server, and the
defaults unchanged. A :class:`mtq.Consumer` driven from the test plays the worker."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest
import redis

import mtq
from mtq.broker.consumer import Chunk
from mtq.client.replies import hub as hub_module
from mtq.settings import QueueSettings
from tests.support.servers import RedisServer
from tests.support.waits import Reader, wait_for

pytestmark = pytest.mark.timeout(60)

FAST = QueueSettings(lease_ms=5000, retry_backoff_ms=0)



def claim(consumer: mtq.Consumer) -> mtq.Claimed:
    (got,) = wait_for(lambda: consumer.claim(1), 5, "nothing to claim")
    return got


def test_events_from_a_start_index_skip_what_the_reader_has_stored_and_live(
        qname: str, client: redis.Redis, redis_url: str) -> None:
    q = mtq.Queue(qname, client=client, settings=FAST)
    consumer = mtq.Consumer(qname, redis_url, settings=FAST)
    t = q.submit("x")
    c = claim(consumer)
    consumer.settle([], chunks=[Chunk(c, i, f"t{i}") for i in range(5)])
    resumed = Reader(lambda: t.events(timeout=20, start=3))
    whole = Reader(lambda: t.events(timeout=20))  # the default: from the first token
    wait_for(lambda: q.hub.watching() == 1 and len(whole.items) >= 5, 10,
             "the readers did not read the stored tokens")
    consumer.settle([], chunks=[Chunk(c, i, f"t{i}") for i in range(5, 8)])
    consumer.settle([mtq.Outcome(c, ok=True, value="done")])

    def toks(evs: list[mtq.Event]) -> list[tuple[int | None, str]]:
        return [(e.index, e.data) for e in evs if e.kind == "token"]

    assert toks(resumed.join(20)) == [(i, f"t{i}") for i in range(3, 8)]
    assert toks(whole.join(20)) == [(i, f"t{i}") for i in range(8)]
    assert resumed.items[-1].kind == "succeeded"
    # a start past the end: only the end; the same through asyncio
    assert [e.kind for e in t.events(timeout=5, start=8)] == ["succeeded"]

    async def atoks(start: int) -> list[tuple[int | None, str]]:
        return toks([e async for e in t.aevents(timeout=5, start=start)])

    assert asyncio.run(atoks(6)) == [(6, "t6"), (7, "t7")]
    with pytest.raises(mtq.ConfigError):
        next(t.events(start=-1))


def test_idle_ticks_only_when_asked_for(qname: str, client: redis.Redis) -> None:
    q = mtq.Queue(qname, client=client, settings=FAST)
    t = q.submit("nobody serves this")
    t0 = time.monotonic()
    ticks = []
    with pytest.raises(mtq.ResultTimeout):
        for ev in t.events(timeout=1.0, idle=0.3):
            ticks.append((round(time.monotonic() - t0, 1), ev.kind))
    # one every 0.3 s (a busy machine may make one late)
    assert 2 <= len(ticks) <= 3 and {k for _, k in ticks} == {"idle"}, ticks
    # without idle, nothing but the timeout (the behaviour events() always had)
    with pytest.raises(mtq.ResultTimeout):
        assert list(t.events(timeout=0.3)) == []

    async def aticks() -> list[str]:
        out = []
        try:
            async for ev in t.aevents(timeout=0.7, idle=0.3):
                out.append(ev.kind)
        except mtq.ResultTimeout:
            pass
        return out

    assert asyncio.run(aticks()) in (["idle"], ["idle", "idle"])


@pytest.mark.slow
def test_fail_fast_ends_when_redis_goes_away_and_the_default_waits(
        qname: str, tmp_path: Path) -> None:
    server = RedisServer(tmp_path, appendonly=True)
    server.start()
    own = redis.Redis.from_url(server.url, client_name="mtqtest-" + uuid.uuid4().hex[:10])
    try:
        q = mtq.Queue(qname, client=own, settings=FAST)
        t = q.submit("long")
        fast = Reader(lambda: t.events(timeout=40, fail_fast=True))
        patient = Reader(lambda: t.events(timeout=40))
        wait_for(lambda: q.hub.watching() == 1 and len(own.client_list()) >= 2, 10,
                 "the readers did not start")
        wait_for(lambda: q.redis.hget(q.broker.keys.task(t.id), "reply"), 5, "no reply")
        server.stop()
        t_stop = time.monotonic()
        assert fast.finished.wait(20), "the fail-fast reader did not end without Redis"
        assert isinstance(fast.error, mtq.RedisUnavailable), fast.error
        assert time.monotonic() - t_stop < 15
        assert not patient.finished.is_set()
        server.start()
        consumer = mtq.Consumer(qname, client=redis.Redis.from_url(server.url), settings=FAST)
        c = claim(consumer)
        consumer.settle([mtq.Outcome(c, ok=True, value="done")])
        assert patient.join(30)[-1].kind == "succeeded"
    finally:
        hub = hub_module._hubs.get(own)
        if hub is not None:
            hub.close_all()
        own.close()
        server.stop()
