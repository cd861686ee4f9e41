"""How claimed tasks ended, and the decisions that need no Redis.

A handler's :class:`Outcome` (and a generator's :class:`Chunk`) become the items of
ack, nack and emit here: what to encode, and for a failure whether it is retried
(after a backoff), dead-lettered or failed. Pure functions, unit-tested without
Redis (tests/unit/test_outcomes.py); :class:`mtq.broker.consumer.Consumer` sends
what they plan and counts the scripts' answers with :func:`count`.

The scripts decide the rest on their side and stay the only place that does: a
lease that expired or a process that died costs a delivery, and a task delivered
``max_deliveries`` times is dead as poison (``reclaim`` in lua/_lib.lua); a cancel
request wins over any action (nack.lua).
"""

from __future__ import annotations

import random
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mtq import serialization
from mtq.broker.codes import Code
from mtq.broker.records import CANCEL, DEAD, FAIL, RELEASE, RETRY, Claimed
from mtq.settings import QueueSettings

#: the most of a traceback kept on a task (its end: the frames nearest the error)
TRACEBACK_MAX = 8000

#: the most of an error's text kept on a task
ERROR_MAX = 4000

#: the counters a SettleReport and a worker's running totals share
OUTCOME_COUNTERS = ("succeeded", "retried", "failed", "dead", "cancelled")

#: an ack item (id, lease token, encoded result) and a nack item (id, lease token,
#: action, argument: see nack.lua)
AckItem = tuple[str, str, bytes]
NackItem = tuple[str, str, str, str]
#: an emit item: (id, lease token, index (-1: a progress report), encoded data)
EmitItem = tuple[str, str, int, bytes]


@dataclass(frozen=True, slots=True)
class Encoded:
    """A result or chunk value already encoded with :func:`mtq.serialization.dumps`
    (by the worker process, before it crossed to its outlet process)."""

    data: bytes


def encode(value: Any) -> bytes:
    """``value`` as stored bytes (an :class:`Encoded` is passed through)."""
    return value.data if isinstance(value, Encoded) else serialization.dumps(value)


@dataclass(frozen=True)
class Outcome:
    """How one claimed task ended in the handler."""

    task: Claimed
    ok: bool
    value: Any = None          # the result when ok
    error: str | None = None   # "Type: message" when not ok
    retryable: bool = True     # False: fail at once (e.g. an undecodable payload)
    cancelled: bool = False    # the handler stopped on a cancel request
    traceback: str | None = None  # where it was raised (bounded: see format_traceback)
    cost: float | None = None  # the cost it really had (scheduling), None: as charged
    #: given back unfinished, to the head of its stream, without a delivery counted (a
    #: generator sheds requests after running out of memory; the request starts over,
    #: and its client's stream goes on where it was)
    released: bool = False


@dataclass(slots=True)
class Chunk:
    """A token (or chunk) of a running task, streamed to its client; index -1 is a
    progress report. (Not frozen: a generator makes one per token, and a frozen
    dataclass's ``__init__`` sets each field through ``object.__setattr__``, which
    takes more Python per object.)"""

    task: Claimed
    index: int
    value: Any


@dataclass
class SettleReport:
    """What a settle call did."""

    succeeded: int = 0
    retried: int = 0
    failed: int = 0
    dead: int = 0
    cancelled: int = 0
    #: tasks whose lease had expired: their outcome was discarded (another worker owns them)
    lost: list[str] = field(default_factory=list)
    #: running tasks whose tokens were refused (lease lost) or could not be encoded
    #: (the task was failed): stop generating them
    stream_lost: list[str] = field(default_factory=list)
    #: tokens written to the tasks' streams
    streamed: int = 0


def format_traceback(exc: BaseException) -> str:
    """``exc``'s traceback as Python prints it, cut to its last TRACEBACK_MAX
    characters (the frames nearest the error)."""
    text = "".join(traceback.format_exception(exc)).rstrip("\n")
    if len(text) > TRACEBACK_MAX:
        text = "...\n" + text[-TRACEBACK_MAX:].split("\n", 1)[-1]
    return text


def storable(text: str) -> str:
    """``text`` that Redis can take: a lone surrogate (bytes of a file name that were
    not UTF-8, in an exception's message) written as its escape, not an error that
    would leave the task unsettled."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# -- decisions ---------------------------------------------------------------------------
def allowed_retries(task_retries: int | None, max_retries: int) -> int:
    """How many retries a task gets: its own ``retries`` if it was submitted with
    one, else the queue's ``max_retries``."""
    return max_retries if task_retries is None else task_retries


def failure_action(retryable: bool, attempts: int, allowed: int, dead_letter: bool) -> str:
    """What a failed run becomes (a nack action): RETRY while a retryable task has
    retries left (``attempts`` runs ended so far, not counting this one), then DEAD
    if the queue keeps dead letters, else FAIL; FAIL at once if not retryable."""
    if retryable and attempts < allowed:
        return RETRY
    if retryable and dead_letter:
        return DEAD
    return FAIL


