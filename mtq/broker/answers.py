"""Answers to the engine commands (load, unload, reload, reset): each engine that
carried one out posts what happened; the operator's command waits for them.

A command is published on the queue's control channel with a fresh reply id
(``mtq.workers.control``); every engine serving the queue, in whatever process,
runs it and pushes one JSON object to ``mtq:{q}:answers:<id>``, a list that expires
after :data:`ANSWER_TTL_S`. The command blocks on that list (BLPOP: no polling)
until it has as many answers as there were engines to ask, or its timeout.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import redis

from mtq.broker import cluster
from mtq.broker.connection import redis_errors
from mtq.broker.keys import QueueKeys

#: how long an answer list is kept for a command that stopped waiting
ANSWER_TTL_S = 600


def new_id() -> str:
    """A reply id for one command."""
    return os.urandom(8).hex()


def key(queue: str, rid: str) -> str:
    """The list the answers to command ``rid`` on ``queue`` are pushed to."""
    return QueueKeys(queue).base + "answers:" + rid


def post(client: redis.Redis, queue: str, rid: str, result: dict[str, Any]) -> None:
    """Push one engine's answer (one round trip); a BrokerError if Redis is gone."""
    client = cluster.for_queue(client, queue)
    k = key(queue, rid)
    with redis_errors("while answering a command"):
        pipe = client.pipeline(transaction=False)
        pipe.rpush(k, json.dumps(result))
        pipe.expire(k, ANSWER_TTL_S)
        pipe.execute()


def collect(client: redis.Redis, queue: str, rid: str, expect: int, timeout_s: float,
            on_answer: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Wait for ``expect`` answers to command ``rid``, at most ``timeout_s`` seconds;
    returns those that came (fewer than ``expect``: the timeout passed).
    ``on_answer`` sees each as it comes."""
    client = cluster.for_queue(client, queue)
    k = key(queue, rid)
    out: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < expect:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        with redis_errors("while waiting for answers"):
            # BLPOP's timeout is in seconds (a float since Redis 6); 0 would mean forever
            got = client.blpop([k], timeout=max(0.01, min(left, 5.0)))
        if got is None:
            continue
        try:
            answer = json.loads(got[1])
        except ValueError:
            continue
        if isinstance(answer, dict):
            out.append(answer)
            if on_answer is not None:
                on_answer(answer)
    return out
