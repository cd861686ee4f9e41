"""Loading the Lua scripts and running them with EVALSHA, alone or pipelined.

Scripts live in ``lua/``, one file per operation; a line ``--@include NAME``
pastes a shared file in. Each script is sent to Redis with SCRIPT LOAD only when
Redis answers NOSCRIPT (first use, or after a restart), so a call costs exactly
one round trip, and a pipeline of calls costs one round trip in all (redis-py's
own pipelined scripts add a SCRIPT EXISTS round trip to every execute).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import redis
from redis.exceptions import NoScriptError

from mtq.broker import cluster, lane
from mtq.broker.connection import redis_errors, single_attempt
from mtq.errors import BrokerError

NAMES = ("submit", "claim", "ack", "nack", "extend", "cancel", "reap", "emit", "watch", "purge",
         "dlq", "orphans", "trace", "admit", "handover", "handed")


@dataclass(frozen=True)
class LuaScript:
    """One operation's source and SHA1."""

    name: str
    source: str
    sha: str


def _read(name: str) -> str:
    return resources.files("mtq.broker").joinpath("lua").joinpath(name).read_text(encoding="utf-8")


_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DEFINES = re.compile(r"(?:local\s+function|local|function)?\s*([A-Za-z_][A-Za-z0-9_]*(?:\s*,\s*[A-Za-z_][A-Za-z0-9_]*)*)")


def _code(text: str) -> str:
    """Lua text without its comments (strings kept: a word in one only over-includes)."""
    text = re.sub(r"--\[(=*)\[.*?\]\1\]", "", text, flags=re.S)
    return re.sub(r"--[^\n]*", "", text)


@dataclass(frozen=True)
class _Statement:
    text: str
    defines: frozenset[str]
    uses: frozenset[str]


@cache
def _library(name: str) -> tuple[_Statement, ...]:
    """A shared file's top-level statements: each starts on a line at column 0 (its
    comment lines just above belong to it) and runs until the next one. The names
    it defines are those a top-level ``local``, ``local function``, ``function`` or
    assignment introduces or sets."""
    statements: list[_Statement] = []
    lines: list[str] = []
    pending: list[str] = []  # comment lines waiting for the statement they precede

    def close() -> None:
        if lines:
            first = next(ln for ln in lines if not ln.startswith("--"))
            head = first.split("=", 1)[0].split("(", 1)[0]
            m = _DEFINES.match(head)
            defines = frozenset(n.strip() for n in m.group(1).split(",")) if m else frozenset()
            text = "\n".join(lines)
            statements.append(_Statement(text, defines, frozenset(_WORD.findall(_code(text)))))
            lines.clear()

    source = _read(name)
    if source.startswith("--[["):  # the file's header: documentation, not code
        source = source[source.index("]]") + 2:].lstrip("\n")
    for line in source.splitlines():
        top = line[:1] not in ("", " ", "\t") and not line.startswith("end") and \
            not line.startswith("}") and not line.startswith(")")
        if line.startswith("--"):
            pending.append(line)
        elif top:
            close()
            lines.extend(pending)
            pending.clear()
            lines.append(line)
        else:
            lines.extend(pending)
            pending.clear()
            lines.append(line)
    lines.extend(pending)
    close()
    return tuple(statements)


def _shaken(name: str, uses: set[str]) -> str:
    """The statements of the shared file ``name`` that define what ``uses`` names,
    and, in turn, what those use: in the file's order, so that Lua's scoping of
    locals is the file's. A script pays each call for every function and table its
    prelude creates (closures included, a fixed cost on every claim), so it gets only
    those it can reach."""
    statements = _library(name)
    wanted: set[str] = set()
    todo = set(uses)
    while todo:
        word = todo.pop()
        for st in statements:
            if word in st.defines and st.text not in wanted:
                wanted.add(st.text)
                todo |= st.uses
    return "\n".join(st.text for st in statements if st.text in wanted)


def _expand(name: str) -> str:
    source = _read(name)
    uses = set(_WORD.findall(_code(source)))
    lines = []
    for line in source.splitlines():
        if line.startswith("--@include "):
            lines.append(_shaken(line.split(None, 1)[1].strip(), uses))
        else:
            lines.append(line)
    return "\n".join(lines) + "\n"


@cache
def script(name: str) -> LuaScript:
    """The script named ``name`` (cached; read from the package once)."""
    if name not in NAMES:
        raise KeyError(f"no Lua script named {name!r}")
    source = _expand(name + ".lua")
    return LuaScript(name, source, hashlib.sha1(source.encode()).hexdigest())


#: the line of _lib.lua that names the publishing command
_PUBLISH = "local PUBLISH = 'PUBLISH'"


@cache
def sharded(plain: LuaScript) -> LuaScript:
    """The variant of ``plain`` for a cluster with sharded pub/sub (Redis 7+): it
    publishes with SPUBLISH, so an event reaches only the shard of its queue."""
    if _PUBLISH not in plain.source:
        return plain  # publishes nothing
    source = plain.source.replace(_PUBLISH, "local PUBLISH = 'SPUBLISH'", 1)
    return LuaScript(plain.name, source, hashlib.sha1(source.encode()).hexdigest())


def _variant(client: Any) -> Callable[[LuaScript], LuaScript]:
    return sharded if cluster.sharded(client) else _same


