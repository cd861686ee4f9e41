"""mtq.broker.lane: the hot path's commands, packed once and sent on connections kept
between calls, against a real redis-server."""

from __future__ import annotations

import multiprocessing
import threading
import time
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


def test_yielding_gives_the_cpu_away_once_with_the_next_replies(
        client: redis.Redis, redis_url: str, qname: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside lane.yielding(), the thread's next exchange yields once, after its commands
    ran (another client already sees their effect) and before it returns; later
    exchanges do not, nor does one after a block that failed, nor another thread."""
    watcher = redis.Redis.from_url(redis_url)
    seen: list[tuple[str, bytes | None]] = []
    monkeypatch.setattr(lane, "sched_yield", lambda: seen.append(
        (threading.current_thread().name, watcher.get(qname))))
    with lane.yielding():
        assert lane.exchange(client, [("INCR", qname)]) == [1]
        assert seen == [("MainThread", b"1")], "no yield, or one before the command ran"
        assert lane.exchange(client, [("INCR", qname)]) == [2]
    assert lane.exchange(client, [("INCR", qname)]) == [3]
    assert len(seen) == 1, "only the first exchange in the block yields"
    other = threading.Thread(target=lane.exchange, args=(client, [("INCR", qname)]))
    with lane.yielding():
        other.start()
        other.join(10)
    assert len(seen) == 1, "another thread's exchange yielded"
    with pytest.raises(ZeroDivisionError), lane.yielding():
        raise ZeroDivisionError
    assert lane.exchange(client, [("INCR", qname)]) == [5]
    assert len(seen) == 1, "a block that failed left the yield armed"
    watcher.close()


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


@pytest.mark.parametrize("protocol", [2, 3])
def test_calls_talk_on_the_socket_directly_and_read_replies_of_any_size(
        redis_url: str, qname: str, protocol: int) -> None:
    c = redis.Redis.from_url(redis_url, retry=retry_policy(), protocol=protocol)
    try:
        lane.exchange(c, [("PING",)])
        conn = lane._lane(c).free[0]
        # what makes a call cost 17 us less: if a redis-py upgrade changed the parser's
        # shape, every call would quietly take the long way again
        assert lane._direct(conn) is conn._parser, \
            "a connected hiredis connection is not talked to directly"
        big = b"x" * 300_000  # several reads of the parser's 64 KiB buffer
        out = lane.exchange(c, [("SET", qname, big), ("GET", qname), ("STRLEN", qname)])
        assert out[1:] == [big, 300_000], "a reply larger than one read came back wrong"
        assert lane.exchange(c, [("PING",)]) == [b"PONG"], "a reply was left on the socket"
    finally:
        c.close()


def test_a_socket_timeout_drops_the_connection_and_leaves_no_reply_behind(
        redis_url: str, r: redis.Redis, qname: str) -> None:
    c = redis.Redis.from_url(redis_url, retry=retry_policy(), socket_timeout=0.2)
    try:
        first = _my_id(c)
        with pytest.raises(redis.TimeoutError):
            lane.exchange(c, [("BLPOP", qname, 2)])  # blocks past the socket timeout
        # closed: Redis drops the client (and its BLPOP) once it reads the close
        deadline = time.monotonic() + 5
        while any(int(cl["id"]) == first for cl in r.client_list()):
            assert time.monotonic() < deadline, "the timed-out connection was not closed"
            time.sleep(0.01)
        r.rpush(qname, "late")
        assert lane.exchange(c, [("LRANGE", qname, 0, -1)]) == [[b"late"]], \
            "a reply left on the timed-out connection was read as this call's"
        assert _my_id(c) != first, "the timed-out connection was kept"
    finally:
        c.close()


class _Counting(redis.connection.Connection):
    """A subclass that overrides how commands are sent (as a tracing or counting one
    would; Sentinel's overrides how replies are read)."""

    sent = 0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        _Counting.sent += 1
        super().send_packed_command(command, check_health)


def test_a_connection_class_that_overrides_sending_keeps_its_override(redis_url: str) -> None:
    pool = redis.ConnectionPool.from_url(redis_url, connection_class=_Counting)
    c = redis.Redis(connection_pool=pool, retry=retry_policy())
    try:
        lane.exchange(c, [("PING",)])
        before = _Counting.sent
        assert lane.exchange(c, [("PING",), ("PING",)]) == [b"PONG", b"PONG"]
        assert _Counting.sent == before + 1, "the lane went around the class's own send"
        assert not lane._plain(redis.sentinel.SentinelManagedConnection), \
            "Sentinel's connection (READONLY -> reconnect) would be talked to directly"
    finally:
        c.close()
