"""The reply hub reads its pub/sub connection itself (``mtq.client.replies.wire.Wire``): a silent
connection is sent a PING, and one that stops answering (a frozen redis-server: no
reset, no closed socket, only silence) is dropped, its feeds told, and a new one
subscribes again once Redis answers."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import redis

import mtq
from mtq import replies
from tests.support.servers import RedisServer
from tests.support.waits import wait_for


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    s = RedisServer(tmp_path)
    s.start()
    yield s
    if s.proc is not None and s.proc.poll() is None:
        os.kill(s.proc.pid, signal.SIGCONT)
    s.stop()


def _pings(admin: redis.Redis) -> int:
    return int(admin.info("commandstats").get("cmdstat_ping", {}).get("calls", 0))


def test_a_silent_reply_connection_is_pinged_and_one_that_stops_answering_is_made_anew(
        server: RedisServer, qname: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replies, "POLL_S", 0.1)
    monkeypatch.setattr(replies, "IDLE_PING_S", 0.5)
    monkeypatch.setattr(replies, "PING_ANSWER_S", 1.0)
    admin = redis.Redis.from_url(server.url)
    client = redis.Redis.from_url(server.url)
    q = mtq.Queue(qname, client=client)
    channel = q.reply_channel()
    hub = q.hub
    try:
        before = _pings(admin)
        wait_for(lambda: _pings(admin) > before, 10,
                 "the hub sent no PING on a connection silent for 0.5 s")

        feed = replies.SyncFeed((qname, "some-task"), fail_fast=True)
        hub.open(feed)
        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGSTOP)  # frozen: the socket stays open, silent
        got = feed.get(timeout=15)
        assert got == replies.LOST, \
            f"a reply connection that stopped answering was not given up ({got!r})"

        os.kill(server.proc.pid, signal.SIGCONT)
        wait_for(lambda: hub.resyncs >= 1, 30,
                 "the hub did not subscribe again once Redis answered")
        assert admin.pubsub_numsub(channel) == [(channel.encode(), 1)]
        # the new connection carries replies: an outcome reaches the feed
        admin.publish(channel, msgpack.packb(["done", 0, ["some-task", "cancelled", ""]]))
        item = feed.get(timeout=10)
        while item == replies.RESYNC:  # the resubscription's own marker comes first
            item = feed.get(timeout=10)
        assert isinstance(item, replies.Event) and item.kind == "cancelled", item
        hub.close(feed)
    finally:
        hub.close_all()
        client.close()
        admin.close()
