"""mtq.broker.lane: the hot path's commands, packed once and sent on connections kept
between calls, against a real redis-server."""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from mtq.broker import lane
from mtq.broker.connection import connect, retry_policy, single_attempt


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url, retry=retry_policy())
    yield c
    c.close()


def test_replies_come_back_in_order_with_an_error_in_its_place(
        client: redis.Redis, qname: str) -> None:
    out = lane.exchange(client, [("SET", qname, "1"), ("HGET", qname, "field"),
                                 ("INCRBY", qname, 2), ("GET", qname)])
    assert out[0] is True or out[0] == b"OK"
    assert isinstance(out[1], redis.ResponseError) and "WRONGTYPE" in str(out[1])
    assert out[2:] == [3, b"3"], "the replies after an error reply were not read in order"
    assert lane.exchange(client, [("PING",)]) == [b"PONG"], "a reply was left on the connection"


def _my_id(client: redis.Redis) -> int:
    return int(lane.exchange(client, [("CLIENT", "ID")])[0])


def test_a_dropped_connection_is_sent_again_except_inside_single_attempt(
        client: redis.Redis, r: redis.Redis, qname: str) -> None:
    first = _my_id(client)
    r.client_kill_filter(_id=str(first))
    assert lane.exchange(client, [("INCR", qname)]) == [1]  # sent again on a new connection
    assert _my_id(client) != first
    r.client_kill_filter(_id=str(_my_id(client)))
    with single_attempt(), pytest.raises(redis.ConnectionError):
        lane.exchange(client, [("INCR", qname)])
    assert r.get(qname) == b"1", "a command sent once was run twice, or the first one lost"


def test_the_lane_keeps_at_most_keep_connections(client: redis.Redis, qname: str) -> None:
    start = threading.Barrier(6)

    def wait() -> None:
        start.wait(10)
        lane.exchange(client, [("BLPOP", f"{qname}:nothing", 0.3)])

    threads = [threading.Thread(target=wait) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    kept = lane._lane(client).free
    assert len(kept) == lane.KEEP, f"{len(kept)} connections kept"
    # the others went back to the pool, where any other command finds them
    assert len(client.connection_pool._available_connections) == 6 - lane.KEEP


def _child_id(url: str, out: Any) -> None:
    out.put(_my_id(_shared(url)))


_clients: dict[str, redis.Redis] = {}


def _shared(url: str) -> redis.Redis:
    return _clients.setdefault(url, connect(url))


def test_a_forked_child_opens_its_own_connection(redis_url: str) -> None:
    parent = _my_id(_shared(redis_url))
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    proc = ctx.Process(target=_child_id, args=(redis_url, out))
    proc.start()
    child = out.get(timeout=20)
    proc.join(20)
    assert child != parent, "the child sent its command on its parent's connection"
    assert _my_id(_shared(redis_url)) == parent, "the parent lost its connection to the fork"
