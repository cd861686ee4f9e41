"""Generator targets of benchmarks/gpu.py: the reference TinyGPT at a size that loads a GPU.

``$MTQ_BENCH_GPT`` picks the shape, read at import (the worker processes inherit it):

* ``gpu`` (the default): d_model 1024, 12 layers, 16 heads, 1,024 positions, in
  bfloat16: 151 M parameters (302 MB) and a KV cache of 1.6 GB for 32 requests. Its
  decode step is bound by kernel launches, as a small model's is on any GPU;
* ``cpu``: the reference shape (d_model 128, 4 layers) in float32, for the dry run.

:class:`GpuGPT` batches continuously, :class:`StaticGpuGPT` statically (a new batch
starts only once the whole previous one finished); both run up to 32 requests.
"""

from __future__ import annotations

import os
from typing import ClassVar

from mtq.reference.gpt import GPTConfig, TinyGPT

SHAPES: dict[str, tuple[GPTConfig, str]] = {
    "gpu": (GPTConfig(d_model=1024, n_layer=12, n_head=16, max_seq=1024), "bfloat16"),
    "cpu": (GPTConfig(d_model=128, n_layer=4, n_head=4, max_seq=512), "float32"),
}
SHAPE = os.environ.get("MTQ_BENCH_GPT", "gpu")
if SHAPE not in SHAPES:
    raise SystemExit(f"MTQ_BENCH_GPT must be one of {sorted(SHAPES)}, not {SHAPE!r}")
CONFIG, DTYPE = SHAPES[SHAPE]


class GpuGPT(TinyGPT):
    """TinyGPT at the ``$MTQ_BENCH_GPT`` shape, continuous batching, 32 requests."""

    default_config: ClassVar[GPTConfig] = CONFIG
    dtype: ClassVar[str] = DTYPE
    max_running = 32
    max_total_tokens = 32 * CONFIG.max_seq
    name = f"tinygpt-{SHAPE}"


class StaticGpuGPT(GpuGPT):
    """The same model with static batching: the baseline of continuous batching."""

    continuous = False
    name = f"tinygpt-{SHAPE}-static"


def param_bytes(config: GPTConfig = CONFIG, dtype: str = DTYPE) -> int:
    """Bytes of the model's parameters on its device."""
    d, L = config.d_model, config.n_layer
    per_block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    n = config.vocab_size * d + config.max_seq * d + L * per_block + 2 * d
    return n * _size(dtype)


def cache_bytes(config: GPTConfig = CONFIG, dtype: str = DTYPE, running: int = 32) -> int:
    """Bytes of the preallocated KV cache (keys and values of every layer)."""
    return 2 * config.n_layer * running * config.max_seq * config.d_model * _size(dtype)


def _size(dtype: str) -> int:
    return {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}[dtype]
