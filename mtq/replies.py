"""Replies: one subscription per client for the events of all the tasks it waits on.

Every task names the reply channel of the client that submitted it (a client
waiting on someone else's task adds its own, see ``watch.lua``). A :class:`Hub`
per Redis client and process holds one pub/sub connection subscribed to that
client's channel on each queue it uses, and one thread that reads it and hands
each event to the *feeds* open on its task: an iterator's queue, an asyncio
queue, or a callback. Nothing polls: a feed wakes when its event arrives.

Nothing is lost either. A feed starts from the task's stored state (status,
result, the tokens streamed so far: one round trip), then takes live events,
dropping tokens it already has by index. When the connection drops, the hub makes a
new one and subscribes again; it sees the new subscription confirmed and tells every
feed of that queue to read the stored state again, so tokens and completions
published while it was away are replayed from Redis. (The hub reads its connection's
pushes itself, see :class:`_Wire`; redis-py connects and subscribes.)
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import queue as queue_mod
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import hiredis
import msgpack
import redis

from mtq import serialization
from mtq.broker import cluster, keys
from mtq.broker.connection import Backoff
from mtq.broker.protocol import TERMINAL, Snapshot
from mtq.errors import BrokerError, PayloadError

if TYPE_CHECKING:
    from mtq.client import Task

log = logging.getLogger(__name__)

#: longest a feed waits without any event before it re-reads the stored state (a
#: safety net: reconnects already trigger a re-read)
RESYNC_S = 10.0
#: a callback's read of the stored state that failed (Redis unreachable) is retried after this
RETRY_READ_S = 1.0
#: the outcomes a hub keeps for tasks nobody waited on when they ended (see Hub.take):
#: at most this many, about this many bytes of the messages that carried them, for
#: this long (s); the oldest go first, and a task whose outcome went is read from
#: Redis as ever. So a producer that never asks for its results holds at most the
#: last minute's, 16 MiB
INBOX_MAX = 100_000
INBOX_MAX_BYTES = 16 << 20
INBOX_TTL_S = 60.0
#: terminal states kept there: final ones. A dead letter can be retried (mtq dlq
#: retry), so a later result() must read what it became
INBOX_KINDS = frozenset({"succeeded", "failed", "cancelled", "expired"})
#: what the inbox keeps for a task that ended in a way it does not keep (dead, or a
#: result too large to ride in the message): that it ended, so that its reader reads
#: the stored state instead of waiting for an event that has come and gone
ENDED = "ended"
#: the values Hub.epoch takes, unique in the process (a hub made again for the same
#: client after close_all() must not repeat an old one's)
_EPOCHS = itertools.count(1)


@dataclass(frozen=True, slots=True)
class Event:
    """One thing that happened to a task.

    ``kind``: queued, started, token, progress, restarted, or a terminal state
    (succeeded, failed, dead, cancelled, expired); ``idle`` only for a reader that
    asked for keep-alive ticks (``Task.events(idle=...)``): nothing happened. ``data``: the token or progress
    value, the result (succeeded) or the error text (failed, dead, expired).
    ``index``: a token's position in the task's stream (0, 1, ...). ``delivery``:
    which delivery of the task it belongs to (started, restarted). ``ts``: Redis
    server time (s since the epoch) when it was published; 0.0 for events replayed
    from the stored state.
    """

    kind: str
    task_id: str
    data: Any = None
    index: int | None = None
    delivery: int | None = None
    ts: float = 0.0

    @property
    def terminal(self) -> bool:
        """True for the task's last event (succeeded, failed, dead, cancelled, expired)."""
        return self.kind in TERMINAL


#: a feed's marker meaning "re-read the stored state" (after a reconnect)
RESYNC = "resync"
#: a feed's marker meaning "the reply connection was lost and redis-py's retries gave
#: up": pushed only to feeds opened with ``fail_fast`` (a web response that would rather
#: end and let its client reconnect than wait for Redis)
LOST = "lost"


class _Fetch:
    """A succeeded event whose result was too large to ride in the message."""


FETCH = _Fetch()


