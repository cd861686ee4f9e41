"""Load, unload, reload and reset the engines serving a queue, and wait until done.

An *engine* is one queue's model in one worker process (``mtq workers list`` shows
one registry entry per engine). Each call here asks every engine that serves the
queue now (the live registry entries whose role is "serving", or the one ``worker``
names), publishes the command with a fresh reply id on the queue's control channel,
and waits, without polling, for each engine's answer (:mod:`mtq.broker.answers`)::

    import mtq.admin
    answers = mtq.admin.reload(client, "emb", options={"pooling": "cls"}, timeout=600)
    failed = [a for a in answers if not a["ok"]]

Each answer is a dict: ``op``, ``ok``, ``queue``, ``worker``, ``host``, ``pid``,
``supervisor``, ``state`` (the engine's state after it: loaded, unloaded, failed ...),
``took_s``, ``detail`` (one line for people) and ``error`` ("" when ok). An engine
that fails (a reload to options or code that cannot load keeps the old model) answers
``ok: False``; the call returns the answers in the order they came and raises only
when it cannot wait for them:

* :class:`~mtq.errors.NoEngine`: no engine serves the queue (or has that worker id);
* :class:`~mtq.errors.EngineTimeout`: not every engine answered within ``timeout``
  seconds (its ``answers`` and ``missing``); the engines that did not answer may
  still carry the command out;
* :class:`~mtq.errors.ConfigError`: a bad option, op or timeout (nothing was sent).

``mtq workers load|unload|reload|reset`` is a thin layer over :func:`command`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis

from mtq.broker import answers, commands
from mtq.broker.registry import list_workers
from mtq.client.queue import Queue
from mtq.errors import ConfigError, EngineTimeout, NoEngine
from mtq.validation import check_queue_name

#: how long a command waits for its answers by default: a model load can take minutes
DEFAULT_TIMEOUT_S = 600.0

Answer = dict[str, Any]


def _target(client_or_queue: redis.Redis | Queue, queue: str | None) -> tuple[redis.Redis, str]:
    if isinstance(client_or_queue, Queue):
        return client_or_queue.redis, client_or_queue.name
    if queue is None:
        raise TypeError("name the queue: load(client, 'emb'), or load(mtq.Queue('emb'))")
    return client_or_queue, check_queue_name(queue)


def engines(client: redis.Redis, queue: str, worker: str | None = None) -> list[dict[str, Any]]:
    """The engines that must answer a command to ``queue``: its live registry entries
    whose role is "serving" (not a quarantine process), only ``worker``'s if given."""
    return [w for w in list_workers(client, queue)
            if w.get("role", "serving") == "serving" and (not worker or w["id"] == worker)]


def command(client_or_queue: redis.Redis | Queue, queue: str | None = None, op: str = "",
            *, options: dict[str, str] | None = None, now: bool = False,
            worker: str | None = None, timeout: float = DEFAULT_TIMEOUT_S,
            on_answer: Callable[[Answer], None] | None = None,
            on_sent: Callable[[list[dict[str, Any]]], None] | None = None) -> list[Answer]:
    """Carry out ``op`` (load, unload, reload, reset) on every engine serving the queue
    and return their answers, in the order they came. ``on_sent(engines)`` is called
    once the command is published, with the registry entries of the engines asked;
    ``on_answer(answer)`` as each answer comes (an engine that started after the
    registry was read may answer too: its answer is in the list, not waited for).
    Raises NoEngine, EngineTimeout or ConfigError (see the module's docstring)."""
    client, name = _target(client_or_queue, queue)
    if op not in commands.ENGINE_COMMANDS:
        raise ConfigError(f"unknown engine command {op!r}; use one of "
                          f"{', '.join(commands.ENGINE_COMMANDS)}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
            not 0 < timeout < float("inf"):
        raise ConfigError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    rid = answers.new_id()
    # checked before anything is read or sent
    msg = commands.message(op, worker=worker, reply=rid, options=options, now=now)
    asked = engines(client, name, worker)
    if not asked:
        raise NoEngine(name, worker)
    if commands.publish(client, name, msg) == 0:
        raise NoEngine(name, worker, detail=(
            f"the registry lists {len(asked)} engine(s) of queue {name!r}, but no process "
            "listens on its control channel (they may have just stopped); start one with "
            f"mtq workers start TARGET -q {name}"))
    if on_sent is not None:
        on_sent(asked)
    pending = {str(w["id"]) for w in asked}
    got: list[Answer] = []

    def take(answer: Answer) -> None:
        got.append(answer)
        pending.discard(str(answer.get("worker")))
        if on_answer is not None:
            on_answer(answer)

    deadline = time.monotonic() + timeout
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        # as many as are missing: an engine not asked may answer too, then wait again
        answers.collect(client, name, rid, len(pending), left, on_answer=take)
    if pending:
        raise EngineTimeout(name, op, timeout, got,
                            [w for w in asked if str(w["id"]) in pending])
    return got


def load(client_or_queue: redis.Redis | Queue, queue: str | None = None, *,
         options: dict[str, str] | None = None, worker: str | None = None,
         timeout: float = DEFAULT_TIMEOUT_S) -> list[Answer]:
    """Load the model of each engine serving the queue (those unloaded; ``options``:
    with these model options, text as ``--set`` takes them); returns the answers."""
    return command(client_or_queue, queue, "load", options=options, worker=worker,
                   timeout=timeout)


def unload(client_or_queue: redis.Redis | Queue, queue: str | None = None, *,
           now: bool = False, worker: str | None = None,
           timeout: float = DEFAULT_TIMEOUT_S) -> list[Answer]:
    """Unload the model of each engine serving the queue: it finishes its running
    work (``now``: gives it back to the queue) and frees the model's memory; the
    queue's tasks wait (or go to other processes) until a load."""
    return command(client_or_queue, queue, "unload", now=now, worker=worker,
                   timeout=timeout)


def reload(client_or_queue: redis.Redis | Queue, queue: str | None = None, *,
           options: dict[str, str] | None = None, worker: str | None = None,
           timeout: float = DEFAULT_TIMEOUT_S) -> list[Answer]:
    """Reload the model of each engine serving the queue (re-import the target, set
    it up again; ``options``: with these); an engine whose reload fails keeps its old
    model and answers ``ok: False`` with the error."""
    return command(client_or_queue, queue, "reload", options=options, worker=worker,
                   timeout=timeout)


def reset(client_or_queue: redis.Redis | Queue, queue: str | None = None, *,
          worker: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> list[Answer]:
    """Drop each engine's caches and state, keeping its weights loaded."""
    return command(client_or_queue, queue, "reset", worker=worker, timeout=timeout)
