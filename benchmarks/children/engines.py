"""Targets of the engines benchmark (benchmarks/engines.py) and the engine tests that
start processes (tests/integration/test_engines_host.py, test_engines_cuda.py).

* :class:`FastGPT`: the reference TinyGPT at the streaming benchmarks' shape
  (:class:`~benchmarks.children.gen.BenchTinyGPT`), the fast model; requests are
  greedy (``temperature 0``) so its tokens can be compared across processes;
* :class:`FastGPT32`: the same in float32 (the GPU check's bit-for-bit comparison);
* :class:`Slow`: a batch model whose every task is ``matmuls`` products of two
  ``size`` x ``size`` float32 matrices (about 15-20 ms each at 1024 on one core of the
  benchmark machine; a payload's ``"k"`` scales the first): a long batch that keeps a
  core busy in torch, which releases the GIL in each product, as a real model's
  forward does;
* :class:`Weights`: ``mb`` MiB of seeded random weights made at setup (a load that
  takes a noticeable time), ``work_ms`` of torch work per batch: the LRU workload's
  three models and the commands' model.

Every model here appends one line per finished task to ``$MTQ_BENCH_RUNLOG`` (when
set): ``<tag> <id>``, the id being the payload's ``"i"`` (a batch model) or its
``"seed"`` (a generator, which takes no other field). The benchmark counts the lines
per id: a task run twice to the end shows twice. ``Weights`` also writes ``<tag>
@setup`` and ``<tag> @teardown`` as its setup and teardown begin.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, ClassVar

import mtq
from benchmarks.children.gen import BenchTinyGPT
from mtq.workers.generator import Generation

RUNLOG = "MTQ_BENCH_RUNLOG"
_lock = threading.Lock()


def log_done(tag: str, ids: list[Any]) -> None:
    """Append ``<tag> <id>`` for each finished task to ``$MTQ_BENCH_RUNLOG``."""
    path = os.environ.get(RUNLOG)
    if not path or not ids:
        return
    text = "".join(f"{tag} {i}\n" for i in ids)
    with _lock:  # one write per call, O_APPEND: lines of engines in one process never mix
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)


def stream_tag() -> str:
    """The current CUDA stream of this thread (``cuda:N/<id>``, ``default`` for the
    device's default stream), or ``cpu``: what an engine's model thread runs under."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return "cpu"
    s = torch.cuda.current_stream()
    if s == torch.cuda.default_stream(s.device):
        return "default"
    return f"{s.device}/{s.stream_id}"


class FastGPT(BenchTinyGPT):
    """The fast model: TinyGPT at the streaming benchmarks' shape, float64, 8 running."""

    max_running = 8
    max_total_tokens = 8 * 512
    name = "fast-gpt"
    tag: ClassVar[str] = "fast"

    def result(self, request: Generation) -> dict[str, Any]:
        out = super().result(request)
        log_done(self.tag, [request.payload.get("seed")])
        return out


class FastGPT32(FastGPT):
    """The fast model in float32 (a GPU's arithmetic: the bit-for-bit comparison)."""

    dtype: ClassVar[str] = "float32"
    name = "fast-gpt32"


class Slow(mtq.Model):
    """Long batches: ``matmuls`` products of ``size`` x ``size`` float32 matrices a task;
    each result ``{"sum", "stream", "thread"}`` (what ran it: see :func:`stream_tag`)."""

    name = "slow"
    version = "1"
    max_batch_size = 1
    max_wait_ms = 0.0
    size = mtq.Option(int, 1024, min=16, help="the matrices' side")
    matmuls = mtq.Option(int, 12, min=1, help="products per batch")

    def setup(self, device: Any) -> None:
        import torch

        g = torch.Generator().manual_seed(0)
        self.a = (torch.randn(self.size, self.size, generator=g) / self.size ** 0.5).to(device)
        self.device = device

    def predict(self, batch: list[Any]) -> list[Any]:
        out = []
        for p in batch:
            k = int(p.get("k", 0)) if isinstance(p, dict) else 0
            x = self.a * (1 + k / 64) if k else self.a
            for _ in range(self.matmuls):
                x = x @ self.a  # torch releases the GIL for the product
            out.append({"sum": float(x.abs().sum()), "stream": stream_tag(),
                        "thread": threading.current_thread().name})
        log_done("slow", [p.get("i") if isinstance(p, dict) else None for p in batch])
        return out


class Weights(mtq.Model):
    """``mb`` MiB of seeded random float32 weights; each result ``{"tag", "i", "w",
    "stream"}`` (``w``: a weight, so a result shows which options made the model)."""

    name = "weights"
    version = "1"
    max_batch_size = 8
    max_wait_ms = 0.0
    tag = mtq.Option(str, "a", help="what its results and run log carry")
    mb = mtq.Option(float, 16.0, min=0.001, help="its weights' size in MiB")
    work_ms = mtq.Option(float, 2.0, min=0, help="torch work per batch (about)")
    seed = mtq.Option(int, 0, help="its weights' seed")
    load_s = mtq.Option(float, 0.0, min=0, help="seconds its setup sleeps (a slow load)")
    unload_s = mtq.Option(float, 0.0, min=0, help="seconds its teardown sleeps")

    def setup(self, device: Any) -> None:
        import torch

        log_done(self.tag, ["@setup"])
        if self.load_s:
            time.sleep(self.load_s)
        g = torch.Generator().manual_seed(self.seed)
        n = max(1, int(self.mb * 2**20 / 4))
        self.weights = torch.randn(n, generator=g).to(device)
        self.device = device
        self.resets = 0

    def predict(self, batch: list[Any]) -> list[Any]:
        import torch

        if self.work_ms:  # a few small products, on the weights' device
            side = 128
            m = self.weights[: side * side].reshape(side, side)
            end = time.perf_counter() + self.work_ms / 1000
            while time.perf_counter() < end:
                m = torch.tanh(m @ m)
        stream = stream_tag()
        ids = [p.get("i") if isinstance(p, dict) else p for p in batch]
        log_done(self.tag, ids)
        w = float(self.weights[0])
        return [{"tag": self.tag, "i": i, "w": w, "stream": stream} for i in ids]

    def reset(self) -> None:
        self.resets += 1

    def teardown(self) -> None:
        log_done(self.tag, ["@teardown"])
        if self.unload_s:
            time.sleep(self.unload_s)
