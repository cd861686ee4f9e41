"""Hugging Face transformers models served by mtq workers (``pip install 'mtq[hf]'``).

* :class:`Embedder` (``hf:Embedder``): sentence embeddings from an ``AutoModel``,
  mean or CLS pooling, dynamic batching;
* :class:`CrossEncoder` (``hf:CrossEncoder``): reranking, query and passages in,
  scores out;
* :class:`CausalLM` (``hf:CausalLM``): text generation from an
  ``AutoModelForCausalLM``, served with continuous batching, tokens streamed.

Each takes its model with ``--set model=PATH_OR_HUB_NAME`` and its other options
the same way (``mtq models`` lists them); docs/models.md describes payloads,
options and results. Importing this package does not import torch or
transformers (a worker process does, in ``setup``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mtq.backends.hf.causal import CausalLM
    from mtq.backends.hf.encoders import CrossEncoder, Embedder

__all__ = ["CausalLM", "CrossEncoder", "Embedder"]

_WHERE = {"Embedder": "encoders", "CrossEncoder": "encoders", "CausalLM": "causal"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f"mtq.backends.hf.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'mtq.backends.hf' has no attribute {name!r}")