def decode_message(data: bytes) -> tuple[str, float, list[tuple[str, Event]]]:
    """Parse one reply-channel message into (kind, ts, [(task id, Event)])."""
    kind_b, ts_us, items = msgpack.unpackb(data, raw=True, use_list=True)
    kind = kind_b.decode()
    ts = ts_us / 1e6
    out: list[tuple[str, Event]] = []
    if kind == "token":
        for i in range(0, len(items), 3):
            tid = items[i].decode()
            out.append((tid, Event("token", tid, serialization.loads(items[i + 2]),
                                   index=int(items[i + 1]), ts=ts)))
    elif kind == "done":
        for i in range(0, len(items), 3):
            tid, status, value = items[i].decode(), items[i + 1].decode(), items[i + 2]
            result: Any
            if status == "succeeded":
                result = FETCH if value is False else serialization.loads(value)
            else:
                result = value.decode(errors="replace") if value else None
            out.append((tid, Event(status, tid, result, ts=ts)))
    elif kind == "started":
        for i in range(0, len(items), 2):
            tid = items[i].decode()
            out.append((tid, Event("started", tid, delivery=int(items[i + 1]), ts=ts)))
    elif kind == "restarted":
        for i in range(0, len(items), 3):
            tid = items[i].decode()
            out.append((tid, Event("restarted", tid, items[i + 2].decode(errors="replace"),
                                   delivery=int(items[i + 1]), ts=ts)))
    elif kind == "progress":
        for i in range(0, len(items), 2):
            tid = items[i].decode()
            out.append((tid, Event("progress", tid, serialization.loads(items[i + 1]), ts=ts)))
    elif kind == "queued":
        for item in items:
            tid = item.decode()
            out.append((tid, Event("queued", tid, ts=ts)))
    return kind, ts, out


class StreamState:
    """What a feed has seen of one task: turns the stored state and live events into
    the events its reader gets (each token index once, in order; one terminal event).

    Sans-IO: the sync and async iterators and the callback runner share it.
    """

    def __init__(self, task_id: str, tokens: bool, start: int = 0) -> None:
        self.task_id = task_id
        self.tokens = tokens
        #: ``start``: tokens before this index are neither read nor handed on (a
        #: reader that resumes a stream it had up to ``start - 1``)
        self.next_index = start
        self.done = False
        #: server time (s) of the last stored state read: older live events are stale
        self.since = 0.0

    @property
    def tokens_from(self) -> int:
        """The first token index the next snapshot should return (-1: none)."""
        return self.next_index if self.tokens else -1

    def from_snapshot(self, snap: Snapshot) -> list[Event]:
        """The events a stored state adds to what was seen (missed tokens, the end)."""
        out: list[Event] = []
        if self.done:
            return out
        self.since = max(self.since, snap.ts)
        if self.tokens:
            for data in snap.tokens:
                out.append(Event("token", self.task_id, serialization.loads(data),
                                 index=self.next_index))
                self.next_index += 1
        if snap.status in TERMINAL:
            self.done = True
            if snap.status == "succeeded":
                value = serialization.loads(snap.result) if snap.result is not None else None
            else:
                value = snap.error
            out.append(Event(snap.status, self.task_id, value, delivery=snap.deliveries))
        return out

    def accept(self, ev: Event) -> tuple[list[Event], bool]:
        """A live event: (events to hand on, whether the stored state must be read)."""
        if self.done:
            return [], False
        if ev.kind == "token":
            if not self.tokens or ev.index is None or ev.index < self.next_index:
                return [], False
            if ev.index > self.next_index:  # a message went missing: read the log
                return [], True
            self.next_index += 1
            return [ev], False
        if ev.terminal:
            if ev.data is FETCH:
                return [], True
            self.done = True
        elif ev.ts and ev.ts < self.since:  # published before the state we replayed
            return [], False
        return [ev], False


