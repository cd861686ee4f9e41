"""What TinyGPT keeps per request (:class:`RequestState`: the parsed payload, its
KV-cache slot, its sampler, what it generated) and how the next token is drawn
(:func:`sample`: one draw per request from its own seeded generator). torch is
imported only inside functions.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from mtq.reference.tokenizer import StreamDecoder

if TYPE_CHECKING:
    import torch

__all__ = ["MIN_TEMPERATURE", "RequestState", "sample"]

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


def sample(logits: torch.Tensor, states: list[RequestState]) -> list[int]:
    """One token per row, each from its request's generator with exactly one draw
    (also when greedy), so a request's stream depends only on its seed."""
    import torch

    logits = logits.to("cpu", torch.float64)
    vocab = logits.shape[-1]
    u = torch.cat([torch.rand(1, generator=s.gen, dtype=torch.float64) for s in states])
    temps = torch.tensor([max(s.temperature, MIN_TEMPERATURE) for s in states],
                         dtype=torch.float64)
    scaled = logits / temps[:, None]
    ks = torch.tensor([min(s.top_k or vocab, vocab) for s in states])
    if bool((ks < vocab).any()):
        kth = scaled.sort(dim=-1, descending=True).values.gather(1, (ks - 1)[:, None])
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    cdf = scaled.softmax(-1).cumsum(-1)
    picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    picked = picked.clamp_max(vocab - 1)
    greedy = torch.tensor([s.temperature < MIN_TEMPERATURE for s in states])
    return torch.where(greedy, logits.argmax(-1), picked).tolist()
