"""The running requests' KV caches as one left-padded batch (CausalLM's decode state).

Each row of :class:`BatchCache` is a running request; its keys and values fill the
row's *last* ``lens[i]`` positions, and the positions before them are zeros that the
attention mask hides (a finite zero times an exact zero weight adds nothing, so a
row's result does not depend on the padding). A decode step feeds every row one
token at its own position (``position_ids`` = its length) and appends one column.

Rows join after their prefill (:meth:`BatchCache.add`: each new cache padded on the
left to the batch's width, or the batch to theirs, and stacked) and leave when their
request does (:meth:`BatchCache.keep`: the rows that stay, trimmed to the longest
one's length): the cache is rebuilt only when the membership changes, never on a
step where it does not.

The cache is a transformers ``DynamicCache`` whose layers are plain
``DynamicLayer`` (full attention: Llama, Qwen2, Mistral, Phi, GPT-2 and most
others); :func:`check_layers` refuses other kinds (sliding-window, linear-attention
and quantized layers keep state this module does not know how to pad or slice).
torch is imported only inside functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mtq.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["BatchCache", "check_layers"]


def check_layers(model: Any, label: str) -> None:
    """ConfigError unless ``model``'s cache is made of plain DynamicLayer layers."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    try:
        layers = DynamicCache(config=model.config).layers
    except Exception as exc:  # a model whose config makes no cache of this kind
        raise ConfigError(f"{label}: cannot make a DynamicCache for it ({exc})") from exc
    kinds = sorted({type(x).__name__ for x in layers if type(x) is not DynamicLayer})
    if kinds:
        raise ConfigError(
            f"{label}: its KV cache has layers of kind {', '.join(kinds)}; hf:CausalLM batches "
            "models whose layers all use full attention with a plain DynamicLayer cache "
            "(Llama, Qwen2, Mistral without a sliding window, Phi, GPT-2, ...)")


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    extra = width - t.shape[-2]
    if extra <= 0:
        return t
    import torch

    return torch.cat([t.new_zeros(*t.shape[:-2], extra, t.shape[-1]), t], dim=-2)


class BatchCache:
    """The KV cache of the running batch, one row per request (see the module doc)."""

    def __init__(self) -> None:
        self.cache: Any = None  # a DynamicCache, or None while no request runs
        #: positions filled in each row (its prompt and the tokens fed back so far)
        self.lens: list[int] = []

    def __len__(self) -> int:
        return len(self.lens)

    @property
    def width(self) -> int:
        """Positions of the cache (the longest row's length, or more after a join)."""
        return 0 if self.cache is None else int(self.cache.layers[0].keys.shape[-2])

    def add(self, parts: Sequence[tuple[Any, Sequence[int]]]) -> None:
        """Append the rows of each ``(cache, lengths)`` part after the current rows: a
        prefill's DynamicCache whose row i holds its prompt in its last ``lengths[i]``
        positions (left-padded). The padding's keys and values are set to zero: finite
        whatever the model computed there."""
        import torch

        parts = [p for p in parts if len(p[1])]
        if not parts:
            return
        with torch.inference_mode():  # the forward made them inference tensors
            for cache, lens in parts:
                width = int(cache.layers[0].keys.shape[-2])
                for row, n in enumerate(lens):
                    if n < width:
                        for layer in cache.layers:
                            layer.keys[row, :, :width - n] = 0
                            layer.values[row, :, :width - n] = 0
        current = [(self.cache, self.lens)] if self.cache is not None else []
        whole = [*current, *parts]
        width = max(int(c.layers[0].keys.shape[-2]) for c, _ in whole)
        target = whole[0][0]
        # every layer's new tensors first, then all of them set: an allocation that
        # fails (out of memory) leaves the cache as it was, not half joined
        new = []
        for i in range(len(target.layers)):
            keys = [_pad_left(c.layers[i].keys, width) for c, _ in whole]
            values = [_pad_left(c.layers[i].values, width) for c, _ in whole]
            new.append((keys[0] if len(keys) == 1 else torch.cat(keys, dim=0),
                        values[0] if len(values) == 1 else torch.cat(values, dim=0)))
        for layer, (k, v) in zip(target.layers, new):
            layer.keys, layer.values = k, v
        self.cache = target
        self.lens = [n for _, lens in whole for n in lens]

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (in that order), trimmed to the longest one's length."""
        import torch

        if not rows:
            self.cache, self.lens = None, []
            return
        if list(rows) == list(range(len(self.lens))):
            return
        lens = [self.lens[i] for i in rows]
        start = self.width - max(lens)
        index = torch.tensor(list(rows), device=self.cache.layers[0].keys.device)
        new = [(layer.keys.index_select(0, index)[..., start:, :],
                layer.values.index_select(0, index)[..., start:, :])
               for layer in self.cache.layers]  # all or nothing, as in add()
        for layer, (k, v) in zip(self.cache.layers, new):
            layer.keys, layer.values = k, v
        self.lens = lens

    def step_inputs(self, device: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(attention_mask [B, width + 1], position_ids [B, 1], cache_position [1]) of a
        decode step feeding each row one token."""
        import torch

        width = self.width
        lens = torch.tensor(self.lens, device=device)
        mask = torch.arange(width + 1, device=device)[None, :] >= (width - lens)[:, None]
        return mask.long(), lens[:, None], torch.tensor([width], device=device)

    def crop(self, width: int) -> None:
        """Cut every layer back to ``width`` positions: after a forward that raised
        (out of memory, say) part way through its layers, the layers it had appended to
        are one position longer than the rest, and the step is run again."""
        if self.cache is None:
            return
        for layer in self.cache.layers:
            if layer.keys.shape[-2] > width:
                layer.keys = layer.keys[..., :width, :]
                layer.values = layer.values[..., :width, :]

    def advance(self) -> None:
        """Every row took one more position (after a decode step's forward)."""
        self.lens = [n + 1 for n in self.lens]
