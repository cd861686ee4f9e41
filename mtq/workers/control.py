"""Control messages over pub/sub: what operators send to running workers.

Commands (JSON on the queue's control channel ``mtq:{q}:control``):

=========  ===========================================================  ===============
command    effect                                                       addressed to
=========  ===========================================================  ===============
pause      stop claiming; give back what was claimed ahead              workers
resume     claim again                                                  workers
load       load the engine's model (an unloaded one); ``options``       workers
unload     finish the running work (``now``: give it back), free the    workers
           model's memory; its tasks wait, or go to other processes
reload     re-import the target and set it up again (``options``: with  workers
           these); no task lost; a failure keeps the old model
reset      drop the engine's caches and state, keep its weights         workers
drain      work until the queue is empty, then exit                     supervisors
stop       finish the running batch, give the rest back, exit           supervisors
scale      ``replicas``: processes per device, added or retired live    supervisors
=========  ===========================================================  ===============

``worker`` (a worker id) or ``supervisor`` (a supervisor id) narrow a command to one
process. Pub/sub delivers to whoever listens now: :func:`send` returns how many
supervisors received the message, and the registry shows the state they reached.

The engine commands (load, unload, reload, reset: :data:`ENGINE_COMMANDS`) may carry
``reply``, a reply id (:func:`mtq.broker.answers.new_id`): every engine that carries
one out posts what happened to it (:mod:`mtq.broker.answers`), and the operator's
command waits for those answers (:mod:`mtq.client.engines`). ``options`` (load,
reload) are model options as ``--set`` gives them (text values); ``now`` (unload)
gives the running requests back instead of finishing them.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import redis

from mtq.broker import cluster
from mtq.broker.commands import COMMANDS, ENGINE_COMMANDS, message, publish
from mtq.broker.connection import Backoff, single_attempt
from mtq.broker.keys import QueueKeys

__all__ = ["COMMANDS", "ENGINE_COMMANDS", "Listener", "message", "send"]

log = logging.getLogger(__name__)

def send(client: redis.Redis, queue: str, cmd: str, **fields: Any) -> int:
    """Publish a command to the queue's supervisors; returns how many received it."""
    return publish(client, queue, message(cmd, **fields))


class Listener:
    """A daemon thread that hands every control message of a queue to ``callback``,
    resubscribing with backoff when the connection drops."""

    def __init__(self, client: redis.Redis, queue: str,
                 callback: Callable[[dict[str, Any]], None]) -> None:
        self.client = cluster.for_queue(client, queue)
        self.channel = QueueKeys(queue).control
        self.callback = callback
        self._closed = threading.Event()
        self._pubsub: Any = None
        self.subscribed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mtq-control", daemon=True)

    def start(self) -> None:
        """Subscribe and start delivering (returns once subscribed, or after 5 s)."""
        self._thread.start()
        self.subscribed.wait(5)

    def close(self, timeout: float = 2.0) -> None:
        """Stop listening (waiting at most ``timeout`` for its thread, a daemon)."""
        self._closed.set()
        ps = self._pubsub
        if ps is not None:
            try:
                ps.close()
            except Exception:  # closing a broken connection may raise anything
                pass
        self._thread.join(timeout=timeout)

    def _run(self) -> None:
        backoff = Backoff()
        while not self._closed.is_set():
            try:
                self._pubsub = self.client.pubsub(ignore_subscribe_messages=True)
                if cluster.sharded(self.client):
                    self._pubsub.ssubscribe(self.channel)
                else:
                    self._pubsub.subscribe(self.channel)
                self.subscribed.set()
                backoff.reset()
                ps = self._pubsub
                while not self._closed.is_set():
                    # one attempt per read: redis-py's own retry would re-open the
                    # connection close() shuts down and block on it (close() would
                    # wait its whole timeout); the loop around reconnects
                    with single_attempt():
                        raw = ps.parse_response(block=True)
                    item = ps.handle_message(raw, ignore_subscribe_messages=False)
                    if self._closed.is_set():
                        return
                    if item is None:
                        continue
                    if item.get("type") == "sunsubscribe":  # the slot moved: again
                        raise redis.exceptions.ConnectionError("the control channel moved")
                    if item.get("type") not in ("message", "smessage"):
                        continue
                    try:
                        msg = json.loads(item["data"])
                        if not isinstance(msg, dict):
                            raise ValueError("not an object")
                    except ValueError:
                        log.warning("malformed control message %r ignored", item["data"])
                        continue
                    self.callback(msg)
            # RuntimeError: redis-py's "pubsub connection not set", once close() ran
            except (redis.RedisError, OSError, ValueError, AttributeError, RuntimeError):
                if self._closed.is_set():
                    return
                delay = backoff.next()  # the first retry at once, then up to 1 s apart
                (log.warning if backoff.failures == 2 else log.debug)(
                    "control channel lost; resubscribing in %.2f s", delay)
                old, self._pubsub = self._pubsub, None
                if old is not None:  # its connection, to a node that may be gone
                    try:
                        old.close()
                    except Exception:  # closing a broken connection may raise anything
                        pass
                self._closed.wait(delay)
