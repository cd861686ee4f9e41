"""Worker target of benchmarks/oom.py: a small torch MLP served in batches of 32, whose
``predict`` runs out of memory when a batch holds a payload with ``"oom": true``.

The poison raises ``torch.OutOfMemoryError`` with CUDA's message where a device would:
at the batch's first allocation, the input tensor, before the forward pass (an input
too large for the device fails there). The forward pass of a batch of 32 takes about
4 ms on one core of the machine the figures were measured on (one thread: see
``setup``), and of one payload about 0.9 ms (the weights, 18 MB, are read once a
call whatever its size): a batch split in parts pays that again for each part.
"""

from __future__ import annotations

from typing import Any

import mtq


class Mlp(mtq.Model):
    """256 -> 2048 -> 2048 -> 256, ReLU between; the result is each row's sum."""

    max_batch_size = 32
    max_wait_ms = 2.0
    name = "mlp"

    def setup(self, device: Any) -> None:
        import torch

        torch.set_num_threads(1)  # one core, whatever the machine: comparable turns
        torch.manual_seed(0)
        self.torch = torch
        self.net = torch.nn.Sequential(
            torch.nn.Linear(256, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
            torch.nn.ReLU(), torch.nn.Linear(2048, 256)).eval()

    def predict(self, batch: list[Any]) -> list[Any]:
        torch = self.torch
        if any(p.get("oom") for p in batch):
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {len(batch) * 8:.2f} GiB (GPU 0; "
                "79.11 GiB total capacity; 3.20 GiB free)")
        x = (torch.tensor([p["i"] % 97 for p in batch], dtype=torch.float32) / 97
             ).unsqueeze(1).expand(len(batch), 256).contiguous()
        with torch.inference_mode():
            y = self.net(x).sum(dim=1)
        return y.tolist()
