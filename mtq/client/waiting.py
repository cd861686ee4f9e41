"""Waiting for a task: ``result()``, ``events()`` and ``tokens()``, sync and async.

:class:`Waiter` is the loop of one reader of a task's events, sans-IO: it is fed the
stored state's news and the items of the reader's feed, hands on the events to
yield, and says what it needs next (:class:`Need`: read the stored state, done,
timed out, or a number of seconds to wait for the feed). ``Task.events`` and
``Task.aevents`` only do the I/O it asks for, the one with blocking calls, the other
with awaits, so the logic is written once. It keeps the reader's clocks (timeout,
keep-alive tick, re-read safety net), and
:class:`~mtq.client.replies.events.StreamState` what the reader has seen.

``result()`` first tries a short way for a task this client submitted: its outcome
is in the inbox, or on its way to a one-shot feed, as long as the reply subscription
was never lost since the submit (:func:`own_wait`, :func:`own_outcome`); else it
takes the long way, ``events(tokens=False)``.
"""

from __future__ import annotations

import enum
import time
from typing import Final

from mtq.client.replies.events import FETCH, Event, StreamState

_monotonic = time.monotonic

#: longest a feed waits without any event before it re-reads the stored state (a
#: safety net: reconnects already trigger a re-read)
RESYNC_S = 10.0
#: how long a reader keeps reading the stored state while Redis cannot be reached
READ_RETRY_S = 60.0


class Need(enum.Enum):
    """What a :class:`Waiter` needs next (else: seconds to wait for the feed)."""

    #: read the stored state (``Task._snapshot``) and give its news to :meth:`Waiter.read`
    READ = "read"
    #: the terminal event was handed on: the iteration ends
    DONE = "done"
    #: the reader's timeout passed: raise ResultTimeout
    TIMEOUT = "timeout"


#: the members under short names, for the readers' loops
READ: Final = Need.READ
DONE: Final = Need.DONE
TIMEOUT: Final = Need.TIMEOUT


class Waiter:
    """One reader's loop over a task's events (sans-IO). The caller asks :meth:`need`;
    for READ it reads the stored state and calls :meth:`read`, for a number of
    seconds it waits that long for its feed's next item (None if none came) and calls
    :meth:`fed`; each returns the events to hand on, in order.

    Its clocks: the reader's ``timeout`` (a deadline), its keep-alive tick (``idle``:
    an ``idle`` event after that long with nothing handed on) and the re-read safety
    net (the stored state is read after RESYNC_S with nothing from the feed)."""

    __slots__ = ("deadline", "heard", "idle", "reread", "said", "state")

    def __init__(self, task_id: str, tokens: bool, start: int, timeout: float | None,
                 idle: float | None) -> None:
        self.state = StreamState(task_id, tokens, start)
        now = _monotonic()
        self.deadline = None if timeout is None else now + timeout
        self.idle = idle
        self.heard = now  # the last item from the feed (or the start)
        self.said = now   # the last event handed on (or idle tick)
        #: the stored state must be read before the feed is waited on (at first, after
        #: a reconnect, a missing token, a result too large for its message)
        self.reread = True

    def need(self) -> Need | float:
        """What to do next: DONE, READ, TIMEOUT, or wait this many seconds for the feed."""
        if self.state.done:
            return DONE
        if self.reread:
            return READ
        now = _monotonic()
        wait = self.heard + RESYNC_S - now
        if self.idle is not None:
            wait = min(wait, self.said + self.idle - now)
        if self.deadline is not None:
            if now >= self.deadline:
                return TIMEOUT
            wait = min(wait, self.deadline - now)
        return wait if wait > 0.0 else 0.0

    def read(self, news: list[Event]) -> list[Event]:
        """The stored state was read: ``news`` (what it adds, from
        ``StreamState.from_snapshot``) is handed on."""
        self.reread = False
        if news:
            self.said = _monotonic()
        return news

    def fed(self, item: Event | str | None) -> list[Event]:
        """The feed gave ``item``: an event, a hub marker (RESYNC, LOST: read the stored
        state), or None (the wait ended quiet: a keep-alive tick, the safety net's
        read, or nothing)."""
        now = _monotonic()
        if item is None:
            if now - self.heard >= RESYNC_S:
                self.heard = now
                self.reread = True
            elif self.idle is not None and now - self.said >= self.idle:
                self.said = now
                return [Event("idle", self.state.task_id)]
            return []
        self.heard = now
        if isinstance(item, str):  # reconnected (or, fail-fast, lost): read
            self.reread = True
            return []
        out, self.reread = self.state.accept(item)
        if out:
            self.said = now
        return out


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
