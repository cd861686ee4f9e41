"""Return codes of the Lua scripts and their translation into exceptions.

:func:`error` is the one place a code becomes an exception: callers pass what they
know (queue, task ids, limits) and raise what it returns.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Literal, overload

from mtq.errors import (
    BrokerError,
    DuplicateTask,
    InvalidArgument,
    LeaseLost,
    MtqError,
    QueueFull,
    RateLimited,
    TaskFinished,
    TaskNotFound,
    WouldMissDeadline,
)


class Code(enum.IntEnum):
    """Negative codes a script returns (mirrors the E_* constants in lua/_lib.lua)."""

    QUEUE_FULL = -1
    DUPLICATE_ID = -2
    LEASE_LOST = -3
    NOT_FOUND = -4
    FINISHED = -5
    BAD_ARGUMENT = -6
    RATE_LIMITED = -7
    WOULD_MISS = -8


def is_error(value: object) -> bool:
    """True if a script result entry is one of the negative codes."""
    return isinstance(value, int) and value < 0


@overload
def error(code: Literal[Code.QUEUE_FULL], *, queue: str = ..., task_id: str = ...,
          task_ids: Sequence[str] = ..., status: str = ..., waiting: int = ...,
          max_length: int = ..., adding: int = ..., detail: str = ...,
          tenant: str = ..., retry_after: float = ...) -> QueueFull: ...
@overload
def error(code: Literal[Code.DUPLICATE_ID], *, queue: str = ..., task_id: str = ...,
          task_ids: Sequence[str] = ..., status: str = ..., waiting: int = ...,
          max_length: int = ..., adding: int = ..., detail: str = ...,
          tenant: str = ..., retry_after: float = ...) -> DuplicateTask: ...
@overload
def error(code: Literal[Code.LEASE_LOST], *, queue: str = ..., task_id: str = ...,
          task_ids: Sequence[str] = ..., status: str = ..., waiting: int = ...,
          max_length: int = ..., adding: int = ..., detail: str = ...,
          tenant: str = ..., retry_after: float = ...) -> LeaseLost: ...
@overload
def error(code: Literal[Code.NOT_FOUND], *, queue: str = ..., task_id: str = ...,
          task_ids: Sequence[str] = ..., status: str = ..., waiting: int = ...,
          max_length: int = ..., adding: int = ..., detail: str = ...,
          tenant: str = ..., retry_after: float = ...) -> TaskNotFound: ...
@overload
def error(code: Literal[Code.FINISHED], *, queue: str = ..., task_id: str = ...,
          task_ids: Sequence[str] = ..., status: str = ..., waiting: int = ...,
          max_length: int = ..., adding: int = ..., detail: str = ...,
          tenant: str = ..., retry_after: float = ...) -> TaskFinished: ...
@overload
def error(code: Literal[Code.BAD_ARGUMENT], *, queue: str = ..., task_id: str = ...,
          task_ids: Sequence[str] = ..., status: str = ..., waiting: int = ...,
          max_length: int = ..., adding: int = ..., detail: str = ...,
          tenant: str = ..., retry_after: float = ...) -> InvalidArgument: ...
@overload
def error(code: Literal[Code.RATE_LIMITED], *, queue: str = ..., task_id: str = ...,
          task_ids: Sequence[str] = ..., status: str = ..., waiting: int = ...,
          max_length: int = ..., adding: int = ..., detail: str = ...,
          tenant: str = ..., retry_after: float = ...) -> RateLimited: ...
@overload
def error(code: Literal[Code.WOULD_MISS], *, queue: str = ..., task_id: str = ...,
          task_ids: Sequence[str] = ..., status: str = ..., waiting: int = ...,
          max_length: int = ..., adding: int = ..., detail: str = ...,
          tenant: str = ..., retry_after: float = ...) -> WouldMissDeadline: ...
@overload
def error(code: int, *, queue: str = ..., task_id: str = ...,
          task_ids: Sequence[str] = ..., status: str = ..., waiting: int = ...,
          max_length: int = ..., adding: int = ..., detail: str = ...,
          tenant: str = ..., retry_after: float = ...) -> MtqError: ...


def error(code: int, *, queue: str = "", task_id: str = "", task_ids: Sequence[str] = (),
          status: str = "", waiting: int = 0, max_length: int = 0, adding: int = 1,
          detail: str = "", tenant: str = "", retry_after: float = 0.0) -> MtqError:
    """The exception that script code ``code`` stands for, to raise.

    The context each code's message uses (the rest is ignored):

    ==============  ==============================================================
    QUEUE_FULL      :class:`QueueFull`: ``queue``, ``waiting``, ``max_length``,
                    ``adding`` (how many did not fit)
    DUPLICATE_ID    :class:`DuplicateTask`: ``queue``, ``task_ids`` (the refused
                    ids, its ``duplicates``; ``created`` starts empty)
    LEASE_LOST      :class:`LeaseLost`: ``task_ids`` (or ``task_id``)
    NOT_FOUND       :class:`TaskNotFound`: ``task_id``, ``queue``
    FINISHED        :class:`TaskFinished`: ``task_id``, ``status`` (the task's)
    BAD_ARGUMENT    :class:`InvalidArgument`: ``detail`` (what was refused and what
                    is accepted), ``queue``
    RATE_LIMITED    :class:`RateLimited`: ``queue``, ``tenant``, ``retry_after`` (s)
    WOULD_MISS      :class:`WouldMissDeadline`: ``queue``, ``task_id``,
                    ``retry_after`` (s)
    ==============  ==============================================================

    Raises BrokerError for a code that is not a :class:`Code` (a script and this
    Python code from different versions of mtq).
    """
    try:
        known = Code(code)
    except ValueError:
        raise BrokerError(
            f"a script of queue {queue!r} answered {code!r}, which is not one of mtq's "
            f"codes ({', '.join(f'{c.name} {c.value}' for c in Code)}): are the Lua "
            "scripts from another version of mtq than this Python code?") from None
    ids = list(task_ids) or ([task_id] if task_id else [])
    if known is Code.QUEUE_FULL:
        return QueueFull(queue, waiting, max_length, adding)
    if known is Code.DUPLICATE_ID:
        dup = DuplicateTask(f"task id(s) {', '.join(map(repr, ids[:5]))} already exist in "
                            f"queue {queue!r}; the other tasks were submitted (see .created); "
                            "use new ids or Queue.task(id)")
        dup.created, dup.duplicates = [], ids
        return dup
    if known is Code.LEASE_LOST:
        return LeaseLost(ids)
    if known is Code.NOT_FOUND:
        return TaskNotFound(f"no task {task_id} in queue {queue!r} "
                            "(wrong id or queue, or its retention time ran out)")
    if known is Code.FINISHED:
        return TaskFinished(task_id, status)
    if known is Code.BAD_ARGUMENT:
        return InvalidArgument(detail or f"a script of queue {queue!r} refused its arguments "
                               "(an unknown action, or a token index past the next one)")
    if known is Code.RATE_LIMITED:
        return RateLimited(queue, tenant, retry_after)
    if known is Code.WOULD_MISS:
        return WouldMissDeadline(queue, task_id, retry_after)
    raise AssertionError(f"mtq.broker.codes.error has no exception for {known!r}")
