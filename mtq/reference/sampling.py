"""What TinyGPT keeps per request (:class:`RequestState`: the parsed payload, its
KV-cache slot, its sampler, what it generated) and how the next token is drawn
(:func:`sample`: one draw per request from its own seeded generator, with
temperature, top-k and top-p; mtq.backends.hf's CausalLM samples with it too). torch
is imported only inside functions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from mtq.reference.tokenizer import StreamDecoder

if TYPE_CHECKING:
    import torch

__all__ = ["MIN_TEMPERATURE", "RequestState", "Sampling", "sample"]

#: temperatures below this sample the argmax (dividing by ~0 would overflow)
MIN_TEMPERATURE = 1e-5


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
    top_p: float = 1.0  # TinyGPT's payload has no top_p: all of the distribution


class Sampling(Protocol):
    """What :func:`sample` reads of a request: its generator (a CPU ``torch.Generator``
    seeded from the request's seed), its temperature (below :data:`MIN_TEMPERATURE`:
    greedy), top-k (None: off) and top-p (1.0: off)."""

    gen: Any
    temperature: float
    top_k: int | None
    top_p: float


def sample(logits: torch.Tensor, states: Sequence[Sampling], *,
           on_device: bool = False) -> list[int]:
    """One token per row, each from its request's generator with exactly one draw
    (also when greedy), so a request's stream depends only on its seed.

    The logits are taken in float64, on the CPU (``on_device``: where they are, so a
    GPU's [batch, vocab] logits need not cross to the host). Top-k keeps the k most
    likely tokens, top-p the fewest most likely ones whose probability reaches p
    (after the temperature and top-k); only the rows that ask for them pay for them.
    """
    import torch

    logits = logits.to(torch.float64) if on_device else logits.to("cpu", torch.float64)
    dev = logits.device
    vocab = logits.shape[-1]
    u = torch.cat([torch.rand(1, generator=s.gen, dtype=torch.float64) for s in states]).to(dev)
    temps = torch.tensor([max(s.temperature, MIN_TEMPERATURE) for s in states],
                         dtype=torch.float64, device=dev)
    scaled = logits / temps[:, None]
    topk = [j for j, s in enumerate(states) if s.top_k and s.top_k < vocab]
    if topk:
        ks = torch.tensor([states[j].top_k for j in topk], device=dev)
        rows = scaled[topk]
        kth = rows.topk(int(ks.max()), dim=-1).values.gather(1, (ks - 1)[:, None])
        scaled[topk] = rows.masked_fill(rows < kth, float("-inf"))
    topp = [j for j, s in enumerate(states) if s.top_p < 1.0]
    if topp:
        ps = torch.tensor([states[j].top_p for j in topp], dtype=torch.float64, device=dev)
        rows = scaled[topp]
        probs, order = rows.softmax(-1).sort(dim=-1, descending=True)
        # a token goes when the more likely ones before it already reach p (the most
        # likely one always stays)
        drop = (probs.cumsum(-1) - probs) >= ps[:, None]
        scaled[topp] = rows.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    cdf = scaled.softmax(-1).cumsum(-1)
    picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    picked = picked.clamp_max(vocab - 1)
    greedy = torch.tensor([s.temperature < MIN_TEMPERATURE for s in states], device=dev)
    return torch.where(greedy, logits.argmax(-1), picked).tolist()
