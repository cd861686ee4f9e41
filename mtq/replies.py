"""The reply subscription lives in :mod:`mtq.client.replies` (events, feeds, the
wire reader, the inbox, the callbacks thread, the hub), and the readers' clocks in
:mod:`mtq.client.waiting`. This module re-exports their names under the path the
docs use, for code that imports it (``mtq.replies.INBOX_MAX``, ``mtq.replies.hub_of``);
setting one of the tunables here (a test's monkeypatch) sets it in the module that reads it.
"""

import sys
import types

import mtq.client.replies.callbacks as _callbacks
import mtq.client.replies.hub as _hub
import mtq.client.replies.inbox as _inbox
import mtq.client.replies.wire as _wire
import mtq.client.waiting as _waiting
from mtq.client.replies.callbacks import RETRY_READ_S
from mtq.client.replies.events import (
    FETCH,
    LOST,
    RESYNC,
    Event,
    StreamState,
    decode_message,
)
from mtq.client.replies.feeds import (
    AsyncFeed,
    AsyncOneShot,
    CallbackFeed,
    Feed,
    OneShot,
    SyncFeed,
    Watched,
)
from mtq.client.replies.hub import PARK_S, Hub, hub_of
from mtq.client.replies.inbox import (
    ENDED,
    INBOX_KINDS,
    INBOX_MAX,
    INBOX_MAX_BYTES,
    INBOX_TTL_S,
)
from mtq.client.replies.wire import IDLE_PING_S, PING_ANSWER_S, POLL_S
from mtq.client.waiting import RESYNC_S

#: the tunables, and the module whose code reads each
_HOMES: dict[str, types.ModuleType] = {
    **dict.fromkeys(("INBOX_MAX", "INBOX_MAX_BYTES", "INBOX_TTL_S"), _inbox),
    **dict.fromkeys(("POLL_S", "IDLE_PING_S", "PING_ANSWER_S"), _wire),
    "PARK_S": _hub,
    "RESYNC_S": _waiting,
    "RETRY_READ_S": _callbacks,
}


class _Forwarding(types.ModuleType):
    def __setattr__(self, name: str, value: object) -> None:
        home = _HOMES.get(name)
        if home is not None:
            setattr(home, name, value)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Forwarding

__all__ = [
    "ENDED", "FETCH", "IDLE_PING_S", "INBOX_KINDS", "INBOX_MAX", "INBOX_MAX_BYTES",
    "INBOX_TTL_S", "LOST", "PARK_S", "PING_ANSWER_S", "POLL_S", "RESYNC", "RESYNC_S",
    "RETRY_READ_S", "AsyncFeed", "AsyncOneShot", "CallbackFeed", "Event", "Feed", "Hub",
    "OneShot", "StreamState", "SyncFeed", "Watched", "decode_message", "hub_of",
]
