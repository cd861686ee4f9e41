"""Targets of tests/integration/test_engines_cuda.py: models that tell, from inside an
engine, which CUDA stream and thread ran them, and one whose setup leaves its last
kernels running when it returns."""

from __future__ import annotations

import threading
from typing import Any

import mtq
from benchmarks.children.engines import FastGPT32, stream_tag
from mtq.workers.generator import Generation


class StreamGPT(FastGPT32):
    """The fast model in float32; each result also carries the streams and threads its
    prefill and decode steps ran on (since setup) and the last step's logits."""

    name = "stream-gpt"

    def setup(self, device: Any = "cpu") -> None:
        super().setup(device)
        self.streams: set[str] = set()
        self.threads: set[str] = set()

    def _seen(self) -> None:
        self.streams.add(stream_tag())
        self.threads.add(threading.current_thread().name)

    def prefill(self, requests: list[Generation]) -> list[Any]:
        self._seen()
        return super().prefill(requests)

    def decode(self, requests: list[Generation]) -> list[Any]:
        self._seen()
        return super().decode(requests)

    def result(self, request: Generation) -> dict[str, Any]:
        out = super().result(request)
        out["streams"] = sorted(self.streams)
        out["threads"] = sorted(self.threads)
        out["logits"] = self.last_logits[-1].float().cpu().tolist()
        return out


class LateWeights(mtq.Model):
    """Weights of ones, written on the device after ``busy`` products of ``side`` x
    ``side`` matrices queued before them: on a GPU, setup returns while those kernels
    still run (CUDA is asynchronous). Each result is the weights' mean: 1.0 once they
    are written, less if a stream that did not wait for setup's reads them."""

    name = "late-weights"
    max_batch_size = 1
    max_wait_ms = 0.0
    n = mtq.Option(int, 1 << 20, min=1, help="floats of weights")
    side = mtq.Option(int, 64, min=2, help="the matrices' side")
    busy = mtq.Option(int, 0, min=0, help="products queued before the weights are written")

    def setup(self, device: Any) -> None:
        import torch

        self.w = torch.zeros(self.n, device=device)
        g = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(self.side, self.side, device=device, generator=g) / self.side ** 0.5
        y = a
        for _ in range(self.busy):
            y = torch.tanh(y @ a)
        self.w.copy_(torch.ones_like(self.w) + y[0, 0] * 0)  # after the products

    def predict(self, batch: list[Any]) -> list[Any]:
        mean = float(self.w.mean())
        return [{"mean": mean, "stream": stream_tag(),
                 "thread": threading.current_thread().name} for _ in batch]
