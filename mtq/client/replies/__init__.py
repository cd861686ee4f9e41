"""Replies: one subscription per client for the events of all the tasks it waits on.

Every task names the reply channel of the client that submitted it (a client
waiting on someone else's task adds its own, see ``watch.lua``). A
:class:`~mtq.client.replies.hub.Hub` per Redis client and process holds one pub/sub
connection subscribed to that client's channel on each queue it uses, and one thread
that reads it and hands each event to the *feeds* open on its task: an iterator's
queue, an asyncio queue, or a callback. Nothing polls: a feed wakes when its event
arrives.

Nothing is lost either. A feed starts from the task's stored state (status,
result, the tokens streamed so far: one round trip), then takes live events,
dropping tokens it already has by index. When the connection drops, the hub makes a
new one and subscribes again; it sees the new subscription confirmed and tells every
feed of that queue to read the stored state again, so tokens and completions
published while it was away are replayed from Redis.

By concern: :mod:`.events` (what an event is, the message parser, a reader's
state), :mod:`.feeds` (where events go), :mod:`.wire` (the connection's reader),
:mod:`.inbox` (outcomes nobody waited for), :mod:`.callbacks` (the callback thread)
and :mod:`.hub` (the subscription and its thread). Log records go to the
``mtq.replies`` logger.
"""

from mtq.client.replies.callbacks import RETRY_READ_S, CallbackThread
from mtq.client.replies.events import FETCH, LOST, RESYNC, Event, StreamState, decode_message
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
    Inbox,
)
from mtq.client.replies.wire import IDLE_PING_S, PING_ANSWER_S, POLL_S, Wire

__all__ = [
    "ENDED",
    "FETCH",
    "IDLE_PING_S",
    "INBOX_KINDS",
    "INBOX_MAX",
    "INBOX_MAX_BYTES",
    "INBOX_TTL_S",
    "LOST",
    "PARK_S",
    "PING_ANSWER_S",
    "POLL_S",
    "RESYNC",
    "RETRY_READ_S",
    "AsyncFeed",
    "AsyncOneShot",
    "CallbackFeed",
    "CallbackThread",
    "Event",
    "Feed",
    "Hub",
    "Inbox",
    "OneShot",
    "StreamState",
    "SyncFeed",
    "Watched",
    "Wire",
    "decode_message",
    "hub_of",
]
