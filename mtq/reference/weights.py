"""TinyGPT's shape (:class:`GPTConfig`) and its weights: the parameter layout, the
trained weights shipped for the default shape (:data:`TRAINED_WEIGHTS`, made by
:mod:`mtq.reference.train`), the GPT-2 style random init from a fixed seed, and the
file random weights are cached in (written atomically, so processes starting at
once never read half a file). torch is imported only inside functions.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtq.broker.embedded import default_state_dir
from mtq.errors import ConfigError
from mtq.reference.tokenizer import VOCAB_SIZE

if TYPE_CHECKING:
    import torch

__all__ = ["RANDOM", "TRAINED_WEIGHTS", "WEIGHTS_ENV", "GPTConfig", "build_module",
           "init_module", "make_weights", "random_weights_path", "save_atomic", "weights_path"]

logger = logging.getLogger(__name__)

#: a weights file to use instead of the default ones, or ``random``
WEIGHTS_ENV = "MTQ_REFERENCE_WEIGHTS"
#: the ``weights`` (or ``$MTQ_REFERENCE_WEIGHTS``) that asks for random weights
RANDOM = "random"
#: the trained weights of the default :class:`GPTConfig` (float16, in the package)
TRAINED_WEIGHTS = Path(__file__).resolve().parent / "data" / "tinygpt-austen.pt"
#: bump when the module layout or the init changes, so old weight files are not reused
_INIT_VERSION = "1"


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of the model. ``max_seq`` bounds prompt + generated tokens. The defaults
    are the shape of the shipped trained weights (:data:`TRAINED_WEIGHTS`)."""

    vocab_size: int = VOCAB_SIZE
    d_model: int = 64
    n_layer: int = 4
    n_head: int = 4
    max_seq: int = 512

    def __post_init__(self) -> None:
        if self.vocab_size < VOCAB_SIZE:
            raise ConfigError(f"vocab_size must be at least {VOCAB_SIZE} (bytes + BOS + EOS)")
        if min(self.d_model, self.n_layer, self.n_head, self.max_seq) < 1:
            raise ConfigError("d_model, n_layer, n_head and max_seq must be positive")
        if self.d_model % self.n_head:
            raise ConfigError(f"d_model ({self.d_model}) must be a multiple of n_head "
                              f"({self.n_head})")

    def digest(self) -> str:
        """A short hash of the config (and of the init scheme), for file names."""
        text = json.dumps(dataclasses.asdict(self), sort_keys=True) + "|init" + _INIT_VERSION
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def random_weights_path(config: GPTConfig | None = None, seed: int = 0,
                        environ: Mapping[str, str] | None = None) -> Path:
    """Where random weights from ``seed`` are cached:
    ``<state dir>/reference/tinygpt-<config hash>-seed<seed>.pt``."""
    config = config or GPTConfig()
    return (default_state_dir(environ) / "reference"
            / f"tinygpt-{config.digest()}-seed{seed}.pt")


def weights_path(config: GPTConfig | None = None, seed: int = 0,
                 environ: Mapping[str, str] | None = None) -> Path:
    """The weights file a model of ``config`` loads when given none:
    ``$MTQ_REFERENCE_WEIGHTS`` if set (``random``: as for any other shape), else the
    shipped :data:`TRAINED_WEIGHTS` for the default shape (and ``seed`` 0), else random
    weights from ``seed`` (:func:`random_weights_path`; :func:`make_weights` creates them)."""
    env = os.environ if environ is None else environ
    config = config or GPTConfig()
    chosen = env.get(WEIGHTS_ENV, "")
    if chosen and chosen != RANDOM:
        return Path(chosen).expanduser()
    if not chosen and config == GPTConfig() and seed == 0:
        return TRAINED_WEIGHTS
    return random_weights_path(config, seed, env)


def build_module(config: GPTConfig) -> torch.nn.ModuleDict:
    """The parameters as a ``ModuleDict`` on the meta device (no storage, and the
    default init draws nothing from the global RNG); the forward is in
    :class:`mtq.reference.decoder.CachedDecoder`, so no ``nn.Module`` subclass is
    defined at import time."""
    import torch
    from torch import nn

    d = config.d_model
    with torch.device("meta"):

        def block() -> nn.ModuleDict:
            return nn.ModuleDict({
                "ln1": nn.LayerNorm(d), "qkv": nn.Linear(d, 3 * d), "proj": nn.Linear(d, d),
                "ln2": nn.LayerNorm(d), "fc": nn.Linear(d, 4 * d), "out": nn.Linear(4 * d, d),
            })

        module = nn.ModuleDict({
            "tok": nn.Embedding(config.vocab_size, d), "pos": nn.Embedding(config.max_seq, d),
            "blocks": nn.ModuleList(block() for _ in range(config.n_layer)),
            "ln_f": nn.LayerNorm(d),
        })
    return module


def init_module(config: GPTConfig, seed: int = 0) -> torch.nn.ModuleDict:
    """The parameters on the CPU in float32, initialised from ``seed`` (GPT-2 style,
    from a local generator: the global RNG is untouched)."""
    import torch

    module = build_module(config).to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    resid_std = 0.02 / math.sqrt(2 * config.n_layer)  # residual branches add up over layers
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
            elif ".ln" in name or name.startswith("ln_f"):
                p.fill_(1.0)
            else:
                std = resid_std if name.endswith(("proj.weight", "out.weight")) else 0.02
                p.normal_(0.0, std, generator=gen)
    return module


def make_weights(path: str | os.PathLike[str], config: GPTConfig | None = None,
                 seed: int = 0) -> Path:
    """Random weights from ``seed`` (:func:`init_module`), saved to ``path``
    atomically (a temp file in the same directory, then ``os.replace``), so processes
    starting at once never read a half-written file. Returns the path."""
    config = config or GPTConfig()
    path = save_atomic(init_module(config, seed).state_dict(), path)
    logger.info("created reference weights %s (seed %d)", path, seed)
    return path


def save_atomic(state: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save`` to ``path`` through a temp file in the same directory and
    ``os.replace``, so processes starting at once never read a half-written file."""
    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
