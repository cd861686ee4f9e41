"""The producer side: :class:`Queue`, :class:`Task` and :class:`Request`."""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis

from mtq import serialization, tracing
from mtq.broker import lane
from mtq.broker.cluster import for_queue
from mtq.broker.codes import Code
from mtq.broker.config import SettingsSource, SettingsSpec
from mtq.broker.connection import Backoff, connect, redis_errors
from mtq.broker.protocol import Answer, Broker, NewTask, Submitted
from mtq.errors import (
    ConfigError,
    DuplicateTask,
    MtqError,
    NotDurable,
    PayloadTooLarge,
    QueueFull,
    QueueInUse,
    RedisUnavailable,
    ResultTimeout,
    TaskCancelled,
    TaskFailed,
    TaskNotFound,
)
from mtq.replies import (
    FETCH,
    RESYNC_S,
    AsyncFeed,
    AsyncOneShot,
    CallbackFeed,
    Event,
    Feed,
    Hub,
    OneShot,
    Pacer,
    StreamState,
    SyncFeed,
    hub_of,
)
from mtq.settings import MAX_RETRIES, QueueSettings
from mtq.validation import check_queue_name, check_stream_name, check_task_id

if TYPE_CHECKING:
    from mtq.group import Group

#: longest accepted ttl (about 31 years); keeps deadlines exact integers in Lua
MAX_TTL_S = 1e9

#: most tasks sent in one submit script call (keeps each call's Redis time short)
SUBMIT_CHUNK = 1000
#: most tasks one purge / dead-letter script call handles
PURGE_CHUNK = 1000
#: how long submit keeps trying to reach Redis (the first retry at once, then up to
#: 1 s apart) before it raises RedisUnavailable, and how long a reader does
SUBMIT_RETRY_S = 10.0
#: the same on a Redis Cluster or behind Sentinel: a failover takes Redis's node timeout
#: (15 s by default) and an election (see docs/scaling.md)
SUBMIT_RETRY_HA_S = 30.0
READ_RETRY_S = 60.0


def _own_wait(timeout: float | None) -> float:
    """How long the short way of result() waits on its feed: the caller's timeout, at
    most RESYNC_S (then the long way reads the stored state); a negative one not at all
    (a lock's -1 would mean forever)."""
    return RESYNC_S if timeout is None else max(0.0, min(timeout, RESYNC_S))


def new_task_id() -> str:
    """A random id of 16 URL-safe characters (about 96 bits) that does not start with
    ``-``: on a command line, ``mtq cancel -Mx...`` would read as an option."""
    while True:
        task_id = secrets.token_urlsafe(12)
        if task_id[0] != "-":  # 1 in 64 draws
            return task_id


@dataclass(frozen=True, slots=True)
class TraceEntry:
    """One step of a task's life (:meth:`Task.trace`)."""

    ts: float    # Redis server time, seconds since the epoch
    kind: str    # queued, started, retry, restarted, released, cancel requested, <status>
    detail: str  # delivery and worker, the error, the reason


@dataclass(frozen=True)
class Request:
    """One item for :meth:`Queue.submit_many` with options of its own."""

    payload: Any
    stream: str | None = None
    key: str | None = None
    ttl: float | None = None
    retries: int | None = None
    id: str | None = None
    #: False: never answered from the result cache, nor attached to an identical task
    cache: bool = True


def cache_digest(payload: Any, data: bytes) -> str:
    """The result cache's digest of a payload (``data``: its encoding): ``c`` or ``u``
    (``u``: it gives no integer ``seed``, so a generator samples it from its task id and
    only a deterministic one may answer it from the cache), then the hex BLAKE2b of the
    bytes. Computed here, not in Redis, whose CPU is the scarce one."""
    seed = payload.get("seed") if isinstance(payload, dict) else None
    seeded = isinstance(seed, int) and not isinstance(seed, bool)
    return ("c" if seeded else "u") + hashlib.blake2b(data, digest_size=20).hexdigest()


