"""Running a batch with failure isolation: when ``predict`` raises, the batch is split
so that the items that succeed on their own keep their results and only the failing
ones get an error. A batch that ran out of memory is split after what the failed call
held is freed, and one of a size that ran before is searched for the one task that
does not fit (see :func:`run_isolated`, and :mod:`mtq.workers.memory`).

Nothing runs again inside an ``except`` block: each call's exception is returned from
:func:`_attempt` and handled after it, so that a failed call's frames, and the
tensors they hold, can be let go before its parts run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
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
    #: not run: left for the caller's next batch (see run_isolated's ``carry``)
    later: bool = False


def _rows(results: Any, n: int) -> list[Any]:
    """predict's results for ``n`` payloads as a list; BatchShapeError if they are not."""
    if isinstance(results, (str, bytes, dict)) or not hasattr(results, "__len__"):
        raise BatchShapeError(f"predict must return a list, got {type(results).__name__}")
    if len(results) != n:
        raise BatchShapeError(f"predict returned {len(results)} results for {n} payloads")
    return list(results)


#: what run_isolated's ``call`` is given: the indices of the payloads to run, ascending
Call = Callable[[list[int]], Any]
#: a search carries suspects (and innocents) over to the next batch (see run_isolated's
#: ``carry``) when they are this part of ``fits`` or fewer
CARRY_PART = 4
#: the most culprit searches in one run_isolated (several tasks that do not fit, each
#: found by one); its other failures are split in halves
SEARCHES_MAX = 8


def run_one(call: Call, j: int) -> ItemResult:
    """:func:`run_isolated` of the one item ``j`` (``call([j])``), without its machinery:
    the per-item path runs this once a task. Running out of memory, it ran out alone:
    :class:`~mtq.errors.DeviceOutOfMemory`."""
    try:
        (r,) = _rows(call([j]), 1)
    except Exception as exc:
        if not memory.is_oom(exc):
            return ItemResult(False, error=exc)
        error = memory.alone(exc)
    else:
        if isinstance(r, BaseException):
            return ItemResult(False, error=r)
        return ItemResult(True, value=r)
    memory.free_memory()  # outside the handler: what the failed call held is gone
    return ItemResult(False, error=error)


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


