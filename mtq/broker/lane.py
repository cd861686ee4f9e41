"""The hot path's own way to Redis: commands packed once, sent on a connection this
module keeps, replies read back raw.

A call through redis-py's ``Redis.execute_command`` spends most of its client CPU in
layers these commands do not need (packing through its encoder, taking and giving back
a pool connection with their observability hooks, response callbacks); a call through
:func:`exchange` skips them (the figures: docs/architecture.md, The hot path's own way
to Redis). mtq's hot commands (the scripts' calls, the worker's BLPOP) go through it:
it keeps everything redis-py does that matters here and drops the rest:

* the **connection** is one of redis-py's own, from the client's pool, so its class
  (TLS, a cluster slot's connection that follows the slot, a Sentinel-watched
  primary), its handshake (AUTH, SELECT, CLIENT SETNAME), its socket timeouts and its
  idle health check are unchanged. The lane keeps up to :data:`KEEP` connections
  between calls (a worker's fetcher and publisher each find one) instead of giving
  each back to the pool after every call (client CPU spent on every call); more
  concurrent callers (a web server's threads) take theirs from the pool and give them
  back to it, so a client holds at most :data:`KEEP` connections more than it would
  without the lane. Kept ones count as in use in the pool, and ``pool.disconnect()``
  still closes them (the next call connects again). A forked child starts with none
  (it never touches its parent's sockets);
* the **retry** is the connection's own (:func:`mtq.broker.connection.retry_policy`): a
  dropped connection is disconnected and the commands sent again, or not at all inside
  :func:`~mtq.broker.connection.single_attempt`;
* **packing** is hiredis's (redis-py's own packer when an argument is of a type hiredis
  does not take);
* **replies** are returned as redis-py's parser reads them, an error reply as its
  exception instance (``NoScriptError``, ``ResponseError``) in its place, so a
  pipeline's other replies are still read;
* **yielding on a reply** (:class:`yielding`): a thread may ask to give its CPU away
  once as the replies of its next exchange come in, before its caller does anything
  with them
  (the worker's model thread, when Redis tells a client the outcome of a task in the
  same moment as it answers the worker's ack: see mtq.workers.publisher.Publisher.settle_here);
* **the socket**: on a connected connection read by hiredis (redis-py's own parser
  when ``redis[hiredis]`` is installed, as mtq requires) a call writes to the
  connection's socket and feeds the connection's hiredis reader itself, without
  ``send_packed_command`` / ``read_response`` and the client CPU their layers take on
  every call (see :func:`_talk` for what it keeps, RESP3 push messages included). Anything
  else (another parser, a connection class that overrides those methods, such as
  Sentinel's, a connection to open, a health check due) goes through those methods.

What is left out: redis-py's response callbacks (the callers parse raw replies), its
event dispatcher and its OpenTelemetry metrics for these commands (mtq traces
its own spans: :mod:`mtq.tracing`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import hiredis
import redis
from hiredis import pack_command as _hiredis_pack  # redis[hiredis]: a dependency
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

_Hiredis: Any = None  # the parser whose reader and socket a call may use (see _direct)
_MORE: Any = None
try:
    from redis._parsers.hiredis import NOT_ENOUGH_DATA as _MORE
    from redis._parsers.hiredis import _HiredisParser as _Hiredis
except ImportError:  # another redis-py: every call goes through the connection's methods
    pass
#: what a hiredis reader returns for a RESP3 push message (hiredis >= 3.2; None: older)
_PUSH = getattr(hiredis, "PushNotification", None)

#: connections a client's lane keeps between calls (see the module docstring)
KEEP = 2


class _Lane:
    """The connections one client's hot calls use, kept between calls."""

    __slots__ = ("free", "pid", "pool")

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.pid = os.getpid()
        self.free: list[Any] = []

    def take(self) -> Any:
        if self.pid != os.getpid():  # a forked child: the parent's sockets are not ours
            self.free, self.pid = [], os.getpid()
        try:
            return self.free.pop()  # atomic under the GIL
        except IndexError:
            return self.pool.get_connection()

    def give(self, conn: Any) -> None:
        if self.pid != os.getpid():
            return
        if len(self.free) < KEEP:
            self.free.append(conn)
        else:
            self.pool.release(conn)


_made = threading.Lock()

#: gives this thread's CPU to another runnable thread or process, if any (POSIX)
sched_yield: Callable[[], None] = getattr(os, "sched_yield", lambda: None)


class _Yield(threading.local):
    on = False


_yield = _Yield()


class yielding:
    """Within this block, the calling thread's next :func:`exchange` gives its CPU away
    once (``sched_yield``) as soon as its replies are in, before it returns them: a
    process that the same commands woke on this CPU (a client reading the event a
    script published) runs first."""

    __slots__ = ()

    def __enter__(self) -> None:
        _yield.on = True

    def __exit__(self, *exc: object) -> None:
        _yield.on = False


def _lane(client: redis.Redis) -> _Lane:
    lane: _Lane | None = getattr(client, "_mtq_lane", None)
    if lane is not None and lane.pool is client.connection_pool:
        return lane
    with _made:  # one lane a client: two made at once would strand one's connections
        lane = getattr(client, "_mtq_lane", None)
        if lane is None or lane.pool is not client.connection_pool:
            lane = _Lane(client.connection_pool)
            client._mtq_lane = lane  # type: ignore[attr-defined]
        return lane


