"""A tiny real torch model served with dynamic batching; the tests use it.

    mtq workers start examples.tiny:TinyClassifier --queue tiny --devices cpu
    mtq submit tiny '{"features": [0.1, 0.2, 0.3, 0.4]}' --wait

The weights come from a fixed seed, so every process computes the same answers; its
options (``--set seed=7 --set hidden=32``) choose another seed and width.
"""

from __future__ import annotations

from typing import Any

import mtq


class TinyClassifier(mtq.Model):
    """4 features in, a label and its score out (a two-layer MLP)."""

    max_batch_size = 32
    max_wait_ms = 5
    name = "tiny-classifier"
    version = "1"
    labels = ("cat", "dog", "bird")
    seed = mtq.Option(int, 0, help="the seed of the random weights")
    hidden = mtq.Option(int, 16, min=1, max=4096, help="the width of the hidden layer")

    def setup(self, device: Any) -> None:
        import torch

        torch.manual_seed(self.seed)
        self.torch = torch
        self.device = device
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, self.hidden), torch.nn.ReLU(),
            torch.nn.Linear(self.hidden, len(self.labels)),
        ).to(device).eval()

    def predict(self, batch: list[Any]) -> list[Any]:
        torch = self.torch
        rows = [p["features"] for p in batch]
        if any(len(r) != 4 for r in rows):
            raise ValueError("each payload needs 'features': a list of 4 numbers")
        with torch.inference_mode():
            x = torch.tensor(rows, dtype=torch.float32, device=self.device)
            probs = torch.softmax(self.net(x), dim=1)
            score, idx = probs.max(dim=1)
        return [{"label": self.labels[int(i)], "score": round(float(s), 6)}
                for i, s in zip(idx.tolist(), score.tolist())]
