"""Control commands as messages: which there are, one built and checked, one published.

The workers' side (who receives them and what each does) is :mod:`mtq.workers.control`;
the engine commands that wait for their answers are :mod:`mtq.client.engines`. The
messages are JSON objects published on the queue's control channel
(``mtq:{q}:control``).
"""

from __future__ import annotations

import json
import re
from typing import Any

import redis

from mtq.broker import cluster
from mtq.broker.connection import redis_errors
from mtq.broker.keys import QueueKeys
from mtq.errors import ConfigError

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


def publish(client: redis.Redis, queue: str, msg: dict[str, Any]) -> int:
    """Publish a message (built by :func:`message`) on the queue's control channel;
    returns how many listeners received it (supervisors, and ``mtq worker run``
    processes)."""
    client = cluster.for_queue(client, queue)
    with redis_errors("while sending a control command"):
        # on a sharded cluster the queue's shard delivers it, and counts its listeners
        publish = client.spublish if cluster.sharded(client) else client.publish
        return int(publish(QueueKeys(queue).control, json.dumps(msg)))
