"""Closing a client's reply listener (``Hub.close_all``) while its thread is reading:
the end is quiet (the benchmarks close it before they stop their redis-server)."""

from __future__ import annotations

import logging

import pytest
import redis

import mtq


@pytest.mark.parametrize("attempt", range(3))
def test_closing_the_reply_listener_mid_read_logs_nothing(
        redis_url: str, qname: str, caplog: pytest.LogCaptureFixture, attempt: int) -> None:
    client = redis.Redis.from_url(redis_url)
    q = mtq.Queue(qname, client=client)
    q.submit({"n": attempt})  # subscribes this client's listener to the queue's replies
    hub = q.hub
    thread = hub._thread
    assert thread is not None and thread.is_alive(), "the submit started no reply listener"
    caplog.set_level(logging.DEBUG, logger="mtq.replies")
    hub.close_all()  # the listener sits in its 1 s read: the connection closes under it
    assert not thread.is_alive(), "close_all() did not end the listener within its 2 s join"
    said = [f"{r.levelname} {r.getMessage()}" for r in caplog.records if r.name == "mtq.replies"]
    assert said == [], f"closing the listener logged: {said}"
    client.close()
