"""Worker targets that log when each ``predict`` call starts and ends, for
benchmarks/batching.py.

The log tells, from inside the worker process and with one clock, how long the
model ran and how long the model thread spent between two calls (taking the
batch, decoding payloads, handing outcomes to the publisher): time the device
sits idle because of the queue. It costs two ``time.perf_counter()`` calls and a
list append per batch. The log is written as JSON to ``$MTQ_BENCH_TIMINGS`` when
the process exits normally (``mtq worker run --burst`` does).
"""

from __future__ import annotations

import atexit
import json
import os
import time
from typing import Any

from benchmarks.children.noop import NoopModel
from examples.embeddings import MiniLM

ENV = "MTQ_BENCH_TIMINGS"


class _Timed:
    """Mix-in: records (start, end, batch size) of every predict call."""

    calls: list[tuple[float, float, int]]

    def setup(self, device: Any) -> None:
        super().setup(device)  # type: ignore[misc]
        self.calls = []
        path = os.environ.get(ENV)
        if path:
            atexit.register(self._dump, path)

    def predict(self, batch: list[Any]) -> list[Any]:
        t0 = time.perf_counter()
        try:
            return super().predict(batch)  # type: ignore[misc]
        finally:
            self.calls.append((t0, time.perf_counter(), len(batch)))

    def _dump(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.calls, f)


class TimedMiniLM(_Timed, MiniLM):
    """examples.embeddings:MiniLM with its predict calls logged."""


class TimedNoop(_Timed, NoopModel):
    """benchmarks.children.noop:NoopModel with its predict calls logged."""
