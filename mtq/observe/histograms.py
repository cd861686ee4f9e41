"""Histograms a worker process keeps for ``mtq metrics serve``, written once per beat.

Observations (a task's queue wait, run time, end-to-end latency; a generation's
time to first token and decode rate) are counted in this process, by bucket,
under a lock held for a few additions; nothing is written to Redis per task. The
heartbeat adds the counts gathered since the last successful write to the
queue's ``hist`` hash (:attr:`mtq.broker.keys.QueueKeys.hist`) in one
MULTI/EXEC, and forgets them only once that succeeded: a write that fails while
Redis is away keeps them for the next beat (nothing lost, nothing counted twice;
a reply lost *after* Redis applied the write would count one beat twice).
A process killed with SIGKILL loses what it gathered since its last beat (≤ 1 s).

Hash fields (one hash per queue, summed over every worker that ever served it):

* ``"<metric>:<i>"``: observations in bucket ``i`` (NOT cumulative): ``i`` indexes
  :data:`BOUNDS` ``[metric]``, an observation ``v`` falling in the first bucket
  whose bound is ``>= v`` (Prometheus' ``le``); ``i == len(bounds)`` is +Inf;
* ``"<metric>:sum"``: the sum of the observations (HINCRBYFLOAT), in the base unit.

No torch import: the exporter reads :data:`BOUNDS` too.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: bucket bounds in seconds (the +Inf bucket follows the last)
SECONDS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                              2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
#: bucket bounds in tokens per second
TOKENS_PER_S: tuple[float, ...] = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0,
                                   1000.0, 2000.0, 5000.0)

#: metric -> its finite bucket bounds. queue_wait: submit to claim, per delivery;
#: run: start of the batch (or prefill) that ran a task to its outcome; latency:
#: submit to the outcome that ends the task (succeeded, failed, dead; not a retry);
#: ttft: submit to a generation's first token; tokens_per_s: a generation's tokens
#: after the first over the seconds from the first to its end (2 tokens or more);
#: load: an engine setting its model up (on demand: the wait of the tasks that came)
BOUNDS: dict[str, tuple[float, ...]] = {
    "queue_wait": SECONDS,
    "run": SECONDS,
    "latency": SECONDS,
    "ttft": SECONDS,
    "tokens_per_s": TOKENS_PER_S,
    "load": SECONDS,
}


@dataclass
class Sent:
    """What one :meth:`Histograms.flush` put in a pipeline: subtracted from the pending
    counts by :meth:`Histograms.commit` once the pipeline succeeded."""

    counts: dict[str, list[int]]
    sums: dict[str, float]


class Histograms:
    """Pending (not yet written) bucket counts of this process (thread-safe).

    ``enabled`` False (the queue's ``metrics`` setting): :meth:`observe` does nothing."""

    def __init__(self) -> None:
        self.enabled = True
        self._lock = threading.Lock()
        self._counts = {m: [0] * (len(b) + 1) for m, b in BOUNDS.items()}
        self._sums = dict.fromkeys(BOUNDS, 0.0)

    def observe(self, metric: str, value: float) -> None:
        """Count one observation of ``metric`` (a key of :data:`BOUNDS`; KeyError else)."""
        if not self.enabled:
            return
        i = bisect.bisect_left(BOUNDS[metric], value)
        with self._lock:
            self._counts[metric][i] += 1
            self._sums[metric] += value

    def observe_many(self, metric: str, values: Sequence[float]) -> None:
        """:meth:`observe` each of ``values`` (one lock for all: a batch's)."""
        if not self.enabled:
            return
        bounds = BOUNDS[metric]
        where = [bisect.bisect_left(bounds, v) for v in values]
        if not where:
            return
        total = sum(values)
        with self._lock:
            counts = self._counts[metric]
            for i in where:
                counts[i] += 1
            self._sums[metric] += total

    def pending(self) -> dict[str, list[int]]:
        """A copy of the counts not yet written, by metric (for tests and reports)."""
        with self._lock:
            return {m: list(c) for m, c in self._counts.items()}

    def flush(self, pipe: Any, key: str) -> Sent | None:
        """Add the pending counts to ``pipe`` (HINCRBY per non-empty bucket, HINCRBYFLOAT
        of the sum) for the hash ``key``; None (nothing added) when there are none. The
        counts stay pending until :meth:`commit` is given what this returned: call it
        only after ``pipe.execute()`` succeeded."""
        with self._lock:
            counts = {m: list(c) for m, c in self._counts.items() if any(c)}
            sums = {m: self._sums[m] for m in counts}
        if not counts:
            return None
        for metric, buckets in counts.items():
            for i, n in enumerate(buckets):
                if n:
                    pipe.hincrby(key, f"{metric}:{i}", n)
            pipe.hincrbyfloat(key, f"{metric}:sum", sums[metric])
        return Sent(counts, sums)

    def commit(self, sent: Sent | None) -> None:
        """The pipeline of a :meth:`flush` succeeded: forget what it wrote (what was
        observed since stays pending)."""
        if sent is None:
            return
        with self._lock:
            for metric, buckets in sent.counts.items():
                mine = self._counts[metric]
                for i, n in enumerate(buckets):
                    mine[i] -= n
                # no float residue that would make an empty histogram look changed
                self._sums[metric] = 0.0 if not any(mine) else \
                    self._sums[metric] - sent.sums[metric]


__all__ = ["BOUNDS", "SECONDS", "TOKENS_PER_S", "Histograms", "Sent"]
