"""Feeds: where the hub puts the events of one task for one reader (an iterator's
queue, an asyncio queue, a one-shot wait for the outcome, or a callback)."""

from __future__ import annotations

import asyncio
import collections
import math
import queue as queue_mod
import threading
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from mtq.broker.protocol import Broker
from mtq.client.replies.events import Event, StreamState


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
        # asyncio.wait, not wait_for: wait_for (before Python 3.12) drops a cancel
        # that lands as the item comes, and cancels the future on a timeout (a second
        # get would raise)
        await asyncio.wait((self.future,), timeout=timeout)
        return self.future.result() if self.future.done() else None


class AsyncItems:
    """An :class:`AsyncFeed`'s items: a deque, and the future its one reader waits on
    (cheaper than an ``asyncio.Queue`` read through ``asyncio.wait_for``, which makes
    a task and two more turns of the loop for every item of a token stream). Used on
    its loop's thread only."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: collections.deque[Event | str] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: Event | str) -> None:
        self.items.append(item)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def empty(self) -> bool:
        return not self.items

    def get_nowait(self) -> Event | str:
        return self.items.popleft()


class AsyncFeed(Feed):
    """The items of one asyncio reader, fed from the hub thread through the loop.

    A wait's time limit is one timer per feed, moved lazily: a token stream waits
    about once a token, each time with a limit seconds away (its keep-alive, the
    safety net's re-read), and a timer made and cancelled per wait costs two pushes
    on the loop's heap of timers, compared in Python. The timer stays where it was
    while the limit only moves later; when it fires early it sets itself again for
    the limit then in force."""

    __slots__ = ("due", "loop", "queue", "timer")

    def __init__(self, key: tuple[str, str], loop: asyncio.AbstractEventLoop,
                 fail_fast: bool = False, ends: bool = False) -> None:
        super().__init__(key, fail_fast, ends)
        self.loop = loop
        self.queue = AsyncItems()
        #: when the present wait ends without an item (loop time; inf: no limit)
        self.due = math.inf
        self.timer: asyncio.TimerHandle | None = None

    def push(self, item: Event | str) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is reading any more
            pass

    async def get(self, timeout: float | None) -> Event | str | None:
        """The next item, or None after ``timeout`` seconds (0: only one already
        there)."""
        q = self.queue
        if q.items:  # a token stream mostly finds its next item waiting
            return q.items.popleft()
        if timeout is not None and timeout <= 0:
            return None
        waiter: asyncio.Future[None] = self.loop.create_future()
        q.waiter = waiter
        if timeout is None:
            self.due = math.inf
        else:
            self.due = self.loop.time() + timeout
            timer = self.timer
            if timer is None or timer.when() > self.due:
                if timer is not None:
                    timer.cancel()
                self.timer = self.loop.call_at(self.due, self._expire)
        try:
            await waiter
        finally:
            q.waiter = None
        return q.items.popleft() if q.items else None

    def _expire(self) -> None:
        self.timer = None
        waiter = self.queue.waiter
        if waiter is None or waiter.done() or self.due == math.inf:
            return  # nobody waits, or without a limit: the next wait sets one if it needs
        if self.loop.time() >= self.due:
            waiter.set_result(None)
        else:  # the limit moved later since this timer was set
            self.timer = self.loop.call_at(self.due, self._expire)

    def close(self) -> None:
        """The reader is done: its timer goes."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


def put_all(items: list[tuple[AsyncItems, Event | str]]) -> None:
    """Put each item on its asyncio queue: the hub's one call through an event loop
    for all that loop's feeds of a message."""
    for q, item in items:
        q.put_nowait(item)


class Watched(Protocol):
    """What a callback feed needs of the task it watches: its id, and the broker of its
    queue, through which the callback thread reads the task's stored state."""

    @property
    def id(self) -> str: ...

    @property
    def broker(self) -> Broker: ...


W = TypeVar("W", bound=Watched)

#: the callback thread's queue: (a feed, an event or a hub marker); None stops it
CallbackQueue = queue_mod.SimpleQueue[tuple["CallbackFeed[Any]", Event | str] | None]


class CallbackFeed(Feed, Generic[W]):
    """Calls ``fn(task, event)`` once, with the task's terminal event, on the hub's
    callback thread (so a slow callback never delays event delivery). ``runs``: that
    thread's queue (``Hub.callbacks``), where the hub's pushes go."""

    __slots__ = ("fired", "fn", "runs", "state", "task")

    def __init__(self, task: W, fn: Callable[[W, Event], None], runs: CallbackQueue) -> None:
        super().__init__((task.broker.queue, task.id), ends=True)
        self.task = task
        self.fn = fn
        self.runs = runs
        self.state = StreamState(task.id, tokens=False)
        self.fired = False

    def push(self, item: Event | str) -> None:
        self.runs.put((self, item))
