"""The callbacks thread: runs task callbacks (``Task.add_done_callback``, groups) one at
a time, off the thread that reads the reply connection, so a slow callback never
delays event delivery. A callback registered on a task that may already have ended
first reads its stored state; the reads of many are pipelined in one round trip."""

from __future__ import annotations

import logging
import queue as queue_mod
import threading
from collections.abc import Callable
from typing import Any

from mtq.broker import scripts
from mtq.broker.protocol import Snapshot
from mtq.client.replies.events import RESYNC, Event
from mtq.client.replies.feeds import CallbackFeed, CallbackQueue, Feed
from mtq.errors import BrokerError

log = logging.getLogger("mtq.replies")

#: a callback's read of the stored state that failed (Redis unreachable) is retried after this
RETRY_READ_S = 1.0


class CallbackThread:
    """The callback thread of one hub (started on first use). ``hub_id``: the hub's id
    (its reply channels name it); ``close``: stops a feed's delivery once it fired."""

    def __init__(self, hub_id: str, close: Callable[[Feed], None]) -> None:
        self.hub_id = hub_id
        self.close = close
        #: what to run: (a feed, an event or RESYNC: read its stored state); None stops
        self.queue: CallbackQueue = queue_mod.SimpleQueue()
        self.thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def add(self, feed: CallbackFeed[Any], known: bool) -> None:
        """Run ``feed`` (already open on the hub). ``known``: registered before its task
        was submitted, so no event can have been missed and no read is needed."""
        self.start()
        if not known:
            self.queue.put((feed, RESYNC))

    def start(self) -> None:
        with self._lock:
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="mtq-callbacks",
                                               daemon=True)
                self.thread.start()

    def stop(self) -> None:
        """Ask the thread to end (see :meth:`join`)."""
        self.queue.put(None)

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            batch = [item]
            while True:  # read the state of every task that needs it in one round trip
                try:
                    more = self.queue.get_nowait()
                except queue_mod.Empty:
                    break
                if more is None:
                    self.queue.put(None)
                    break
                batch.append(more)
            reads = [f for f, it in batch if it == RESYNC and not f.fired]
            snaps = self._read_many(reads) if reads else {}
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
                        self.queue.put((feed, RESYNC))
                for ev in events:
                    if ev.terminal:
                        feed.fired = True
                        self.close(feed)
                        try:
                            feed.fn(feed.task, ev)
                        except Exception:
                            log.exception("a task callback raised")

    def _read_many(self, feeds: list[CallbackFeed[Any]]) -> dict[int, Snapshot | None]:
        """Snapshots of several tasks in one round trip (pipelined watch calls)."""
        calls = []
        for f in feeds:
            b = f.task.broker
            calls.append(b.watch_call(f.task.id, b.keys.reply(self.hub_id)))
        try:
            snaps = scripts.run(feeds[0].task.broker.redis, *calls)
        except BrokerError:
            log.warning("could not read %d task(s) for their callbacks; retrying in %g s",
                        len(feeds), RETRY_READ_S, exc_info=True)

            def retry() -> None:
                for f in feeds:
                    self.queue.put((f, RESYNC))

            # later, off the callback thread: the other tasks' callbacks keep running
            # meanwhile
            timer = threading.Timer(RETRY_READ_S, retry)
            timer.daemon = True
            timer.start()
            return {}
        return {id(f): s for f, s in zip(feeds, snaps)}