class Pacer:
    """When a reader of events wakes up without news: its timeout, its keep-alive tick
    (``idle``) and the re-read safety net (RESYNC_S). Sans-IO, shared by the sync and
    async iterators."""

    def __init__(self, timeout: float | None, idle: float | None) -> None:
        now = time.monotonic()
        self.deadline = None if timeout is None else now + timeout
        self.idle = idle
        self.heard = now  # the last item from the feed (or the start)
        self.said = now   # the last event handed on (or idle tick)

    def wait(self) -> float | None:
        """Seconds to wait for the feed's next item; None once the timeout has passed."""
        now = time.monotonic()
        wait = self.heard + RESYNC_S - now
        if self.idle is not None:
            wait = min(wait, self.said + self.idle - now)
        if self.deadline is not None:
            if now >= self.deadline:
                return None
            wait = min(wait, self.deadline - now)
        return max(wait, 0.0)

    def item(self) -> None:
        """The feed gave an item."""
        self.heard = time.monotonic()

    def handed(self, events: list[Event]) -> list[Event]:
        """``events`` are handed on (returned as they are)."""
        if events:
            self.said = time.monotonic()
        return events

    def quiet(self) -> str:
        """The wait ended with no item: ``read`` (re-read the stored state), ``idle``
        (tell the reader nothing happened) or ``""`` (wait again)."""
        now = time.monotonic()
        if now - self.heard >= RESYNC_S:
            self.heard = now
            return "read"
        if self.idle is not None and now - self.said >= self.idle:
            self.said = now
            return "idle"
        return ""


class Feed:
    """Where the hub puts the events of one task for one reader. ``fail_fast``: it
    also gets :data:`LOST` when the hub's connection is lost. ``ends``: it gets only
    the terminal event (and the hub's markers): a reader that waits for the outcome
    alone (``result()``, a callback) is not woken for the others."""

    __slots__ = ("ends", "fail_fast", "key")

    def __init__(self, key: tuple[str, str], fail_fast: bool = False,
                 ends: bool = False) -> None:
        self.key = key
        self.fail_fast = fail_fast
        self.ends = ends

    def push(self, item: Event | str) -> None:
        raise NotImplementedError


class SyncFeed(Feed):
    """A thread-safe queue an iterator blocks on."""

    __slots__ = ("cond", "items")

    def __init__(self, key: tuple[str, str], fail_fast: bool = False,
                 ends: bool = False) -> None:
        super().__init__(key, fail_fast, ends)
        self.items: collections.deque[Event | str] = collections.deque()
        self.cond = threading.Condition(threading.Lock())

    def push(self, item: Event | str) -> None:
        with self.cond:
            self.items.append(item)
            self.cond.notify()

    def get(self, timeout: float | None) -> Event | str | None:
        """The next item, or None after ``timeout`` seconds."""
        with self.cond:
            if not self.items and not self.cond.wait_for(lambda: self.items, timeout):
                return None
            return self.items.popleft()


class OneShot(Feed):
    """A feed for a reader that waits for one item, the task's terminal event (or a hub
    marker): ``Task.result()``'s wait for a task its client submitted. A lock released
    by the first push, cheaper to wait on than :class:`SyncFeed`'s condition."""

    __slots__ = ("items", "ready")

    def __init__(self, key: tuple[str, str]) -> None:
        super().__init__(key, ends=True)
        self.items: list[Event | str] = []
        self.ready = threading.Lock()
        self.ready.acquire()

    def push(self, item: Event | str) -> None:
        self.items.append(item)
        if self.ready.locked():  # (only the hub thread pushes)
            self.ready.release()

    def get(self, timeout: float | None) -> Event | str | None:
        """The first item pushed, or None after ``timeout`` seconds."""
        if self.ready.acquire(timeout=-1 if timeout is None else timeout):
            return self.items[0]
        return None


