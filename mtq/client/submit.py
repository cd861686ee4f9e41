"""The submit protocol: validate and encode tasks, send them in chunks, retry while
Redis cannot be reached, and recognise after a retry what a lost try already wrote
(so a reset yields neither a ghost nor a duplicate).

:class:`~mtq.client.queue.Queue` calls it; it builds no handle itself (``make``
does), so it needs nothing of the queue but :class:`Target`.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any, Protocol, TypeVar

from mtq import serialization
from mtq.broker import codes, lane
from mtq.broker.codes import Code
from mtq.broker.connection import Backoff, redis_errors
from mtq.broker.protocol import Answer, Broker, NewTask, Submitted
from mtq.client.records import new_task_id
from mtq.errors import (
    ConfigError,
    InvalidArgument,
    NotDurable,
    PayloadTooLarge,
    RateLimited,
    RedisUnavailable,
    WouldMissDeadline,
)
from mtq.settings import MAX_RETRIES, QueueSettings
from mtq.validation import (
    check_cost,
    check_priority,
    check_stream_name,
    check_task_id,
    check_tenant,
)

#: longest accepted ttl (about 31 years); keeps deadlines exact integers in Lua
MAX_TTL_S = 1e9

#: most tasks sent in one submit script call (keeps each call's Redis time short)
SUBMIT_CHUNK = 1000
#: how long submit keeps trying to reach Redis (the first retry at once, then up to
#: 1 s apart) before it raises RedisUnavailable, and how long a reader does
SUBMIT_RETRY_S = 10.0
#: the same on a Redis Cluster or behind Sentinel: a failover takes Redis's node timeout
#: (15 s by default) and an election (see docs/scaling.md)
SUBMIT_RETRY_HA_S = 30.0

T = TypeVar("T")


class Target(Protocol):
    """What the submit protocol needs of the queue it submits to."""

    name: str
    redis: Any
    broker: Broker

    @property
    def settings(self) -> QueueSettings: ...


def cache_digest(payload: Any, data: bytes) -> str:
    """The result cache's digest of a payload (``data``: its encoding): ``c`` or ``u``
    (``u``: it gives no integer ``seed``, so a generator samples it from its task id and
    only a deterministic one may answer it from the cache), then the hex BLAKE2b of the
    bytes. Computed here, not in Redis, whose CPU is the scarce one."""
    seed = payload.get("seed") if isinstance(payload, dict) else None
    seeded = isinstance(seed, int) and not isinstance(seed, bool)
    return ("c" if seeded else "u") + hashlib.blake2b(data, digest_size=20).hexdigest()


def estimate_cost(payload: Any) -> float | None:
    """A generation request's cost when it gives none: its prompt's tokens plus its
    ``max_tokens``, if the payload is a mapping with an integer ``max_tokens``. The
    prompt (``prompt``, else ``messages``' contents) counts one token per list item or
    per UTF-8 byte of text, as the reference byte tokenizer counts it (more than a
    subword tokenizer's; the worker's report settles the difference). None: not such
    a request."""
    if not isinstance(payload, dict):
        return None
    most = payload.get("max_tokens")
    if isinstance(most, bool) or not isinstance(most, int) or most < 0:
        return None
    return float(most + _tokens(payload.get("prompt", payload.get("messages"))))


def _tokens(prompt: Any) -> int:
    if isinstance(prompt, str):
        return len(prompt.encode("utf-8", "replace"))
    if isinstance(prompt, (list, tuple)):
        if all(isinstance(m, dict) for m in prompt):  # chat messages
            return sum(_tokens(m.get("content", "")) for m in prompt)
        return len(prompt)
    return 0


def new_task(settings: QueueSettings, payload: Any, stream: str | None, key: str | None,
             ttl: float | None, retries: int | None, task_id: str | None,
             cache: bool = True, *, priority: str | None = None, tenant: str | None = None,
             cost: float | None = None, deadline: float | datetime | None = None,
             timeout: float | None = None, delay: float | None = None,
             at: datetime | None = None) -> NewTask:
    """One task validated and encoded for :func:`send` (its id chosen here unless
    given). ``priority``, ``tenant``, ``cost``, ``deadline``: see docs/scheduling.md
    (cost: the given one, else the payload's estimate, else the queue's
    ``default_cost``; deadline: seconds from now or an aware datetime, a ttl that is
    checked at once: refused with WouldMissDeadline if it would be missed); timeout:
    seconds a run may take once started (TaskTimeout past it); delay, at: see
    :func:`delay_ms` (no result cache, no deadline with one).
    Raises InvalidName, InvalidArgument, PayloadTooLarge, EncodeError, ConfigError."""
    wait_ms = delay_ms(delay, at)
    band = check_priority(priority)
    admit = deadline is not None
    if wait_ms and admit:
        raise InvalidArgument("give delay/at or deadline, not both (a deadline is checked "
                              "against the work ahead now; give a ttl, counted from the "
                              "task's due time)")
    if admit:
        if ttl is not None:
            raise InvalidArgument("give ttl or deadline, not both (a deadline is a ttl "
                                  "that is checked at submit)")
        ttl = _seconds_until(deadline)
    tenant = check_tenant(tenant) if tenant is not None else ""
    if cost is not None:
        cost = check_cost(cost)
    else:
        cost = estimate_cost(payload)
        if cost is None and settings.default_cost != 1.0:
            cost = settings.default_cost
    data = serialization.dumps(payload)
    if len(data) > settings.max_payload_bytes:
        raise PayloadTooLarge(
            f"payload is {len(data)} bytes encoded, over this queue's max_payload_bytes "
            f"({settings.max_payload_bytes}); send a reference (a URL or a key) "
            "instead, or raise max_payload_bytes"
        )
    if ttl is not None:
        check_seconds("ttl", ttl)
    if timeout is not None:
        check_seconds("timeout", timeout, TIMEOUT_HINT)
    if retries is not None:
        check_retries(retries)
    return NewTask(
        id=check_task_id(task_id) if task_id is not None else new_task_id(),
        own_id=task_id is None,
        payload=data,
        stream=check_stream_name(stream) if stream is not None else "",
        key=check_stream_name(key, "idempotency key") if key is not None else "",
        ttl_ms=max(1, int(ttl * 1000)) if ttl is not None else 0,
        retries=retries,
        digest=cache_digest(payload, data) if cache and settings.cache_ttl_s > 0
        and not wait_ms else "",
        band=band, tenant=tenant, cost=cost, admit=admit,
        timeout_ms=max(1, int(timeout * 1000)) if timeout is not None else 0,
        delay_ms=wait_ms,
    )


#: what a run timeout is, said when one is refused
TIMEOUT_HINT = (" (how long a run may take once started; leave it out for the queue's "
                "task_timeout_s)")


def check_seconds(name: str, value: object, hint: str = "") -> float:
    """``value``, a number of seconds in (0, MAX_TTL_S] (a ttl, a run timeout); else
    ConfigError naming ``name`` (and ``hint``: what it is)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or not 0 < value <= MAX_TTL_S:
        raise ConfigError(f"{name} must be a number of seconds in (0, {MAX_TTL_S:.0e}]"
                          f"{hint}, got {value!r}")
    return float(value)


def check_retries(value: object) -> int:
    """``value``, a task's retries (an integer in [0, MAX_RETRIES]); else ConfigError."""
    if isinstance(value, bool) or not isinstance(value, int) \
            or not 0 <= value <= MAX_RETRIES:
        raise ConfigError(f"retries must be an integer in [0, {MAX_RETRIES}], got {value!r}")
    return value


def delay_ms(delay: object, at: object) -> int:
    """A submit's ``delay`` (seconds, in [0, MAX_TTL_S]) or ``at`` (an aware datetime)
    as ms from now (0: queued at once; an ``at`` in the past is due now). Raises
    InvalidArgument for both given, a delay that is not a finite number in range (a
    bool included), an ``at`` that is not a datetime or is naive."""
    if delay is not None and at is not None:
        raise InvalidArgument("give delay or at, not both (delay: seconds from now; at: "
                              "an aware datetime)")
    if at is not None:
        if not isinstance(at, datetime):
            raise InvalidArgument(f"at takes an aware datetime, got {at!r}")
        if at.tzinfo is None or at.utcoffset() is None:
            raise InvalidArgument("at is a naive datetime: give it a time zone "
                                  "(datetime(2030, 1, 1, 9, tzinfo=ZoneInfo('Europe/Paris')), "
                                  "or datetime.now(timezone.utc) + timedelta(minutes=5))")
        left = (at - datetime.now(timezone.utc)).total_seconds()
        if left > MAX_TTL_S:
            raise InvalidArgument(f"at is {left:.0f} s from now, over the longest delay "
                                  f"({MAX_TTL_S:.0e} s)")
        return max(0, math.ceil(left * 1000))
    if delay is None:
        return 0
    if isinstance(delay, bool) or not isinstance(delay, (int, float)) \
            or not math.isfinite(delay) or not 0 <= delay <= MAX_TTL_S:
        raise InvalidArgument(f"delay must be a number of seconds in [0, {MAX_TTL_S:.0e}] "
                              f"(how long the task waits before it is queued), got {delay!r}")
    return math.ceil(delay * 1000)


def _seconds_until(deadline: object) -> float:
    """A deadline (seconds from now, or an aware datetime) as seconds from now; raises
    InvalidArgument for one that is not in the future."""
    if isinstance(deadline, datetime):
        if deadline.tzinfo is None:
            raise InvalidArgument("deadline is a naive datetime: give it a time zone "
                                  "(datetime.now(timezone.utc) + timedelta(seconds=5))")
        left = (deadline - datetime.now(timezone.utc)).total_seconds()
    elif isinstance(deadline, (int, float)) and not isinstance(deadline, bool) \
            and math.isfinite(deadline):
        left = float(deadline)
    else:
        raise InvalidArgument(f"deadline takes seconds from now or an aware datetime, got "
                              f"{deadline!r}")
    if left <= 0:
        raise InvalidArgument(f"deadline is {-left:.3f} s in the past: nothing can meet it")
    return min(left, MAX_TTL_S)


def send(q: Target, tasks: list[NewTask], reply: str, epoch: int,
         make: Callable[[str, bytes | None, int | None], T]) -> list[T]:
    """Submit ``tasks`` to ``q`` in chunks of SUBMIT_CHUNK, answering each on the reply
    channel ``reply``; ``make(task id, cached result or None, epoch or None)`` builds
    each handle (``epoch``: the reply subscription's, read before the submit, for a
    task created with its own id). Raises QueueFull, NotDurable, DuplicateTask (each
    with ``.created``: the handles of the tasks that went in), RedisUnavailable."""
    out: list[T] = []
    duplicates: list[str] = []
    unconfirmed = -1  # the fewest replicas that confirmed a chunk, when too few
    for start in range(0, len(tasks), SUBMIT_CHUNK):
        chunk = tasks[start:start + SUBMIT_CHUNK]
        answer, acks = _submit_chunk(q, chunk, reply)
        if answer and answer[0] == Code.QUEUE_FULL:  # only ever [QUEUE_FULL, waiting]
            waiting = answer[1] if isinstance(answer[1], int) else 0
            full = codes.error(Code.QUEUE_FULL, queue=q.name, waiting=waiting,
                               max_length=q.settings.max_length, adding=len(chunk))
            full.created = out  # earlier chunks went in
            raise full
        if answer and answer[0] in (Code.RATE_LIMITED, Code.WOULD_MISS):
            # [code, retry after ms, tenant or task id]: nothing of the chunk went in
            what, after = str(answer[2]), answer[1]
            refused = codes.error(Code(answer[0]), queue=q.name, tenant=what, task_id=what,
                                  retry_after=(after if isinstance(after, int) else 0) / 1000)
            assert isinstance(refused, (RateLimited, WouldMissDeadline))
            refused.created = out
            raise refused
        for item, value in zip(chunk, answer):
            if value == Code.DUPLICATE_ID:
                duplicates.append(item.id)
            elif isinstance(value, tuple):  # a result cache hit
                out.append(make(value[0], value[1], None))
            else:  # its own id: a new task (not one an idempotency key names)
                tid = str(value)
                out.append(make(tid, None, epoch if tid == item.id else None))
        if 0 <= acks < q.settings.durable_replicas:
            unconfirmed = acks if unconfirmed < 0 else min(unconfirmed, acks)
    if unconfirmed >= 0:
        s = q.settings
        nd = NotDurable(q.name, unconfirmed, s.durable_replicas, s.durable_timeout_ms)
        nd.created = out
        raise nd
    if duplicates:
        dup = codes.error(Code.DUPLICATE_ID, queue=q.name, task_ids=duplicates)
        dup.created = out
        raise dup
    return out


def _submit_chunk(q: Target, chunk: list[NewTask], reply: str) -> tuple[list[Submitted], int]:
    """One submit call, retried while Redis cannot be reached. The call is sent once
    per try, never repeated by the connection; after a retry, the tasks a lost try
    already wrote are recognised (see :func:`written`), so a reset yields neither a
    ghost nor a duplicate. Returns the answer and, for a durable queue, how many
    replicas confirmed it (-1 otherwise). Raises RedisUnavailable after
    SUBMIT_RETRY_S."""
    backoff = Backoff()
    start = time.monotonic()
    retried = False
    acks = -1
    answer: list[Submitted]
    while True:
        try:
            sent: Answer
            if q.settings.durable_replicas:
                sent, acks = q.broker.submit_durable(chunk, reply)
            else:
                sent = q.broker.submit(chunk, reply)
            answer = sent
            if sent.handed:
                # Redis woke a sleeping worker with these tasks as it answered: if it
                # shares this CPU, it runs them before this thread's bookkeeping
                # (docs/architecture.md, "Direct delivery")
                lane.sched_yield()
            break
        except RedisUnavailable as exc:
            # a cluster's or a sentinel's client: long enough for a failover
            limit = SUBMIT_RETRY_HA_S if getattr(q.redis, "mtq_url", None) \
                else SUBMIT_RETRY_S
            if time.monotonic() - start > limit:
                err = RedisUnavailable(
                    f"{exc}; the {len(chunk)} task(s) of this submit may or may not be "
                    "queued: their ids are in .task_ids, and submitting them again "
                    "with the same ids (Request(id=...)) is safe")
                err.task_ids = [t.id for t in chunk]  # type: ignore[attr-defined]
                raise err from exc
            retried = True
            time.sleep(backoff.next())
    if retried:
        answer = written(q, chunk, answer, reply)
    return answer, acks


def written(q: Target, chunk: list[NewTask], answer: list[Submitted], reply: str
             ) -> list[Submitted]:
    """Correct the answer of a retried submit for what the lost try wrote: a task it
    created comes back as a duplicate (or, if it filled the queue, the whole chunk
    as queue-full). A duplicate is this call's own if its id was generated here
    (96 random bits), or if the stored task names this client's reply channel and
    holds the very same payload (a task this client merely watched, or submitted
    before with another payload, stays a duplicate)."""
    full = bool(answer) and answer[0] == Code.QUEUE_FULL
    doubtful = range(len(chunk)) if full else \
        [i for i, v in enumerate(answer) if v == Code.DUPLICATE_ID]
    if not doubtful:
        return answer
    keys = q.broker.keys
    with redis_errors("while checking a retried submit"):
        pipe = q.redis.pipeline(transaction=False)
        for i in doubtful:
            pipe.hmget(keys.task(chunk[i].id), "reply", "payload")
            if chunk[i].key:
                pipe.get(keys.idem(chunk[i].key))
        rows = iter(pipe.execute())
    mine: dict[int, str] = {}
    for i in doubtful:
        stored, payload = next(rows)
        idem = next(rows) if chunk[i].key else None
        if stored is not None and (chunk[i].own_id or (
                reply in stored.decode().split() and payload == chunk[i].payload)):
            mine[i] = chunk[i].id
        elif chunk[i].key and idem is not None:
            mine[i] = idem.decode()
    if full:
        if not any(v == chunk[i].id for i, v in mine.items()):
            return answer  # the queue really is full: nothing of this chunk was written
        return [mine.get(i, Code.DUPLICATE_ID) for i in range(len(chunk))]
    out = list(answer)
    for i, task_id in mine.items():
        if task_id == chunk[i].id:
            out[i] = task_id
    return out
