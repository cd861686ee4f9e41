"""Schedules: a task submitted to a queue at each occurrence of a cron expression, in an
explicit time zone. Made, listed and removed here (``mtq schedule add|list|remove``, a
host file's ``[[schedule]]``); run by :mod:`mtq.workers.scheduler` (``mtq schedule
run``, and a thread of ``mtq workers start``).

Redis holds, under one hash tag (one cluster slot, so each script touches one slot):
``DEFS`` (hash: name -> the schedule's JSON), ``CURSOR`` (hash: name -> the unix time,
in whole seconds, of the last occurrence dealt with: submitted or skipped), ``LEASE``
(the leader's token, with an expiry) and ``VERSION`` (bumped by every add and remove,
and published on ``CHANNEL``, so that the leader reloads at once).

Each occurrence's task has the id ``s-<name>-<unix seconds>``: mtq refuses a second
task with an id its queue still holds (``DuplicateTask``), so an occurrence submitted
twice (a leader killed between its submit and its cursor's advance, a stale leader) is
a no-op. The cursor advances only after the submit, and only under the lease's token.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from mtq.broker.cluster import shared
from mtq.broker.keys import PREFIX
from mtq.errors import PayloadError, ScheduleError
from mtq.validation import check_queue_name, check_stream_name, check_tenant

__all__ = ["CATCH_UP", "Schedule", "add", "check", "cursors", "get", "list_schedules",
           "next_after", "occurrences", "put", "remove", "task_id"]

_TAG = "{schedules}"
DEFS = f"{PREFIX}:{_TAG}:defs"
CURSOR = f"{PREFIX}:{_TAG}:cursor"
LEASE = f"{PREFIX}:{_TAG}:lease"
VERSION = f"{PREFIX}:{_TAG}:version"
CHANNEL = f"{PREFIX}:{_TAG}:changed"

#: what a schedule does with occurrences missed while no scheduler ran
CATCH_UP = ("all", "latest", "none")
#: the most missed occurrences one schedule submits when caught up with ``all``
CATCH_UP_MAX = 1000
#: a name: it goes into task ids (``s-<name>-<seconds>``, at most 64 characters)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,39}")

_ADD = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
local v = redis.call('INCR', KEYS[3])
redis.call('PUBLISH', ARGV[4], v)
return 1
"""
_PUT = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
local cur = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '')
if not cur or (ARGV[5] == '1' and tonumber(ARGV[3]) > cur) then
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
end
local v = redis.call('INCR', KEYS[3])
redis.call('PUBLISH', ARGV[4], v)
return 1
"""
_REMOVE = """
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HDEL', KEYS[2], ARGV[1])
local v = redis.call('INCR', KEYS[3])
redis.call('PUBLISH', ARGV[2], v)
return 1
"""


@dataclass(frozen=True)
class Schedule:
    """One schedule. ``cron``: five fields (minute hour day month weekday), or six with
    seconds last (croniter's order); ``tz``: an IANA zone (``UTC``, ``Europe/Paris``);
    ``catch_up``: ``all`` (every missed occurrence, at most :data:`CATCH_UP_MAX`),
    ``latest`` (the last missed one) or ``none`` (skip them); ``created``: unix time."""

    name: str
    queue: str
    cron: str
    payload: Any
    stream: str | None = None
    tenant: str | None = None
    tz: str = "UTC"
    catch_up: str = "latest"
    created: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "queue": self.queue, "cron": self.cron,
                "payload": self.payload, "stream": self.stream, "tenant": self.tenant,
                "tz": self.tz, "catch_up": self.catch_up, "created": self.created}

    def next_after(self, ts: float) -> float:
        """The unix time of the first occurrence strictly after ``ts``."""
        return next_after(self.cron, self.tz, ts)


def _croniter(expr: str, zone: str, ts: float) -> Any:
    from croniter import croniter

    return croniter(expr, datetime.fromtimestamp(ts, ZoneInfo(zone)))


def next_after(expr: str, zone: str, ts: float) -> float:
    """The unix time (whole seconds) of ``expr``'s first occurrence after ``ts`` in
    ``zone``."""
    return float(_croniter(expr, zone, ts).get_next(float))


def occurrences(expr: str, zone: str, after: float, until: float,
                most: int = CATCH_UP_MAX + 1) -> list[float]:
    """The occurrences in (after, until], oldest first: the latest ``most`` of them."""
    it = _croniter(expr, zone, after)
    out: list[float] = []
    while len(out) < most:
        t = float(it.get_next(float))
        if t > until:
            return out
        out.append(t)
    if float(_croniter(expr, zone, out[-1]).get_next(float)) > until:
        return out
    # more than ``most``: the latest ones, read back from until (occurrences are whole
    # seconds, so those before floor(until) + 1 are those at or before until)
    back = _croniter(expr, zone, math.floor(until) + 1)
    out = []
    while len(out) < most:
        t = float(back.get_prev(float))
        if t <= after:
            break
        out.append(t)
    return out[::-1]


def task_id(name: str, occurrence: float) -> str:
    """The id of the task of ``name``'s occurrence at unix time ``occurrence``."""
    return f"s-{name}-{int(occurrence)}"


def check(name: object, queue: object, cron: object, payload: object,
           stream: object, tenant: object, tz: object, catch_up: object) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ScheduleError(f"a schedule name is 1 to 40 letters, digits, '_' or '-' "
                            f"(starting with a letter or digit), got {name!r}")
    check_queue_name(queue)
    if stream is not None:
        check_stream_name(stream)
    if tenant is not None:
        check_tenant(tenant)
    if not isinstance(tz, str) or not tz:
        raise ScheduleError(f"give the time zone as an IANA name (UTC, Europe/Paris), "
                            f"got {tz!r}")
    try:
        ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise ScheduleError(f"unknown time zone {tz!r}: give an IANA name such as UTC or "
                            f"Europe/Paris") from exc
    if catch_up not in CATCH_UP:
        raise ScheduleError(f"catch_up must be one of {', '.join(CATCH_UP)}, got "
                            f"{catch_up!r}")
    from croniter import croniter

    if not isinstance(cron, str) or not croniter.is_valid(cron) or \
            len(cron.split()) not in (5, 6):
        raise ScheduleError(f"bad cron expression {cron!r}: give five fields (minute hour "
                            f"day month weekday, e.g. '*/5 * * * *') or six with seconds "
                            f"last ('* * * * * */10')")
    try:
        json.dumps(payload)
    except (TypeError, ValueError) as exc:
        raise PayloadError(f"a schedule's payload must be JSON (str, number, bool, None, "
                           f"list, dict): {exc}") from exc


def add(client: Any, name: str, queue: str, cron: str, payload: Any, *,
        stream: str | None = None, tenant: str | None = None, tz: str = "UTC",
        catch_up: str = "latest") -> Schedule:
    """Add a schedule; its first occurrence is the first after now. Raises
    ScheduleError (bad cron, zone, name or policy; the name taken), InvalidName (queue,
    stream, tenant) or PayloadError (not JSON), writing nothing."""
    check(name, queue, cron, payload, stream, tenant, tz, catch_up)
    now = time.time()
    sched = Schedule(name=name, queue=queue, cron=cron, payload=payload, stream=stream,
                     tenant=tenant, tz=tz, catch_up=catch_up, created=now)
    c = shared(client)
    done = c.eval(_ADD, 3, DEFS, CURSOR, VERSION, name, json.dumps(sched.as_dict()),
                  str(int(now)), CHANNEL)
    if not int(done):
        raise ScheduleError(f"a schedule named {name!r} exists: remove it first ('mtq "
                            f"schedule remove {name}') or choose another name")
    return sched


def put(client: Any, name: str, queue: str, cron: str, payload: Any, *,
        stream: str | None = None, tenant: str | None = None, tz: str = "UTC",
        catch_up: str = "latest") -> Schedule:
    """Add the schedule, or replace the one of that name (a host file's
    ``[[schedule]]``, applied at every ``mtq workers start``): left as it is when the
    same; else replaced. A new cron or zone starts from now, as an added schedule does
    (the old cursor would make the new expression's occurrences before now look
    missed, and caught up); other changes keep the cursor (no occurrence submitted
    twice). Raises as :func:`add` does, writing nothing."""
    check(name, queue, cron, payload, stream, tenant, tz, catch_up)
    c = shared(client)
    old = get(c, name)
    sched = Schedule(name=name, queue=queue, cron=cron, payload=payload, stream=stream,
                     tenant=tenant, tz=tz, catch_up=catch_up,
                     created=old.created if old is not None else time.time())
    if old == sched:
        return old
    retimed = old is not None and (old.cron, old.tz) != (cron, tz)
    c.eval(_PUT, 3, DEFS, CURSOR, VERSION, name, json.dumps(sched.as_dict()),
           str(int(time.time())), CHANNEL, "1" if retimed else "0")
    return sched


def remove(client: Any, name: str) -> bool:
    """Remove the schedule ``name``; False if there is none. Its tasks already
    submitted stay."""
    return bool(int(shared(client).eval(_REMOVE, 3, DEFS, CURSOR, VERSION, name, CHANNEL)))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _parse(raw: bytes | str) -> Schedule:
    return Schedule(**json.loads(_text(raw)))


def get(client: Any, name: str) -> Schedule | None:
    raw = shared(client).hget(DEFS, name)
    return None if raw is None else _parse(raw)


def list_schedules(client: Any, queue: str | None = None) -> list[Schedule]:
    """Every schedule (of ``queue`` if given), by name."""
    if queue is not None:
        check_queue_name(queue)
    rows = [_parse(v) for v in shared(client).hgetall(DEFS).values()]
    return sorted((s for s in rows if queue is None or s.queue == queue),
                  key=lambda s: s.name)


def cursors(client: Any) -> dict[str, float]:
    """name -> the unix time of its last occurrence dealt with."""
    return {_text(k): float(v) for k, v in shared(client).hgetall(CURSOR).items()}
