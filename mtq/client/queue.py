"""A named queue: :class:`Queue` (settings, submit, submit_many, look-ups, purge,
delete, dead letters). The submit protocol itself is :mod:`mtq.client.submit`."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import partial
from typing import Any

import redis

from mtq.broker import chains
from mtq.broker.cluster import for_queue, shared
from mtq.broker.config import SettingsSource, SettingsSpec
from mtq.broker.connection import connect
from mtq.broker.protocol import Broker, NewTask
from mtq.client import chains as chain_steps
from mtq.client.chains import Step
from mtq.client.group import Group
from mtq.client.records import Request
from mtq.client.replies.hub import Hub, hub_of
from mtq.client.submit import new_task, send
from mtq.client.task import Task
from mtq.errors import QueueInUse
from mtq.observe import otel as tracing
from mtq.settings import QueueSettings
from mtq.validation import check_queue_name, check_task_id

#: most tasks one purge / dead-letter script call handles
PURGE_CHUNK = 1000


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
            self._reply = None  # the closed hub's channel: nobody reads it any more
        return hub

    def reply_channel(self) -> str:
        """This client's reply channel on the queue, subscribed (once per hub)."""
        hub = self.hub
        if self._reply is None:
            self._reply = hub.channel(self.name)
        return self._reply

    def __repr__(self) -> str:
        return f"<Queue {self.name}>"

    def _new(self, payload: Any, stream: str | None, key: str | None, ttl: float | None,
             retries: int | None, task_id: str | None, cache: bool = True,
             priority: str | None = None, tenant: str | None = None,
             cost: float | None = None, deadline: Any = None,
             timeout: float | None = None, delay: float | None = None,
             at: datetime | None = None) -> NewTask:
        return new_task(self.settings, payload, stream, key, ttl, retries, task_id,
                        cache, priority=priority, tenant=tenant, cost=cost,
                        deadline=deadline, timeout=timeout, delay=delay, at=at)

    def _send(self, tasks: list[NewTask]) -> list[Task]:
        if tracing.api() is not None:  # cached: one check without OpenTelemetry
            return tracing.traced_submit(self.name, tasks, self._send_tasks)
        return self._send_tasks(tasks)

    def _send_tasks(self, tasks: list[NewTask]) -> list[Task]:
        if not self._registered:
            self.broker.register()
            self._registered = True
        reply = self.reply_channel()
        epoch = self.hub.epoch(self.name)  # before the submit: see Task._open_own
        if any(t.chain for t in tasks):
            self._chain_replies(tasks)
        return send(self, tasks, reply, epoch, partial(Task, self))

    def _chain_replies(self, tasks: list[NewTask]) -> None:
        """Subscribe this client's replies on every queue of the chains in ``tasks``
        before they are submitted: the hand-off carries the first task's reply channels
        to each step, so every step's events come here (docs/streaming.md, "Chains")."""
        if shared(self.redis) is not self.redis:
            # a cluster: each queue's replies come to a hub of its slot's own client,
            # which the hand-off's channels do not name; a chain's reader reads each
            # step's state instead (docs/streaming.md, "Chains", limits)
            return
        hub = self.hub
        for t in tasks:
            if not t.chain:
                continue
            epochs: dict[str, int] = {}
            for q in chains.read_info(t.chain)[2]:
                if q not in epochs:
                    hub.channel(q)
                    epochs[q] = hub.epoch(q)
            chain_steps.remember(hub.id, t.id, epochs)

    def _chained(self, task: NewTask, then: Sequence[Step | str] | None) -> NewTask:
        return task if then is None else chain_steps.prepare(task, then, self.name)

    def submit(self, payload: Any, *, stream: str | None = None, key: str | None = None,
               ttl: float | None = None, retries: int | None = None,
               id: str | None = None, cache: bool = True, priority: str | None = None,
               tenant: str | None = None, cost: float | None = None,
               deadline: float | datetime | None = None,
               timeout: float | None = None, delay: float | None = None,
               at: datetime | None = None,
               then: Sequence[Step | str] | None = None) -> Task:
        """Submit one task (one round trip) and return its handle.

        ``stream``: tasks of one stream run one at a time in submit order.
        ``key``: idempotency key; within the window, the same key returns the same task.
        ``ttl``: seconds after which the task, if not started, ends expired unrun.
        ``retries``: retries after a handler error (default: the queue's max_retries).
        ``cache=False``: bypass the queue's result cache (when ``cache_ttl_s`` > 0, an
        identical earlier request's result, or an identical task still running,
        otherwise answers it; see docs/operations.md).
        ``priority``: ``interactive``, ``standard`` (the default) or ``batch``;
        ``tenant``: whose fair share of the workers it counts against; ``cost``: what
        it costs them (tokens, say; default: the payload's prompt plus ``max_tokens``
        where it says them, else the queue's ``default_cost``); ``deadline``: seconds
        from now or an aware datetime by which it must start: a ttl that is checked at
        once, refused with WouldMissDeadline if the work ahead would make it late. See
        docs/scheduling.md.
        ``timeout``: seconds a run of it may take once started (from when its predict
        call or generator step began running it; ``ttl`` covers the wait before): past
        it, it is stopped and fails with TaskTimeout, retried under its retry policy
        (default: the queue's ``task_timeout_s``; see docs/workers.md, "Timeouts and
        cancel"). A bad value raises ConfigError before anything is sent.
        ``delay``: seconds, or ``at``: an aware datetime, before which it is not queued:
        it waits in Redis (status ``delayed``, counted in ``delayed``, not ``waiting``),
        then joins the tail of its stream at its due time; ``ttl`` counts from then; it
        can be cancelled meanwhile. Not with ``deadline``; no result cache. A naive
        datetime, a negative, infinite or too large delay, or both raise InvalidArgument
        (docs/scheduling.md, "Delayed tasks").
        ``then``: the steps of a chain that follow this task (:class:`mtq.Step`, or a
        queue name): each is a task of its own on its queue, submitted once the one
        before it succeeded, its payload built from that one's result; a failure stops
        the chain. ``task.chain()`` follows every step (docs/streaming.md, "Chains").
        Bad steps raise ChainError before anything is written.
        Raises InvalidName, InvalidArgument, PayloadTooLarge, EncodeError, QueueFull,
        RateLimited, WouldMissDeadline, DuplicateTask, BrokerError.
        """
        return self._send([self._chained(
            self._new(payload, stream, key, ttl, retries, id, cache, priority, tenant,
                      cost, deadline, timeout, delay, at), then)])[0]

    def submit_many(self, items: Iterable[Any], *, stream: str | None = None,
                    ttl: float | None = None, retries: int | None = None,
                    cache: bool = True, priority: str | None = None,
                    tenant: str | None = None, cost: float | None = None,
                    timeout: float | None = None, delay: float | None = None,
                    at: datetime | None = None) -> list[Task]:
        """Submit many tasks, up to 1 000 per round trip, and return their handles.

        Items are payloads, or :class:`Request` objects for per-task options
        (their fields override the keyword defaults). Every item is validated and
        encoded before anything is sent; with max_length set, each chunk of up to
        1 000 is admitted whole or refused whole (QueueFull). ``cache=False`` (or a
        Request's ``cache=False``) bypasses the result cache. ``delay`` / ``at`` (or a
        Request's own) delay the tasks (see :meth:`submit`).
        """
        tasks = self.prepare(items, stream=stream, ttl=ttl, retries=retries, cache=cache,
                             priority=priority, tenant=tenant, cost=cost, timeout=timeout,
                             delay=delay, at=at)
        return self.send(tasks) if tasks else []

    def prepare(self, items: Iterable[Any], *, stream: str | None = None,
                ttl: float | None = None, retries: int | None = None,
                cache: bool = True, priority: str | None = None,
                tenant: str | None = None, cost: float | None = None,
                timeout: float | None = None, delay: float | None = None,
                at: datetime | None = None) -> list[NewTask]:
        """Validate and encode items for :meth:`send` (ids are chosen here)."""
        tasks = []
        for item in items:
            if isinstance(item, Request):
                # its own delay or at replaces both defaults
                own = item.delay is not None or item.at is not None
                tasks.append(self._chained(self._new(
                    item.payload, item.stream if item.stream is not None else stream, item.key,
                    item.ttl if item.ttl is not None else ttl,
                    item.retries if item.retries is not None else retries, item.id,
                    cache and item.cache,
                    item.priority if item.priority is not None else priority,
                    item.tenant if item.tenant is not None else tenant,
                    item.cost if item.cost is not None else cost, item.deadline,
                    item.timeout if item.timeout is not None else timeout,
                    item.delay if own else delay, item.at if own else at), item.then))
            else:
                tasks.append(self._new(item, stream, None, ttl, retries, None, cache,
                                       priority, tenant, cost, timeout=timeout,
                                       delay=delay, at=at))
        return tasks

    def send(self, tasks: list[NewTask]) -> list[Task]:
        """Submit prepared tasks (see :meth:`submit_many`)."""
        return self._send(tasks)

    def group(self) -> Group:
        """A new :class:`~mtq.client.group.Group` on this queue: callbacks over many tasks."""
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
        from mtq.broker.registry import list_workers

        serving = [w["id"] for w in list_workers(self.redis, self.name)]
        if serving and not force:
            raise QueueInUse(self.name, serving)
        return self.broker.delete_queue()

    def schedule(self, name: str, cron: str, payload: Any, *, stream: str | None = None,
                 tenant: str | None = None, tz: str = "UTC",
                 catch_up: str = "latest") -> Any:
        """Submit ``payload`` to this queue at each occurrence of ``cron`` in zone ``tz``
        (see :func:`mtq.client.schedules.add`, ``mtq schedule add``); returns the
        :class:`~mtq.client.schedules.Schedule`."""
        from mtq.client import schedules

        return schedules.add(self.redis, name, self.name, cron, payload, stream=stream,
                             tenant=tenant, tz=tz, catch_up=catch_up)

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
