"""The inbox: outcomes that reached this client while nobody waited on their task, for
a later ``Task.result()`` to take without a round trip (a loop over many results); and
per queue an *epoch*, which changes whenever an event may have gone unseen.

Not thread-safe on its own: the hub calls it with its lock held.
"""

from __future__ import annotations

import collections
import itertools
import time

from mtq.client.replies.events import Event

#: the outcomes a hub keeps for tasks nobody waited on when they ended (see Hub.take):
#: at most this many, about this many bytes of the messages that carried them, for
#: this long (s); the oldest go first, and a task whose outcome went is read from
#: Redis as ever. So a producer that never asks for its results holds at most the
#: last minute's, 16 MiB
INBOX_MAX = 100_000
INBOX_MAX_BYTES = 16 << 20
INBOX_TTL_S = 60.0
#: terminal states kept there: final ones. A dead letter can be retried (mtq dlq
#: retry), so a later result() must read what it became
INBOX_KINDS = frozenset({"succeeded", "failed", "cancelled", "expired"})
#: what the inbox keeps for a task that ended in a way it does not keep (dead, or a
#: result too large to ride in the message): that it ended, so that its reader reads
#: the stored state instead of waiting for an event that has come and gone
ENDED = "ended"
#: the values an epoch takes, unique in the process (a hub made again for the same
#: client after close_all() must not repeat an old one's)
_EPOCHS = itertools.count(1)


class Inbox:
    """Outcomes nobody waited for, bounded by INBOX_MAX, INBOX_MAX_BYTES and
    INBOX_TTL_S, and the epoch of each queue (see :meth:`epoch`)."""

    __slots__ = ("_bytes", "_epochs", "_items")

    def __init__(self) -> None:
        #: (queue, task id) -> (its terminal event or ENDED, bytes charged, when it
        #: came, monotonic), oldest first
        self._items: collections.OrderedDict[tuple[str, str], tuple[Event | str, int, float]] = \
            collections.OrderedDict()
        self._bytes = 0
        #: queue -> its epoch
        self._epochs: dict[str, int] = {}

    def epoch(self, queue: str) -> int:
        """A number that changes whenever an event on the reply subscription to
        ``queue`` may have gone unseen: each time the subscription is confirmed (0: not
        yet; again after a lost connection, :meth:`renew`) and each time an outcome is
        dropped from the inbox unread (unique in the process). A task submitted at
        epoch ``e`` whose terminal event is not in the inbox has not ended yet if the
        epoch is still ``e`` once its reader's feed is open (Task.result then needs no
        read of the stored state)."""
        return self._epochs.get(queue, 0)

    def renew(self, queue: str) -> None:
        """The subscription to ``queue`` was (again) confirmed: a new epoch."""
        self._epochs[queue] = next(_EPOCHS)

    def keep(self, queue: str, tid: str, ev: Event | str, charge: int) -> None:
        """Keep a terminal event (or ENDED) for :meth:`take`, charged ``charge`` bytes;
        drop the oldest past the bounds."""
        items = self._items
        old = items.pop((queue, tid), None)
        if old is not None:
            self._bytes -= old[1]
        now = time.monotonic()
        items[(queue, tid)] = (ev, charge, now)
        self._bytes += charge
        while items and (len(items) > INBOX_MAX or self._bytes > INBOX_MAX_BYTES
                         or next(iter(items.values()))[2] < now - INBOX_TTL_S):
            (dropped, _), (_, gone, _) = items.popitem(last=False)
            self._bytes -= gone
            # an outcome nobody will find here: a reader of a task submitted before
            # now must read the stored state (see epoch)
            self._epochs[dropped] = next(_EPOCHS)

    def take(self, queue: str, task_id: str) -> Event | str | None:
        """The task's kept outcome (then forgotten here), or None."""
        kept = self._items.pop((queue, task_id), None)
        if kept is None:
            return None
        self._bytes -= kept[1]
        return kept[0]

    def __len__(self) -> int:
        return len(self._items)
