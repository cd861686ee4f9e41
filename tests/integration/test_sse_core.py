"""mtq.contrib.sse's sync stream (what a WSGI server iterates) against a real
redis-server, a Consumer driven from the test playing the worker: the bytes in order
with keep-alives, a resume from a token index, and a close before the end (a client
gone) that cancels the task when asked to."""

from __future__ import annotations

import threading
import time

import pytest
import redis

import mtq
from mtq.broker.consumer import Chunk
from mtq.contrib import sse
from mtq.contrib.sse import EventStream
from mtq.settings import QueueSettings
from tests.support.waits import wait_for
from tests.support.web import SSE, parse_block

pytestmark = pytest.mark.timeout(60)

FAST = QueueSettings(lease_ms=5000, retry_backoff_ms=0)



class Client:
    """Iterates a stream in a thread, as a WSGI server would, parsing what it sends."""

    def __init__(self, stream: EventStream) -> None:
        self.stream = stream
        self.it = iter(stream)
        self.events: list[SSE] = []
        self.more = threading.Event()
        self.stop = threading.Event()
        self.ended = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        buf = ""
        try:
            for chunk in self.it:
                buf += chunk.decode()
                while "\n\n" in buf:
                    block, buf = buf.split("\n\n", 1)
                    self.events.append(parse_block(block))
                if self.stop.is_set():
                    return
        finally:
            self.ended.set()

    def tokens(self) -> list[tuple[int, object]]:
        return [(int(e.id or -1), e.json()) for e in self.events if e.event == "token"]


def test_sync_stream_bytes_resume_and_keep_alives(qname: str, client: redis.Redis,
                                                  redis_url: str) -> None:
    q = mtq.Queue(qname, client=client, settings=FAST)
    consumer = mtq.Consumer(qname, redis_url, settings=FAST)
    t = q.submit("x")
    (c,) = wait_for(lambda: consumer.claim(1), 5, "nothing to claim")
    consumer.settle([], chunks=[Chunk(c, i, f"t{i}") for i in range(4)])
    s = EventStream(t, start=2, keepalive_s=0.2)
    s.open()
    reader = Client(s)
    wait_for(lambda: sum(e.comment == "keep-alive" for e in reader.events) >= 2, 10,
             "no keep-alive comments while nothing happened")
    consumer.settle([mtq.Outcome(c, ok=True, value="ok")],
                    chunks=[Chunk(c, i, f"t{i}") for i in range(4, 6)])
    assert reader.ended.wait(10), "the stream did not end with the task"
    assert reader.events[0].retry == 1000
    assert reader.tokens() == [(i, f"t{i}") for i in range(2, 6)]
    assert reader.events[-1].event == "done"
    assert reader.events[-1].json() == {"status": "succeeded", "result": "ok"}
    assert s.finished and not s.cancelled
    with pytest.raises(mtq.TaskNotFound):
        EventStream(q.task("NoSuchTask")).open()


def test_closing_the_sync_stream_before_the_end_cancels_when_asked(
        qname: str, client: redis.Redis) -> None:
    q = mtq.Queue(qname, client=client, settings=FAST)
    keep, drop = q.submit("keep"), q.submit("drop")
    also = q.submit("drop too")
    for task, cancel in ((keep, False), (drop, True), (also, True)):
        s = EventStream(task, cancel_on_disconnect=cancel)
        s.open()
        it = iter(s)
        assert next(it).startswith(b"retry:")
        if task is also:
            it.close()  # the generator itself
        else:
            s.close()  # what a WSGI server does when the client has gone (PEP 3333)
        assert s.cancelled is cancel
    assert keep.status() == "queued"
    assert drop.status() == "cancelled" and also.status() == "cancelled"
    assert q.hub.watching() == 0


def test_with_a_grace_time_a_stream_reopened_in_time_keeps_its_task(
        qname: str, client: redis.Redis, redis_url: str) -> None:
    """cancel_grace_s: a page that reloads closes its stream and opens another within
    the grace time, maybe in another server process (here: another Queue on a Redis
    connection of its own; the streams share nothing but Redis): no cancel. A client
    that does not come back: cancelled after it."""
    q = mtq.Queue(qname, client=client, settings=FAST)
    elsewhere = mtq.Queue(qname, client=redis.Redis.from_url(redis_url), settings=FAST)
    kept, left = q.submit("kept"), q.submit("left")
    for task in (kept, left):
        s = EventStream(task, cancel_on_disconnect=True, cancel_grace_s=0.3)
        s.open()
        it = iter(s)
        assert next(it).startswith(b"retry:")
        gone = time.monotonic()
        s.close()  # the client went away
        assert task.status() == "queued", "cancelled before the grace time"
        if task is kept:  # the reloaded page's stream, served by another process
            again = EventStream(elsewhere.task(task.id), cancel_on_disconnect=True,
                                cancel_grace_s=0.3)
            again.open()
            assert next(iter(again)).startswith(b"retry:")
    wait_for(lambda: left.status() == "cancelled", 5,
             "the task of the client that did not come back was not cancelled")
    assert time.monotonic() - gone >= 0.3
    time.sleep(0.5)  # past kept's grace time: nothing may cancel it (a negative check)
    assert kept.status() == "queued"
    again.close()  # the reloaded page leaves too: now it is cancelled
    wait_for(lambda: kept.status() == "cancelled", 5, "the re-attached stream's leaving "
             "did not cancel its task")
    viewers = q.broker.keys.viewers(kept.id)
    assert client.get(viewers) == b"2", "each stream of the task takes a number"
    assert 0 < client.ttl(viewers) <= sse.VIEWERS_TTL_S, "the count must expire"
    plain = q.submit("no grace")
    s = EventStream(plain, cancel_on_disconnect=True)
    s.open()
    assert next(iter(s)).startswith(b"retry:")
    s.close()
    assert not client.exists(q.broker.keys.viewers(plain.id)), "no grace: no Redis work"
