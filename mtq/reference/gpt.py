"""TinyGPT: a small GPT-style decoder served as an :class:`mtq.Generator`.

Token + position embeddings, pre-LayerNorm blocks (causal multi-head attention,
GELU MLP), a final LayerNorm and a head tied to the token embedding, over the
byte vocabulary of :mod:`mtq.reference.tokenizer`. The default shape loads the
trained weights shipped in the package (trained on *Pride and Prejudice* by
:mod:`mtq.reference.train`, so it writes English words); ``weights="random"`` or
any other shape gets random weights from a fixed seed, cached in a file
(:mod:`mtq.reference.weights`). ``prefill`` runs each prompt into
a preallocated KV-cache slot, ``decode`` runs one token of every running request
in one batched forward over their caches (:mod:`mtq.reference.decoder`), and each
request samples from its own seeded generator (:mod:`mtq.reference.sampling`).
This module holds the :class:`mtq.Generator` side: payloads, prefill, decode,
release, results; :func:`generate` and :func:`decode_rate` drive it without a
queue. torch is imported only inside functions: importing this module does not
need it.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import mtq
from mtq.errors import ConfigError, PermanentError
from mtq.reference.decoder import CachedDecoder
from mtq.reference.sampling import RequestState, sample
from mtq.reference.tokenizer import BOS, EOS, StreamDecoder, encode
from mtq.reference.weights import (
    RANDOM,
    TRAINED_WEIGHTS,
    WEIGHTS_ENV,
    GPTConfig,
    build_module,
    make_weights,
    random_weights_path,
    save_atomic,
    weights_path,
)
from mtq.workers.generator import Generation

if TYPE_CHECKING:
    import torch

__all__ = ["RANDOM", "TRAINED_WEIGHTS", "WEIGHTS_ENV", "GPTConfig", "RequestState", "TinyGPT",
           "build_module", "decode_rate", "generate", "make_weights", "random_weights_path",
           "save_atomic", "weights_path"]

logger = logging.getLogger(__name__)

_PAYLOAD_KEYS = ("prompt", "max_tokens", "temperature", "top_k", "seed", "stop_at_eos")
_EXAMPLE = "{'prompt': 'Once upon a time', 'max_tokens': 32, 'temperature': 0.8}"


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class TinyGPT(CachedDecoder, mtq.Generator):
    """A small GPT with a KV cache, served with continuous batching.

    Payload: ``{"prompt": str, "max_tokens": 32, "temperature": 0.8, "top_k": None,
    "seed": int, "stop_at_eos": True}``; each token is the text it completes (a str,
    ``""`` for EOS or half a character); the result is ``{"text", "tokens" (ids),
    "finish_reason" ("stop" | "length"), "prompt_tokens"}``.

    ``weights``: a file, ``"random"`` (random weights from ``weights_seed``), or
    None: ``$MTQ_REFERENCE_WEIGHTS`` if set (a file, or ``random``), else the shipped
    trained weights for the default shape, else random weights
    (:func:`mtq.reference.weights.weights_path`).
    """

    max_running = 32
    max_prefill_tokens = 4096
    max_total_tokens = 32 * 512
    name = "tinygpt"
    version = "2"
    #: the model's shape when the constructor is given none (the engine passes none)
    default_config: ClassVar[GPTConfig] = GPTConfig()
    # float64, not float32, for batch invariance: a request must sample the same
    # tokens whether it is decoded alone or with others. A batched GEMM's rounding
    # depends on the batch size (kernel choice, blocking); in float64 that error is
    # ~1e-16, far too small to flip a sample or an argmax, in float32 it is not.
    dtype: ClassVar[str] = "float64"

    def __init__(self, config: GPTConfig | None = None,
                 weights: str | os.PathLike[str] | None = None, weights_seed: int = 0) -> None:
        self.config = config or self.default_config
        #: a weights file, "random", or None (:func:`weights_path`, read at setup)
        self.weights = weights
        self.weights_seed = weights_seed
        self.ready = False
        self.last_logits: Any = None  # the last step's logits [B, vocab] (for tests)

    def weights_file(self) -> Path:
        """The file :meth:`setup` loads (see the class docstring)."""
        if self.weights == RANDOM:
            return random_weights_path(self.config, self.weights_seed)
        if self.weights:
            return Path(self.weights)
        return weights_path(self.config, self.weights_seed)

    def setup(self, device: Any = "cpu") -> None:
        """Load the weights onto ``device`` (random ones: creating the file first if
        missing). Raises ConfigError, naming the file, if it is missing (the shipped
        one), corrupt or does not fit the config."""
        import torch

        self.device = torch.device(device)
        self.torch_dtype = getattr(torch, self.dtype)
        path = self.weights_file()
        shipped = path == TRAINED_WEIGHTS
        fix = (f"reinstall mtq (the file is part of its package), or ask for random weights "
               f"(TinyGPT(weights='random') or {WEIGHTS_ENV}=random)" if shipped else
               f"delete {path} and it will be recreated, or point {WEIGHTS_ENV} at a good file")
        if not path.exists():
            if shipped:
                raise ConfigError(f"the trained reference weights {path} are missing; {fix}")
            make_weights(path, self.config, self.weights_seed)
        try:
            state = torch.load(path, map_location=self.device, weights_only=True)
        except Exception as e:
            raise ConfigError(f"reference weights file {path} is unreadable or corrupt "
                              f"({type(e).__name__}: {e}); {fix}") from e
        module = build_module(self.config)
        try:
            module.load_state_dict(state, strict=True, assign=True)
        except Exception as e:
            raise ConfigError(f"reference weights file {path} does not match {self.config} "
                              f"({type(e).__name__}: {str(e)[:300]}); {fix}") from e
        self.module = module.to(self.torch_dtype).eval().requires_grad_(False)
        self._bind(self.module)
        self.ready = True
        logger.info("loaded reference weights %s on %s (%s)", path, self.device, self.dtype)

    def _sample(self, logits: torch.Tensor, states: list[RequestState]) -> list[int]:
        """One token per row (:func:`mtq.reference.sampling.sample`)."""
        return sample(logits, states)

    def _emit(self, request: Generation, state: RequestState, token: int) -> str:
        """Record ``token``; finish the request if it is its last; return its text."""
        state.token_ids.append(token)
        piece = state.decoder.push(token)
        if token == EOS and state.stop_at_eos:
            state.finish_reason = "stop"
        elif len(state.token_ids) >= state.max_tokens:
            state.finish_reason = "length"
        if state.finish_reason is not None:
            piece += state.decoder.flush()
            request.finish()
        state.pieces.append(piece)
        return piece

    def admit(self, request: Generation) -> None:
        """Check the payload; raise PermanentError saying what to send instead."""
        p = request.payload
        if not isinstance(p, dict) or not isinstance(p.get("prompt"), str):
            got = f"'prompt': {p.get('prompt')!r}" if isinstance(p, dict) else type(p).__name__
            raise PermanentError(f"send a dict with a str 'prompt' (may be empty), like "
                                 f"{_EXAMPLE}; got {got}")
        unknown = sorted(map(str, set(p) - set(_PAYLOAD_KEYS)))
        if unknown:
            raise PermanentError(f"unknown payload keys {unknown}: send only {list(_PAYLOAD_KEYS)}")
        max_tokens, temperature = p.get("max_tokens", 32), p.get("temperature", 0.8)
        top_k, seed, stop = p.get("top_k"), p.get("seed"), p.get("stop_at_eos", True)
        for key, ok, want in (
            ("max_tokens", _int(max_tokens) and max_tokens >= 1, "an int >= 1"),
            ("temperature", isinstance(temperature, (int, float)) and not isinstance(
                temperature, bool) and math.isfinite(temperature) and temperature >= 0,
             "a finite number >= 0 (0: greedy)"),
            ("top_k", top_k is None or (_int(top_k) and top_k >= 1), "an int >= 1 or null"),
            ("seed", seed is None or _int(seed), "an int or absent"),
            ("stop_at_eos", isinstance(stop, bool), "true or false"),
        ):
            if not ok:
                raise PermanentError(f"'{key}' must be {want}, got {p[key]!r}")
        ids = [BOS, *encode(p["prompt"])]
        limit = self.config.max_seq - 1
        if len(ids) + max_tokens > limit:
            raise PermanentError(
                f"prompt ({len(ids) - 1} UTF-8 bytes) + BOS + max_tokens ({max_tokens}) must "
                f"be at most max_seq - 1 = {limit}: send a prompt of at most "
                f"{max(limit - 1 - max_tokens, 0)} bytes or lower max_tokens")
        request.state = RequestState(ids, max_tokens, float(temperature), top_k, stop)
        request.prompt_tokens = len(ids)
        request.max_tokens = max_tokens

    def prefill(self, requests: list[Generation]) -> list[Any]:
        """Run each prompt into a free cache slot; return each request's first token.
        Safe to call again for a request (the engine bisects a failed prefill)."""
        import torch

        if not self.k_pool:
            self._allocate_cache()
        out, logits = [], []
        for r in requests:
            if not isinstance(r.state, RequestState):
                self.admit(r)
            s: RequestState = r.state
            if s.slot is None:
                self._take_slot(s)
            s.token_ids, s.pieces, s.finish_reason = [], [], None
            s.decoder = StreamDecoder()
            s.gen = torch.Generator().manual_seed(r.seed % 2**64)
            logits.append(self.forward_full(s.prompt_ids, s.slot)[-1])
            s.length = len(s.prompt_ids)
            out.append(self._emit(r, s, self._sample(logits[-1][None], [s])[0]))
        self.last_logits = torch.stack(logits) if logits else None
        return out

    def decode(self, requests: list[Generation]) -> list[Any]:
        """One batched step: the next token (its text) of every running request."""
        if not requests:
            return []
        states: list[RequestState] = [r.state for r in requests]
        for r, s in zip(requests, states):
            if not isinstance(s, RequestState) or s.slot is None or not s.token_ids:
                raise RuntimeError(f"decode of {r.id} before its prefill")
            if s.finish_reason is not None:
                raise RuntimeError(f"decode of {r.id} after it finished ({s.finish_reason})")
        self.last_logits = self._decode_logits(states, [s.token_ids[-1] for s in states])
        tokens = self._sample(self.last_logits, states)
        return [self._emit(r, s, t) for r, s, t in zip(requests, states, tokens)]

    def release(self, requests: list[Generation]) -> None:
        """Give back the requests' cache slots (a no-op for those that hold none)."""
        for r in requests:
            if isinstance(r.state, RequestState):
                self._free_slot(r.state)

    def result(self, request: Generation) -> dict[str, Any]:
        """``{"text", "tokens" (ids, EOS included), "finish_reason", "prompt_tokens"}``."""
        s: RequestState = request.state
        return {"text": "".join(s.pieces), "tokens": list(s.token_ids),
                "finish_reason": s.finish_reason, "prompt_tokens": len(s.prompt_ids)}


