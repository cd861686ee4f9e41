"""The hub: one reply subscription per Redis client and process.

A :class:`Hub` holds one pub/sub connection subscribed to its client's reply channel
on each queue it uses, and one thread that reads it (:mod:`~mtq.client.replies.wire`)
and hands each event to the feeds open on its task
(:mod:`~mtq.client.replies.feeds`); an outcome that finds no feed goes to the inbox
(:mod:`~mtq.client.replies.inbox`), callbacks run on a thread of their own
(:mod:`~mtq.client.replies.callbacks`). After a reconnect it subscribes again and
tells every feed of the queue to read the stored state again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import threading
import time
import weakref
from typing import Any

import msgpack
import redis

import mtq.client.replies.wire as wires
from mtq.broker import cluster, keys
from mtq.broker.connection import Backoff
from mtq.client.replies.callbacks import CallbackThread
from mtq.client.replies.events import FETCH, LOST, RESYNC, Event, decode_message
from mtq.client.replies.feeds import (
    AsyncFeed,
    CallbackFeed,
    CallbackQueue,
    Feed,
    OneShot,
    put_all,
)
from mtq.client.replies.inbox import ENDED, INBOX_KINDS, Inbox
from mtq.client.replies.wire import Wire
from mtq.errors import BrokerError, PayloadError

log = logging.getLogger("mtq.replies")

#: a listener parked for result() waiters (Hub.read_own) reads again after this long
#: with none reading
PARK_S = 0.02



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
        self._runs = CallbackThread(self.id, self.close)
        #: the callback thread's queue (a CallbackFeed pushes there)
        self.callbacks: CallbackQueue = self._runs.queue
        #: outcomes that arrived with no feed open on their task, and each queue's
        #: epoch (guarded by _lock)
        self._inbox = Inbox()
        #: who reads the reply connection: "listener", None (nobody: the listener is
        #: parked), or the ident of a thread reading for its own result (see read_own)
        self._owner: Any = "listener"
        self._park = threading.Condition(self._lock)
        self._want = False      # a result() waiter asked the listener to park
        self._resume = False    # the parked listener must read again at once
        self._broken = False    # a reading thread found the connection broken
        self._freed_at = 0.0
        self._wire: Wire | None = None
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
                    self._wire = Wire(ps)
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
                poll = wires.POLL_S
                msg = wire.next(poll if left > poll else left)
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
        if broken and not feed.items and not self._closed.is_set():
            return feed.get(max(0.0, end - time.monotonic()))
        # (closed: nothing comes to the feed any more; the caller reads the stored state)
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
            self._inbox.renew(queue)
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
                    self._inbox.keep(queue, tid, ev if usable else ENDED,
                                     charge if usable else 64)
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
                loop.call_soon_threadsafe(put_all, batch)
            except RuntimeError:  # the loop is closed: nobody is reading any more
                pass

    # -- outcomes nobody waited for -------------------------------------------------
    def epoch(self, queue: str) -> int:
        """A number that changes whenever an event on this hub's reply subscription to
        ``queue`` may have gone unseen (see :meth:`Inbox.epoch`): a task submitted at
        epoch ``e`` whose terminal event is not in the inbox has not ended yet if the
        epoch is still ``e`` once its reader's feed is open (mtq.client.Task.result
        then needs no read of the stored state)."""
        with self._lock:
            return self._inbox.epoch(queue)

    def take(self, queue: str, task_id: str) -> Event | str | None:
        """The task's terminal event if it reached this client while nobody waited on
        the task (then forgotten here); :data:`ENDED` if it ended in a way the inbox
        does not keep (read the stored state); None if none came (or it was dropped)."""
        with self._lock:
            return self._inbox.take(queue, task_id)

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
        self._runs.stop()
        ps = self._pubsub
        if ps is not None:
            try:
                ps.close()
            except Exception:  # closing a broken connection may raise anything
                pass
        for t in (self._thread, self._runs.thread):
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
    def add_callback(self, feed: CallbackFeed[Any], known: bool = False) -> None:
        """Call ``feed.fn`` once the task ends. ``known``: registered before the task
        was submitted, so no event can have been missed and no read is needed."""
        self.open(feed)
        self._runs.add(feed, known)


_hubs: weakref.WeakKeyDictionary[redis.Redis, Hub] = weakref.WeakKeyDictionary()
_hubs_lock = threading.Lock()


def hub_of(client: redis.Redis) -> Hub:
    """The hub of ``client`` in this process (created on first use)."""
    with _hubs_lock:
        hub = _hubs.get(client)
        if hub is None:
            hub = _hubs[client] = Hub(client)
        return hub