def run_isolated(call: Call, n: int, *, fits: int = 0, fitted_s: float = 0.0,
                 alone: Sequence[int] = (), suspects: Sequence[int] = (),
                 carry: list[tuple[int, bool]] | None = None,
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
    searched for with probes that run a share of the suspects together with the items
    shown innocent so far, so that most items finish in a probe as large as a batch
    instead of in halves, quarters, eighths... The share
    (:func:`~mtq.workers.memory.probe_share`) weighs what the failed call took against
    what it would have taken had it run: ``fitted_s`` is what a call on ``fits`` items
    takes (0: not known).

    ``carry``, if given, lets a search leave items unrun rather than run them in a
    small call of their own (a call costs much the same for 3 items as for 30): the
    few suspects left once every other item has run, and the items shown innocent
    that are left over. It receives (item, whether it is a suspect); their results say
    ``later``, and the caller runs them in its next batch, filled with other tasks,
    passing the suspects back as ``suspects``: if that batch runs out of memory, the
    search starts from them.

    The items in ``alone`` (they ran out of memory alone before) are called each on its
    own, first. ``calls``, if given, receives each call's items and how it went ("ok",
    "oom", "error"): what the worker learns its load from."""
    return _Split(call, n, fits, fitted_s, carry, calls).run(alone, suspects)


class _Split:
    """The state of one :func:`run_isolated`."""

    def __init__(self, call: Call, n: int, fits: int, fitted_s: float,
                 carry: list[tuple[int, bool]] | None,
                 calls: list[tuple[list[int], str]] | None) -> None:
        self.call = call
        self.out: list[ItemResult | None] = [None] * n
        self.fits = fits
        self.fitted_s = fitted_s
        self.carry = carry
        self.calls = calls

    def attempt(self, items: list[int]) -> tuple[BaseException | None, bool]:
        """Run a call; (what it raised or None, whether that is running out of memory)."""
        exc = _attempt(self.call, items, self.out)
        oom = exc is not None and memory.is_oom(exc)
        if self.calls is not None:
            self.calls.append((items, "ok" if exc is None else "oom" if oom else "error"))
        return exc, oom

    def later(self, items: Sequence[int], suspected: bool) -> None:
        """Leave ``items`` for the caller's next batch (see ``carry``)."""
        assert self.carry is not None
        for j in items:
            self.out[j] = ItemResult(False, later=True)
            self.carry.append((j, suspected))

    def run(self, alone: Sequence[int], suspected: Sequence[int]) -> list[ItemResult]:
        n = len(self.out)
        if alone:
            lone = set(alone)
            others = [j for j in range(n) if j not in lone]
            todo = ([others] if others else []) + [[j] for j in sorted(lone, reverse=True)]
        else:
            todo = [list(range(n))] if n else []
        searches = 0  # culprit searches (see probe); halves past SEARCHES_MAX, or the load
        while todo:
            items = todo.pop()
            t0 = time.perf_counter()
            exc, oom = self.attempt(items)
            if exc is None:
                continue
            if len(items) == 1:
                self.out[items[0]] = ItemResult(False, error=memory.alone(exc) if oom else exc)
                continue
            memory.drop(exc)  # its frames hold the call's inputs (on a device, maybe)
            exc = None
            if oom:
                memory.free_memory()
            if oom and searches < SEARCHES_MAX and len(items) <= self.fits:
                searches += 1
                share = memory.probe_share(time.perf_counter() - t0,
                                           self.fitted_s * len(items) / self.fits)
                inside = set(items)
                known = [j for j in suspected if j in inside]
                suspected = ()  # (for the first search only)
                suspect, rest, ran = self.probe(items, share, known)
                todo.extend(reversed(rest))
                if suspect is None:
                    continue
                exc, oom = self.attempt([suspect])
                if exc is None:  # not one item's doing after all (another's: a probe ran;
                    if not ran:  # none did: the load's): split the rest in halves
                        searches = SEARCHES_MAX
                else:
                    self.out[suspect] = ItemResult(False, error=memory.alone(exc) if oom
                                                   else exc)
                    exc = None
                continue
            mid = len(items) // 2
            todo.append(items[mid:])
            todo.append(items[:mid])
        return self.out  # type: ignore[return-value]

    def probe(self, items: list[int], share: float, known: list[int]
              ) -> tuple[int | None, list[list[int]], bool]:
        """Search ``items`` (which ran out of memory together) for the one that does
        not fit: each probe runs ``share`` of the suspects with the items shown innocent
        so far (no more than ``fits`` in all). A probe that runs clears them all, and
        the culprit is among the other suspects; one that runs out of memory has it
        among its suspects. ``known``: the suspects of an earlier search among them (the
        others taken for innocent), or none. Returns (the last suspect, to run alone;
        the groups still to run, in order; whether a probe ran); no suspect if a probe
        failed otherwise than by running out of memory, or the suspects were carried."""
        fits = self.fits
        if known and len(known) < len(items):
            mark = set(known)
            suspects, clean = known, [j for j in items if j not in mark]
        else:
            suspects, clean = items, []
        ran = False
        carry = self.carry is not None
        while len(suspects) > 1:
            # (suspects carried over once are searched for to the end: the next batch
            # might hold nothing else)
            if carry and not known and not clean and \
                    len(suspects) <= max(2, fits // CARRY_PART):
                self.later(suspects, True)  # searched for in the next batch, with others
                return None, [], ran
            k = min(len(suspects) - 1, max(1, round(len(suspects) * share)))
            with_them = clean[:fits - k]  # (no probe larger than what fits)
            probe = sorted(with_them + suspects[:k])
            exc, oom = self.attempt(probe)
            if exc is None:
                suspects, clean = suspects[k:], clean[len(with_them):]
                ran = True
                continue
            memory.drop(exc)
            exc = None
            if not oom:  # another failure: its parts are split as any failed batch's
                return None, [probe, clean[len(with_them):] + suspects[k:]], ran
            memory.free_memory()
            clean, suspects = clean + suspects[k:], suspects[:k]
        rest = [sorted(clean[i:i + fits]) for i in range(0, len(clean), fits)]
        if carry and rest and len(rest[-1]) <= fits // CARRY_PART:
            self.later(rest.pop(), False)  # a small call's worth: into the next batch
        return suspects[0], rest, ran
