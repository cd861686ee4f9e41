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
import re
import threading
from collections.abc import Callable
from typing import Any

import redis

from mtq.broker import cluster
from mtq.broker.connection import Backoff, redis_errors, single_attempt
from mtq.broker.keys import QueueKeys
from mtq.errors import ConfigError

log = logging.getLogger(__name__)

COMMANDS = ("pause", "resume", "load", "unload", "reload", "reset", "drain", "stop", "scale")
#: the commands each engine carries out and answers (with a reply id)
ENGINE_COMMANDS = ("load", "unload", "reload", "reset")
#: a reply id: what mtq.broker.answers.new_id makes, or any id of these characters
_REPLY_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _check_options(cmd: str, options: Any) -> dict[str, str]:
    if cmd not in ("load", "reload"):
        raise ConfigError(f"{cmd} takes no model options (--set): only load and reload do")
    if not isinstance(options, dict):
        raise ConfigError(f"{cmd}: options must be a dict of option name to text value "
                          f"(as --set KEY=VALUE gives them), got {type(options).__name__}")
    for k, v in options.items():
        if not isinstance(k, str) or not k.strip() or "=" in k:
            raise ConfigError(f"{cmd}: option name {k!r} is not a name (as in --set KEY=VALUE)")
        if not isinstance(v, str):
            raise ConfigError(f"{cmd}: option {k!r} must be given as text, as with --set "
                              f"{k}=VALUE (e.g. {json.dumps(str(v))}), got "
                              f"{type(v).__name__}")
    return dict(options)


def message(cmd: str, *, worker: str | None = None, supervisor: str | None = None,
            replicas: int | None = None, reply: str | None = None,
            options: dict[str, str] | None = None, now: bool = False) -> dict[str, Any]:
    """Build and check a control message; raises ConfigError for a bad one.

    ``reply`` (a reply id), ``options`` and ``now`` are for the engine commands
    (:data:`ENGINE_COMMANDS`): options for load and reload, now for unload."""
    if cmd not in COMMANDS:
        raise ConfigError(f"unknown control command {cmd!r}; use one of {', '.join(COMMANDS)}")
    msg: dict[str, Any] = {"cmd": cmd}
    if cmd == "scale":
        if replicas is None or replicas < 0:
            raise ConfigError("scale needs a number of replicas >= 0")
        msg["replicas"] = replicas
    if reply is not None:
        if cmd not in ENGINE_COMMANDS:
            raise ConfigError(f"{cmd} is not answered; only {', '.join(ENGINE_COMMANDS)} "
                              "take a reply id")
        if not isinstance(reply, str) or not _REPLY_ID.fullmatch(reply):
            raise ConfigError(f"reply id {reply!r}: 1 to 64 letters, digits, '_' or '-' "
                              "(mtq.broker.answers.new_id() makes one)")
        msg["reply"] = reply
    if options:
        msg["options"] = _check_options(cmd, options)
    elif options is not None and not isinstance(options, dict):
        _check_options(cmd, options)
    if now:
        if cmd != "unload":
            raise ConfigError(f"{cmd} takes no --now: only unload does (it gives the "
                              "running requests back instead of finishing them)")
        msg["now"] = True
    if worker:
        msg["worker"] = worker
    if supervisor:
        msg["supervisor"] = supervisor
    return msg


def send(client: redis.Redis, queue: str, cmd: str, **fields: Any) -> int:
    """Publish a command to the queue's supervisors; returns how many received it."""
    msg = message(cmd, **fields)
    client = cluster.for_queue(client, queue)
    with redis_errors("while sending a control command"):
        # on a sharded cluster the queue's shard delivers it, and counts its listeners
        publish = client.spublish if cluster.sharded(client) else client.publish
        return int(publish(QueueKeys(queue).control, json.dumps(msg)))


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

    def close(self) -> None:
        """Stop listening."""
        self._closed.set()
        ps = self._pubsub
        if ps is not None:
            try:
                ps.close()
            except Exception:  # closing a broken connection may raise anything
                pass
        self._thread.join(timeout=2)

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
