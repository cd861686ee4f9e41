"""What a task's reply subscription carries: :class:`Event`, the hub's markers, the
parser of one reply-channel message, and :class:`StreamState`, which turns the stored
state and live events into what a reader gets (sans-IO)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from mtq import serialization
from mtq.broker.protocol import TERMINAL, Snapshot


@dataclass(frozen=True, slots=True)
class Event:
    """One thing that happened to a task.

    ``kind``: queued, started, token, progress, restarted, or a terminal state
    (succeeded, failed, dead, cancelled, expired); ``idle`` only for a reader that
    asked for keep-alive ticks (``Task.events(idle=...)``): nothing happened. ``data``: the token or progress
    value, the result (succeeded) or the error text (failed, dead, expired).
    ``index``: a token's position in the task's stream (0, 1, ...). ``delivery``:
    which delivery of the task it belongs to (started, restarted). ``ts``: Redis
    server time (s since the epoch) when it was published; 0.0 for events replayed
    from the stored state.
    """

    kind: str
    task_id: str
    data: Any = None
    index: int | None = None
    delivery: int | None = None
    ts: float = 0.0

    @property
    def terminal(self) -> bool:
        """True for the task's last event (succeeded, failed, dead, cancelled, expired)."""
        return self.kind in TERMINAL


#: a feed's marker meaning "re-read the stored state" (after a reconnect)
RESYNC = "resync"
#: a feed's marker meaning "the reply connection was lost and redis-py's retries gave
#: up": pushed only to feeds opened with ``fail_fast`` (a web response that would rather
#: end and let its client reconnect than wait for Redis)
LOST = "lost"


class _Fetch:
    """A succeeded event whose result was too large to ride in the message."""


FETCH = _Fetch()


def decode_message(data: bytes) -> tuple[str, float, list[tuple[str, Event]]]:
    """Parse one reply-channel message into (kind, ts, [(task id, Event)])."""
    kind_b, ts_us, items = msgpack.unpackb(data, raw=True, use_list=True)
    kind = kind_b.decode()
    ts = ts_us / 1e6
    out: list[tuple[str, Event]] = []
    if kind == "token":
        for i in range(0, len(items), 3):
            tid = items[i].decode()
            out.append((tid, Event("token", tid, serialization.loads(items[i + 2]),
                                   index=int(items[i + 1]), ts=ts)))
    elif kind == "done":
        for i in range(0, len(items), 3):
            tid, status, value = items[i].decode(), items[i + 1].decode(), items[i + 2]
            result: Any
            if status == "succeeded":
                result = FETCH if value is False else serialization.loads(value)
            else:
                result = value.decode(errors="replace") if value else None
            out.append((tid, Event(status, tid, result, ts=ts)))
    elif kind == "started":
        for i in range(0, len(items), 2):
            tid = items[i].decode()
            out.append((tid, Event("started", tid, delivery=int(items[i + 1]), ts=ts)))
    elif kind == "restarted":
        for i in range(0, len(items), 3):
            tid = items[i].decode()
            out.append((tid, Event("restarted", tid, items[i + 2].decode(errors="replace"),
                                   delivery=int(items[i + 1]), ts=ts)))
    elif kind == "progress":
        for i in range(0, len(items), 2):
            tid = items[i].decode()
            out.append((tid, Event("progress", tid, serialization.loads(items[i + 1]), ts=ts)))
    elif kind == "queued":
        for item in items:
            tid = item.decode()
            out.append((tid, Event("queued", tid, ts=ts)))
    return kind, ts, out


class StreamState:
    """What a feed has seen of one task: turns the stored state and live events into
    the events its reader gets (each token index once, in order; one terminal event).

    Sans-IO: the sync and async iterators and the callback runner share it.
    """

    def __init__(self, task_id: str, tokens: bool, start: int = 0) -> None:
        self.task_id = task_id
        self.tokens = tokens
        #: ``start``: tokens before this index are neither read nor handed on (a
        #: reader that resumes a stream it had up to ``start - 1``)
        self.next_index = start
        self.done = False
        #: server time (s) of the last stored state read: older live events are stale
        self.since = 0.0

    @property
    def tokens_from(self) -> int:
        """The first token index the next snapshot should return (-1: none)."""
        return self.next_index if self.tokens else -1

    def from_snapshot(self, snap: Snapshot) -> list[Event]:
        """The events a stored state adds to what was seen (missed tokens, the end)."""
        out: list[Event] = []
        if self.done:
            return out
        self.since = max(self.since, snap.ts)
        if self.tokens:
            for data in snap.tokens:
                out.append(Event("token", self.task_id, serialization.loads(data),
                                 index=self.next_index))
                self.next_index += 1
        if snap.status in TERMINAL:
            self.done = True
            if snap.status == "succeeded":
                value = serialization.loads(snap.result) if snap.result is not None else None
            else:
                value = snap.error
            out.append(Event(snap.status, self.task_id, value, delivery=snap.deliveries))
        return out

    def accept(self, ev: Event) -> tuple[list[Event], bool]:
        """A live event: (events to hand on, whether the stored state must be read)."""
        if self.done:
            return [], False
        if ev.kind == "token":
            if not self.tokens or ev.index is None or ev.index < self.next_index:
                return [], False
            if ev.index > self.next_index:  # a message went missing: read the log
                return [], True
            self.next_index += 1
            return [ev], False
        if ev.terminal:
            if ev.data is FETCH:
                return [], True
            self.done = True
        elif ev.ts and ev.ts < self.since:  # published before the state we replayed
            return [], False
        return [ev], False
