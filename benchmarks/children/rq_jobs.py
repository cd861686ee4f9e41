"""Job functions for ``benchmarks/rq.py``, enqueued by plain RQ and run by either
``rq worker`` or ``mtq rq worker``.

Worker processes import this module by the job's function name
(``benchmarks.children.rq_jobs.noop`` / ``benchmarks.children.rq_jobs.embed``), so it stays light:
torch and the model are imported on the first ``embed`` call, once per process.

``embed`` is an ``mtq.rq.batched`` function: ``mtq rq worker`` hands it the texts of
up to 32 single-sentence jobs at once; plain ``rq worker`` calls ``embed(text)``,
which runs a batch of one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from mtq.rq import batched

#: torch intra-op threads of every process that runs the model (the driver's direct
#: pass and the workers): set explicitly so that all sides run the model alike
THREADS_ENV = "MTQ_BENCH_TORCH_THREADS"

_encoder: Any = None


def noop() -> None:
    """Does nothing: the queue's own cost per job."""


def encoder() -> Any:
    """The process's MiniLM encoder (``examples.embeddings.MiniLMEncoder`` on the CPU),
    loaded on the first call with torch set to ``$MTQ_BENCH_TORCH_THREADS`` threads."""
    global _encoder
    if _encoder is None:
        import torch

        threads = os.environ.get(THREADS_ENV)
        if threads:
            torch.set_num_threads(int(threads))
        from examples.embeddings import MiniLMEncoder

        _encoder = MiniLMEncoder("cpu")
    return _encoder


def encode(texts: Sequence[str]) -> list[list[float]]:
    """One model call over ``texts`` (what the direct pass times)."""
    rows: list[list[float]] = encoder()(texts)
    return rows


@batched(max_batch_size=32, max_wait_ms=5)
def embed(texts: list[str]) -> list[list[float]]:
    """all-MiniLM-L6-v2 sentence embeddings: one 384-float list per text."""
    return encode(texts)
