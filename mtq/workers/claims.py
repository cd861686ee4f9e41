"""Claims sized to the work: how many tasks a worker takes at a time.

A worker claims ahead only about as much work as it can start soon. Tasks that the
model runs one after another (a plain function, a per-item model) start one task's
time apart, so the worker claims

    size = clamp(ceil(CLAIM_AHEAD_S / seconds per task), 1, max_batch_size)

tasks at a time: for the batch it claims when idle, for each batch it keeps claimed
ahead while the model runs, and for the room it registers for direct delivery (the
most one submit hands it). A function that returns in microseconds claims full
batches (64) as before; one that takes half a second claims one task at a time, so
a burst spreads over the idle workers instead of queueing behind one of them. A
worker with no measurement yet (just started, or reloaded) claims one task at a
time and grows with its first measured batches.

The tasks of a batch model's batch start together, in one call: its claims stay
whole batches (the batch is how it spreads its cost), and its claim-ahead follows
the time of its batches (:meth:`mtq.workers.fetcher.Fetcher.claim_ahead`).

A worker that took more than that (a burst handed to it while its function looked
fast) gives the rest back: a task of a per-item batch that runs longer than
CLAIM_AHEAD_S updates the estimate at once, and if the batch's tasks not started are
more than a claim of the new size, the batch ends there and those beyond the claims
the worker now keeps go back to the queue for idle workers (:meth:`ClaimSizer.slow`).

Seconds per task: the time of a batch over its size, taken at once when it is
longer than the estimate (a slow task makes the claims small from the next one),
halved towards it when shorter (a fast function's claims double each batch).
"""

from __future__ import annotations

import math

from mtq.workers.batching import BatchSlot

#: a worker that runs its tasks one after another claims about this much of its work
#: at a time (by its measured seconds per task)
CLAIM_AHEAD_S = 0.005


class ClaimSizer:
    """Sets the slot's claim size from the measured time per task (model thread)."""

    def __init__(self, slot: BatchSlot) -> None:
        self.slot = slot
        #: the model runs its tasks one after another (a plain function, a per-item model)
        self.per_item = False
        #: seconds per task of its recent batches (None: not measured yet)
        self.task_s: float | None = None
        #: the batch being measured was cut short (see :meth:`slow`)
        self._cut = False

    def reset(self, per_item: bool) -> None:
        """A new model (start, reload): no measurement; a per-item model claims one task
        at a time until it has one, a batch model whole batches."""
        self.per_item = per_item
        self.task_s = None
        self._cut = False
        self.slot.set_claim_size(1 if per_item else None)

    def observe(self, n: int, seconds: float) -> None:
        """A batch of ``n`` tasks ran in ``seconds`` (the model thread, after it)."""
        if self._cut:
            self._cut = False
            return
        if not self.per_item or n <= 0 or self.slot.max_batch_size == 1:
            return  # (nothing to size: a batch model claims whole batches, and a batch of
            # one task is one task a claim)
        new = seconds / n if seconds > 0 else 0.0
        last = self.task_s
        self.task_s = new if last is None or new >= last else (last + new) * 0.5
        size = self.size()
        if size != self.slot.claim_size:  # (once a batch: no lock when it stays)
            self.slot.set_claim_size(size)

    def slow(self, seconds: float, rest: int) -> bool:
        """One task of a per-item batch ran in ``seconds`` with ``rest`` more after it:
        True when the batch is to be cut short (the task was slower than CLAIM_AHEAD_S
        and the rest is more than a claim of the size its time now gives), its time
        taken into the estimate. The batch then counts as measured (:meth:`observe`
        skips it)."""
        if seconds <= CLAIM_AHEAD_S or not self.per_item:
            return False
        self.observe(1, seconds)
        self._cut = rest > self.size()
        return self._cut

    def size(self) -> int:
        """Tasks per claim now (before the slot's max_batch_size caps it)."""
        b = self.slot.max_batch_size
        task_s = self.task_s
        if not self.per_item or task_s is None:
            return 1 if self.per_item else b
        if task_s * b <= CLAIM_AHEAD_S:  # (a fast function: whole batches)
            return b
        return max(1, min(b, math.ceil(CLAIM_AHEAD_S / task_s)))
