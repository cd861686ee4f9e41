"""Running out of memory: telling it apart, freeing what a failed call held, and the
load a worker takes on after it (a batch model's batch size; a generator's running
requests and token budgets).

An out-of-memory error is the most common failure on a device, and unlike others it
says nothing about the tasks: a batch that does not fit may hold no bad task at all.
So the worker (:func:`mtq.workers.splitting.run_isolated`, the generation engine):

* frees the failed call's memory before anything else runs: the error's traceback,
  whose frames hold the call's tensors, is dropped outside the ``except`` block, and
  the device's cached blocks go back to the driver (:func:`free_memory`);
* splits the batch and runs the parts in the same delivery (or the next batch), so
  the tasks that fit are never charged for it; a task that runs out of memory alone
  fails with :class:`~mtq.errors.DeviceOutOfMemory`, and is retried alone;
* lowers its load to what ran (:class:`Limit`), and raises it again, a step at a
  time, after :data:`RECOVER_BATCHES` batches (a generator: :data:`RECOVER_STEPS`
  decode steps) without running out of memory.

This module never imports torch: it looks at ``sys.modules``.
"""

from __future__ import annotations

import logging
import sys
import traceback
from collections.abc import Callable, Sequence

from mtq.errors import DeviceOutOfMemory

log = logging.getLogger("mtq.workers.worker")  # the worker's log, as its users read it

#: batches in a row that ran without running out of memory before a lowered batch size
#: goes up a step (a quarter of itself, at least one)
RECOVER_BATCHES = 20
#: a generator's decode steps in a row without running out of memory before its lowered
#: limits (running requests, tokens in flight, prefill tokens) go up a step
RECOVER_STEPS = 200
#: once a batch that fitted before runs out of memory (one task's doing, most likely),
#: the share of the suspects each probe runs with the tasks shown to fit
#: (:func:`mtq.workers.splitting.run_isolated`), between these: the more a probe that
#: runs out of memory costs next to one that runs, the nearer a half (see probe_share)
PROBE_SHARE_MIN, PROBE_SHARE_MAX = 0.5, 0.8

#: what torch and others say in a RuntimeError when an allocation fails: CUDA
#: ("CUDA out of memory", "CUDA error: out of memory"), MPS ("MPS backend out of
#: memory"), the CPU allocator ("DefaultCPUAllocator: can't allocate memory"), and
#: the cuBLAS/cuDNN handles ("CUBLAS_STATUS_ALLOC_FAILED")
_MESSAGES = ("out of memory", "can't allocate memory", "cannot allocate memory",
             "_STATUS_ALLOC_FAILED")


def is_oom(exc: BaseException) -> bool:
    """True if ``exc`` says an allocation failed: ``torch.OutOfMemoryError`` (CUDA),
    a ``MemoryError`` (the host: Python, numpy), :class:`~mtq.errors.DeviceOutOfMemory`,
    or a RuntimeError whose message says so (MPS, torch's CPU allocator)."""
    if isinstance(exc, (MemoryError, DeviceOutOfMemory)):
        return True
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if oom is not None and isinstance(exc, oom):
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc)[:2000].lower()
        return any(m.lower() in text for m in _MESSAGES)
    return False


def probe_share(failed_s: float, fitted_s: float) -> float:
    """The share of the suspects a probe runs, from what the call that ran out of memory
    took (``failed_s``) next to what a call of that size takes when it runs
    (``fitted_s``; 0: not known). A failure that costs little (it stops at its first
    allocation) makes large probes pay: most of them fail, cheaply, and the one that
    runs finishes most of the batch; one that costs as much as a run makes halves pay."""
    if fitted_s <= 0:
        return PROBE_SHARE_MIN
    lost = min(1.0, failed_s / fitted_s)
    return max(PROBE_SHARE_MIN, min(PROBE_SHARE_MAX, PROBE_SHARE_MAX - 0.6 * lost))


