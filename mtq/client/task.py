"""A handle on one submitted task: :class:`Task` (status, info, cancel, trace,
callbacks, and waiting for its events and result, sync and async)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Protocol

from mtq import serialization
from mtq.broker import codes
from mtq.broker.codes import Code
from mtq.broker.connection import Backoff, redis_errors
from mtq.broker.protocol import Broker
from mtq.client.records import TaskInfo, TraceEntry
from mtq.client.replies.events import Event, StreamState
from mtq.client.replies.feeds import AsyncFeed, AsyncOneShot, CallbackFeed, Feed, OneShot, SyncFeed
from mtq.client.replies.hub import Hub
from mtq.client.waiting import DONE, READ, READ_RETRY_S, TIMEOUT, Waiter, own_outcome, own_wait
from mtq.errors import (
    ConfigError,
    MtqError,
    RedisUnavailable,
    ResultTimeout,
    TaskCancelled,
    TaskFailed,
    TaskNotFound,
)


class TaskQueue(Protocol):
    """What a task handle needs of its queue (:class:`~mtq.client.queue.Queue`)."""

    name: str
    redis: Any
    broker: Broker

    @property
    def hub(self) -> Hub: ...

    def reply_channel(self) -> str: ...


def _s(value: bytes | None) -> str | None:
    return None if value is None else value.decode()


def _i(value: bytes | None) -> int | None:
    return None if value is None else int(value)


class Task:
    """A handle on one submitted task. Cheap to create from an id (:meth:`Queue.task`)."""

    __slots__ = ("_cached", "_epoch", "id", "queue")

    def __init__(self, queue: TaskQueue, task_id: str, cached: bytes | None = None,
                 epoch: int | None = None) -> None:
        self.queue = queue
        self.id = task_id
        #: the encoded result when the submit was answered from the result cache
        self._cached = cached
        #: the reply subscription's epoch (mtq.client.replies.Hub.epoch) when this
        #: client created the task, its events sent to this client; None: not known
        self._epoch = epoch

    @property
    def cached(self) -> bool:
        """True if this handle's submit was answered from the result cache (the task
        was created succeeded; :meth:`result` needs no round trip)."""
        return self._cached is not None

    @property
    def broker(self) -> Broker:
        """The broker of the task's queue (what a callback feed reads the task through)."""
        return self.queue.broker

    def __repr__(self) -> str:
        return f"<Task {self.queue.name}/{self.id}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Task) and (other.queue.name, other.id) == (self.queue.name, self.id)

    def __hash__(self) -> int:
        return hash((self.queue.name, self.id))

    def _hmget(self, *names: str) -> list[Any]:
        with redis_errors():
            return list(self.queue.redis.hmget(self.queue.broker.keys.task(self.id), names))

    def _not_found(self) -> TaskNotFound:
        return codes.error(Code.NOT_FOUND, queue=self.queue.name, task_id=self.id)

    def status(self) -> str:
        """The task's state: queued, running, delayed (a retry's or a submit's delay),
        succeeded, failed, dead, cancelled or expired. Raises TaskNotFound."""
        (status,) = self._hmget("status")
        if status is None:
            raise self._not_found()
        return status.decode()

    def info(self) -> TaskInfo:
        """Everything stored about the task except payload and result. Raises TaskNotFound."""
        names = ("status", "stream", "attempts", "deliveries", "created", "started",
                 "finished", "deadline", "worker", "error", "cancel", "traceback", "due",
                 "timeout")
        v = dict(zip(names, self._hmget(*names)))
        if v["status"] is None:
            raise self._not_found()
        return TaskInfo(
            id=self.id, status=v["status"].decode(), stream=_s(v["stream"]),
            attempts=_i(v["attempts"]) or 0, deliveries=_i(v["deliveries"]) or 0,
            created=_i(v["created"]), started=_i(v["started"]), finished=_i(v["finished"]),
            deadline=_i(v["deadline"]), worker=_s(v["worker"]), error=_s(v["error"]),
            cancel_requested=v["cancel"] is not None, traceback=_s(v["traceback"]),
            due=_i(v["due"]) if v["status"] == b"delayed" else None,
            timeout=int(v["timeout"]) / 1000 if v["timeout"] else None,
        )

    def trace(self) -> list[TraceEntry]:
        """The task's life, oldest first: queued, started (delivery, worker), retry,
        restarted, released, cancel requested, and how it ended. Kept as long as
        the task. Raises TaskNotFound."""
        entries = [TraceEntry(ts / 1000, kind, detail)
                   for ts, kind, detail in self.queue.broker.trace(self.id)]
        if not entries:
            self.status()  # raises TaskNotFound if it does not exist
        return entries

    def chain(self) -> Any:
        """The :class:`~mtq.client.chains.Chain` this task is a step of (submitted with
        ``then=``): every step's queue, task id and status, the last step's result,
        every step's tokens, cancel; None if it is not a chain's. Raises TaskNotFound."""
        from mtq.client.chains import of  # (chains.py imports this module)

        return of(self)

    def cancel(self) -> bool:
        """Cancel the task. Returns True if it is cancelled now (it was waiting),
        False if it is running and its worker has been asked to stop it.
        Raises TaskNotFound, or TaskFailed-free: a finished task returns False."""
        code, _status = self.queue.broker.cancel(self.id)
        if code == Code.NOT_FOUND:
            raise self._not_found()
        return code == 1

    # -- waiting (the loop itself is mtq.client.waiting.Waiter) -----------------------
    def _snapshot(self, state: StreamState, fail_fast: bool = False) -> list[Event]:
        """The stored state's news for ``state``, read again while Redis cannot be
        reached (a dropped connection, a restart), for up to READ_RETRY_S; only once
        (with redis-py's own retries, a few seconds) when ``fail_fast``."""
        b = self.queue.broker
        backoff = Backoff()
        start = time.monotonic()
        while True:
            try:
                snap = b.watch(self.id, b.keys.reply(self.queue.hub.id), state.tokens_from)
                break
            except RedisUnavailable:
                if fail_fast or time.monotonic() - start > READ_RETRY_S:
                    raise
                time.sleep(backoff.next())
        if snap is None:
            raise self._not_found()
        return state.from_snapshot(snap)

    def _outcome(self, ev: Event) -> Any:
        if ev.kind == "succeeded":
            return ev.data
        if ev.kind == "cancelled":
            raise TaskCancelled(self.id, ev.kind, ev.data)
        raise TaskFailed(self.id, ev.kind, ev.data)

    def _timeout(self, timeout: float | None) -> ResultTimeout:
        try:
            status = self.status()
        except MtqError:
            status = "unknown"
        return ResultTimeout(self.id, timeout or 0.0, status)

    def _given(self, exc: ResultTimeout, timeout: float | None) -> ResultTimeout:
        """``exc`` as the caller's timeout, not what the long way had left of it."""
        return ResultTimeout(self.id, timeout or 0.0, exc.status)

    def _reader(self, start: int) -> tuple[Hub, tuple[str, str]]:
        """What events() and aevents() start with: the hub and the feed's key."""
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ConfigError(f"start must be a token index >= 0, got {start!r}")
        self._epoch = None  # this reader may take the outcome: later ones read it
        return self.queue.hub, (self.queue.name, self.id)

    def _take_outcome(self) -> tuple[Event | None, int | None]:
        """What result() starts from: the outcome if the inbox holds it, else the epoch
        this client submitted the task under (None: not known, read the stored state).
        Either way the outcome is taken by this call: a later one reads it."""
        kept = self.queue.hub.take(self.queue.name, self.id)
        since = self._epoch if kept is None else None
        self._epoch = None
        return (kept if isinstance(kept, Event) else None), since

    def _open_own(self, feed: Feed, epoch: int) -> tuple[bool, Event | str | None]:
        """Open result()'s short way's ``feed`` (``epoch``: the task's, taken by the
        caller): (whether the short way goes on, the outcome the inbox held, None for
        none yet). It goes on if the reply subscription was not lost since the submit:
        then the task's terminal event is in the inbox or on its way to the feed."""
        hub, name = self.queue.hub, self.queue.name
        hub.open(feed)
        item = hub.take(name, self.id)
        return hub.epoch(name) == epoch and not isinstance(item, str), item

    def _await_own(self, epoch: int, timeout: float | None
                   ) -> tuple[Event | None, float | None]:
        """result()'s short way for a task this client submitted: (its terminal event,
        None), or (None, the timeout left) for the long way (see own_outcome)."""
        feed, start = OneShot((self.queue.name, self.id)), time.monotonic()
        try:
            going, item = self._open_own(feed, epoch)
            if going and item is None:
                item = self.queue.hub.read_own(feed, own_wait(timeout))
        finally:
            self.queue.hub.close(feed)
        return own_outcome(item if going else None, timeout, start)

    async def _await_own_async(self, epoch: int, timeout: float | None
                               ) -> tuple[Event | None, float | None]:
        """:meth:`_await_own` for asyncio (a future of the running loop)."""
        feed = AsyncOneShot((self.queue.name, self.id), asyncio.get_running_loop())
        start = time.monotonic()
        try:
            going, item = self._open_own(feed, epoch)
            if going and item is None:
                item = await feed.get(own_wait(timeout))
        finally:
            self.queue.hub.close(feed)
        return own_outcome(item if going else None, timeout, start)

    def events(self, timeout: float | None = None, *, tokens: bool = True, start: int = 0,
               idle: float | None = None, fail_fast: bool = False,
               _ends: bool = False) -> Iterator[Event]:
        """Iterate over the task's events until its terminal one (included).

        Starts from the stored state: the tokens streamed so far (replayed with
        ``ts`` 0.0), and the terminal event if the task already ended; then live
        events as they are published, each token index exactly once and in order.
        ``timeout``: seconds for the whole iteration (ResultTimeout past it).
        ``tokens=False`` leaves token events out. ``start``: the first token index
        wanted (a reader resuming a stream it had up to ``start - 1``: no gap, no
        repeat). ``idle``: yield an ``Event("idle", ...)`` after that many seconds
        in which nothing was yielded (a keep-alive hook). ``fail_fast``: raise
        RedisUnavailable as soon as Redis is found unreachable (the reply connection
        lost and one read failed) instead of retrying reads for up to 60 s. Raises
        TaskNotFound, BrokerError.
        """
        hub, key = self._reader(start)
        self.queue.reply_channel()
        feed = SyncFeed(key, fail_fast, _ends)
        w = Waiter(self.id, tokens, start, timeout, idle)
        hub.open(feed)
        try:
            while True:
                need = w.need()
                if need is DONE:
                    return
                if need is TIMEOUT:
                    raise self._timeout(timeout)
                if need is READ:
                    yield from w.read(self._snapshot(w.state, fail_fast))
                else:
                    yield from w.fed(feed.get(need))
        finally:
            hub.close(feed)

    async def aevents(self, timeout: float | None = None, *, tokens: bool = True,
                      start: int = 0, idle: float | None = None, fail_fast: bool = False,
                      _ends: bool = False) -> AsyncIterator[Event]:
        """:meth:`events` for asyncio (the Redis reads run in a thread)."""
        hub, key = self._reader(start)
        if not hub.epoch(self.queue.name):  # not subscribed yet (a call that may block)
            await asyncio.to_thread(self.queue.reply_channel)
        feed = AsyncFeed(key, asyncio.get_running_loop(), fail_fast, _ends)
        w = Waiter(self.id, tokens, start, timeout, idle)
        hub.open(feed)
        try:
            while True:
                need = w.need()
                if need is DONE:
                    return
                if need is TIMEOUT:
                    raise await asyncio.to_thread(self._timeout, timeout)
                if need is READ:
                    out = w.read(await asyncio.to_thread(self._snapshot, w.state, fail_fast))
                else:
                    out = w.fed(await feed.get(need))
                for ev in out:
                    yield ev
        finally:
            hub.close(feed)
            feed.close()

    def tokens(self, timeout: float | None = None) -> Iterator[Any]:
        """Iterate over the task's tokens (or chunks), live as they are produced:
        those already streamed first, then each new one, each exactly once and in
        order, also across a worker crash and redelivery. Ends when the task
        succeeds; raises TaskFailed / TaskCancelled if it does not, ResultTimeout,
        TaskNotFound."""
        for ev in self.events(timeout):
            if ev.kind == "token":
                yield ev.data
            elif ev.terminal:
                self._outcome(ev)

    async def atokens(self, timeout: float | None = None) -> AsyncIterator[Any]:
        """:meth:`tokens` for asyncio."""
        async for ev in self.aevents(timeout):
            if ev.kind == "token":
                yield ev.data
            elif ev.terminal:
                self._outcome(ev)

    def result(self, timeout: float | None = None) -> Any:
        """Wait for the task to finish and return its result.

        Waits for the completion event on this client's reply subscription (no
        polling). A task this client submitted costs no round trip at all: its
        outcome is taken from the client's inbox of outcomes nobody waited for if it
        already came (a loop collecting many results; Hub.take), else
        awaited, as long as the subscription was never lost since the submit. Any
        other task's stored state is read first (one round trip), so a completion
        that happened before the call is not missed. Raises TaskFailed (failed, dead,
        expired), TaskCancelled, ResultTimeout, TaskNotFound, BrokerError.
        """
        if self._cached is not None:  # answered from the result cache at submit
            return serialization.loads(self._cached)
        kept, since = self._take_outcome()
        if kept is not None:
            return self._outcome(kept)
        left = timeout
        if since is not None:  # the short way
            ev, left = self._await_own(since, timeout)
            if ev is not None:
                return self._outcome(ev)
        try:  # the long way: from the stored state
            for ev in self.events(left, tokens=False, _ends=True):
                if ev.terminal:
                    return self._settled(ev)
        except ResultTimeout as exc:
            if left is timeout:
                raise
            raise self._given(exc, timeout) from None
        raise AssertionError("unreachable: events() ends with a terminal event")

    async def aresult(self, timeout: float | None = None) -> Any:
        """:meth:`result` for asyncio."""
        if self._cached is not None:
            return serialization.loads(self._cached)
        kept, since = self._take_outcome()
        if kept is not None:
            return self._outcome(kept)
        left = timeout
        if since is not None:
            ev, left = await self._await_own_async(since, timeout)
            if ev is not None:
                return self._outcome(ev)
        try:
            async for ev in self.aevents(left, tokens=False, _ends=True):
                if ev.terminal:
                    return self._settled(ev)
        except ResultTimeout as exc:
            if left is timeout:
                raise
            raise self._given(exc, timeout) from None
        raise AssertionError("unreachable: aevents() ends with a terminal event")

    def _settled(self, ev: Event) -> Any:
        """The long way's end: the outcome of terminal ``ev``, dropped from the inbox
        too if it also came there with nobody waiting."""
        self.queue.hub.take(self.queue.name, self.id)
        return self._outcome(ev)

    # -- callbacks -----------------------------------------------------------------
    def add_done_callback(self, fn: Callable[[Task, Event], None], *, _known: bool = False
                          ) -> None:
        """Call ``fn(task, event)`` once with the task's terminal event, on this
        client's callback thread (keep it short; it never blocks event delivery).
        Registered after the task ended, it is called at once. Exceptions it raises
        are logged."""
        self._epoch = None  # the callback takes the outcome: a later result() reads it
        self.queue.reply_channel()
        hub = self.queue.hub
        hub.add_callback(CallbackFeed(self, fn, hub.callbacks), known=_known)

    def on_success(self, fn: Callable[[Task, Any], None]) -> Task:
        """Call ``fn(task, result)`` if the task succeeds (see :meth:`add_done_callback`)."""
        def done(task: Task, ev: Event) -> None:
            if ev.kind == "succeeded":
                fn(task, ev.data)
        self.add_done_callback(done)
        return self

    def on_error(self, fn: Callable[[Task, TaskFailed], None]) -> Task:
        """Call ``fn(task, error)`` if the task ends failed, dead, expired or cancelled;
        ``error`` is the TaskFailed (or TaskCancelled) that :meth:`result` would raise."""
        def done(task: Task, ev: Event) -> None:
            if ev.kind != "succeeded":
                fn(task, failure(task, ev))
        self.add_done_callback(done)
        return self


def failure(task: Task, ev: Event) -> TaskFailed:
    """The TaskFailed (or TaskCancelled) that ``task.result()`` raises for its terminal
    event ``ev``, a failure (failed, dead, expired, cancelled)."""
    try:
        task._outcome(ev)
    except TaskFailed as exc:
        return exc
    raise AssertionError(f"{ev.kind} is not a failure")


def adopt(task: Task, feed: CallbackFeed[Task]) -> None:
    """Run ``feed``, a callback feed opened on the hub before ``task`` was submitted (a
    group's), as the task's callback; it takes the task's outcome, so a later
    ``task.result()`` reads the stored state."""
    task._epoch = None
    task.queue.hub.add_callback(feed, known=True)
