"""A reference sentence encoder: :class:`TinyEmbedder`, served in dynamic batches.

Byte tokens (:mod:`mtq.reference.tokenizer`), a 2-layer transformer encoder,
mean pooling over the real tokens and L2 normalisation: the shape of a
sentence-embedding model (all-MiniLM-L6-v2, see ``examples/embeddings.py``), small
enough for the demo to run on any CPU with no download. Weights come from a fixed
seed into ``<state dir>/reference/`` on first use and are loaded with
``torch.load(weights_only=True)``, like :class:`mtq.reference.gpt.TinyGPT`.

Payload: a string, or ``{"text": str}``; result: ``DIM`` floats of unit length.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mtq
from mtq.broker.embedded import default_state_dir
from mtq.errors import ConfigError, PermanentError
from mtq.reference.tokenizer import BOS, VOCAB_SIZE, encode

logger = logging.getLogger(__name__)

#: size of one embedding
DIM = 64
#: longest input in tokens (bytes); longer texts are truncated
MAX_TOKENS = 128
_LAYERS, _HEADS = 2, 4
_INIT_VERSION = "1"


def weights_path(seed: int = 0, environ: Mapping[str, str] | None = None) -> Path:
    """``<state dir>/reference/embedder-d<DIM>-v<init>-seed<seed>.pt``."""
    env = os.environ if environ is None else environ
    return default_state_dir(env) / "reference" / \
        f"embedder-d{DIM}-l{_LAYERS}-v{_INIT_VERSION}-seed{seed}.pt"


def _build() -> Any:
    import torch
    from torch import nn

    layer = nn.TransformerEncoderLayer(DIM, _HEADS, dim_feedforward=4 * DIM, dropout=0.0,
                                       batch_first=True, norm_first=True)
    return nn.ModuleDict({
        "tok": nn.Embedding(VOCAB_SIZE, DIM),
        "pos": nn.Embedding(MAX_TOKENS + 1, DIM),
        "enc": nn.TransformerEncoder(layer, _LAYERS, enable_nested_tensor=False),
        "ln": nn.LayerNorm(DIM),
    }).to(torch.float32)


def _text(payload: Any) -> str:
    if isinstance(payload, dict) and isinstance(payload.get("text"), str):
        return str(payload["text"])
    if isinstance(payload, str):
        return payload
    raise PermanentError(f"send a string or {{'text': str}}, not {payload!r:.60}")


class TinyEmbedder(mtq.Model):
    """Sentence embeddings from a small transformer encoder (random weights from a
    fixed seed: similar texts are not close; the point is the serving path)."""

    max_batch_size = 32
    max_wait_ms = 5.0
    name = "tiny-embedder"
    version = _INIT_VERSION

    def __init__(self, weights_seed: int = 0) -> None:
        self.weights_seed = weights_seed
        self.module: Any = None
        self.device: Any = None

    def setup(self, device: Any = "cpu") -> None:
        import torch

        path = weights_path(self.weights_seed)
        if not path.exists():
            from mtq.reference.gpt import save_atomic

            with torch.random.fork_rng(devices=[]):  # the global RNG is left as it was
                torch.manual_seed(self.weights_seed)
                save_atomic(_build().state_dict(), path)
            logger.info("created embedder weights %s", path)
        module = _build()
        try:
            module.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        except Exception as exc:
            raise ConfigError(f"embedder weights file {path} is unreadable or does not match "
                              f"the model ({exc}); delete it to have it made again") from exc
        self.device = torch.device(device) if isinstance(device, str) else device
        self.module = module.to(self.device).eval()

    def predict(self, batch: list[Any]) -> list[list[float]]:
        import torch

        ids = [[BOS, *encode(_text(p))[:MAX_TOKENS]] for p in batch]
        width = max(len(x) for x in ids)
        tokens = torch.zeros(len(ids), width, dtype=torch.long)
        pad = torch.ones(len(ids), width, dtype=torch.bool)
        for i, row in enumerate(ids):
            tokens[i, :len(row)] = torch.tensor(row)
            pad[i, :len(row)] = False
        m = self.module
        with torch.inference_mode():
            tokens, pad = tokens.to(self.device), pad.to(self.device)
            positions = torch.arange(width, device=self.device)
            x = m["tok"](tokens) + m["pos"](positions)[None]
            x = m["ln"](m["enc"](x, src_key_padding_mask=pad))
            keep = (~pad).unsqueeze(-1).to(x.dtype)
            pooled = (x * keep).sum(1) / keep.sum(1)
            out = torch.nn.functional.normalize(pooled, dim=-1)
        return [[round(v, 6) for v in row] for row in out.cpu().tolist()]