def drop(exc: BaseException) -> None:
    """Let go of what a failed call held: the frames of ``exc``'s traceback (and of the
    errors chained to it) with their locals, a batch's tensors among them."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        e = e.__cause__ or e.__context__


def alone(exc: BaseException) -> DeviceOutOfMemory:
    """The error a task ends with when it ran out of memory alone: a
    :class:`~mtq.errors.DeviceOutOfMemory` caused by ``exc``, whose traceback it keeps
    (for the task's record) with the frames' locals cleared."""
    if isinstance(exc, DeviceOutOfMemory):
        traceback.clear_frames(exc.__traceback__)
        return exc
    traceback.clear_frames(exc.__traceback__)
    out = DeviceOutOfMemory(exc)
    out.__cause__ = exc
    return out


def free_memory() -> None:
    """Give a device's cached memory back after an out-of-memory error (CUDA, MPS), if
    torch is loaded and the device in use; nothing otherwise. Never raises."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    try:
        cuda = getattr(torch, "cuda", None)
        if cuda is not None and cuda.is_initialized():
            cuda.empty_cache()
        mps = getattr(torch, "mps", None)
        backends = getattr(torch, "backends", None)
        if mps is not None and backends is not None and backends.mps.is_available() \
                and mps.driver_allocated_memory() > 0:
            mps.empty_cache()
    except Exception:  # a broken device is the next call's to report
        log.debug("could not free the device's cached memory", exc_info=True)


class Limit:
    """One measure of the load a worker takes on at once (a batch's size, requests
    running, tokens in flight), lowered when the load runs out of memory and raised
    again, a step at a time, after ``recover_after`` successes in a row.

    ``configured`` is the model's own limit (None: none); :attr:`value` the one in
    force (None: none)."""

    def __init__(self, name: str, configured: int | None, recover_after: int) -> None:
        self.name = name
        self.configured = configured
        self.value = configured
        self.recover_after = recover_after
        #: the most that ran without running out of memory since the value last went down
        self.good = 0
        #: the least that ran out of memory (the load's doing), since the value went down
        self.failed: int | None = None
        self.streak = 0

    @property
    def lowered(self) -> bool:
        return self.value != self.configured

    def allows(self, amount: int) -> bool:
        return self.value is None or amount <= self.value

    def ran(self, amount: int) -> bool:
        """``amount`` ran without running out of memory. True if that raised the value
        (a run of :attr:`recover_after` successes)."""
        if amount > self.good:
            self.good = amount
        if not self.lowered:
            return False
        self.streak += 1
        if self.streak < self.recover_after:
            return False
        self.streak = 0
        value = self.value or 1
        new: int | None = value + max(1, value // 4)
        if self.configured is not None:
            new = min(new, self.configured)  # type: ignore[type-var]
        elif self.failed is not None and new is not None and new >= 2 * self.failed:
            new = None  # well past what failed: no limit again, as configured
        self.value = new
        if new == self.configured:
            self.failed = None
        log.info("%s raised to %s after %d successes in a row", self.name,
                 "no limit" if new is None else new, self.recover_after)
        return True

    def out_of_memory(self, failed: int, ran: int = 0) -> bool:
        """``failed`` ran out of memory, and no task of it did alone (the load, not a
        task); ``ran``: the most that ran in the same attempt. The value goes down to
        what is known to fit: ``ran``, or what ran before if less than ``failed``, else
        half of ``failed``; at least 1. True if that lowered it."""
        fits = max(ran, self.good if self.good < failed else 0)
        new = max(1, min(failed - 1, fits or failed // 2))
        self.streak = 0
        self.good = min(fits, new)
        self.failed = failed if self.failed is None else min(self.failed, failed)
        if self.value is not None and new >= self.value:
            return False
        log.info("%s lowered to %d: %d ran out of memory", self.name, new, failed)
        self.value = new
        return True


def load_failures(calls: Sequence[tuple[Sequence[int], str]], ran: Callable[[int], bool]
                  ) -> tuple[list[Sequence[int]], list[Sequence[int]]]:
    """From the calls of a split batch (items, "ok" / "oom" / "error"): (the calls that
    ran out of memory though each of their items ran in the end (``ran(item)``): the
    load's doing, the calls that ran)."""
    load = [items for items, kind in calls if kind == "oom" and all(map(ran, items))]
    return load, [items for items, kind in calls if kind == "ok"]


def learn(limit: Limit, calls: Sequence[tuple[Sequence[int], str]], ok: Callable[[int], bool],
          weight: Callable[[Sequence[int]], int] = len) -> bool:
    """What a split batch's calls say of the load (``weight``: what a call's items
    weigh; their number by default): if one ran out of memory though each of its items
    ran in the end (``ok(item)``), ``limit`` goes down to what ran that weighed less;
    otherwise what ran counts as a success. True if the limit's value changed."""
    load, ran = load_failures(calls, ok)
    if load:
        failed = min(weight(c) for c in load)
        return limit.out_of_memory(failed, max((w for w in map(weight, ran) if w < failed),
                                               default=0))
    return bool(ran) and limit.ran(max(weight(c) for c in ran))


class GeneratorLimits:
    """A generator's load in force (:class:`Limit` each): requests running, tokens in
    flight (prompt + max_tokens of the running requests) and prompt tokens per prefill
    step, from its ``max_running`` (or the worker's max_batch_size),
    ``max_total_tokens`` and ``max_prefill_tokens``."""

    def __init__(self, max_running: int, max_total_tokens: int | None,
                 max_prefill_tokens: int | None) -> None:
        self.running = Limit("running requests", max_running, RECOVER_STEPS)
        self.tokens = Limit("tokens in flight", max_total_tokens, RECOVER_STEPS)
        self.prefill = Limit("prefill tokens", max_prefill_tokens, RECOVER_STEPS)

    @property
    def lowered(self) -> bool:
        return self.running.lowered or self.tokens.lowered

    def shed(self, loads: Sequence[int]) -> int:
        """A decode step on requests of these loads (prompt + max tokens each, in the
        order they were admitted) ran out of memory: lower the limits on running
        requests and tokens in flight, and return how many of the oldest stay within
        them (at least one; fewer than all)."""
        self.running.out_of_memory(len(loads))
        self.tokens.out_of_memory(sum(loads))
        cap = self.running.value or 1
        keep = total = 0
        for w in loads:
            if keep and (keep >= cap or not self.tokens.allows(total + w)):
                break
            keep += 1
            total += w
        return keep

    def ran(self, running: int, tokens: int) -> bool:
        """A decode step of ``running`` requests and ``tokens`` in flight fitted. True
        if that raised the limit on running requests."""
        self.tokens.ran(tokens)
        return self.running.ran(running)

    def snapshot(self) -> tuple[tuple[int | None, int, int | None, int], ...]:
        """The running and token limits as they are (see :meth:`restore`)."""
        return tuple((lim.value, lim.good, lim.failed, lim.streak)
                     for lim in (self.running, self.tokens))

    def restore(self, snap: tuple[tuple[int | None, int, int | None, int], ...]) -> None:
        """Put the running and token limits back as :meth:`snapshot` saw them: the
        steps that lowered them since ran out of memory because of one request (it did
        alone), not because of the load."""
        for lim, (value, good, failed, streak) in zip((self.running, self.tokens), snap):
            lim.value, lim.good, lim.failed, lim.streak = value, good, failed, streak
        log.info("running requests back at %s, tokens in flight at %s: one request ran "
                 "out of memory alone", self.running.value, self.tokens.value)
