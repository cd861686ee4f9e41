"""The decoder's forward passes over a KV cache of fixed slots (the compute half of
:class:`mtq.reference.gpt.TinyGPT`).

Pre-LayerNorm blocks (causal multi-head attention, GELU MLP), a final LayerNorm and
a head tied to the token embedding. :meth:`CachedDecoder.forward_full` runs a prompt
from scratch into a cache slot; :meth:`CachedDecoder._decode_logits` runs one token
of every running request in one batched step over their caches. Slots are kept
compact (a freed slot takes the last one's cache), so a decode batch reads its
caches as one slice. torch is imported only inside functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, cast

from mtq.reference.sampling import RequestState
from mtq.reference.weights import GPTConfig

if TYPE_CHECKING:
    import torch

__all__ = ["CachedDecoder"]


class CachedDecoder:
    """The forward passes and the KV-cache slots of a GPT (a mixin: the model class
    sets ``config``, ``max_running``, ``device`` and ``torch_dtype``, then calls
    :meth:`_bind` with its loaded parameters)."""

    config: GPTConfig
    max_running: ClassVar[int]
    device: Any  # torch.device
    torch_dtype: Any  # torch.dtype

    def _bind(self, module: torch.nn.ModuleDict) -> None:
        """Take the parameters of ``module`` (laid out by
        :func:`mtq.reference.weights.build_module`) and start with no cache."""
        params: dict[str, torch.Tensor] = dict(module.named_parameters())
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
        (a gather would copy, and allocate, B x span keys per layer on every step,
        a cost that grows with the batch); slots of that range outside the batch get
        a zero query whose output is dropped. Slots are kept compact, so the engine's
        batch has none.
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
