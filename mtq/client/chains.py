"""Chains on the client side: :class:`Step` (what follows a task, and how its payload
is built from the previous result), the checks a chain passes before anything is
written (:func:`prepare`), and :class:`Chain`, a handle on every step of one chain
(status, result, events and tokens through every step, cancel). The hand-off itself
is the worker's: :mod:`mtq.broker.chains`. See docs/streaming.md, "Chains"."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from mtq import serialization
from mtq.broker import chains
from mtq.broker.cluster import shared
from mtq.broker.connection import Backoff, redis_errors
from mtq.broker.records import NewTask
from mtq.client.replies.events import Event
from mtq.client.replies.feeds import AsyncFeed, SyncFeed
from mtq.client.submit import TIMEOUT_HINT, check_retries, check_seconds
from mtq.errors import (
    ChainError,
    ChainFailed,
    ConfigError,
    MtqError,
    ResultTimeout,
    TaskCancelled,
    TaskFailed,
    TaskNotFound,
)
from mtq.validation import check_priority, check_queue_name, check_stream_name, check_tenant

#: how often, at most, a reader waiting for a step not submitted yet looks whether it
#: is (s); an event of the step wakes it at once
LOOK_MAX_S = 1.0


@dataclass(frozen=True)
class Step:
    """A step of a chain (``Queue.submit(..., then=[Step(...), ...])``): a task on
    ``queue`` submitted when the step before it succeeds. Its payload is built from
    that step's result, as data: the result itself by default; ``pick="key"`` takes
    one key of a dict result; ``field="text"`` puts the (picked) value under that key
    of ``payload`` (a dict, default ``{}``). ``stream`` defaults to the chain's first
    task's stream, ``tenant`` and ``priority`` to its own; ``ttl``, ``timeout`` and
    ``retries`` are the step's as for a submit; ``deadline`` (seconds from the chain's
    submit, or an aware datetime): past it, the step ends expired unrun."""

    queue: str
    payload: Any = None
    field: str | None = None
    pick: str | None = None
    stream: str | None = None
    tenant: str | None = None
    priority: str | None = None
    timeout: float | None = None
    ttl: float | None = None
    deadline: float | datetime | None = None
    retries: int | None = None


def _ms(name: str, value: Any, where: str, hint: str = "") -> int:
    """A step's ttl, timeout or deadline in ms, checked as a submit's (ChainError)."""
    try:
        return max(1, int(check_seconds(name, value, hint) * 1000))
    except ConfigError as exc:
        raise ChainError(f"{where}: {exc}") from None


def _spec(step: Step | str, index: int, stream: str, tenant: str, band: str) -> dict[str, Any]:
    """One step checked and turned into its spec (see mtq.broker.chains). Raises
    ChainError, EncodeError."""
    if isinstance(step, str):
        step = Step(step)
    if not isinstance(step, Step):
        raise ChainError(f"then= takes Step objects or queue names, got {step!r} at "
                         f"step {index}")
    where = f"step {index} ({step.queue!r})"
    try:
        queue = check_queue_name(step.queue)
        spec: dict[str, Any] = {
            "q": queue,
            "s": check_stream_name(step.stream) if step.stream is not None else stream,
            "t": check_tenant(step.tenant) if step.tenant is not None else tenant,
            "b": check_priority(step.priority) if step.priority is not None else band,
        }
    except MtqError as exc:
        raise ChainError(f"{where}: {exc}") from exc
    for name in ("field", "pick"):
        v = getattr(step, name)
        if v is not None and (not isinstance(v, str) or not v):
            raise ChainError(f"{where}: {name} must be a non-empty string (a key of a "
                             f"dict), got {v!r}")
    if step.payload is not None and step.field is None:
        raise ChainError(f"{where}: a payload needs field= (the key its previous "
                         "result goes under); without payload, the previous result is "
                         "the payload")
    if step.field is not None and step.payload is not None and not isinstance(step.payload, dict):
        raise ChainError(f"{where}: field= puts the previous result into payload, which "
                         f"must then be a dict, got {type(step.payload).__name__}")
    if step.payload is not None:
        serialization.dumps(step.payload)  # EncodeError now, not at the hand-off
    spec.update(p=step.payload, f=step.field, k=step.pick)
    if step.ttl is not None:
        spec["l"] = _ms("ttl", step.ttl, where)
    if step.timeout is not None:
        spec["o"] = _ms("timeout", step.timeout, where, TIMEOUT_HINT)
    if step.retries is not None:
        try:
            spec["y"] = check_retries(step.retries)
        except ConfigError as exc:
            raise ChainError(f"{where}: {exc}") from None
    if step.deadline is not None:
        d = step.deadline
        if isinstance(d, datetime):
            if d.tzinfo is None or d.utcoffset() is None:
                raise ChainError(f"{where}: deadline is a naive datetime: give it a time "
                                 "zone")
            spec["d"] = int(d.astimezone(timezone.utc).timestamp() * 1000)
        else:
            spec["d"] = int(time.time() * 1000) + _ms("deadline", d, where)
    return spec


def prepare(task: NewTask, then: Sequence[Step | str], first_queue: str) -> NewTask:
    """``task`` (the chain's first, validated) with its chain fields, every step
    checked. Raises ChainError (or EncodeError) before anything is written."""
    if isinstance(then, (str, Step)) or not isinstance(then, Sequence) or not then:
        raise ChainError(f"then= takes a non-empty list of steps (Step objects or queue "
                         f"names), got {then!r}")
    if len(then) + 1 > chains.MAX_STEPS:
        raise ChainError(f"a chain has at most {chains.MAX_STEPS} steps (its first task "
                         f"included), got {len(then) + 1}")
    if len(task.id) > chains.MAX_CHAIN_ID:
        raise ChainError(f"a chain's first task id is at most {chains.MAX_CHAIN_ID} "
                         f"characters (its steps' ids add '-<step>'), got {len(task.id)}")
    if task.delay_ms:
        raise ChainError("a chain's first task cannot be delayed (delay/at): submit it "
                         "when it is due, or give its first step the delay's work")
    specs = [_spec(s, i + 1, task.stream, task.tenant, task.band) for i, s in enumerate(then)]
    queues = [first_queue] + [s["q"] for s in specs]
    return dataclasses.replace(task, digest="", chain=chains.info(task.id, 0, queues),
                               then=serialization.dumps(specs))


#: the reply epochs of chains this process submitted, by (hub id, chain id): their
#: steps' events come to this client, so a wait needs no read (see Chain.result)
_OWN: collections.OrderedDict[tuple[str, str], dict[str, int]] = collections.OrderedDict()
_OWN_MAX = 10_000
_own_lock = threading.Lock()


def remember(hub_id: str, chain_id: str, epochs: dict[str, int]) -> None:
    with _own_lock:
        _OWN[(hub_id, chain_id)] = epochs
        while len(_OWN) > _OWN_MAX:
            _OWN.popitem(last=False)


@dataclass(frozen=True)
class StepStatus:
    """One step as :meth:`Chain.steps` reads it: ``status`` is ``pending`` for a step
    not submitted yet."""

    step: int
    queue: str
    id: str
    status: str
    error: str | None = None


class Chain:
    """Every step of one chain (``Task.chain()``): its tasks, their status, the last
    step's result, every step's events and tokens in order, and cancel."""

    def __init__(self, first: Any, chain_id: str, queues: list[str]) -> None:
        self.id = chain_id
        self.queues = queues
        client = shared(first.queue.redis)  # (a cluster's: a slot's client is one slot's)
        qs = {first.queue.name: first.queue}
        for name in queues:
            if name not in qs:
                # a Queue like the task's (queue.py imports this module)
                qs[name] = type(first.queue)(name, client=client)
        #: a handle on each step's task (those not submitted yet too)
        #: the task class (mtq.client.task.Task, which imports this module lazily)
        self._make = make = type(first)
        self.tasks = [make(qs[q], chains.step_id(chain_id, i)) for i, q in enumerate(queues)]
        #: whose entry in _OWN holds the reply epochs this client submitted the chain
        #: under, if it did; the first wait takes them (see _take_own)
        self._own_key = (self.tasks[0].queue.hub.id, chain_id)
        #: its queues' replies all come to one hub (not so on a cluster, where each
        #: queue's slot has a client of its own)
        self._one_hub = len({id(t.queue.hub) for t in self.tasks}) == 1

    def __repr__(self) -> str:
        return f"<Chain {self.id}: {' -> '.join(self.queues)}>"

    def __len__(self) -> int:
        return len(self.tasks)

    # -- reading ---------------------------------------------------------------------
    def _fields(self, i: int, *names: str) -> list[Any]:
        t = self.tasks[i]
        with redis_errors():
            return list(t.queue.redis.hmget(t.queue.broker.keys.task(t.id), names))

    def steps(self) -> list[StepStatus]:
        """Every step: its index, queue, task id and status (``pending``: not submitted
        yet), and the error of one that failed. One read per step."""
        out = []
        for i, t in enumerate(self.tasks):
            status, error, chainerr = self._fields(i, "status", "error", "chainerr")
            out.append(StepStatus(i, t.queue.name, t.id,
                                  status.decode() if status else "pending",
                                  (error or chainerr or b"").decode() or None))
        return out

    def status(self, steps: list[StepStatus] | None = None) -> str:
        """The chain's state: ``succeeded`` (its last step did), ``failed`` /
        ``cancelled`` / ``dead`` / ``expired`` (a step ended so, or its payload could
        not be built: ``failed``), else ``running``. ``steps``: what :meth:`steps`
        just gave, not read again."""
        for i, s in enumerate(self.steps() if steps is None else steps):
            if s.status == "pending":
                if i > 0:
                    stop, err, end = self._fields(i - 1, "chainstop", "chainerr", "chainend")
                    if stop:
                        return "cancelled"
                    if err:
                        return (end or b"failed").decode()
                return "running"
            if s.status in ("failed", "dead", "cancelled", "expired"):
                return s.status
            if s.status != "succeeded":
                return "running"
        return "succeeded"

    def _stopped(self, i: int) -> None:
        """Raise ChainFailed if step ``i`` (not submitted) never will be: the chain was
        cancelled, or its payload could not be built; TaskNotFound if it was submitted
        and is gone (deleted with its queue, its retention over)."""
        p, t = self.tasks[i - 1], self.tasks[i]
        keys = p.queue.broker.keys
        with redis_errors():
            pipe = p.queue.redis.pipeline(transaction=False)
            pipe.hmget(keys.task(p.id), ("status", "chainstop", "chainerr", "chainend"))
            pipe.zscore(keys.handoffs, p.id)
            (status, stop, err, end), record = pipe.execute()
        if status is None:
            raise TaskNotFound(f"step {i - 1} of chain {self.id} is gone (its retention "
                               f"ran out) and step {i} ({t.id}) was never submitted")
        if stop:
            raise ChainFailed(i, t.queue.name, t.id, "cancelled", "the chain was cancelled")
        if err:
            raise ChainFailed(i, t.queue.name, t.id, (end or b"failed").decode(), err.decode())
        # succeeded with no hand-off left to make (ack.lua records it in the call that
        # ends the step; it goes once the step is submitted): a step not there now was
        # submitted and is gone, or a worker without chains acked the step before it
        if status == b"succeeded" and record is None and not self._exists(i):
            raise TaskNotFound(f"step {i} of chain {self.id} ({t.id}, queue "
                               f"{t.queue.name!r}) is gone: it was submitted and its "
                               "queue was deleted or its retention ran out (or a worker "
                               f"without chains ran step {i - 1})")

    def _exists(self, i: int) -> bool:
        t = self.tasks[i]
        with redis_errors():
            return bool(t.queue.redis.exists(t.queue.broker.keys.task(t.id)))

    def _submitted(self, i: int) -> bool:
        """Whether step ``i`` is submitted; raises as :meth:`_stopped` when it never
        will be."""
        if self._exists(i):
            return True
        self._stopped(i)
        return False

    def _await_submitted(self, i: int, deadline: float | None) -> None:
        """Wait until step ``i`` is submitted: woken by any event of it on this client's
        reply subscription, and looking at most every LOOK_MAX_S (a follower whose
        channel the hand-off did not carry hears nothing). Raises ChainFailed,
        ResultTimeout."""
        t = self.tasks[i]
        t.queue.reply_channel()
        hub = t.queue.hub
        feed = SyncFeed((t.queue.name, t.id))
        hub.open(feed)
        backoff = Backoff()
        try:
            while not self._submitted(i):
                feed.get(_look_wait(backoff, deadline, t.id))
        finally:
            hub.close(feed)

    @staticmethod
    def _left(deadline: float | None) -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def _failed(self, i: int, exc: TaskFailed) -> ChainFailed:
        t = self.tasks[i]
        return ChainFailed(i, t.queue.name, t.id, exc.status, exc.error, exc)

    def _take_own(self) -> dict[str, int] | None:
        """The reply epochs this client submitted the chain under, taken: only the first
        wait may expect the steps' outcomes in the inbox or on their way (as
        Task.result takes its own); None for a chain this client did not submit."""
        with _own_lock:
            own = _OWN.pop(self._own_key, None)
        return own if self._one_hub else None

    def _step_result(self, i: int, deadline: float | None,
                     epochs: dict[str, int] | None) -> Any:
        t = self.tasks[i]
        # not the first step's: its handle may have taken its outcome (task.result())
        epoch = epochs.get(t.queue.name) if epochs and i > 0 else None
        try:
            try:  # this client's own chain: the step's outcome comes here, no read
                return self._make(t.queue, t.id, epoch=epoch).result(self._left(deadline))
            except TaskNotFound:
                if i == 0:
                    raise
            self._await_submitted(i, deadline)
            return self._make(t.queue, t.id).result(self._left(deadline))
        except ChainFailed:
            raise
        except TaskFailed as exc:
            raise self._failed(i, exc) from exc

    def result(self, timeout: float | None = None) -> Any:
        """Wait through every step and return the last one's result. Raises
        ChainFailed naming the step that did not succeed (a TaskFailed: ``status``,
        ``error``, and ``step``, ``queue``, ``task_id``), ResultTimeout, TaskNotFound."""
        deadline = None if timeout is None else time.monotonic() + timeout
        epochs = self._take_own()
        value = None
        try:
            for i in range(len(self.tasks)):
                value = self._step_result(i, deadline, epochs)
        except ResultTimeout as exc:  # the time given, not what was left of it
            raise ResultTimeout(exc.task_id, timeout or 0.0, exc.status) from None
        return value

    async def aresult(self, timeout: float | None = None) -> Any:
        """:meth:`result` for asyncio: each step's wait is its task's ``aresult`` (a
        cancel ends the wait at once); the reads that look for a step not yet submitted
        run in a thread, off the loop. Raises as :meth:`result`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        epochs = self._take_own()
        value = None
        try:
            for i in range(len(self.tasks)):
                value = await self._astep_result(i, deadline, epochs)
        except ResultTimeout as exc:  # the time given, not what was left of it
            raise ResultTimeout(exc.task_id, timeout or 0.0, exc.status) from None
        return value

    async def _astep_result(self, i: int, deadline: float | None,
                            epochs: dict[str, int] | None) -> Any:
        """:meth:`_step_result` for asyncio."""
        t = self.tasks[i]
        epoch = epochs.get(t.queue.name) if epochs and i > 0 else None
        try:
            try:
                return await self._make(t.queue, t.id, epoch=epoch).aresult(
                    self._left(deadline))
            except TaskNotFound:
                if i == 0:
                    raise
            await self._await_submitted_async(i, deadline)
            return await self._make(t.queue, t.id).aresult(self._left(deadline))
        except ChainFailed:
            raise
        except TaskFailed as exc:
            raise self._failed(i, exc) from exc

    async def _await_submitted_async(self, i: int, deadline: float | None) -> None:
        """:meth:`_await_submitted` for asyncio."""
        t = self.tasks[i]
        await asyncio.to_thread(t.queue.reply_channel)  # (Redis reads: off the loop)
        hub = t.queue.hub
        feed = AsyncFeed((t.queue.name, t.id), asyncio.get_running_loop())
        hub.open(feed)
        backoff = Backoff()
        try:
            while not await asyncio.to_thread(self._submitted, i):
                await feed.get(_look_wait(backoff, deadline, t.id))
        finally:
            hub.close(feed)
            feed.close()

    def events(self, timeout: float | None = None, *, tokens: bool = True) -> Iterator[Event]:
        """Every step's events in order (each ``Event.task_id`` names its step's task),
        a streaming step's tokens live: the terminal event of each step included. Ends
        after the last step's; raises ChainFailed when a step does not succeed,
        ResultTimeout, TaskNotFound."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._take_own()  # its feeds take the outcomes: a later wait reads them
        for i, t in enumerate(self.tasks):
            if i > 0:
                self._await_submitted(i, deadline)  # (at once when it is there)
            for ev in self._make(t.queue, t.id).events(self._left(deadline), tokens=tokens):
                yield ev
                if ev.terminal and ev.kind != "succeeded":
                    try:
                        t._outcome(ev)
                    except TaskFailed as exc:
                        raise self._failed(i, exc) from exc

    def tokens(self, timeout: float | None = None) -> Iterator[Any]:
        """The tokens of every streaming step of the chain, in order (an LLM step's,
        between a speech-to-text step and a text-to-speech one). Raises as
        :meth:`events`."""
        for ev in self.events(timeout):
            if ev.kind == "token":
                yield ev.data

    def cancel(self) -> int | None:
        """Cancel the chain: the step that runs or waits is cancelled (a running one's
        worker is told) and no later step is submitted. Returns the index of the step
        stopped, None if the chain had already ended."""
        for i, t in enumerate(self.tasks):
            (status,) = self._fields(i, "status")
            if status is None:
                if i == 0:
                    raise t._not_found()
                # its previous step succeeded and its hand-off is pending: stop it (the
                # hand-off reads the mark before and after its submit)
                p = self.tasks[i - 1]
                if self._fields(i - 1, "chainerr")[0] is not None:
                    return None  # the chain already ended at this hand-off
                with redis_errors():
                    p.queue.redis.hset(p.queue.broker.keys.task(p.id), "chainstop", "1")
                if self._exists(i):
                    t.cancel()
                return i
            if status in (b"queued", b"running", b"delayed"):
                # marked first, so that a hand-off racing this cancel (the step
                # succeeding now) stops before or after its submit
                with redis_errors():
                    t.queue.redis.hset(t.queue.broker.keys.task(t.id), "chainstop", "1")
                t.cancel()
                if self._fields(i, "status")[0] != b"succeeded":
                    return i
                continue  # it succeeded first: stop the step after it
            if status != b"succeeded":
                return None
        return None


def of(task: Any) -> Chain | None:
    """The chain ``task`` is a step of (None: it is not), read from its ``chain`` field.
    Raises TaskNotFound."""
    with redis_errors():
        raw, status = task.queue.redis.hmget(task.queue.broker.keys.task(task.id),
                                             ("chain", "status"))
    if status is None:
        raise task._not_found()
    if raw is None:
        return None
    chain_id, _index, queues = chains.read_info(raw)
    return Chain(task, chain_id, queues)


__all__ = ["Chain", "ChainFailed", "Step", "StepStatus", "TaskCancelled"]


def _look_wait(backoff: Backoff, deadline: float | None, task_id: str) -> float:
    """How long a wait for a step not yet submitted sleeps before it looks again: the
    backoff's next step (at least 10 ms, at most LOOK_MAX_S), cut to the time left.
    Raises ResultTimeout once none is left."""
    wait = min(max(backoff.next(), 0.01), LOOK_MAX_S)
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ResultTimeout(task_id, 0.0, "pending")
        wait = min(wait, left)
    return wait