@dataclass(frozen=True)
class TaskInfo:
    """A snapshot of a task's stored state. Times are Redis server ms since the epoch."""

    id: str
    status: str
    stream: str | None
    attempts: int
    deliveries: int
    created: int | None
    started: int | None
    finished: int | None
    deadline: int | None
    worker: str | None
    error: str | None
    cancel_requested: bool
    #: the traceback of the last exception the task's handler raised (bounded)
    traceback: str | None = None


def _s(value: bytes | None) -> str | None:
    return None if value is None else value.decode()


def _i(value: bytes | None) -> int | None:
    return None if value is None else int(value)


class Task:
    """A handle on one submitted task. Cheap to create from an id (:meth:`Queue.task`)."""

    __slots__ = ("_cached", "_epoch", "id", "queue")

    def __init__(self, queue: Queue, task_id: str, cached: bytes | None = None,
                 epoch: int | None = None) -> None:
        self.queue = queue
        self.id = task_id
        #: the encoded result when the submit was answered from the result cache
        self._cached = cached
        #: the reply subscription's epoch (mtq.replies.Hub.epoch) when this client
        #: created the task, its events sent to this client; None: not known
        self._epoch = epoch

    @property
    def cached(self) -> bool:
        """True if this handle's submit was answered from the result cache (the task
        was created succeeded; :meth:`result` needs no round trip)."""
        return self._cached is not None

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
        return TaskNotFound(f"no task {self.id} in queue {self.queue.name!r} "
                            "(wrong id or queue, or its retention time ran out)")

    def status(self) -> str:
        """The task's state: queued, running, delayed, succeeded, failed, dead,
        cancelled or expired. Raises TaskNotFound."""
        (status,) = self._hmget("status")
        if status is None:
            raise self._not_found()
        return status.decode()

    def info(self) -> TaskInfo:
        """Everything stored about the task except payload and result. Raises TaskNotFound."""
        names = ("status", "stream", "attempts", "deliveries", "created", "started",
                 "finished", "deadline", "worker", "error", "cancel", "traceback")
        v = dict(zip(names, self._hmget(*names)))
        if v["status"] is None:
            raise self._not_found()
        return TaskInfo(
            id=self.id, status=v["status"].decode(), stream=_s(v["stream"]),
            attempts=_i(v["attempts"]) or 0, deliveries=_i(v["deliveries"]) or 0,
            created=_i(v["created"]), started=_i(v["started"]), finished=_i(v["finished"]),
            deadline=_i(v["deadline"]), worker=_s(v["worker"]), error=_s(v["error"]),
            cancel_requested=v["cancel"] is not None, traceback=_s(v["traceback"]),
        )

    # -- waiting -------------------------------------------------------------------
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

    @staticmethod
    def _check_start(start: int) -> None:
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ConfigError(f"start must be a token index >= 0, got {start!r}")

    def _take_outcome(self) -> tuple[Event | None, int | None]:
        """What result() starts from: the outcome if the inbox holds it, else the epoch
        this client submitted the task under (None: not known, read the stored state).
        Either way the outcome is taken by this call: a later one reads it."""
        kept = self.queue.hub.take(self.queue.name, self.id)
        since = self._epoch if kept is None else None
        self._epoch = None
        return (kept if isinstance(kept, Event) else None), since

    def _unbroken(self, state: StreamState, epoch: int) -> list[Event] | None:
        """With this task's feed open: if this client created the task and its reply
        subscription has not been lost since, every event of the task reached or will
        reach the feed or the inbox, so the stored state need not be read. Returns the
        events of an outcome that reached the inbox meanwhile ([] for none yet), or
        None: read the stored state. ``epoch``: the task's, taken by the caller."""
        hub = self.queue.hub
        kept = hub.take(self.queue.name, self.id)
        if hub.epoch(self.queue.name) != epoch or isinstance(kept, str):
            return None
        return [] if kept is None else state.accept(kept)[0]

    def _await_own(self, epoch: int, timeout: float | None
                   ) -> tuple[Event | None, float | None]:
        """result()'s short way for a task this client submitted (``epoch``: the task's,
        taken by the caller): with its one-shot feed open and the reply subscription
        unbroken since the submit (see :meth:`_unbroken`), its terminal event is in the
        inbox or on its way to the feed. Returns (that event, None), or (None, the
        timeout left) for the long way (:meth:`events`, from the stored state): the
        subscription broke, the result is too large to ride in the message, or nothing
        came in RESYNC_S (the long way's safety net) or the timeout."""
        feed, start = OneShot((self.queue.name, self.id)), time.monotonic()
        try:
            going, item = self._open_own(feed, epoch)
            if going and item is None:
                item = self.queue.hub.read_own(feed, _own_wait(timeout))
        finally:
            self.queue.hub.close(feed)
        return self._own_outcome(item if going else None, timeout, start)

    def _open_own(self, feed: Feed, epoch: int) -> tuple[bool, Event | str | None]:
        """Open the short way's ``feed``: (whether the short way goes on, the outcome the
        inbox held, None for none yet)."""
        hub, name = self.queue.hub, self.queue.name
        hub.open(feed)
        item = hub.take(name, self.id)
        return hub.epoch(name) == epoch and not isinstance(item, str), item

    @staticmethod
    def _own_outcome(item: Event | str | None, timeout: float | None, start: float
                     ) -> tuple[Event | None, float | None]:
        """What the short way ends with (see :meth:`_await_own`)."""
        if isinstance(item, Event) and item.terminal and item.data is not FETCH:
            return item, None
        return None, None if timeout is None else max(0.0, timeout - (time.monotonic() - start))

    def _given(self, exc: ResultTimeout, timeout: float | None) -> ResultTimeout:
        """``exc`` as the caller's timeout, not what the long way had left of it."""
        return ResultTimeout(self.id, timeout or 0.0, exc.status)

    def events(self, timeout: float | None = None, *, tokens: bool = True, start: int = 0,
               idle: float | None = None, fail_fast: bool = False,
               _since: int | None = None, _ends: bool = False) -> Iterator[Event]:
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
        self._check_start(start)
        if _since is None:  # (_since: the task's epoch, from result())
            self._epoch = None  # this reader may take the outcome: later ones read it
        hub = self.queue.hub
        self.queue.reply_channel()
        state = StreamState(self.id, tokens, start)
        feed = SyncFeed((self.queue.name, self.id), fail_fast, _ends)
        pace = Pacer(timeout, idle)
        hub.open(feed)
        try:
            first = None if _since is None else self._unbroken(state, _since)
            yield from pace.handed(first if first is not None else
                                   self._snapshot(state, fail_fast))
            while not state.done:
                wait = pace.wait()
                if wait is None:
                    raise self._timeout(timeout)
                item = feed.get(wait)
                if item is None:  # quiet: keep-alive tick, or the safety net's read
                    quiet = pace.quiet()
                    if quiet == "idle":
                        yield Event("idle", self.id)
                    elif quiet == "read":
                        yield from pace.handed(self._snapshot(state, fail_fast))
                    continue
                pace.item()
                if isinstance(item, str):  # reconnected (or, fail-fast, lost): read
                    yield from pace.handed(self._snapshot(state, fail_fast))
                    continue
                out, again = state.accept(item)
                yield from pace.handed(out)
                if again:
                    yield from pace.handed(self._snapshot(state, fail_fast))
        finally:
            hub.close(feed)

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

    def result(self, timeout: float | None = None) -> Any:
        """Wait for the task to finish and return its result.

        Waits for the completion event on this client's reply subscription (no
        polling). A task this client submitted costs no round trip at all: its
        outcome is taken from the client's inbox of outcomes nobody waited for if it
        already came (a loop collecting many results; mtq.replies.Hub.take), else
        awaited, as long as the subscription was never lost since the submit. Any
        other task's stored state is read first (one round trip), so a completion
        that happened before the call is not missed. Raises TaskFailed (failed, dead,
        expired), TaskCancelled, ResultTimeout, TaskNotFound, BrokerError.
        """
        if self._cached is not None:  # answered from the result cache at submit
            return serialization.loads(self._cached)
        hub = self.queue.hub
        kept, since = self._take_outcome()
        if kept is not None:
            return self._outcome(kept)
        left = timeout
        if since is not None:
            ev, left = self._await_own(since, timeout)
            if ev is not None:
                return self._outcome(ev)
            since = None  # the long way reads the stored state first
        try:
            for ev in self.events(left, tokens=False, _since=since, _ends=True):
                if ev.terminal:
                    hub.take(self.queue.name, self.id)  # if it also came with nobody waiting
                    return self._outcome(ev)
        except ResultTimeout as exc:
            if left is timeout:
                raise
            raise self._given(exc, timeout) from None
        raise AssertionError("unreachable: events() ends with a terminal event")

    async def aevents(self, timeout: float | None = None, *, tokens: bool = True,
                      start: int = 0, idle: float | None = None, fail_fast: bool = False,
                      _since: int | None = None, _ends: bool = False
                      ) -> AsyncIterator[Event]:
        """:meth:`events` for asyncio (the Redis reads run in a thread)."""
        self._check_start(start)
        if _since is None:  # (_since: the task's epoch, from result())
            self._epoch = None  # this reader may take the outcome: later ones read it
        hub = self.queue.hub
        if not hub.epoch(self.queue.name):  # not subscribed yet (a call that may block)
            await asyncio.to_thread(self.queue.reply_channel)
        state = StreamState(self.id, tokens, start)
        feed = AsyncFeed((self.queue.name, self.id), asyncio.get_running_loop(), fail_fast,
                         _ends)
        pace = Pacer(timeout, idle)
        hub.open(feed)
        try:
            first = None if _since is None else self._unbroken(state, _since)
            if first is None:
                first = await asyncio.to_thread(self._snapshot, state, fail_fast)
            for ev in pace.handed(first):
                yield ev
            while not state.done:
                wait = pace.wait()
                if wait is None:
                    raise await asyncio.to_thread(self._timeout, timeout)
                item = await feed.get(wait)
                out: list[Event] = []
                if item is None:
                    quiet = pace.quiet()
                    if quiet == "idle":
                        out = [Event("idle", self.id)]
                    elif quiet == "read":
                        out = await asyncio.to_thread(self._snapshot, state, fail_fast)
                else:
                    pace.item()
                    again = isinstance(item, str)
                    if not isinstance(item, str):
                        out, again = state.accept(item)
                    if again:
                        out = out + await asyncio.to_thread(self._snapshot, state, fail_fast)
                for ev in pace.handed(out):
                    yield ev
        finally:
            hub.close(feed)

    async def atokens(self, timeout: float | None = None) -> AsyncIterator[Any]:
        """:meth:`tokens` for asyncio."""
        async for ev in self.aevents(timeout):
            if ev.kind == "token":
                yield ev.data
            elif ev.terminal:
                self._outcome(ev)

    async def aresult(self, timeout: float | None = None) -> Any:
        """:meth:`result` for asyncio."""
        if self._cached is not None:
            return serialization.loads(self._cached)
        hub = self.queue.hub
        kept, since = self._take_outcome()
        if kept is not None:
            return self._outcome(kept)
        left = timeout
        if since is not None:  # the short way, as result() takes it
            ev, left = await self._await_own_async(since, timeout)
            if ev is not None:
                return self._outcome(ev)
            since = None
        try:
            async for ev in self.aevents(left, tokens=False, _since=since, _ends=True):
                if ev.terminal:
                    hub.take(self.queue.name, self.id)  # if it also came with nobody waiting
                    return self._outcome(ev)
        except ResultTimeout as exc:
            if left is timeout:
                raise
            raise self._given(exc, timeout) from None
        raise AssertionError("unreachable: aevents() ends with a terminal event")

    async def _await_own_async(self, epoch: int, timeout: float | None
                               ) -> tuple[Event | None, float | None]:
        """:meth:`_await_own` for asyncio (a future of the running loop)."""
        feed = AsyncOneShot((self.queue.name, self.id), asyncio.get_running_loop())
        start = time.monotonic()
        try:
            going, item = self._open_own(feed, epoch)
            if going and item is None:
                item = await feed.get(_own_wait(timeout))
        finally:
            self.queue.hub.close(feed)
        return self._own_outcome(item if going else None, timeout, start)

    # -- callbacks -----------------------------------------------------------------
    def add_done_callback(self, fn: Callable[[Task, Event], None], *, _known: bool = False
                          ) -> None:
        """Call ``fn(task, event)`` once with the task's terminal event, on this
        client's callback thread (keep it short; it never blocks event delivery).
        Registered after the task ended, it is called at once. Exceptions it raises
        are logged."""
        self._epoch = None  # the callback takes the outcome: a later result() reads it
        self.queue.reply_channel()
        self.queue.hub.add_callback(CallbackFeed(self, fn), known=_known)

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
                try:
                    task._outcome(ev)
                except TaskFailed as exc:
                    fn(task, exc)
        self.add_done_callback(done)
        return self

    def trace(self) -> list[TraceEntry]:
        """The task's life, oldest first: queued, started (delivery, worker), retry,
        restarted, released, cancel requested, and how it ended. Kept as long as
        the task. Raises TaskNotFound."""
        entries = [TraceEntry(ts / 1000, kind, detail)
                   for ts, kind, detail in self.queue.broker.trace(self.id)]
        if not entries:
            self.status()  # raises TaskNotFound if it does not exist
        return entries

    def cancel(self) -> bool:
        """Cancel the task. Returns True if it is cancelled now (it was waiting),
        False if it is running and its worker has been asked to stop it.
        Raises TaskNotFound, or TaskFailed-free: a finished task returns False."""
        code, _status = self.queue.broker.cancel(self.id)
        if code == Code.NOT_FOUND:
            raise self._not_found()
        return code == 1


