"""Groups: success, error and all-done callbacks over many tasks.

MTFIFO's ``SUCCESS`` / ``ERROR`` / ``END`` events, event-driven instead of a 50 ms
polling dispatcher::

    with q.group() as g:
        g.on_success(lambda task, result: print(task.id, result))
        g.on_error(lambda task, error: print(task.id, error))
        g.on_done(lambda group: print("all done", group.counts()))
        g.submit_many(payloads)
    g.wait(60)

Callbacks run on the client's callback thread, one at a time, each once per task.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from mtq.broker.protocol import NewTask
from mtq.client.records import Request
from mtq.client.replies.events import Event
from mtq.client.replies.feeds import CallbackFeed
from mtq.client.replies.hub import Hub
from mtq.client.task import Task, adopt, failure
from mtq.errors import ResultTimeout, TaskFailed, UsageError

log = logging.getLogger("mtq.group")


class GroupQueue(Protocol):
    """What a group needs of its queue (:class:`~mtq.client.queue.Queue`)."""

    @property
    def hub(self) -> Hub: ...

    def reply_channel(self) -> str: ...

    def prepare(self, items: Iterable[Any], *, stream: str | None = None,
                ttl: float | None = None, retries: int | None = None,
                cache: bool = True) -> list[NewTask]: ...

    def send(self, tasks: list[NewTask]) -> list[Task]: ...

    def task(self, task_id: str) -> Task: ...


class Group:
    """A set of tasks with shared callbacks; it ends when it is closed and every
    task in it has ended. Thread-safe."""

    def __init__(self, queue: GroupQueue | None = None) -> None:
        self.queue = queue
        self._lock = threading.Lock()
        self._tasks: list[Task] = []
        self._outcomes: dict[Task, Event] = {}
        self._on_success: list[Callable[[Task, Any], None]] = []
        self._on_error: list[Callable[[Task, TaskFailed], None]] = []
        self._on_done: list[Callable[[Group], None]] = []
        self._closed = False
        self._done = threading.Event()

    def __enter__(self) -> Group:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._tasks)

    @property
    def tasks(self) -> list[Task]:
        """The tasks, in the order they were added."""
        with self._lock:
            return list(self._tasks)

    # -- callbacks -----------------------------------------------------------------
    def on_success(self, fn: Callable[[Task, Any], None]) -> Group:
        """Call ``fn(task, result)`` for each task that succeeds (at once, in this
        thread, for those that already have)."""
        with self._lock:
            self._on_success.append(fn)
            past = [(t, e) for t, e in self._outcomes.items() if e.kind == "succeeded"]
        for t, e in past:
            fn(t, e.data)
        return self

    def on_error(self, fn: Callable[[Task, TaskFailed], None]) -> Group:
        """Call ``fn(task, error)`` for each task that ends failed, dead, expired or
        cancelled (``error`` is the TaskFailed that ``result()`` would raise)."""
        with self._lock:
            self._on_error.append(fn)
            past = [(t, e) for t, e in self._outcomes.items() if e.kind != "succeeded"]
        for t, e in past:
            fn(t, failure(t, e))
        return self

    def on_done(self, fn: Callable[[Group], None]) -> Group:
        """Call ``fn(group)`` once, when the group is closed and every task has ended."""
        with self._lock:
            self._on_done.append(fn)
            now = self._done.is_set()
        if now:
            fn(self)
        return self

    # -- tasks -----------------------------------------------------------------------
    def add(self, *tasks: Task) -> Group:
        """Add tasks already submitted (by anyone, to any queue)."""
        for t in tasks:
            self._track(t, known=False)
        return self

    def _track(self, task: Task, known: bool) -> None:
        with self._lock:
            if self._closed:
                raise UsageError("this group is closed; add tasks before close() or wait()")
            self._tasks.append(task)
        task.add_done_callback(self._finished, _known=known)

    def _queue(self) -> GroupQueue:
        if self.queue is None:
            raise UsageError("this group has no queue: create it with Queue.group(), "
                               "or submit on a queue and add() the tasks")
        return self.queue

    def submit(self, payload: Any, **options: Any) -> Task:
        """Submit one task to the group's queue (see :meth:`Queue.submit`) and add it."""
        return self.submit_many([payload], _options=options)[0]

    def submit_many(self, items: Iterable[Any], *, _options: dict[str, Any] | None = None,
                    **options: Any) -> list[Task]:
        """Submit tasks to the group's queue (see :meth:`Queue.submit_many`) and add
        them. Their callbacks are in place before they are submitted, so not even
        the fastest completion needs a read from Redis."""
        q = self._queue()
        opts = {**(_options or {}), **options}
        q.reply_channel()
        if "id" in opts or "key" in opts:  # submit() options that submit_many lacks
            items = [Request(p, **opts) for p in items]
            opts = {}
        new = q.prepare(items, **opts)
        hub = q.hub
        feeds: dict[str, CallbackFeed[Task]] = {}
        for n in new:
            task = q.task(n.id)
            feed = CallbackFeed(task, self._finished, hub.callbacks)
            hub.open(feed)  # before the submit: no event can be missed
            feeds[n.id] = feed
        try:
            tasks = q.send(new)
        except Exception as exc:
            created = {t.id for t in getattr(exc, "created", [])}
            for tid, feed in feeds.items():
                if tid not in created:
                    hub.close(feed)
            for t in getattr(exc, "created", []):
                self._adopt(t, feeds.get(t.id))
            raise
        for t in tasks:
            self._adopt(t, feeds.get(t.id))
        returned = {t.id for t in tasks}  # built once, not per feed (that would be O(n^2))
        for tid, feed in feeds.items():  # an idempotency hit returned another task
            if tid not in returned:
                hub.close(feed)
        return tasks

    def _adopt(self, task: Task, feed: CallbackFeed[Task] | None) -> None:
        with self._lock:
            self._tasks.append(task)
        if feed is not None:
            adopt(task, feed)  # the group's callback takes its outcome: result() reads it
        else:
            task.add_done_callback(self._finished)

    def _finished(self, task: Task, ev: Event) -> None:
        with self._lock:
            if task in self._outcomes:
                return
            self._outcomes[task] = ev
            ok, err = list(self._on_success), list(self._on_error)
        try:
            if ev.kind == "succeeded":
                for fn in ok:
                    _call(fn, task, ev.data)
            else:
                error = failure(task, ev)
                for fn in err:
                    _call(fn, task, error)
        finally:
            self._check_done()

    def _check_done(self) -> None:
        with self._lock:
            if not self._closed or self._done.is_set() or len(self._outcomes) < len(self._tasks):
                return
            self._done.set()
            fns = list(self._on_done)
        for fn in fns:
            _call(fn, self)

    # -- ending ----------------------------------------------------------------------
    def close(self) -> None:
        """No more tasks: on_done fires once the ones in the group have ended."""
        with self._lock:
            self._closed = True
        self._check_done()

    def wait(self, timeout: float | None = None) -> bool:
        """Close the group and wait until every task has ended; False on timeout."""
        self.close()
        return self._done.wait(timeout)

    def counts(self) -> dict[str, int]:
        """How many tasks succeeded, failed (any other end) or are still pending."""
        with self._lock:
            ok = sum(1 for e in self._outcomes.values() if e.kind == "succeeded")
            return {"succeeded": ok, "failed": len(self._outcomes) - ok,
                    "pending": len(self._tasks) - len(self._outcomes)}

    def results(self, timeout: float | None = None) -> list[Any]:
        """Wait, then return each task's result in order; a task that did not succeed
        has its TaskFailed in its place. Raises ResultTimeout."""
        if not self.wait(timeout):
            pending = [t for t in self.tasks if t not in self._outcomes]
            raise ResultTimeout(pending[0].id if pending else "?", timeout or 0.0,
                                f"one of {len(pending)} unfinished in the group")
        with self._lock:
            return [e.data if e.kind == "succeeded" else failure(t, e)
                    for t, e in ((t, self._outcomes[t]) for t in self._tasks)]


def _call(fn: Callable[..., None], *args: Any) -> None:
    try:
        fn(*args)
    except Exception:  # one bad callback must not stop the others, nor on_done
        log.exception("a group callback raised")
