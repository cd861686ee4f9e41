"""Running a batch with failure isolation: when ``predict`` raises, the batch is split
so that the items that succeed on their own keep their results and only the failing
ones get an error (a batch that ran out of memory is split the same way, after what
the failed call held is freed: see :mod:`mtq.workers.memory`).

Nothing runs again inside an ``except`` block: each call's exception is returned from
:func:`_attempt` and handled after it, so that a failed call's frames, and the
tensors they hold, can be let go before its parts run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mtq.errors import BatchShapeError
from mtq.workers import memory


@dataclass(slots=True)
class ItemResult:
    """What happened to one payload of a batch."""

    ok: bool
    value: Any = None
    error: BaseException | None = None


def _rows(results: Any, n: int) -> list[Any]:
    """predict's results for ``n`` payloads as a list; BatchShapeError if they are not."""
    if isinstance(results, (str, bytes, dict)) or not hasattr(results, "__len__"):
        raise BatchShapeError(f"predict must return a list, got {type(results).__name__}")
    if len(results) != n:
        raise BatchShapeError(f"predict returned {len(results)} results for {n} payloads")
    return list(results)


#: what run_isolated's ``call`` is given: the indices of the payloads to run, ascending
Call = Callable[[list[int]], Any]


def run_one(call: Call, j: int) -> ItemResult:
    """:func:`run_isolated` of the one item ``j`` (``call([j])``), without its machinery:
    the per-item path runs this once a task. Running out of memory, it ran out alone:
    :class:`~mtq.errors.DeviceOutOfMemory`."""
    try:
        (r,) = _rows(call([j]), 1)
    except Exception as exc:
        return ItemResult(False, error=memory.alone(exc) if memory.is_oom(exc) else exc)
    if isinstance(r, BaseException):
        return ItemResult(False, error=r)
    return ItemResult(True, value=r)


def _attempt(call: Call, items: list[int], out: list[ItemResult | None]) -> BaseException | None:
    """Run ``call`` on ``items``: their results go in ``out`` and None is returned, or
    the exception it raised is (the caller handles it outside any ``except`` block, so
    that what the failed call held can be freed before anything else runs)."""
    try:
        rows = _rows(call(items), len(items))
    except Exception as exc:
        return exc
    for j, r in zip(items, rows):
        out[j] = ItemResult(False, error=r) if isinstance(r, BaseException) else \
            ItemResult(True, value=r)
    return None


def run_isolated(call: Call, n: int, *, fits: int = 0,
                 calls: list[tuple[list[int], str]] | None = None) -> list[ItemResult]:
    """Run ``call(items)`` (predict on those payloads) for the whole batch; when it
    raises, split the batch so the items that succeed on their own keep their results
    and only the failing ones get an error. An exception instance returned in place of
    a result fails that item only.

    Nothing runs again inside an ``except`` block: a failed call's error is kept only
    for an item that failed alone. Running out of memory (:func:`mtq.workers.memory.is_oom`),
    the error's frames are dropped and the device's cache freed before the parts run;
    an item that runs out alone fails with :class:`~mtq.errors.DeviceOutOfMemory`.

    A batch is split in halves, except one that ran out of memory at ``fits`` items or
    fewer (a size that ran before: one item's doing, most likely). Then the culprit is
    searched for with probes that run a share (:data:`~mtq.workers.memory.PROBE_SHARE`)
    of the suspects together with the items shown innocent so far, so that most items
    finish in the first probe that fits instead of in halves, quarters, eighths...
    ``calls``, if given, receives each call's items and how it went ("ok", "oom",
    "error"): what the worker learns its load from."""
    out: list[ItemResult | None] = [None] * n
    todo = [list(range(n))] if n else []
    probing = True  # until a probe search's last suspect runs alone without failing
    while todo:
        items = todo.pop()
        exc = _attempt(call, items, out)
        if exc is None:
            if calls is not None:
                calls.append((items, "ok"))
            continue
        oom = memory.is_oom(exc)
        if calls is not None:
            calls.append((items, "oom" if oom else "error"))
        if len(items) == 1:
            out[items[0]] = ItemResult(False, error=memory.alone(exc) if oom else exc)
            continue
        memory.drop(exc)  # its frames hold the call's inputs (on a device, maybe)
        exc = None
        if oom:
            memory.free_memory()
            if probing and len(items) <= fits:
                suspect, rest = _probe(call, items, out, calls)
                todo.extend(reversed(rest))
                if suspect is None:
                    continue
                exc = _attempt(call, [suspect], out)
                if calls is not None:
                    calls.append(([suspect], "ok" if exc is None else
                                  "oom" if memory.is_oom(exc) else "error"))
                if exc is None:  # not one item's doing after all: split the rest in halves
                    probing = False
                else:
                    oom = memory.is_oom(exc)
                    out[suspect] = ItemResult(False, error=memory.alone(exc) if oom else exc)
                    exc = None
                continue
        mid = len(items) // 2
        todo.append(items[mid:])
        todo.append(items[:mid])
    return out  # type: ignore[return-value]


def _probe(call: Call, items: list[int], out: list[ItemResult | None],
           calls: list[tuple[list[int], str]] | None) -> tuple[int | None, list[list[int]]]:
    """Search ``items`` (which ran out of memory together) for the one that does not
    fit: each probe runs :data:`~mtq.workers.memory.PROBE_SHARE` of the suspects with
    the items shown innocent so far. A probe that runs clears them all, and the culprit
    is among the other suspects; one that runs out of memory has it among its suspects.
    Returns (the last suspect, to run alone; the groups still to run, in order); no
    suspect if a probe failed otherwise than by running out of memory."""
    suspects, clean = items, list[int]()
    while len(suspects) > 1:
        k = min(len(suspects) - 1, max(1, round(len(suspects) * memory.PROBE_SHARE)))
        probe = sorted(clean + suspects[:k])
        exc = _attempt(call, probe, out)
        if exc is None:
            if calls is not None:
                calls.append((probe, "ok"))
            suspects, clean = suspects[k:], []
            continue
        oom = memory.is_oom(exc)
        memory.drop(exc)
        exc = None
        if calls is not None:
            calls.append((probe, "oom" if oom else "error"))
        if not oom:  # another failure: its parts are split as any failed batch's
            return None, [probe, suspects[k:]]
        memory.free_memory()
        clean, suspects = clean + suspects[k:], suspects[:k]
    return suspects[0], [sorted(clean)] if clean else []