def pack(conn: Any, args: Sequence[Any]) -> list[bytes]:
    """One command's bytes."""
    try:
        return [_hiredis_pack(tuple(args))]
    except TypeError:  # bytearray, memoryview, ...: redis-py's encoder takes them
        return list(conn.pack_command(*args))


#: connection classes -> whether they send and read as redis-py's own do (see _direct)
_PLAIN: dict[type, bool] = {}
_BASE = getattr(redis.connection, "AbstractConnection", redis.connection.Connection)


def _plain(cls: type) -> bool:
    """Whether connections of ``cls`` send commands and read replies with redis-py's own
    methods: a class that overrides them (Sentinel's, which turns a READONLY reply into
    a reconnect to the new primary; a counting or tracing subclass) keeps its override."""
    plain = _PLAIN.get(cls)
    if plain is None:
        plain = _PLAIN[cls] = getattr(cls, "send_packed_command", None) is \
            _BASE.send_packed_command and getattr(cls, "read_response", None) is \
            _BASE.read_response
    return plain


def _direct(conn: Any) -> Any:
    """The parser of ``conn`` if this call may talk on its socket directly (see
    :func:`_talk`): a connected connection of a plain class (:func:`_plain`) read by
    hiredis (RESP3 only with a hiredis that marks push messages) whose health check is
    not due. None: go through the connection's own methods (they connect, check
    health, and do what a subclass adds)."""
    parser = getattr(conn, "_parser", None)
    if _Hiredis is None or type(parser) is not _Hiredis or not _plain(type(conn)) or \
            conn._sock is None or \
            getattr(parser, "_sock", None) is not conn._sock or \
            (getattr(conn, "protocol", 2) not in (2, "2", None) and
             (_PUSH is None or not hasattr(parser, "handle_push_response"))):
        return None
    interval = conn.health_check_interval
    if interval and time.monotonic() > conn.next_health_check:
        return None
    return parser


def _talk(conn: Any, parser: Any, packed: list[bytes], n: int) -> list[Any]:
    """Send ``packed`` and read ``n`` replies on the socket and hiredis reader that
    redis-py's connection set up, without its per-call layers (their client CPU on every
    call: docs/architecture.md, The hot path's own way to Redis). What those layers do
    that matters is done here: one write (one syscall for a pipeline too), an
    error reply returned in its place, a dropped or timed-out socket disconnected and
    raised as redis-py's ConnectionError or TimeoutError (its retry then reconnects),
    and the idle health check moved on."""
    sock, reader, buf = parser._sock, parser._reader, parser._buffer
    try:
        sock.sendall(packed[0] if len(packed) == 1 else b"".join(packed))
        out: list[Any] = []
        while len(out) < n:
            reply = reader.gets()
            if reply is _MORE:
                got = sock.recv_into(buf)
                if not got:
                    raise RedisConnectionError("Connection closed by server.")
                reader.feed(buf, 0, got)
            elif isinstance(reply, RedisConnectionError):
                raise reply
            elif _PUSH is not None and type(reply) is _PUSH:
                parser.handle_push_response(reply)  # RESP3: not a reply (as redis-py does)
            else:
                out.append(reply)
    except TimeoutError as exc:  # the socket timed out (socket.timeout)
        conn.disconnect()
        raise RedisTimeoutError(f"Timeout talking to Redis: {exc}") from exc
    except OSError as exc:
        conn.disconnect()
        raise RedisConnectionError(f"Error talking to Redis: {exc}") from exc
    except BaseException:
        # whatever broke the exchange (an interrupt, a closed connection): replies may be
        # left unread on the socket, and the next caller must not get them
        conn.disconnect()
        raise
    if conn.health_check_interval:
        conn.next_health_check = time.monotonic() + conn.health_check_interval
    return out


def exchange(client: redis.Redis, commands: Sequence[Sequence[Any]]) -> list[Any]:
    """Send ``commands`` in one write and read their replies, in order: one round trip.

    A reply that is an error is returned as its exception instance. Connection errors
    raise (redis-py's ``ConnectionError`` / ``TimeoutError``) after the connection's
    retry policy gave up on them, as ``Redis.execute_command`` does.
    """
    if getattr(client, "connection_pool", None) is None:
        # a cluster client (mtq passes a queue's slot client, but a caller may not):
        # redis-py routes each command by its keys, one at a time (its pipelines refuse
        # EVALSHA)
        out: list[Any] = []
        for args in commands:
            try:
                out.append(client.execute_command(*args))
            except ResponseError as error:
                out.append(error)
        return out
    lane = _lane(client)
    conn = lane.take()
    try:
        packed: list[bytes] = []
        for args in commands:
            packed += pack(conn, args)
        n = len(commands)

        def once() -> list[Any]:
            parser = _direct(conn)
            if parser is not None:
                return _talk(conn, parser, packed, n)
            conn.send_packed_command(packed)
            out = []
            try:
                for _ in range(n):
                    try:
                        out.append(conn.read_response())
                    except ResponseError as error:
                        out.append(error)
            except BaseException:
                # whatever broke the read (an interrupt, a bug): replies may be left
                # unread on the socket, and the next caller must not get them
                conn.disconnect()
                raise
            return out

        retry = conn.retry
        if retry is None:
            out = once()
        else:
            out = retry.call_with_retry(once, lambda _error: conn.disconnect())
    finally:
        lane.give(conn)
    if _yield.on:
        _yield.on = False
        sched_yield()
    return out