class AsyncOneShot(Feed):
    """:class:`OneShot` for asyncio: a future of the loop, set (through the loop) by the
    first push (``Task.aresult()``'s wait for a task its client submitted)."""

    __slots__ = ("future", "loop")

    def __init__(self, key: tuple[str, str], loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(key, ends=True)
        self.loop = loop
        self.future: asyncio.Future[Event | str] = loop.create_future()

    def push(self, item: Event | str) -> None:
        try:
            self.loop.call_soon_threadsafe(self._set, item)
        except RuntimeError:  # the loop is closed: nobody is reading any more
            pass

    def _set(self, item: Event | str) -> None:
        if not self.future.done():
            self.future.set_result(item)

    async def get(self, timeout: float | None) -> Event | str | None:
        """The first item pushed, or None after ``timeout`` seconds."""
        try:
            return await asyncio.wait_for(self.future, timeout)
        except asyncio.TimeoutError:
            return None


class AsyncFeed(Feed):
    """An asyncio queue, fed from the hub thread through the loop."""

    __slots__ = ("loop", "queue")

    def __init__(self, key: tuple[str, str], loop: asyncio.AbstractEventLoop,
                 fail_fast: bool = False, ends: bool = False) -> None:
        super().__init__(key, fail_fast, ends)
        self.loop = loop
        self.queue: asyncio.Queue[Event | str] = asyncio.Queue()

    def push(self, item: Event | str) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is reading any more
            pass

    async def get(self, timeout: float | None) -> Event | str | None:
        if not self.queue.empty():  # a token stream mostly finds its next item waiting
            return self.queue.get_nowait()
        try:
            return await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            return None


def _put_all(items: list[tuple[asyncio.Queue[Event | str], Event | str]]) -> None:
    for q, item in items:
        q.put_nowait(item)


class CallbackFeed(Feed):
    """Calls ``fn(task, event)`` once, with the task's terminal event, on the hub's
    callback thread (so a slow callback never delays event delivery)."""

    __slots__ = ("fired", "fn", "state", "task")

    def __init__(self, task: Task, fn: Callable[[Task, Event], None]) -> None:
        super().__init__((task.queue.name, task.id), ends=True)
        self.task = task
        self.fn = fn
        self.state = StreamState(task.id, tokens=False)
        self.fired = False

    def push(self, item: Event | str) -> None:
        hub_of(self.task.queue.redis).callbacks.put((self, item))


#: how long the hub's read blocks before it looks whether it was closed (s)
POLL_S = 1.0
#: a reply connection silent this long is sent a PING (its answer proves it alive) ...
IDLE_PING_S = 30.0
#: ... and one that does not answer it within this long is dropped and made anew
PING_ANSWER_S = 30.0
#: a listener parked for result() waiters (Hub.read_own) reads again after this long
#: with none reading
PARK_S = 0.02


class _Wire:
    """The pushes of one pub/sub connection, read straight off its socket with a
    hiredis reader of their own: ``[kind, channel, data]`` lists as Redis sends them.

    redis-py's ``PubSub.get_message`` costs about 40 us of Python per message (its
    retry wrapper, readiness checks, push handlers, a dict per message); a task's round
    trip brings two (started, done) to a client that is sharing its CPU with the
    worker. redis-py still connects (AUTH, TLS, a cluster slot's owner) and sends the
    (S)SUBSCRIBE commands; every read is this class's, so no bytes are left in
    redis-py's own parser. Any failure raises ConnectionError and the hub makes a new
    connection, which subscribes to every channel again (see Hub._confirm). A
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


class Hub:
    """The reply listener of one Redis client in this process (thread-safe).

    Its thread reads the pub/sub connection, except while it is parked: a thread
    waiting for the result of a task this client submitted (:meth:`read_own`) then
    reads it in its place, so the message wakes that thread alone (docs/streaming.md).
    Who reads is ``_owner`` (under ``_lock``): "listener", a waiting thread's ident,
    or None (the listener parked, nobody reading); a waiter takes the connection only
    from None, and the listener parks only at a message boundary, so two threads never
    read it at once."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.id = secrets.token_hex(8)
        self.hub_channel = keys.hub(self.id)
        self._hub_bytes = self.hub_channel.encode()
        self._lock = threading.Lock()
        self._feeds: dict[tuple[str, str], list[Feed]] = {}
        self._queues: dict[bytes, str] = {}          # reply channel -> queue
        self._confirmed: dict[str, threading.Event] = {}
        self._pending: list[str] = []
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._pubsub: Any = None
        self._sharded = False
        self._closed = threading.Event()
        #: subscriptions confirmed again after a reconnect (for tests and metrics)
        self.resyncs = 0
        self.callbacks: queue_mod.SimpleQueue[tuple[CallbackFeed, Event | str] | None] = \
            queue_mod.SimpleQueue()
        self._runner: threading.Thread | None = None
        #: (queue, task id) -> (its terminal event, bytes charged, when it came,
        #: monotonic): outcomes that arrived with no feed open on their task, for a
        #: later Task.result() to take without a round trip (a loop over many results)
        self._inbox: collections.OrderedDict[tuple[str, str], tuple[Event | str, int, float]] = \
            collections.OrderedDict()
        self._inbox_bytes = 0
        #: queue -> its epoch (see epoch())
        self._epochs: dict[str, int] = {}
        #: who reads the reply connection: "listener", None (nobody: the listener is
        #: parked), or the ident of a thread reading for its own result (see read_own)
        self._owner: Any = "listener"
        self._park = threading.Condition(self._lock)
        self._want = False      # a result() waiter asked the listener to park
        self._resume = False    # the parked listener must read again at once
        self._broken = False    # a reading thread found the connection broken
        self._freed_at = 0.0
        self._wire: _Wire | None = None
        #: messages read by threads waiting for their own result (for tests and metrics)
        self.read_by_callers = 0
        self._pid = os.getpid()

    # -- subscriptions -----------------------------------------------------------
    def channel(self, queue: str, timeout: float = 10.0) -> str:
        """This client's reply channel on ``queue``, subscribed before it returns
        (so no event of a task submitted after this call can be missed)."""
        name = keys.QueueKeys(queue).reply(self.id)
        with self._lock:
            done = self._confirmed.get(queue)
            if done is None:
                done = self._confirmed[queue] = threading.Event()
                self._queues[name.encode()] = queue
                self._pending.append(name)
                first = self._thread is None
                if first:
                    self._thread = threading.Thread(target=self._run, name="mtq-replies",
                                                    daemon=True)
                    self._thread.start()
            else:
                first = False
        if done.is_set():
            return name
        if not first:
            with self._lock:
                self._wake()
            if not self._ready.wait(timeout):
                raise BrokerError("the reply listener could not subscribe; is Redis reachable?")
            try:  # wake the listener so it subscribes from its own thread
                self.client.publish(self.hub_channel, b"subscribe")
            except redis.RedisError as exc:
                raise BrokerError(f"cannot reach Redis to subscribe to replies ({exc})") from exc
        if not done.wait(timeout):
            raise BrokerError(f"no reply subscription on queue {queue!r} after {timeout:g} s; "
                              "is Redis reachable?")
        return name

    def _subscribe_pending(self, ps: Any) -> None:
        with self._lock:
            names, self._pending = self._pending, []
        if names:
            # a reply channel carries its queue's hash tag: on a sharded cluster, the
            # shard that owns the queue publishes it (see mtq.broker.cluster)
            (ps.ssubscribe if self._sharded else ps.subscribe)(*names)

    def _run(self) -> None:
        backoff = Backoff()
        while not self._closed.is_set():
            try:
                if self._wire is None:
                    self._sharded = cluster.sharded(self.client)
                    ps = self._pubsub = self.client.pubsub()
                    # the hub channel stays a plain one: a rare poke, from this process
                    ps.subscribe(self.hub_channel)
                    self._wire = _Wire(ps)
                    with self._lock:  # every queue channel, after a full reconnect too
                        self._pending = [c.decode() for c in self._queues]
                if self._want and self._parked():
                    continue
                msg = self._wire.next()
                backoff.reset()
                if msg is not None:
                    self._handle(msg)
            except (redis.RedisError, OSError) as exc:
                if self._closed.is_set():
                    return
                delay = backoff.next()  # the first retry at once, then up to 1 s apart
                if backoff.failures == 1:
                    self._lost()
                (log.warning if backoff.failures == 2 else log.debug)(
                    "reply channel lost (%s); reconnecting in %.2f s", exc, delay)
                ps, self._wire = self._pubsub, None
                if ps is not None:  # a new connection subscribes to every channel again
                    try:
                        ps.close()
                    except Exception:  # a broken connection may raise anything on close
                        pass
                self._closed.wait(delay)  # close_all() ends it at once
            except Exception:  # never let the listener die: every waiter would hang
                if self._closed.is_set():
                    # close_all() closed the connection under a read in progress, which
                    # may be answered with any error: the end asked for, not a
                    # message that failed
                    return
                log.exception("a reply message could not be handled")

    def _handle(self, msg: list[Any]) -> None:
        """One push read off the reply connection (by the listener, or a thread reading
        for its own result)."""
        kind, channel = msg[0], msg[1]
        if kind == b"message" or kind == b"smessage":
            if channel == self._hub_bytes:
                self._subscribe_pending(self._pubsub)
            else:
                self._dispatch(channel, msg[2])
        elif kind == b"subscribe" or kind == b"ssubscribe":
            self._confirm(channel, self._pubsub)
        elif kind == b"sunsubscribe" and not self._closed.is_set():
            # the server dropped a shard channel: its slot moved (a failover,
            # a reshard). Subscribe anew, on the slot's new owner
            raise redis.exceptions.PubSubError(f"shard channel {channel!r} moved")

    def _waiting(self, mine: Feed | None = None) -> bool:
        """Whether a feed other than ``mine`` waits for events: anything but a one-shot
        feed that has its item (the lock held)."""
        for fs in self._feeds.values():
            for f in fs:
                if f is not mine and not (type(f) is OneShot and f.items):
                    return True
        return False

    def _parked(self) -> bool:
        """The listener, asked to by a result() waiter (read_own): leave the connection
        to threads that read it for their own results, and sleep until one finds other
        waiters (or a broken connection), or nobody read it for PARK_S. False: nothing
        to park for."""
        with self._lock:
            self._want = False
            if self._waiting():
                return False
            self._owner, self._freed_at = None, time.monotonic()
            while not self._closed.is_set():
                if self._owner is None:
                    left = PARK_S - (time.monotonic() - self._freed_at)
                    if self._resume or left <= 0:
                        break
                    self._park.wait(left)
                else:
                    self._park.wait(PARK_S)
            self._owner, self._resume = "listener", False
            broken, self._broken = self._broken, False
        if broken:
            raise redis.exceptions.ConnectionError("a reader found the reply connection broken")
        return True

    def _wake(self) -> None:
        """Make a parked listener read again at once (the lock held)."""
        if self._owner != "listener":
            self._resume = True
            self._park.notify_all()

    @property
    def reader(self) -> str:
        """Who reads the reply connection now: "listener", "waiter" (a thread waiting
        for its own result, see :meth:`read_own`) or "nobody" (the listener is parked
        and no waiter reads; for tests and metrics)."""
        owner = self._owner
        return "listener" if owner == "listener" else "nobody" if owner is None else "waiter"

    def read_own(self, feed: OneShot, timeout: float) -> Event | str | None:
        """Wait for ``feed``'s item (``Task.result()`` on a task this client submitted):
        read the reply connection in this thread if nobody else does (the listener
        parks while threads wait for their own results one after another: the message
        then wakes the thread that waits for it, not the listener and then it), else
        wait for the listener (and ask it to park after its next message). A forked
        child never reads its parent's connection (nor takes a lock a thread of the
        parent may have held at the fork)."""
        if self._pid != os.getpid():
            return feed.get(timeout)
        with self._lock:
            wire = self._wire
            lead = self._owner is None and timeout > 0 and not self._closed.is_set()
            if lead:
                self._owner = threading.get_ident()
            else:
                self._want = True
        if not lead or wire is None:  # (the wire is there while the listener parks)
            return feed.get(timeout)
        end = time.monotonic() + timeout
        broken = False
        try:
            while not feed.items and not self._closed.is_set():
                left = end - time.monotonic()
                if left <= 0:
                    break
                msg = wire.next(POLL_S if left > POLL_S else left)
                if msg is not None:
                    self.read_by_callers += 1
                    try:
                        self._handle(msg)
                    except redis.RedisError:
                        raise
                    except Exception:  # as the listener: one bad message harms no other
                        log.exception("a reply message could not be handled")
        except (redis.RedisError, OSError):
            broken = True
        except BaseException:
            # an interrupt between a read and its parse may have lost bytes of the
            # stream: the listener makes a new connection
            broken = True
            raise
        finally:
            with self._lock:
                self._owner, self._freed_at = None, time.monotonic()
                if broken:
                    self._broken = True
                if broken or self._waiting(feed):
                    self._resume = True
                    self._park.notify_all()
        if broken and not feed.items:
            return feed.get(max(0.0, end - time.monotonic()))
        return feed.items[0] if feed.items else None

    def _lost(self) -> None:
        """Tell the fail-fast feeds that the connection is gone (redis-py's own retries,
        a few seconds, already failed); the others wait for the resubscription."""
        with self._lock:
            feeds = [f for fs in self._feeds.values() for f in fs if f.fail_fast]
        for f in feeds:
            f.push(LOST)

    def _confirm(self, channel: bytes, ps: Any) -> None:
        if channel == self._hub_bytes:
            self._ready.set()
            self._subscribe_pending(ps)
            return
        queue = self._queues.get(channel)
        if queue is None:
            return
        done = self._confirmed[queue]
        with self._lock:
            self._epochs[queue] = next(_EPOCHS)
        if done.is_set():  # subscribed again after a reconnect: events may be missing
            self.resyncs += 1
            with self._lock:
                feeds = [f for key, fs in self._feeds.items() if key[0] == queue for f in fs]
            for f in feeds:
                f.push(RESYNC)
        done.set()

    def _dispatch(self, channel: bytes, data: bytes) -> None:
        queue = self._queues.get(channel)
        if queue is None:
            return
        try:
            _, _, items = decode_message(data)
        except (ValueError, TypeError, IndexError, PayloadError, msgpack.UnpackException):
            log.warning("malformed reply message ignored (%d bytes)", len(data))
            return
        charge = len(data) // max(1, len(items))  # the inbox's bound: message bytes
        with self._lock:  # copies: a reader may close its feed while we deliver
            targets = []
            for tid, ev in items:
                feeds = self._feeds.get((queue, tid))
                if feeds:
                    targets.append((list(feeds), ev))
                elif ev.terminal:
                    usable = ev.kind in INBOX_KINDS and ev.data is not FETCH
                    self._keep(queue, tid, ev if usable else ENDED, charge if usable else 64)
        loops: dict[asyncio.AbstractEventLoop, list[Any]] = {}
        for feeds, ev in targets:
            for f in feeds:
                if f.ends and not ev.terminal:
                    continue
                if type(f) is AsyncFeed:  # one wake-up of each event loop per message
                    loops.setdefault(f.loop, []).append((f.queue, ev))
                else:
                    f.push(ev)
        for loop, batch in loops.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the loop is closed: nobody is reading any more
                pass

    # -- outcomes nobody waited for -------------------------------------------------
    def epoch(self, queue: str) -> int:
        """A number that changes whenever an event on this hub's reply subscription to
        ``queue`` may have gone unseen: each time the subscription is confirmed (0: not
        yet; again after a lost connection) and each time an outcome is dropped from the
        inbox unread (unique in the process). A task submitted at epoch ``e`` whose
        terminal event is not in the inbox has not ended yet if the epoch is still ``e``
        once its reader's feed is open (mtq.client.Task.result then needs no read of
        the stored state)."""
        with self._lock:
            return self._epochs.get(queue, 0)

    def _keep(self, queue: str, tid: str, ev: Event | str, charge: int) -> None:
        """Keep a terminal event for :meth:`take` (the lock held)."""
        inbox = self._inbox
        old = inbox.pop((queue, tid), None)
        if old is not None:
            self._inbox_bytes -= old[1]
        now = time.monotonic()
        inbox[(queue, tid)] = (ev, charge, now)
        self._inbox_bytes += charge
        while inbox and (len(inbox) > INBOX_MAX or self._inbox_bytes > INBOX_MAX_BYTES
                         or next(iter(inbox.values()))[2] < now - INBOX_TTL_S):
            (dropped, _), (_, gone, _) = inbox.popitem(last=False)
            self._inbox_bytes -= gone
            # an outcome nobody will find here: a reader of a task submitted before
            # now must read the stored state (see epoch)
            self._epochs[dropped] = next(_EPOCHS)

    def take(self, queue: str, task_id: str) -> Event | str | None:
        """The task's terminal event if it reached this client while nobody waited on
        the task (then forgotten here); :data:`ENDED` if it ended in a way the inbox
        does not keep (read the stored state); None if none came (or it was dropped)."""
        with self._lock:
            kept = self._inbox.pop((queue, task_id), None)
            if kept is None:
                return None
            self._inbox_bytes -= kept[1]
            return kept[0]

    def kept(self) -> int:
        """How many outcomes wait in the inbox (for tests and metrics)."""
        with self._lock:
            return len(self._inbox)

    # -- feeds ---------------------------------------------------------------------
    def open(self, feed: Feed) -> None:
        """Start delivering the events of ``feed.key`` to it."""
        with self._lock:
            feeds = self._feeds.setdefault(feed.key, [])
            if feed not in feeds:
                feeds.append(feed)
            if type(feed) is not OneShot:
                self._wake()

    def close(self, feed: Feed) -> None:
        """Stop delivering to ``feed``."""
        with self._lock:
            feeds = self._feeds.get(feed.key)
            if feeds is not None:
                try:
                    feeds.remove(feed)
                except ValueError:
                    pass
                if not feeds:
                    del self._feeds[feed.key]

    @property
    def closed(self) -> bool:
        """close_all() was called: hub_of() makes a new hub for the client."""
        return self._closed.is_set()

    def close_all(self) -> None:
        """Stop the listener and callback threads and drop the subscription (a hub
        for a client that is going away). Waiters still open get no more events."""
        self._closed.set()
        with self._lock:
            self._park.notify_all()
        self.callbacks.put(None)
        ps = self._pubsub
        if ps is not None:
            try:
                ps.close()
            except Exception:  # closing a broken connection may raise anything
                pass
        for t in (self._thread, self._runner):
            if t is not None and t is not threading.current_thread():
                t.join(timeout=2)
        with _hubs_lock:
            if _hubs.get(self.client) is self:
                del _hubs[self.client]

    def watching(self) -> int:
        """How many tasks have a feed open (for tests and metrics)."""
        with self._lock:
            return len(self._feeds)

    # -- callbacks -----------------------------------------------------------------
    def add_callback(self, feed: CallbackFeed, known: bool = False) -> None:
        """Call ``feed.fn`` once the task ends. ``known``: registered before the task
        was submitted, so no event can have been missed and no read is needed."""
        self.open(feed)
        self._start_runner()
        if not known:
            self.callbacks.put((feed, RESYNC))

    def _start_runner(self) -> None:
        with self._lock:
            if self._runner is None:
                self._runner = threading.Thread(target=self._run_callbacks,
                                                name="mtq-callbacks", daemon=True)
                self._runner.start()

    def _run_callbacks(self) -> None:
        while True:
            item = self.callbacks.get()
            if item is None:
                return
            batch = [item]
            while True:  # read the state of every task that needs it in one round trip
                try:
                    more = self.callbacks.get_nowait()
                except queue_mod.Empty:
                    break
                if more is None:
                    self.callbacks.put(None)
                    break
                batch.append(more)
            reads = [f for f, it in batch if it == RESYNC and not f.fired]
            snaps = _read_many(reads, self.id) if reads else {}
            for feed, it in batch:
                if feed.fired:
                    continue
                if it == RESYNC:
                    snap = snaps.get(id(feed))
                    events = feed.state.from_snapshot(snap) if snap else []
                    if snap is None and id(feed) in snaps:  # gone: retention ran out
                        events = [Event("expired", feed.task.id, "the task no longer exists")]
                        feed.state.done = True
                else:
                    assert isinstance(it, Event)
                    events, again = feed.state.accept(it)
                    if again:
                        self.callbacks.put((feed, RESYNC))
                for ev in events:
                    if ev.terminal:
                        feed.fired = True
                        self.close(feed)
                        try:
                            feed.fn(feed.task, ev)
                        except Exception:
                            log.exception("a task callback raised")


def _read_many(feeds: list[CallbackFeed], hub_id: str) -> dict[int, Snapshot | None]:
    """Snapshots of several tasks in one round trip (pipelined watch calls)."""
    from mtq.broker import scripts

    calls = []
    for f in feeds:
        b = f.task.queue.broker
        calls.append(b.watch_call(f.task.id, b.keys.reply(hub_id)))
    try:
        snaps = scripts.run(feeds[0].task.queue.redis, *calls)
    except BrokerError:
        log.warning("could not read %d task(s) for their callbacks; retrying in %g s",
                    len(feeds), RETRY_READ_S, exc_info=True)
        hub = hub_of(feeds[0].task.queue.redis)

        def retry() -> None:
            for f in feeds:
                hub.callbacks.put((f, RESYNC))

        # later, off the callback thread: the other tasks' callbacks keep running meanwhile
        timer = threading.Timer(RETRY_READ_S, retry)
        timer.daemon = True
        timer.start()
        return {}
    return {id(f): s for f, s in zip(feeds, snaps)}


_hubs: weakref.WeakKeyDictionary[redis.Redis, Hub] = weakref.WeakKeyDictionary()
_hubs_lock = threading.Lock()


def hub_of(client: redis.Redis) -> Hub:
    """The hub of ``client`` in this process (created on first use)."""
    with _hubs_lock:
        hub = _hubs.get(client)
        if hub is None:
            hub = _hubs[client] = Hub(client)
        return hub