def _append(model: mtq.Generator, requests: list[Generation], tokens: list[Any] | None) -> None:
    """Append a step's tokens as the engine does (after the call)."""
    for r, t in zip(requests, tokens or [None] * len(requests)):
        r.tokens.append(t)


def generate(model: mtq.Generator, payloads: Sequence[Any],
             seeds: Sequence[int | None] | None = None) -> list[dict[str, Any]]:
    """Run ``payloads`` to completion without a queue: admit, prefill, decode until
    all finish, release; in static batches of ``max_running``. Works for any
    generator (TinyGPT, mtq.backends.hf's CausalLM); one with a false ``ready``
    attribute is set up on the CPU first. Raises PermanentError for a bad payload."""
    if not getattr(model, "ready", True):
        model.setup("cpu")
    seeds = list(seeds) if seeds is not None else [None] * len(payloads)
    results: list[dict[str, Any]] = []
    for start in range(0, len(payloads), model.max_running):
        batch = [Generation(f"generate-{i}", payloads[i], seeds[i])
                 for i in range(start, min(start + model.max_running, len(payloads)))]
        try:
            for r in batch:
                model.admit(r)
            _append(model, batch, model.prefill(batch))
            running = [r for r in batch if not r.finished]
            while running:
                _append(model, running, model.decode(running))
                running = [r for r in running if not r.finished]
            results.extend(model.result(r) for r in batch)
        finally:
            model.release(batch)
    return results


