"""The wire reader: the pushes of the hub's pub/sub connection, read off its socket."""

from __future__ import annotations

import time
from typing import Any

import hiredis
import redis

#: how long the hub's read blocks before it looks whether it was closed (s)
POLL_S = 1.0
#: a reply connection silent this long is sent a PING (its answer proves it alive) ...
IDLE_PING_S = 30.0
#: ... and one that does not answer it within this long is dropped and made anew
PING_ANSWER_S = 30.0
class Wire:
    """The pushes of one pub/sub connection, read straight off its socket with a
    hiredis reader of their own: ``[kind, channel, data]`` lists as Redis sends them.

    redis-py's ``PubSub.get_message`` spends Python on every message (its retry
    wrapper, readiness checks, push handlers, a dict per message; the figure:
    docs/architecture.md, The hot path's own way to Redis); a task's round
    trip brings two (started, done) to a client that is sharing its CPU with the
    worker. redis-py still connects (AUTH, TLS, a cluster slot's owner) and sends the
    (S)SUBSCRIBE commands; every read is this class's, so no bytes are left in
    redis-py's own parser. Any failure raises ConnectionError and the hub makes a new
    connection, which subscribes to every channel again (see Hub._confirm in mtq.client.replies.hub). A
    connection silent for :data:`IDLE_PING_S` is sent a PING (redis-py's health check
    does the same for its own readers)."""

    __slots__ = ("last", "pinged", "ps", "reader", "sock", "timeout")

    def __init__(self, ps: Any) -> None:
        conn = ps.connection
        sock = getattr(conn, "_sock", None) if conn is not None else None
        if sock is None:
            raise redis.exceptions.ConnectionError("the reply connection is not open")
        sock.settimeout(POLL_S)
        self.timeout = POLL_S
        self.ps, self.sock = ps, sock
        self.reader = hiredis.Reader()
        self.last = time.monotonic()
        self.pinged: float | None = None

    def next(self, timeout: float = POLL_S) -> list[Any] | None:
        """The next push, or None after ``timeout`` seconds without one."""
        while True:
            msg = self.reader.gets()
            if msg is not False:
                if isinstance(msg, Exception):
                    raise redis.exceptions.ResponseError(str(msg))
                return msg
            if timeout != self.timeout:
                self.sock.settimeout(timeout)
                self.timeout = timeout
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                now = time.monotonic()
                if self.pinged is not None:
                    if now - self.pinged > PING_ANSWER_S:
                        raise redis.exceptions.ConnectionError(
                            "the reply connection did not answer a PING") from None
                elif now - self.last > IDLE_PING_S:
                    self.ps.ping()
                    self.pinged = now
                return None
            except OSError as exc:
                raise redis.exceptions.ConnectionError(
                    f"reading the reply connection failed: {exc}") from exc
            if not data:
                raise redis.exceptions.ConnectionError("the server closed the reply connection")
            self.reader.feed(data)
            self.last = time.monotonic()
            self.pinged = None
