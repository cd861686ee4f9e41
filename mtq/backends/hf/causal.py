"""``hf:CausalLM``: text generation from a transformers ``AutoModelForCausalLM``,
served with continuous batching and streamed as text.

    mtq workers start hf:CausalLM -q chat --set model=Qwen/Qwen2.5-0.5B-Instruct

The engine (mtq.workers.engine) admits, prefills, decodes and releases requests
step by step; this class keeps the running requests' KV caches as one left-padded
batch (:mod:`mtq.backends.hf.kvbatch`): each prefill runs the new prompts (those of
about one length together, left-padded), joins their caches to the batch, and each decode step is one
forward of every running request. Each request samples from its own generator
seeded with its seed (:func:`mtq.reference.sampling.sample`) and turns its tokens
into text pieces that never split a character or a stop string
(:mod:`mtq.backends.hf.text`). docs/models.md describes the payload, the result,
the options, and why this runs rather than transformers' own continuous batching.

torch and transformers are imported in ``setup`` and the methods it enables only.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
from typing import TYPE_CHECKING, Any

from mtq.backends.hf.kvbatch import BatchCache, check_layers
from mtq.backends.hf.loading import HFOptions, load_pretrained, load_tokenizer
from mtq.backends.hf.payload import Params, parse
from mtq.backends.hf.text import TextStream
from mtq.errors import BadRequest, ConfigError
from mtq.reference.sampling import sample
from mtq.workers.generator import Generation, Generator
from mtq.workers.options import Option

if TYPE_CHECKING:
    import torch

__all__ = ["CausalLM"]

log = logging.getLogger(__name__)


def _groups(lengths: list[int]) -> list[list[int]]:
    """The prompts (their indexes) prefilled together, in one forward each: from the
    longest down, a prompt joins the group of a longer one when padding it to that
    length wastes at most 16 tokens or a quarter of the length."""
    order = sorted(range(len(lengths)), key=lambda j: -lengths[j])
    groups: list[list[int]] = []
    for j in order:
        if groups and lengths[groups[-1][0]] - lengths[j] <= max(16, lengths[groups[-1][0]] // 4):
            groups[-1].append(j)
        else:
            groups.append([j])
    return groups


#: a prompt of more characters than this times the context cannot fit in it (no
#: tokenizer makes tokens this long)
_CHARS_PER_TOKEN = 32


@dataclasses.dataclass(eq=False)
class _State:
    """What CausalLM keeps in ``Generation.state``."""

    params: Params
    prompt_ids: list[int]
    max_tokens: int
    # what mtq.reference.sampling.sample reads
    temperature: float
    top_k: int | None
    top_p: float
    gen: Any = None  # torch.Generator, seeded at prefill
    text: TextStream | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    pieces: list[str] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None


class CausalLM(HFOptions, Generator):
    """A causal language model served with continuous batching (see the module doc).

    Payload: ``{"prompt": str}`` or ``{"messages": [{"role", "content"}, ...]}`` (rendered
    with the chat template), and optionally ``max_tokens``, ``temperature`` (0: greedy),
    ``top_p``, ``top_k``, ``repetition_penalty``, ``stop`` (strings), ``stop_token_ids``,
    ``seed``, ``logprobs``, ``ignore_eos``. Tokens stream as text pieces; the result is
    ``{"text", "finish_reason" ("stop" | "length"), "usage": {"prompt_tokens",
    "completion_tokens"}}``, with ``"logprobs"`` when asked.
    """

    max_running = Option(int, 16, min=1, max=4096,
                         help="most requests decoded together (the batch of a decode step)")
    max_total_tokens = Option(int, None, min=1,
                              help="most tokens in flight: prompt + max_tokens summed over the "
                                   "running requests, which bounds the KV cache (none: no bound)")
    max_prefill_tokens = Option(int, 4096, min=1,
                                help="most prompt tokens prefilled in one step (a longer prompt "
                                     "runs alone)")
    max_context = Option(int, None, min=2,
                         help="longest prompt + reply in tokens (default: the model's "
                              "max_position_embeddings, else the tokenizer's model_max_length)")
    default_max_tokens = Option(int, 256, min=1,
                                help="max_tokens of a payload that gives none (fewer when the "
                                     "context leaves less room)")
    chat_template = Option(str, None, help="a jinja chat template (a file, or the template "
                                           "itself) used instead of the tokenizer's")
    continuous = Option(bool, True,
                        help="false: static batching (a new batch starts only when the whole "
                             "previous one has finished): the benchmark's baseline")

    ready = False

    # -- setup ----------------------------------------------------------------------
    def setup(self, device: Any = "cpu") -> None:
        """Load the tokenizer and the model onto ``device`` in the dtype option's dtype."""
        import torch
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        self.tokenizer = load_tokenizer(self)
        self.lm = load_pretrained(AutoModelForCausalLM, self, self.device).requires_grad_(False)
        label = f"model {self.model!r}"
        check_layers(self.lm, label)
        accepts = set(inspect.signature(self.lm.forward).parameters)
        if "position_ids" not in accepts:
            raise ConfigError(f"{label}: its forward takes no position_ids, which batched "
                              "decoding of prompts of different lengths needs")
        self._cache_arg = "cache" if "cache" in accepts else "past_key_values"
        self._keep_arg = {"logits_to_keep": 1} if "logits_to_keep" in accepts else {}
        self.context = self._context(label)
        eos = getattr(self.lm.generation_config, "eos_token_id", None)
        eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
        if self.tokenizer.eos_token_id is not None:
            eos.append(self.tokenizer.eos_token_id)
        self.eos_ids = frozenset(int(i) for i in eos)
        self.vocab = int(self.lm.get_output_embeddings().weight.shape[0])
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else min(self.eos_ids, default=0))
        self.template = self._template()
        self.batch = BatchCache()
        self.rows: list[_State] = []  # the batch's requests, in its rows' order
        #: ids of the states of released requests whose rows are still in the cache
        self._released: set[int] = set()
        self.ready = True
        log.info("loaded %s on %s (%s), context %d tokens", self.model, self.device,
                 self.lm.dtype, self.context)

    def _context(self, label: str) -> int:
        config = self.lm.config
        known = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions",
                                                                             None)
        limit = getattr(self.tokenizer, "model_max_length", None)
        if not known and isinstance(limit, int) and limit < 10**7:
            known = limit
        context = self.max_context or known
        if not context:
            raise ConfigError(f"{label} states no context length: give it with "
                              "--set max_context=TOKENS")
        return int(context)

    def _template(self) -> str | None:
        given = self.chat_template
        if given is None:
            return getattr(self.tokenizer, "chat_template", None) or None
        if os.path.isfile(given):
            with open(given, encoding="utf-8") as f:
                return f.read()
        return given

    # -- the Generator contract ---------------------------------------------------------
    def admit(self, request: Generation) -> None:
        """Check the payload and tokenize its prompt; :class:`mtq.BadRequest` saying what
        to send instead when the model cannot take it."""
        params = parse(request.payload)
        chars = len(params.prompt or "") + sum(len(m["content"]) for m in params.messages or ())
        if chars > _CHARS_PER_TOKEN * self.context:  # refused before tokenizing: the model
            # thread tokenizes, and megabytes of text would hold up every running request
            raise BadRequest(f"the prompt is {chars} characters, far past the model's context "
                             f"of {self.context} tokens: shorten it")
        ids = self._prompt_ids(params)
        room = self.context - len(ids)
        if room < 1:
            raise BadRequest(f"the prompt is {len(ids)} tokens and the model's context is "
                             f"{self.context}: send a prompt of at most {self.context - 1} "
                             "tokens (prompt and reply share the context)")
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = min(self.default_max_tokens, room)
        elif max_tokens > room:
            raise BadRequest(f"max_tokens {max_tokens} is past the model's context: the prompt "
                             f"takes {len(ids)} of its {self.context} tokens, so at most {room} "
                             "can be generated; lower max_tokens or shorten the prompt")
        bad = sorted(i for i in params.stop_token_ids if i >= self.vocab)
        if bad:
            raise BadRequest(f"stop_token_ids {bad} are outside the vocabulary [0, {self.vocab})")
        request.state = _State(params, ids, max_tokens, params.temperature, params.top_k,
                               params.top_p)
        request.prompt_tokens = len(ids)
        request.max_tokens = max_tokens

    def _prompt_ids(self, params: Params) -> list[int]:
        tok = self.tokenizer
        if params.messages is None:
            ids = list(tok(params.prompt)["input_ids"])
        else:
            if not self.template:
                raise BadRequest(f"model {self.model!r} has no chat template: send a 'prompt', "
                                 "or start the worker with --set chat_template=FILE")
            try:
                text = tok.apply_chat_template(params.messages, chat_template=self.template,
                                               tokenize=False, add_generation_prompt=True)
            except Exception as exc:  # jinja's errors (raise_exception in a template, say)
                raise BadRequest(f"the chat template cannot render these messages: "
                                 f"{type(exc).__name__}: {exc}") from exc
            ids = list(tok(text, add_special_tokens=False)["input_ids"])
        if not ids:
            raise BadRequest("the prompt is empty and the tokenizer adds no BOS token: send "
                             "some text")
        return ids

    def prefill(self, requests: list[Generation]) -> list[Any]:
        """Run the new prompts (one forward for those of about one length, left-padded),
        join their caches to the running batch and return each request's first text piece. Nothing joins the
        batch if it raises (the engine then bisects the requests)."""
        import torch

        states: list[_State] = []
        for r in requests:
            if not isinstance(r.state, _State):
                self.admit(r)
            states.append(r.state)
        parts, order, logits = [], [], []
        with torch.inference_mode():
            for group in _groups([len(s.prompt_ids) for s in states]):
                lens = [len(states[j].prompt_ids) for j in group]
                width = max(lens)
                ids = torch.tensor([[self.pad_id] * (width - n) + states[j].prompt_ids
                                    for j, n in zip(group, lens)], device=self.device)
                kw: dict[str, Any] = {}
                if min(lens) < width:  # left padding, masked, each row from position 0
                    mask = torch.tensor([[0] * (width - n) + [1] * n for n in lens],
                                        device=self.device)
                    kw = {"attention_mask": mask,
                          "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
                out = self.lm(input_ids=ids, use_cache=True, **kw, **self._keep_arg)
                parts.append((getattr(out, self._cache_arg, None) or out.past_key_values, lens))
                order += group
                logits.append(out.logits[:, -1])
        rows = [states[j] for j in order]
        for r, s in zip(requests, states):
            s.gen = torch.Generator().manual_seed(r.seed % 2**64)
            s.text = TextStream(self.tokenizer, s.prompt_ids, s.params.stop)
            s.token_ids, s.pieces, s.logprobs, s.finish_reason = [], [], [], None
        tokens = self._pick(torch.cat(logits), rows)
        self.batch.add(parts)
        self.rows += rows
        first = {id(s): t for s, t in zip(rows, tokens)}
        return [self._emit(r, s, first[id(s)]) for r, s in zip(requests, states)]

    def decode(self, requests: list[Generation]) -> list[Any]:
        """One forward of every running request: each one's next text piece."""
        import torch

        if not requests:
            return []
        states: list[_State] = [r.state for r in requests]
        given = {id(s) for s in states}
        if len(given) != len(self.rows) or any(id(s) not in given for s in self.rows):
            # finished rows not released yet (a driver that releases a static batch at
            # its end, say) leave the batch now; an unfinished one left out is a mistake
            left = [s for s in self.rows if id(s) not in given]
            if any(s.finish_reason is None and id(s) not in self._released for s in left):
                raise RuntimeError(f"decode was given {len(states)} requests and left out "
                                   f"{len(left)} running ones: decode every running "
                                   "request, release those that left")
            keep = [i for i, s in enumerate(self.rows) if id(s) in given]
            self.batch.keep(keep)
            self.rows = [self.rows[i] for i in keep]
            self._released.clear()
            if len(self.rows) != len(given):
                raise RuntimeError("decode was given requests that were never prefilled")
        where = {id(s): i for i, s in enumerate(self.rows)}
        mask, positions, cache_position = self.batch.step_inputs(self.device)
        last = torch.tensor([[s.token_ids[-1]] for s in self.rows], device=self.device)
        extra = {"cache_position": cache_position} if self._cache_arg == "past_key_values" \
            else {}
        width = self.batch.width
        drawn = [s.gen.get_state() for s in self.rows]
        try:
            with torch.inference_mode():
                out = self.lm(input_ids=last, attention_mask=mask, position_ids=positions,
                              use_cache=True, **{self._cache_arg: self.batch.cache}, **extra)
            tokens = self._pick(out.logits[:, -1], self.rows)
        except BaseException:
            # (out of memory, say): the engine runs the step again, with fewer requests
            # perhaps, so every request must be as it was (the Generator contract): the
            # cache cut back to its width, each generator before its draw
            self.batch.crop(width)
            for s, state in zip(self.rows, drawn):
                s.gen.set_state(state)
            raise
        self.batch.advance()
        return [self._emit(r, s, tokens[where[id(s)]]) for r, s in zip(requests, states)]

    def release(self, requests: list[Generation]) -> None:
        """Take the requests' rows out of the batch (a no-op for those without one)."""
        gone = {id(r.state) for r in requests}
        # remembered first: if cutting the cache fails (out of memory), the rows stay in
        # it, and the next decode takes them out before its step
        self._released |= gone
        keep = [i for i, s in enumerate(self.rows) if id(s) not in self._released]
        if len(keep) < len(self.rows):
            self.batch.keep(keep)
            self.rows = [self.rows[i] for i in keep]
        self._released.clear()

    def result(self, request: Generation) -> dict[str, Any]:
        """``{"text", "finish_reason", "usage": {"prompt_tokens", "completion_tokens"}}``,
        and ``"logprobs"`` (one per generated token) when the payload asked for them."""
        s: _State = request.state
        out: dict[str, Any] = {
            "text": "".join(s.pieces), "finish_reason": s.finish_reason,
            "usage": {"prompt_tokens": len(s.prompt_ids), "completion_tokens": len(s.token_ids)}}
        if s.params.logprobs:
            out["logprobs"] = list(s.logprobs)
        return out

    # -- sampling and text ----------------------------------------------------------------
    def _pick(self, logits: torch.Tensor, states: list[_State]) -> list[int]:
        """The next token of each row of ``logits`` [B, vocab], in float64: the repetition
        penalty, then :func:`~mtq.reference.sampling.sample` with the row's generator;
        each asking row's log-probability of its token under the model's distribution."""
        import torch

        on_device = logits.device.type == "cuda"
        raw = logits.to(torch.float64) if on_device else logits.to("cpu", torch.float64)
        x = raw
        penalised = [j for j, s in enumerate(states) if s.params.repetition_penalty != 1.0]
        if penalised:
            x = raw.clone()
            for j in penalised:
                s = states[j]
                seen = torch.tensor(sorted({*s.prompt_ids, *s.token_ids}), device=x.device)
                row = x[j, seen]
                p = s.params.repetition_penalty
                x[j, seen] = torch.where(row < 0, row * p, row / p)
        tokens = sample(x, states, on_device=on_device)
        asking = [j for j, s in enumerate(states) if s.params.logprobs]
        if asking:
            picked = torch.tensor([tokens[j] for j in asking], device=raw.device)
            lp = raw[asking].log_softmax(-1).gather(1, picked[:, None])[:, 0].tolist()
            for j, v in zip(asking, lp):
                states[j].logprobs.append(float(v))
        return tokens

    def _emit(self, request: Generation, s: _State, token: int) -> str:
        """Record ``token``; return the text it makes safe to send; finish the request
        on EOS, a stop token or string, or its max_tokens."""
        assert s.text is not None
        s.token_ids.append(token)
        reason = None
        if token in s.params.stop_token_ids or (token in self.eos_ids
                                                and not s.params.ignore_eos):
            piece, reason = "", "stop"  # the token ends the text and is not part of it
        else:
            piece = s.text.push(token)
            if s.text.stopped:
                reason = "stop"
            elif len(s.token_ids) >= s.max_tokens:
                reason = "length"
        if reason is not None:
            piece += s.text.finish()
            s.finish_reason = "stop" if s.text.stopped else reason
            request.finish()
        s.pieces.append(piece)
        return piece