def decode_rate(model: mtq.Generator, batch_size: int, steps: int, prompt: str = "Hello, world",
                extra: Mapping[str, Any] | None = None) -> float:
    """Raw decode throughput (tokens/s = batch_size * steps / seconds) of ``steps``
    back-to-back ``decode`` calls on ``batch_size`` prefilled requests that do not
    stop early; one warm-up step is not timed. ``extra``: the payload's other fields,
    those that keep a request from stopping early (TinyGPT's ``stop_at_eos: false``
    by default; CausalLM's is ``ignore_eos: true``)."""
    if not getattr(model, "ready", True):
        model.setup("cpu")
    if not 1 <= batch_size <= model.max_running:
        raise ValueError(f"batch_size must be in [1, {model.max_running}]")
    payload = {"prompt": prompt, "max_tokens": steps + 2,
               **({"stop_at_eos": False} if extra is None else extra)}
    batch = [Generation(f"rate-{i}", payload, i) for i in range(batch_size)]
    try:
        for r in batch:
            model.admit(r)
        _append(model, batch, model.prefill(batch))
        _append(model, batch, model.decode(batch))
        t0 = time.perf_counter()
        for _ in range(steps):
            _append(model, batch, model.decode(batch))
        return batch_size * steps / (time.perf_counter() - t0)
    finally:
        model.release(batch)