def _same(s: LuaScript) -> LuaScript:
    return s


@dataclass(frozen=True)
class Call:
    """A script invocation plus the function that turns its raw reply into a value."""

    script: LuaScript
    keys: Sequence[str]
    args: Sequence[Any]
    parse: Callable[[Any], Any]


MIN_REDIS = (6, 2)


def load_all(client: redis.Redis) -> None:
    """SCRIPT LOAD every script in one round trip (after a NOSCRIPT reply).

    Checks the server version first: the scripts use ``LPOP key count`` (6.2+).
    """
    version = str(client.info("server").get("redis_version", "0"))
    parts = tuple(int(x) for x in version.split(".")[:2] if x.isdigit())
    if parts < MIN_REDIS:
        raise BrokerError(f"Redis {version} is too old: mtq needs Redis "
                          f"{'.'.join(map(str, MIN_REDIS))} or newer (or Valkey)")
    variant = _variant(client)
    pipe = client.pipeline(transaction=False)
    for name in NAMES:
        pipe.script_load(variant(script(name)).source)
    pipe.execute()


#: scripts that must not be sent twice without their caller knowing: a repeated
#: claim leaves the first one's tasks held by nobody (until their leases expire), a
#: repeated submit of tasks without ids of their own would duplicate them. They go
#: out once; their callers retry (Queue dedupes by task id, a worker sweeps orphans).
SEND_ONCE = frozenset({"claim", "submit"})


def run(client: redis.Redis, *calls: Call) -> list[Any]:
    """Run ``calls`` in one round trip (a non-transactional pipeline if several).

    A dropped connection is re-opened and the calls sent again (see
    :func:`mtq.broker.connection.retry_policy`), except calls of :data:`SEND_ONCE`
    scripts: a round trip that holds one raises RedisUnavailable instead. Scripts
    Redis does not know yet are loaded and only those calls re-run: a NOSCRIPT reply
    means the script did not execute at all, so re-running it is safe.
    """
    if any(c.script.name in SEND_ONCE for c in calls):
        with single_attempt():
            return _run(client, calls)
    return _run(client, calls)


def _evalsha(variant: Callable[[LuaScript], LuaScript], c: Call) -> tuple[Any, ...]:
    return ("EVALSHA", variant(c.script).sha, len(c.keys), *c.keys, *c.args)


def _run(client: redis.Redis, calls: Sequence[Call]) -> list[Any]:
    with redis_errors():
        variant = _variant(client)
        raws = lane.exchange(client, [_evalsha(variant, c) for c in calls])
        missing = [i for i, r in enumerate(raws) if isinstance(r, NoScriptError)]
        if missing:
            # Each script is atomic and order-independent for correctness (the busy
            # set, not call order, keeps streams ordered); re-running only the
            # missing calls may just leave a claim emptier than it could have been.
            load_all(client)
            variant = _variant(client)
            again = lane.exchange(client, [_evalsha(variant, calls[i]) for i in missing])
            for i, r in zip(missing, again):
                raws[i] = r
        for r in raws:
            if isinstance(r, Exception):
                raise r
        return [c.parse(r) for c, r in zip(calls, raws)]


def run_then_wait(client: redis.Redis, call: Call, replicas: int, timeout_ms: int
                  ) -> tuple[Any, int]:
    """Run ``call``, then ``WAIT replicas timeout_ms`` on the same connection, in one
    round trip: (the call's value, how many replicas acknowledged its writes).
    See :func:`run_durable`."""
    values, acks = run_durable(client, [call], replicas, timeout_ms)
    return values[0], acks


def run_durable(client: redis.Redis, calls: Sequence[Call], replicas: int, timeout_ms: int,
                _load: bool = True) -> tuple[list[Any], int]:
    """Run ``calls``, then ``WAIT replicas timeout_ms`` on the same connection, in one
    round trip: (the calls' values, how many replicas acknowledged their writes).

    WAIT counts the replicas that received every write this connection made, so it
    must follow the scripts on the connection that ran them (a pipeline does). A round
    trip holding a :data:`SEND_ONCE` script is sent once; any other is sent again
    after a dropped connection, WAIT included: a worker's acks whose reply or whose
    WAIT was lost with a primary that died go again to the replica promoted in its
    place (fenced by their lease tokens, an ack the replica already has changes
    nothing), so an acknowledged result is not lost with the primary."""
    once = any(c.script.name in SEND_ONCE for c in calls)
    with redis_errors():
        with single_attempt() if once else nullcontext():
            variant = _variant(client)
            *raws, acks = lane.exchange(client, [*(_evalsha(variant, c) for c in calls),
                                                 ("WAIT", replicas, timeout_ms)])
        missing = [i for i, r in enumerate(raws) if isinstance(r, NoScriptError)] \
            if _load else []
        values: list[Any] = [None] * len(calls)
        if missing:
            # those did not run (the others did): load the scripts, run them, WAIT again
            load_all(client)
            again, acks = run_durable(client, [calls[i] for i in missing], replicas,
                                      timeout_ms, _load=False)
            for i, v in zip(missing, again):
                values[i] = v
        for i, (c, r) in enumerate(zip(calls, raws)):
            if i in missing:
                continue
            if isinstance(r, Exception):
                raise r
            values[i] = c.parse(r)
        if isinstance(acks, Exception):
            raise acks
        return values, int(acks)