class Queue:
    """A named queue: submit tasks, look them up, read its counters.

    ``url`` defaults to ``MTQ_REDIS_URL``, else the embedded server. Its settings are
    the queue's, stored in Redis (``mtq queue config``, :meth:`configure`) and read
    again every few seconds; keyword overrides (``Queue("embed", max_length=10_000)``)
    change some for this object only, and a :class:`QueueSettings` given as
    ``settings`` fixes them all (nothing is read). Unknown names raise ConfigError.
    """

    def __init__(self, name: str, url: str | None = None, *,
                 settings: QueueSettings | None = None, client: redis.Redis | None = None,
                 **overrides: Any) -> None:
        self.name = check_queue_name(name)
        spec: SettingsSpec = overrides or None
        if settings is not None:
            spec = settings.replace(**overrides) if overrides else settings
        # a cluster's client for the queue's slot (mtq.broker.cluster); else the client
        self.redis = for_queue(client if client is not None else connect(url), self.name)
        self.broker = Broker(self.redis, self.name, SettingsSource.shared(self.redis, self.name,
                                                                   spec))
        self._registered = False
        self._hub: Hub | None = None
        self._reply: str | None = None

    @property
    def settings(self) -> QueueSettings:
        """The queue's settings as this object uses them now."""
        return self.broker.settings

    def configure(self, **changes: Any) -> QueueSettings:
        """Store settings of the queue in Redis, for every producer and worker (they
        read them within REFRESH_S seconds); returns the queue's stored settings.
        Raises ConfigError, storing nothing, for an unknown key or a bad value.
        ``mtq queue config Q KEY VALUE`` does the same."""
        from mtq.broker import config

        stored = config.store(self.redis, self.name, changes)
        self.broker.source.refresh()
        return stored

    @property
    def hub(self) -> Hub:
        """The reply listener this queue's client shares with every queue on it."""
        hub = self._hub
        if hub is None or hub.closed:  # (a closed hub is replaced by hub_of)
            hub = self._hub = hub_of(self.redis)
        return hub

    def reply_channel(self) -> str:
        """This client's reply channel on the queue, subscribed (once per process)."""
        if self._reply is None:
            self._reply = self.hub.channel(self.name)
        return self._reply

    def __repr__(self) -> str:
        return f"<Queue {self.name}>"

    def _new(self, payload: Any, stream: str | None, key: str | None, ttl: float | None,
             retries: int | None, task_id: str | None, cache: bool = True) -> NewTask:
        data = serialization.dumps(payload)
        settings = self.settings
        if len(data) > settings.max_payload_bytes:
            raise PayloadTooLarge(
                f"payload is {len(data)} bytes encoded, over this queue's max_payload_bytes "
                f"({self.settings.max_payload_bytes}); send a reference (a URL or a key) "
                "instead, or raise max_payload_bytes"
            )
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float))
                                or not 0 < ttl <= MAX_TTL_S):
            raise ConfigError(f"ttl must be a number of seconds in (0, {MAX_TTL_S:.0e}], "
                              f"got {ttl!r}")
        if retries is not None and (isinstance(retries, bool) or not isinstance(retries, int)
                                    or not 0 <= retries <= MAX_RETRIES):
            raise ConfigError(f"retries must be an integer in [0, {MAX_RETRIES}], got "
                              f"{retries!r}")
        return NewTask(
            id=check_task_id(task_id) if task_id is not None else new_task_id(),
            own_id=task_id is None,
            payload=data,
            stream=check_stream_name(stream) if stream is not None else "",
            key=check_stream_name(key, "idempotency key") if key is not None else "",
            ttl_ms=max(1, int(ttl * 1000)) if ttl is not None else 0,
            retries=retries,
            digest=cache_digest(payload, data) if cache and settings.cache_ttl_s > 0 else "",
        )

    def _send(self, tasks: list[NewTask]) -> list[Task]:
        if tracing.api() is not None:  # cached: one check without OpenTelemetry
            return tracing.traced_submit(self.name, tasks, self._send_tasks)
        return self._send_tasks(tasks)

    def _send_tasks(self, tasks: list[NewTask]) -> list[Task]:
        if not self._registered:
            self.broker.register()
            self._registered = True
        reply = self.reply_channel()
        epoch = self.hub.epoch(self.name)  # before the submit: see Task._unbroken
        out: list[Task] = []
        duplicates: list[str] = []
        unconfirmed = -1  # the fewest replicas that confirmed a chunk, when too few
        for start in range(0, len(tasks), SUBMIT_CHUNK):
            chunk = tasks[start:start + SUBMIT_CHUNK]
            answer, acks = self._submit_chunk(chunk, reply)
            if answer and answer[0] == Code.QUEUE_FULL:  # only ever [QUEUE_FULL, waiting]
                waiting = answer[1] if isinstance(answer[1], int) else 0
                full = QueueFull(self.name, waiting, self.settings.max_length, len(chunk))
                full.created = out  # earlier chunks went in
                raise full
            for item, value in zip(chunk, answer):
                if value == Code.DUPLICATE_ID:
                    duplicates.append(item.id)
                elif isinstance(value, tuple):  # a result cache hit
                    out.append(Task(self, value[0], value[1]))
                else:  # its own id: a new task (not one an idempotency key names)
                    tid = str(value)
                    out.append(Task(self, tid, epoch=epoch if tid == item.id else None))
            if 0 <= acks < self.settings.durable_replicas:
                unconfirmed = acks if unconfirmed < 0 else min(unconfirmed, acks)
        if unconfirmed >= 0:
            s = self.settings
            nd = NotDurable(self.name, unconfirmed, s.durable_replicas, s.durable_timeout_ms)
            nd.created = out
            raise nd
        if duplicates:
            dup = DuplicateTask(f"task id(s) {', '.join(map(repr, duplicates[:5]))} already "
                                f"exist in queue {self.name!r}; the other tasks were submitted "
                                "(see .created); use new ids or Queue.task(id)")
            dup.created, dup.duplicates = out, duplicates
            raise dup
        return out

    def _submit_chunk(self, chunk: list[NewTask], reply: str) -> tuple[list[Submitted], int]:
        """One submit call, retried while Redis cannot be reached. The call is sent once
        per try, never repeated by the connection; after a retry, the tasks a lost try
        already wrote are recognised (see :meth:`_written`), so a reset yields neither a
        ghost nor a duplicate. Returns the answer and, for a durable queue, how many
        replicas confirmed it (-1 otherwise). Raises RedisUnavailable after
        SUBMIT_RETRY_S."""
        backoff = Backoff()
        start = time.monotonic()
        retried = False
        acks = -1
        answer: list[Submitted]
        while True:
            try:
                sent: Answer
                if self.settings.durable_replicas:
                    sent, acks = self.broker.submit_durable(chunk, reply)
                else:
                    sent = self.broker.submit(chunk, reply)
                answer = sent
                if sent.handed:
                    # Redis woke a sleeping worker with these tasks as it answered: if it
                    # shares this CPU, it runs them before this thread's bookkeeping
                    # (docs/architecture.md, "Direct delivery")
                    lane.sched_yield()
                break
            except RedisUnavailable as exc:
                # a cluster's or a sentinel's client: long enough for a failover
                limit = SUBMIT_RETRY_HA_S if getattr(self.redis, "mtq_url", None) \
                    else SUBMIT_RETRY_S
                if time.monotonic() - start > limit:
                    err = RedisUnavailable(
                        f"{exc}; the {len(chunk)} task(s) of this submit may or may not be "
                        "queued: their ids are in .task_ids, and submitting them again "
                        "with the same ids (Request(id=...)) is safe")
                    err.task_ids = [t.id for t in chunk]  # type: ignore[attr-defined]
                    raise err from exc
                retried = True
                time.sleep(backoff.next())
        if retried:
            answer = self._written(chunk, answer, reply)
        return answer, acks

    def _written(self, chunk: list[NewTask], answer: list[Submitted], reply: str
                 ) -> list[Submitted]:
        """Correct the answer of a retried submit for what the lost try wrote: a task it
        created comes back as a duplicate (or, if it filled the queue, the whole chunk
        as queue-full). A duplicate is this call's own if its id was generated here
        (96 random bits), or if the stored task names this client's reply channel and
        holds the very same payload (a task this client merely watched, or submitted
        before with another payload, stays a duplicate)."""
        full = bool(answer) and answer[0] == Code.QUEUE_FULL
        doubtful = range(len(chunk)) if full else \
            [i for i, v in enumerate(answer) if v == Code.DUPLICATE_ID]
        if not doubtful:
            return answer
        keys = self.broker.keys
        with redis_errors("while checking a retried submit"):
            pipe = self.redis.pipeline(transaction=False)
            for i in doubtful:
                pipe.hmget(keys.task(chunk[i].id), "reply", "payload")
                if chunk[i].key:
                    pipe.get(keys.idem(chunk[i].key))
            rows = iter(pipe.execute())
        mine: dict[int, str] = {}
        for i in doubtful:
            stored, payload = next(rows)
            idem = next(rows) if chunk[i].key else None
            if stored is not None and (chunk[i].own_id or (
                    reply in stored.decode().split() and payload == chunk[i].payload)):
                mine[i] = chunk[i].id
            elif chunk[i].key and idem is not None:
                mine[i] = idem.decode()
        if full:
            if not any(v == chunk[i].id for i, v in mine.items()):
                return answer  # the queue really is full: nothing of this chunk was written
            return [mine.get(i, Code.DUPLICATE_ID) for i in range(len(chunk))]
        out = list(answer)
        for i, task_id in mine.items():
            if task_id == chunk[i].id:
                out[i] = task_id
        return out

    def submit(self, payload: Any, *, stream: str | None = None, key: str | None = None,
               ttl: float | None = None, retries: int | None = None,
               id: str | None = None, cache: bool = True) -> Task:
        """Submit one task (one round trip) and return its handle.

        ``stream``: tasks of one stream run one at a time in submit order.
        ``key``: idempotency key; within the window, the same key returns the same task.
        ``ttl``: seconds after which the task, if not started, ends expired unrun.
        ``retries``: retries after a handler error (default: the queue's max_retries).
        ``cache=False``: bypass the queue's result cache (when ``cache_ttl_s`` > 0, an
        identical earlier request's result, or an identical task still running,
        otherwise answers it; see docs/operations.md).
        Raises InvalidName, PayloadTooLarge, EncodeError, QueueFull, DuplicateTask,
        BrokerError.
        """
        return self._send([self._new(payload, stream, key, ttl, retries, id, cache)])[0]

    def submit_many(self, items: Iterable[Any], *, stream: str | None = None,
                    ttl: float | None = None, retries: int | None = None,
                    cache: bool = True) -> list[Task]:
        """Submit many tasks, up to 1 000 per round trip, and return their handles.

        Items are payloads, or :class:`Request` objects for per-task options
        (their fields override the keyword defaults). Every item is validated and
        encoded before anything is sent; with max_length set, each chunk of up to
        1 000 is admitted whole or refused whole (QueueFull). ``cache=False`` (or a
        Request's ``cache=False``) bypasses the result cache.
        """
        tasks = self.prepare(items, stream=stream, ttl=ttl, retries=retries, cache=cache)
        return self.send(tasks) if tasks else []

    def prepare(self, items: Iterable[Any], *, stream: str | None = None,
                ttl: float | None = None, retries: int | None = None,
                cache: bool = True) -> list[NewTask]:
        """Validate and encode items for :meth:`send` (ids are chosen here)."""
        tasks = []
        for item in items:
            if isinstance(item, Request):
                tasks.append(self._new(
                    item.payload, item.stream if item.stream is not None else stream, item.key,
                    item.ttl if item.ttl is not None else ttl,
                    item.retries if item.retries is not None else retries, item.id,
                    cache and item.cache))
            else:
                tasks.append(self._new(item, stream, None, ttl, retries, None, cache))
        return tasks

    def send(self, tasks: list[NewTask]) -> list[Task]:
        """Submit prepared tasks (see :meth:`submit_many`)."""
        return self._send(tasks)

    def group(self) -> Group:
        """A new :class:`~mtq.group.Group` on this queue: callbacks over many tasks."""
        from mtq.group import Group

        return Group(self)

    def task(self, task_id: str) -> Task:
        """A handle on an existing task by id (not checked until used)."""
        return Task(self, check_task_id(task_id))

    def stats(self) -> dict[str, int]:
        """O(1) counters: waiting, running, delayed, dead, streams, totals."""
        return self.broker.stats()

    # -- maintenance -----------------------------------------------------------------
    def delete(self, *, force: bool = False) -> int:
        """Delete the queue: every task (waiting, running, finished, dead), its
        streams, counters, settings and timelines, and its name in the list of queues
        (``mtq status``). Raises QueueInUse while live workers serve it, unless
        ``force``. A submit made while it runs may be lost with the rest: stop the
        queue's producers first. A later submit creates the queue anew. Deletes in
        chunks (SCAN and UNLINK), so Redis is never blocked for long. Returns how
        many keys were deleted."""
        from mtq.workers.registry import list_workers

        serving = [w["id"] for w in list_workers(self.redis, self.name)]
        if serving and not force:
            raise QueueInUse(self.name, serving)
        return self.broker.delete_queue()

    def purge(self) -> int:
        """Drop every waiting task (each ends cancelled with the error 'purged'; a
        client waiting on one is told). Running tasks, retries waiting for their
        delay and dead letters stay. Works in chunks of 1000, so Redis is never
        blocked for long. Returns how many were dropped."""
        total, more = 0, True
        while more:
            n, more = self.broker.purge(PURGE_CHUNK)
            total += n
        return total

    def dead_letters(self, start: int = 0, count: int = 20) -> list[dict[str, Any]]:
        """Dead letters, newest first: id, stream, error, attempts, deliveries,
        created and finished (ms since the epoch), and traceback (or None)."""
        return self.broker.dead_letters(start, count)

    def retry_dead(self, ids: Iterable[str] | None = None) -> int:
        """Queue dead letters again (``ids``, or all of them): each goes to the tail
        of its stream with its attempts reset. Returns how many were queued."""
        return self._dlq("retry", ids)

    def purge_dead(self, ids: Iterable[str] | None = None) -> int:
        """Delete dead letters (``ids``, or all of them). Returns how many."""
        return self._dlq("purge", ids)

    def _dlq(self, action: str, ids: Iterable[str] | None) -> int:
        if ids is not None:
            chosen = [check_task_id(i) for i in ids]
            return sum(self.broker.dlq(action, chosen[k:k + PURGE_CHUNK])[0]
                       for k in range(0, len(chosen), PURGE_CHUNK))
        total, more = 0, True
        while more:
            n, more = self.broker.dlq(action, (), PURGE_CHUNK)
            total += n
        return total
