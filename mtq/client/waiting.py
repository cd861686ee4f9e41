"""Waiting for a task: ``result()``, ``events()`` and ``tokens()``, sync and async.

:class:`Waiter` is the loop of one reader of a task's events, sans-IO: it is fed the
stored state's news and the items of the reader's feed, hands on the events to
yield, and says what it needs next (:class:`Need`: read the stored state, done,
timed out, or a number of seconds to wait for the feed). ``Task.events`` and
``Task.aevents`` only do the I/O it asks for, the one with blocking calls, the other
with awaits, so the logic is written once. :class:`Pacer` keeps its clocks
(timeout, keep-alive tick, re-read safety net) and
:class:`~mtq.client.replies.events.StreamState` what it has seen.

``result()`` first tries a short way for a task this client submitted: its outcome
is in the inbox, or on its way to a one-shot feed, as long as the reply subscription
was never lost since the submit (:func:`own_wait`, :func:`own_outcome`); else it
takes the long way, ``events(tokens=False)``.
"""

from __future__ import annotations

import enum
import time

from mtq.client.replies.events import FETCH, Event, StreamState

#: longest a feed waits without any event before it re-reads the stored state (a
#: safety net: reconnects already trigger a re-read)
RESYNC_S = 10.0
#: how long a reader keeps reading the stored state while Redis cannot be reached
READ_RETRY_S = 60.0


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


class Need(enum.Enum):
    """What a :class:`Waiter` needs next (else: seconds to wait for the feed)."""

    #: read the stored state (``Task._snapshot``) and give its news to :meth:`Waiter.read`
    READ = "read"
    #: the terminal event was handed on: the iteration ends
    DONE = "done"
    #: the reader's timeout passed: raise ResultTimeout
    TIMEOUT = "timeout"


class Waiter:
    """One reader's loop over a task's events (sans-IO). The caller asks :meth:`need`;
    for READ it reads the stored state and calls :meth:`read`, for a number of
    seconds it waits that long for its feed's next item (None if none came) and calls
    :meth:`fed`; each returns the events to hand on, in order."""

    __slots__ = ("pace", "reread", "state")

    def __init__(self, task_id: str, tokens: bool, start: int, timeout: float | None,
                 idle: float | None) -> None:
        self.state = StreamState(task_id, tokens, start)
        self.pace = Pacer(timeout, idle)
        #: the stored state must be read before the feed is waited on (at first, after
        #: a reconnect, a missing token, a result too large for its message)
        self.reread = True

    def need(self) -> Need | float:
        """What to do next: DONE, READ, TIMEOUT, or wait this many seconds for the feed."""
        if self.state.done:
            return Need.DONE
        if self.reread:
            return Need.READ
        wait = self.pace.wait()
        return Need.TIMEOUT if wait is None else wait

    def read(self, news: list[Event]) -> list[Event]:
        """The stored state was read: ``news`` (what it adds, from
        ``StreamState.from_snapshot``) is handed on."""
        self.reread = False
        return self.pace.handed(news)

    def fed(self, item: Event | str | None) -> list[Event]:
        """The feed gave ``item``: an event, a hub marker (RESYNC, LOST: read the stored
        state), or None (the wait ended quiet: a keep-alive tick, the safety net's
        read, or nothing)."""
        if item is None:
            quiet = self.pace.quiet()
            if quiet == "idle":
                return [Event("idle", self.state.task_id)]
            self.reread = quiet == "read"
            return []
        self.pace.item()
        if isinstance(item, str):  # reconnected (or, fail-fast, lost): read
            self.reread = True
            return []
        out, self.reread = self.state.accept(item)
        return self.pace.handed(out)


def own_wait(timeout: float | None) -> float:
    """How long the short way of result() waits on its feed: the caller's timeout, at
    most RESYNC_S (then the long way reads the stored state); a negative one not at all
    (a lock's -1 would mean forever)."""
    return RESYNC_S if timeout is None else max(0.0, min(timeout, RESYNC_S))


def own_outcome(item: Event | str | None, timeout: float | None, start: float
                ) -> tuple[Event | None, float | None]:
    """What result()'s short way ends with: (the terminal event, None), or (None, the
    timeout left) for the long way: the subscription broke, the result is too large
    to ride in the message, or nothing came in time. ``start``: when the short way
    began (monotonic)."""
    if isinstance(item, Event) and item.terminal and item.data is not FETCH:
        return item, None
    return None, None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
