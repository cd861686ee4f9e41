"""No-op worker targets: the benchmarks measure the queue, not the handler.

* :func:`handle`, a plain function (one payload per call): the round trips and drains
  of hotpath, cache, collect and scaling;
* :class:`NoopModel`, a batched :class:`mtq.Model` that returns ``None`` per item: the
  queue's own cost per batch (batching, observability);
* :func:`marked`, :func:`handle` that stamps the first and last task (hotpath's drain).
"""

from __future__ import annotations

import os
import time
from typing import Any

import mtq


def handle(payload: Any) -> None:
    """Do nothing: the benchmark measures the queue, not the handler."""


class NoopModel(mtq.Model):
    """A batched model that does nothing: what is left is mtq's cost per batch."""

    max_batch_size = 32
    max_wait_ms = 5
    name = "noop"
    version = "1"

    def predict(self, batch: list[Any]) -> list[Any]:
        return [None] * len(batch)


_count = 0


def marked(payload: Any) -> None:
    """Do nothing but count, and stamp ``time.time()`` into the files ``first`` and
    ``last`` of $MTQ_BENCH_MARK_DIR at task 1 and task $MTQ_BENCH_N (no Redis work;
    benchmarks/hotpath.py times a drain by them, as the peer harness does)."""
    global _count
    _count += 1
    if _count == 1 or _count == _N:
        name = "first" if _count == 1 else "last"
        path = os.path.join(_MARK, name)
        with open(path + ".tmp", "w") as f:
            f.write(repr(time.time()))
        os.replace(path + ".tmp", path)


_MARK = os.environ.get("MTQ_BENCH_MARK_DIR", "")
_N = int(os.environ.get("MTQ_BENCH_N", "0"))
