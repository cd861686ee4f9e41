"""No-op worker targets: the benchmarks measure the queue, not the handler.

* :func:`handle`, a plain function (one payload per call), for benchmarks/broker.py;
* :class:`NoopModel`, a batched :class:`mtq.Model` that returns ``None`` per item,
  for benchmarks/batching.py (the queue's own cost per batch).
"""

from __future__ import annotations

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