def ends(o: Outcome, max_retries: int) -> bool:
    """The outcome ends its task (succeeded, failed or dead), as :func:`plan` decides
    from ``max_retries``: not a retry, not a cancel."""
    if o.ok:
        return True
    if o.cancelled or o.released:
        return False
    return not (o.retryable and o.task.attempts < allowed_retries(o.task.retries, max_retries))


def backoff_ceiling_ms(attempts: int, base_ms: int, max_ms: int) -> int:
    """The longest wait before retry ``attempts`` + 1: ``base_ms`` doubled per
    attempt, at most ``max_ms``."""
    return min(max_ms, base_ms * (2 ** min(attempts, 30)))


def backoff_ms(attempts: int, base_ms: int, max_ms: int, draw: float) -> int:
    """Exponential backoff with full jitter over the upper half: with ``draw`` in
    [0, 1), between 0.5 and 1 times :func:`backoff_ceiling_ms`."""
    return int(backoff_ceiling_ms(attempts, base_ms, max_ms) * (0.5 + draw / 2))


def plan(outcomes: Sequence[Outcome], settings: QueueSettings, rng: random.Random
         ) -> tuple[list[AckItem], list[NackItem]]:
    """The ack and nack items of ``outcomes``. A result that cannot be encoded fails
    its task (not retryable); a failure's error (bounded, with its traceback after a
    NUL: nack.lua stores that part as the traceback) goes with its action."""
    acks: list[AckItem] = []
    nacks: list[NackItem] = []
    for o in outcomes:
        t = o.task
        if o.ok:
            try:
                acks.append((t.id, t.token, encode(o.value)))
                continue
            except Exception as exc:  # PayloadError, or anything a tensor's .cpu() raises
                o = Outcome(t, ok=False, error=f"{type(exc).__name__}: {exc}",
                            retryable=False)
        if o.cancelled:
            nacks.append((t.id, t.token, CANCEL, ""))
            continue
        if o.released:
            nacks.append((t.id, t.token, RELEASE, ""))
            continue
        error = storable((o.error or "error")[:ERROR_MAX]).replace("\0", " ")
        if o.traceback:
            error += "\0" + storable(o.traceback[-TRACEBACK_MAX - 4:]).replace("\0", " ")
        action = failure_action(o.retryable, t.attempts,
                                allowed_retries(t.retries, settings.max_retries),
                                settings.dead_letter)
        if action == RETRY:
            delay = backoff_ms(t.attempts, settings.retry_backoff_ms,
                               settings.retry_backoff_max_ms, rng.random())
            nacks.append((t.id, t.token, RETRY, f"{delay}|{error}"))
        else:
            nacks.append((t.id, t.token, action, error))
    return acks, nacks


def stream_items(chunks: Sequence[Chunk]) -> tuple[list[EmitItem], list[Outcome], set[str]]:
    """The emit items of ``chunks``; a chunk that cannot be encoded fails its task
    (an outcome, not retryable) and drops the rest of that task's chunks: (items, those
    outcomes, their task ids)."""
    items: list[EmitItem] = []
    failed: list[Outcome] = []
    bad: set[str] = set()
    for c in chunks:
        t = c.task
        if t.id in bad:
            continue
        try:
            items.append((t.id, t.token, c.index, encode(c.value)))
        except Exception as exc:  # an unencodable token fails its task, no other
            bad.add(t.id)
            failed.append(Outcome(t, ok=False, retryable=False,
                                  error=f"{type(exc).__name__}: token {c.index}: {exc}"))
    return items, failed, bad


_COUNTED = {RETRY: "retried", FAIL: "failed", DEAD: "dead", CANCEL: "cancelled"}
#: ack.lua's code for a success that ended cancelled: a cancel request came first
ENDED_CANCELLED = 2


def count(acks: Sequence[AckItem], nacks: Sequence[NackItem], ack_codes: Sequence[int],
          nack_codes: Sequence[int]) -> SettleReport:
    """What ack and nack did, from their codes (one per item): a task whose lease was
    lost is reported in ``lost`` (its outcome was discarded), the others counted by
    action."""
    report = SettleReport()
    for (task_id, _, _), code in zip(acks, ack_codes):
        if code == Code.LEASE_LOST:
            report.lost.append(task_id)
        elif code == ENDED_CANCELLED:  # a cancel request reached Redis first (ack.lua)
            report.cancelled += 1
        else:
            report.succeeded += 1
    for (task_id, _, action, _), code in zip(nacks, nack_codes):
        if code == Code.LEASE_LOST:
            report.lost.append(task_id)
        elif action in _COUNTED:
            setattr(report, _COUNTED[action], getattr(report, _COUNTED[action]) + 1)
    return report
