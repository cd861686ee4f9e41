"""TinyGPT: a small GPT-style decoder served as an :class:`mtq.Generator`.

Token + position embeddings, pre-LayerNorm blocks (causal multi-head attention,
GELU MLP), a final LayerNorm and a head tied to the token embedding, over the
byte vocabulary of :mod:`mtq.reference.tokenizer`; weights from a fixed seed,
cached in a file. ``prefill`` runs each prompt into a preallocated KV-cache
slot, ``decode`` runs one token of every running request in one batched forward
over their caches, and each request samples from its own seeded generator.
:func:`generate` and :func:`decode_rate` drive it without a queue. torch is
imported only inside functions: importing this module does not need it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, cast

import mtq
from mtq.broker.embedded import default_state_dir
from mtq.errors import ConfigError, PermanentError
from mtq.reference.tokenizer import BOS, EOS, VOCAB_SIZE, StreamDecoder, encode
from mtq.workers.generator import Generation

if TYPE_CHECKING:
    import torch

__all__ = ["WEIGHTS_ENV", "GPTConfig", "TinyGPT", "decode_rate", "generate", "make_weights",
           "weights_path"]

logger = logging.getLogger(__name__)

#: a weights file to use instead of the default one under the state dir
WEIGHTS_ENV = "MTQ_REFERENCE_WEIGHTS"
#: bump when the module layout or the init changes, so old weight files are not reused
_INIT_VERSION = "1"
#: temperatures below this sample the argmax (dividing by ~0 would overflow)
_MIN_TEMPERATURE = 1e-5
_PAYLOAD_KEYS = ("prompt", "max_tokens", "temperature", "top_k", "seed", "stop_at_eos")
_EXAMPLE = "{'prompt': 'Once upon a time', 'max_tokens': 32, 'temperature': 0.8}"


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of the model. ``max_seq`` bounds prompt + generated tokens."""

    vocab_size: int = VOCAB_SIZE
    d_model: int = 128
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


def weights_path(config: GPTConfig | None = None, seed: int = 0,
                 environ: Mapping[str, str] | None = None) -> Path:
    """The weights file: ``$MTQ_REFERENCE_WEIGHTS`` if set, else
    ``<state dir>/reference/tinygpt-<config hash>-seed<seed>.pt``."""
    env = os.environ if environ is None else environ
    if env.get(WEIGHTS_ENV):
        return Path(env[WEIGHTS_ENV]).expanduser()
    config = config or GPTConfig()
    return default_state_dir(env) / "reference" / f"tinygpt-{config.digest()}-seed{seed}.pt"


def build_module(config: GPTConfig) -> torch.nn.ModuleDict:
    """The parameters as a ``ModuleDict`` on the meta device (no storage, and the
    default init draws nothing from the global RNG); the forward is in
    :class:`TinyGPT`, so no ``nn.Module`` subclass is defined at import time."""
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


def make_weights(path: str | os.PathLike[str], config: GPTConfig | None = None,
                 seed: int = 0) -> Path:
    """Initialise the model from ``seed`` (GPT-2 style, from a local generator: the
    global RNG is untouched) and save its state_dict to ``path`` atomically (a temp
    file in the same directory, then ``os.replace``), so processes starting at once
    never read a half-written file. Returns the path."""
    import torch

    config = config or GPTConfig()
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
    path = save_atomic(module.state_dict(), path)
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


