"""The web dashboard's one reader of the queues: a :class:`Sampler` takes one
:func:`mtq.admin.snapshot` every ``refresh_s``, whatever the number of pages open,
and keeps the last :data:`HISTORY_S` seconds of figures per queue for the charts.

The history lives in this process's memory: it starts when the process starts (a
dashboard restarted shows no history before its start) and holds, per refresh and
queue, five numbers. While Redis cannot be read the sampler keeps the last good
snapshot, records the error (the pages show it in a banner) and tries again every
refresh; it never stops by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import redis

from mtq.admin import Snapshot, snapshot
from mtq.errors import MtqError

log = logging.getLogger(__name__)

#: seconds of history kept for the charts
HISTORY_S = 600.0


@dataclass(frozen=True)
class Point:
    """One queue at one refresh."""

    waiting: int
    running: int
    #: tasks succeeded per second since the refresh before (None for the first)
    rate: float | None
    p50_ms: float | None
    p99_ms: float | None


@dataclass(frozen=True)
class Sample:
    """One refresh: its time (this host's clock, s) and each queue's :class:`Point`."""

    ts: float
    points: dict[str, Point]


class Sampler:
    """One snapshot per refresh for every viewer of a dashboard (see the module
    docstring). :meth:`start` runs it on the running event loop (the app's lifespan,
    or its first request when mounted in an app whose lifespan does not reach it);
    :meth:`stop` ends it and wakes every stream waiting on it."""

    def __init__(self, client: redis.Redis, refresh_s: float = 1.0,
                 history_s: float = HISTORY_S) -> None:
        self.client = client
        self.refresh_s = float(refresh_s)
        self.history: deque[Sample] = deque(maxlen=max(2, int(history_s / self.refresh_s) + 1))
        #: the last good snapshot (None before the first)
        self.last: Snapshot | None = None
        #: why the last refresh failed (None when it succeeded)
        self.error: str | None = None
        #: snapshots attempted (the test of "one per refresh" counts them)
        self.reads = 0
        #: bumped at every refresh, failed ones too: what a stream waits for
        self.version = 0
        self.stopping = False
        #: live streams open on this sampler (mtq.dashboard.web.live)
        self.viewers = 0
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tick: asyncio.Future[None] | None = None

    # -- life ----------------------------------------------------------------------
    def start(self) -> None:
        """Start sampling on the running loop (no-op when it runs there already)."""
        loop = asyncio.get_running_loop()
        if self._task is not None and not self._task.done() and self._loop is loop:
            return
        self.stopping = False
        self._loop = loop
        self._tick = loop.create_future()
        self._task = loop.create_task(self._run(), name="mtq-dashboard-sampler")

    async def stop(self) -> None:
        """Stop sampling; streams waiting in :meth:`wait` return at once."""
        self.stopping = True
        self._wake()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def stop_soon(self) -> None:
        """:meth:`stop`'s first half, from any thread (a server's signal handler):
        mark it stopping and wake the streams, which then end."""
        self.stopping = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def _run(self) -> None:
        while not self.stopping:
            started = time.monotonic()
            await self.refresh()
            left = self.refresh_s - (time.monotonic() - started)
            if left > 0:
                await asyncio.sleep(left)

    async def refresh(self) -> None:
        """Take one snapshot (in a thread: redis-py blocks) and tell the waiters."""
        self.reads += 1
        try:
            snap = await asyncio.to_thread(snapshot, self.client)
        except MtqError as exc:
            self.error = str(exc)
        except Exception as exc:  # keep sampling whatever one read raised
            log.exception("dashboard snapshot failed")
            self.error = f"{type(exc).__name__}: {exc}"
        else:
            self.add(snap)
            self.error = None
        self.version += 1
        self._wake()

    def _wake(self) -> None:
        tick = self._tick
        if self._loop is not None and not self._loop.is_closed():
            self._tick = self._loop.create_future()
        if tick is not None and not tick.done():
            tick.set_result(None)

    async def wait(self, version: int, timeout: float) -> int:
        """Wait (at most ``timeout`` s) for a refresh after ``version``; the version
        now (the same one on a timeout, or when stopping)."""
        if self.version != version or self.stopping:
            return self.version
        tick = self._tick
        if tick is None:  # not started: no refresh will wake us, but never spin
            await asyncio.sleep(min(timeout, self.refresh_s))
            return self.version
        # asyncio.wait, not wait_for: wait_for (before Python 3.12) returns the result
        # and drops a cancel that lands as the tick fires, so a stream whose client
        # left at a refresh would go on sending to nobody, never ending
        await asyncio.wait((tick,), timeout=timeout)
        return self.version

    async def stopped(self) -> None:
        """Return once the sampler is stopping (what a long answer races against)."""
        while not self.stopping:
            await self.wait(self.version, 3600.0)

    # -- history -------------------------------------------------------------------
    def add(self, snap: Snapshot) -> None:
        """Record ``snap`` (rates against the snapshot before it)."""
        before = self.last
        dt = snap.ts - before.ts if before is not None else 0.0
        points = {}
        for q in snap.queues:
            prev = before.queue(q.name) if before is not None else None
            # a counter that went down (the queue was purged and began again) is no rate
            rate = (max(0, q.succeeded - prev.succeeded) / dt
                    if prev is not None and dt > 0 else None)
            points[q.name] = Point(q.waiting, q.running, rate, q.p50_ms, q.p99_ms)
        self.history.append(Sample(snap.ts, points))
        self.last = snap

    def rate(self, queue: str) -> float | None:
        """``queue``'s tasks per second at the last refresh."""
        if not self.history:
            return None
        point = self.history[-1].points.get(queue)
        return point.rate if point is not None else None

    def series(self, queue: str, field: str, window_s: float) -> list[tuple[float, float | None]]:
        """(time, value of ``field``) of ``queue`` over the last ``window_s`` seconds,
        oldest first; None where the queue or the value was missing."""
        if not self.history:
            return []
        since = self.history[-1].ts - window_s
        out: list[tuple[float, float | None]] = []
        for s in self.history:
            if s.ts < since:
                continue
            point = s.points.get(queue)
            value: Any = getattr(point, field) if point is not None else None
            out.append((s.ts, None if value is None else float(value)))
        return out