@dataclasses.dataclass(eq=False)
class RequestState:
    """What TinyGPT keeps in ``Generation.state``: the parsed payload, the KV-cache
    slot, the sampler and the generated ids and text pieces."""

    prompt_ids: list[int]  # BOS + the prompt's bytes
    max_tokens: int
    temperature: float
    top_k: int | None
    stop_at_eos: bool
    slot: int | None = None
    length: int = 0  # positions written in the slot's cache
    gen: Any = None  # torch.Generator, one draw per token
    decoder: StreamDecoder = dataclasses.field(default_factory=StreamDecoder)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    pieces: list[str] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class TinyGPT(mtq.Generator):
    """A small GPT with a KV cache, served with continuous batching.

    Payload: ``{"prompt": str, "max_tokens": 32, "temperature": 0.8, "top_k": None,
    "seed": int, "stop_at_eos": True}``; each token is the text it completes (a str,
    ``""`` for EOS or half a character); the result is ``{"text", "tokens" (ids),
    "finish_reason" ("stop" | "length"), "prompt_tokens"}``.
    """

    max_running = 32
    max_prefill_tokens = 4096
    max_total_tokens = 32 * 512
    name = "tinygpt"
    version = "1"
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
        #: the weights file (default: :func:`weights_path`, read at setup)
        self.weights = weights
        self.weights_seed = weights_seed
        self.ready = False
        self.last_logits: Any = None  # the last step's logits [B, vocab] (for tests)

    def setup(self, device: Any = "cpu") -> None:
        """Load the weights (creating the file first if missing) onto ``device``.
        Raises ConfigError, naming the file, if it is corrupt or does not fit the config."""
        import torch

        self.device = torch.device(device)
        self.torch_dtype = getattr(torch, self.dtype)
        path = Path(self.weights or weights_path(self.config, self.weights_seed))
        if not path.exists():
            make_weights(path, self.config, self.weights_seed)
        fix = (f"delete {path} and it will be recreated, or point {WEIGHTS_ENV} at a good file")
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
        params: dict[str, torch.Tensor] = dict(self.module.named_parameters())
        self.tok_w, self.pos_w = params["tok.weight"], params["pos.weight"]
        self.ln_f = (params["ln_f.weight"], params["ln_f.bias"])
        self.layers = [tuple(params[f"blocks.{i}.{key}.{kind}"]
                             for key in ("ln1", "qkv", "proj", "ln2", "fc", "out")
                             for kind in ("weight", "bias"))
                       for i in range(self.config.n_layer)]
        self.k_pool: list[torch.Tensor] = []
        self.v_pool: list[torch.Tensor] = []
        #: owners[i]: the request holding slot i; slots [0, used) are taken (kept
        #: compact by release, so a decode batch reads its caches as one slice)
        self.owners: list[RequestState | None] = []
        self.used = 0
        self.ready = True
        logger.info("loaded reference weights %s on %s (%s)", path, self.device, self.dtype)

    def _allocate_cache(self) -> None:
        import torch

        c = self.config
        shape = (self.max_running, c.n_head, c.max_seq, c.d_model // c.n_head)
        # zeros, not empty: unused positions are multiplied by an exact 0 attention
        # weight, which keeps a row's result independent of them only if they are finite
        self.k_pool = [torch.zeros(shape, dtype=self.torch_dtype, device=self.device)
                       for _ in range(c.n_layer)]
        self.v_pool = [torch.zeros_like(k) for k in self.k_pool]
        self.owners, self.used = [None] * self.max_running, 0

    def _take_slot(self, state: RequestState) -> None:
        if self.used == len(self.owners):
            raise RuntimeError(f"all {len(self.owners)} KV-cache slots are in use: "
                               "release finished requests before prefilling more")
        state.slot, self.owners[self.used] = self.used, state
        self.used += 1

    def _free_slot(self, state: RequestState) -> None:
        """Free the state's slot, moving the last taken slot's cache into it."""
        slot, last = state.slot, self.used - 1
        state.slot = None
        if slot is None or slot >= self.used or self.owners[slot] is not state:
            return
        mover = self.owners[last]
        if slot != last and mover is not None:
            n = mover.length
            for pool in (*self.k_pool, *self.v_pool):
                pool[slot, :, :n] = pool[last, :, :n]
            self.owners[slot], mover.slot = mover, slot
        self.owners[last] = None
        self.used -= 1

    def _forward(self, x: torch.Tensor, attend: Any) -> torch.Tensor:
        """Run the blocks on ``x`` [N, d]; ``attend(layer, q, k, v)`` ([N, H, hd] each)
        returns the attention output [N, H, hd] (and writes the cache)."""
        import torch.nn.functional as F

        n, d = x.shape
        h_ = self.config.n_head
        for i, (w1, b1, wqkv, bqkv, wp, bp, w2, b2, wfc, bfc, wo, bo) in enumerate(self.layers):
            qkv = F.linear(F.layer_norm(x, (d,), w1, b1), wqkv, bqkv)
            q, k, v = qkv.view(n, 3, h_, -1).unbind(1)
            x = x + F.linear(attend(i, q, k, v).reshape(n, d), wp, bp)
            x = x + F.linear(F.gelu(F.linear(F.layer_norm(x, (d,), w2, b2), wfc, bfc)), wo, bo)
        return F.layer_norm(x, (d,), *self.ln_f)

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   allowed: torch.Tensor) -> torch.Tensor:
        # masked scores are -inf, so their weight is exactly 0: a row's result does
        # not depend on how far other rows made the keys reach
        scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
        return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v

    def forward_full(self, ids: Sequence[int], slot: int | None = None) -> torch.Tensor:
        """Logits [L, vocab] of every position of ``ids`` from scratch (causal
        attention); with ``slot``, also write the keys/values into that cache slot."""
        import torch

        n = len(ids)
        x = self.tok_w[torch.tensor(list(ids), device=self.device)] + self.pos_w[:n]
        causal = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, N, hd]
            if slot is not None:
                self.k_pool[i][slot, :, :n] = k
                self.v_pool[i][slot, :, :n] = v
            return self._attention(q, k, v, causal).transpose(0, 1)

        with torch.inference_mode():
            return self._forward(x, attend) @ self.tok_w.T

    def _decode_logits(self, states: list[RequestState], tokens: list[int]) -> torch.Tensor:
        """Feed ``tokens[j]`` to request j at its next position, in one batched step,
        attending over the cache only: logits [B, vocab].

        Attention reads the slots [lo, hi) spanning the batch as a view of the pool
        (a gather would copy, and allocate, B x span keys per layer: most of a step
        at B=32); slots of that range outside the batch get a zero query whose
        output is dropped. Slots are kept compact, so the engine's batch has none.
        """
        import torch

        dev = self.device
        slot_list = [cast(int, s.slot) for s in states]  # decode checked they are set
        lo, hi = min(slot_list), max(slot_list) + 1
        slots = torch.tensor(slot_list, device=dev)
        rows = slots - lo
        pos = torch.tensor([s.length for s in states], device=dev)
        span = max(s.length for s in states) + 1
        x = self.tok_w[torch.tensor(tokens, device=dev)] + self.pos_w[pos]
        row_pos = torch.zeros(hi - lo, dtype=pos.dtype, device=dev).index_copy_(0, rows, pos)
        allowed = (torch.arange(span, device=dev) <= row_pos[:, None])[:, None, None, :]
        in_order = slot_list == list(range(lo, hi))

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.k_pool[i][slots, :, pos] = k
            self.v_pool[i][slots, :, pos] = v
            if not in_order:
                q = q.new_zeros(hi - lo, *q.shape[1:]).index_copy_(0, rows, q)
            keys = self.k_pool[i][lo:hi, :, :span]  # [hi - lo, H, span, hd], a view
            values = self.v_pool[i][lo:hi, :, :span]
            return self._attention(q[:, :, None], keys, values, allowed)[rows, :, 0]

        with torch.inference_mode():
            logits = self._forward(x, attend) @ self.tok_w.T
        for s in states:
            s.length += 1
        return logits

    def _sample(self, logits: torch.Tensor, states: list[RequestState]) -> list[int]:
        """One token per row, each from its request's generator with exactly one draw
        (also when greedy), so a request's stream depends only on its seed."""
        import torch

        logits = logits.to("cpu", torch.float64)
        vocab = logits.shape[-1]
        u = torch.cat([torch.rand(1, generator=s.gen, dtype=torch.float64) for s in states])
        temps = torch.tensor([max(s.temperature, _MIN_TEMPERATURE) for s in states],
                             dtype=torch.float64)
        scaled = logits / temps[:, None]
        ks = torch.tensor([min(s.top_k or vocab, vocab) for s in states])
        if bool((ks < vocab).any()):
            kth = scaled.sort(dim=-1, descending=True).values.gather(1, (ks - 1)[:, None])
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        cdf = scaled.softmax(-1).cumsum(-1)
        picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
        picked = picked.clamp_max(vocab - 1)
        greedy = torch.tensor([s.temperature < _MIN_TEMPERATURE for s in states])
        return torch.where(greedy, logits.argmax(-1), picked).tolist()

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


def _append(model: TinyGPT, requests: list[Generation], tokens: list[Any] | None) -> None:
    """Append a step's tokens as the engine does (after the call)."""
    for r, t in zip(requests, tokens or [None] * len(requests)):
        r.tokens.append(t)


def generate(model: TinyGPT, payloads: Sequence[Any],
             seeds: Sequence[int | None] | None = None) -> list[dict[str, Any]]:
    """Run ``payloads`` to completion without a queue: admit, prefill, decode until
    all finish, release; in static batches of ``max_running``. Sets the model up
    on CPU if needed. Raises PermanentError for a bad payload."""
    if not model.ready:
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


def decode_rate(model: TinyGPT, batch_size: int, steps: int, prompt: str = "Hello, world") -> float:
    """Raw decode throughput (tokens/s = batch_size * steps / seconds) of ``steps``
    back-to-back ``decode`` calls on ``batch_size`` prefilled requests that do not
    stop early; one warm-up step is not timed."""
    if not model.ready:
        model.setup("cpu")
    if not 1 <= batch_size <= model.max_running:
        raise ValueError(f"batch_size must be in [1, {model.max_running}]")
    payload = {"prompt": prompt, "max_tokens": steps + 2, "stop_at_eos": False}
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
