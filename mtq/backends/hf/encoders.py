"""Encoder models: :class:`Embedder` (``hf:Embedder``) and :class:`CrossEncoder`
(``hf:CrossEncoder``), served in dynamic batches.

``Embedder``: payload a string or ``{"text": str}``; result ``{"embedding": [float,
...], "tokens": n, "truncated": bool}``. ``CrossEncoder``: payload ``{"query": str,
"passages": [str, ...], "top_n": n}`` (``top_n`` optional); result ``{"scores":
[float per passage], "ranking": [passage indices, best first], "tokens": n,
"truncated": [bool per passage]}``. docs/models.md has the options and the choices.

Inputs are padded to the longest of a forward pass and truncated at the model's
limit (``max_length``), which the result says. A payload the model cannot take gets
:class:`mtq.BadRequest` in its place: it fails at once, alone, and the rest of the
batch runs. Each result is reported with its token count as its cost
(:class:`mtq.Costed`), which the queue's fair share of tenants settles.

torch and transformers are imported in ``setup`` and ``predict`` only.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, ClassVar

import mtq
from mtq.backends.hf.loading import HFOptions, load_pretrained, load_tokenizer
from mtq.errors import BadRequest, ConfigError
from mtq.workers.options import Option

#: a tokenizer's ``model_max_length`` at or above this means none was saved with it
#: (transformers then reports a huge number)
_UNSET = 1_000_000


#: models whose position ids start after the padding index, so that
#: max_position_embeddings counts pad_token_id + 1 positions no input can use
_OFFSET_POSITIONS = frozenset({"roberta", "xlm-roberta", "xlm-roberta-xl", "camembert",
                               "longformer", "roberta-prelayernorm", "data2vec-text", "ibert",
                               "mpnet"})


def model_limit(tokenizer: Any, config: Any) -> int | None:
    """The longest input, in tokens, the model takes: the smaller of the tokenizer's
    ``model_max_length`` and the config's ``max_position_embeddings`` (less the
    positions a RoBERTa-style model reserves; either may be missing); None when
    neither says."""
    limits = []
    saved = getattr(tokenizer, "model_max_length", None)
    if isinstance(saved, int) and 0 < saved < _UNSET:
        limits.append(saved)
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and positions > 0:
        if getattr(config, "model_type", "") in _OFFSET_POSITIONS:  # (514 for 512 usable)
            positions -= int(getattr(config, "pad_token_id", None) or 0) + 1
        limits.append(positions)
    return min(limits) if limits else None


def choose_limit(given: int | None, tokenizer: Any, config: Any, name: str,
                 pair: bool = False) -> int | None:
    """The ``max_length`` option checked against the model's own limit and the special
    tokens an input takes (ConfigError when it is out of that range), or the model's
    limit when the option is not given."""
    limit = model_limit(tokenizer, config)
    if given is None:
        return limit
    if limit is not None and given > limit:
        raise ConfigError(f"max_length={given} is over the limit of {name!r}, {limit} tokens "
                          f"(max_position_embeddings / model_max_length): give at most {limit}")
    special = tokenizer.num_special_tokens_to_add(pair=pair) + (2 if pair else 1)
    if given < special:
        raise ConfigError(f"max_length={given} leaves no room for text: {name!r} adds "
                          f"{special - (2 if pair else 1)} special tokens to "
                          f"{'a pair' if pair else 'an input'}; give at least {special}")
    return given


def prepare_tokenizer(tokenizer: Any) -> Any:
    """Pad on the right (CLS pooling reads position 0), with a pad token even when the
    tokenizer names none (the attention mask leaves it out whatever it is)."""
    tokenizer.padding_side = "right"
    if tokenizer.pad_token is None:
        for spare in ("sep_token", "eos_token", "unk_token"):
            if getattr(tokenizer, spare, None) is not None:
                tokenizer.pad_token = getattr(tokenizer, spare)
                break
    return tokenizer


def forward_inputs(net: Any) -> frozenset[str]:
    """The names the model's ``forward`` takes (a tokenizer may return more, e.g.
    ``token_type_ids`` for a model without them)."""
    return frozenset(inspect.signature(net.forward).parameters)


def overflowed(tokenizer: Any, enc: Any, limit: int | None, first: Sequence[str],
               second: Sequence[str] | None = None) -> list[bool]:
    """For each input of ``enc`` (tokenized with truncation at ``limit``), whether
    truncation cut it. A fast tokenizer keeps what it cut with each encoding; for
    another one the inputs are tokenized again without truncation and measured."""
    n = len(first)
    if limit is None:
        return [False] * n
    encodings = getattr(enc, "encodings", None)
    if encodings is not None and len(encodings) == n:
        return [bool(e.overflowing) for e in encodings]
    full = tokenizer(list(first), None if second is None else list(second),
                     truncation=False, verbose=False)["input_ids"]
    return [len(ids) > limit for ids in full]


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _fields(payload: dict[Any, Any], known: tuple[str, ...], what: str) -> None:
    unknown = [k for k in payload if k not in known]
    if unknown:
        raise BadRequest(f"unknown field {_shown(unknown[0])} in an {what} payload; its "
                         f"fields are {', '.join(known)}")


def text_of(payload: Any) -> str:
    """The text of an ``hf:Embedder`` payload (a string or ``{"text": str}``);
    BadRequest saying what to send otherwise."""
    if isinstance(payload, str):
        return payload
    if not isinstance(payload, dict):
        raise BadRequest(f"an hf:Embedder payload is a string or {{'text': str}}; got "
                         f"{_shown(payload)} ({type(payload).__name__})")
    _fields(payload, ("text",), "hf:Embedder")
    if "text" not in payload:
        raise BadRequest("an hf:Embedder payload {'text': str} needs its 'text'")
    text = payload["text"]
    if not isinstance(text, str):
        raise BadRequest(f"'text' must be a string; got {_shown(text)} "
                         f"({type(text).__name__})")
    return text


def pool(hidden: Any, mask: Any, pooling: str, normalize: bool) -> Any:
    """One vector per row of ``hidden`` (batch, tokens, dim), in float32: the mean over
    the tokens ``mask`` keeps, or the first token's state (CLS); L2-normalised when
    ``normalize``."""
    import torch

    hidden = hidden.float()
    if pooling == "cls":
        out = hidden[:, 0]
    else:
        keep = mask.unsqueeze(-1).to(hidden.dtype)
        out = (hidden * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1e-9)
    return torch.nn.functional.normalize(out, p=2, dim=1) if normalize else out


class Embedder(HFOptions, mtq.Model):
    """Sentence embeddings from an ``AutoModel`` encoder (BERT, RoBERTa, MPNet,
    XLM-RoBERTa, DistilBERT ...): mean or CLS pooling, L2-normalised by default.

    Each batch is one forward pass, padded to its longest input and truncated at
    ``max_length``; ``--max-batch-size`` (of ``mtq worker run`` and ``mtq workers
    start``) sets how many payloads a batch takes."""

    max_batch_size: ClassVar[int] = 32
    max_wait_ms: ClassVar[float] = 5.0

    pooling = Option(str, "mean", choices=("mean", "cls"),
                     help="mean: the mean of the token states (sentence-transformers' "
                          "default); cls: the first token's state")
    normalize = Option(bool, True, help="L2-normalise each embedding (a dot product is "
                                        "then the cosine similarity)")
    max_length = Option(int, None, min=1,
                        help="truncate inputs at this many tokens (default: the model's "
                             "limit); the result says when it did")

    def setup(self, device: Any) -> None:
        import torch
        from transformers import AutoModel

        self.device = torch.device(device) if isinstance(device, str) else device
        self.tokenizer = prepare_tokenizer(load_tokenizer(self))
        self.net = load_pretrained(AutoModel, self, self.device)
        self.limit = choose_limit(self.max_length, self.tokenizer, self.net.config, self.model)
        self.inputs = forward_inputs(self.net)

    def predict(self, batch: list[Any]) -> list[Any]:
        out: list[Any] = [None] * len(batch)
        texts: list[str] = []
        where: list[int] = []
        for i, payload in enumerate(batch):
            try:
                texts.append(text_of(payload))
                where.append(i)
            except BadRequest as exc:  # this one fails alone; the others run
                out[i] = exc
        if texts:
            for i, result in zip(where, self.embed(texts)):
                out[i] = result
        return out

    def embed(self, texts: list[str]) -> list[mtq.Costed]:
        """Embed ``texts`` in one forward pass: one :class:`mtq.Costed` result each."""
        import torch

        enc = self.tokenizer(texts, padding=True, truncation=self.limit is not None,
                             max_length=self.limit, return_tensors="pt")
        cut = overflowed(self.tokenizer, enc, self.limit, texts)
        tokens = enc["attention_mask"].sum(dim=1).tolist()
        with torch.inference_mode():
            inputs = {k: v.to(self.device) for k, v in enc.items() if k in self.inputs}
            hidden = self.net(**inputs).last_hidden_state
            mask = enc["attention_mask"].to(self.device)
            rows = pool(hidden, mask, self.pooling, self.normalize).cpu().tolist()
        return [mtq.Costed({"embedding": row, "tokens": n, "truncated": c}, cost=n)
                for row, n, c in zip(rows, tokens, cut)]


class Rerank:
    """One ``hf:CrossEncoder`` request, checked."""

    __slots__ = ("passages", "query", "top_n")

    def __init__(self, payload: Any, most: int) -> None:
        what = "hf:CrossEncoder"
        if not isinstance(payload, dict):
            raise BadRequest(f"an {what} payload is {{'query': str, 'passages': [str, ...]}}; "
                             f"got {_shown(payload)} ({type(payload).__name__})")
        _fields(payload, ("query", "passages", "top_n"), what)
        query, passages, top_n = payload.get("query"), payload.get("passages"), \
            payload.get("top_n")
        if not isinstance(query, str):
            raise BadRequest(f"'query' must be a string; got {_shown(query)}")
        if not isinstance(passages, list):
            raise BadRequest(f"'passages' must be a list of strings; got {_shown(passages)}")
        if len(passages) > most:
            raise BadRequest(f"{len(passages)} passages in one request; this worker takes at "
                             f"most {most} (its max_passages option): send them in requests "
                             "of fewer")
        for j, p in enumerate(passages):
            if not isinstance(p, str):
                raise BadRequest(f"passage {j} must be a string; got {_shown(p)} "
                                 f"({type(p).__name__})")
        if top_n is not None and (not isinstance(top_n, int) or isinstance(top_n, bool)
                                  or top_n < 1):
            raise BadRequest(f"'top_n' must be an integer of 1 or more; got {_shown(top_n)}")
        self.query: str = query
        self.passages: list[str] = passages
        self.top_n: int | None = top_n


class CrossEncoder(HFOptions, mtq.Model):
    """Reranking with an ``AutoModelForSequenceClassification`` cross encoder (a
    ms-marco MiniLM, bge-reranker ...): a query and its passages in, a score per
    passage and their ranking out.

    The (query, passage) pairs of a whole batch of requests run together, in forward
    passes of at most ``max_pairs`` pairs (sorted by length first when there are more,
    so that a pass pads little), then go back to their requests. A score is the logit
    of a one-label model (its sigmoid with ``activation=sigmoid``), or the softmax
    probability of label 1 of a two-label model."""

    max_batch_size: ClassVar[int] = 16
    max_wait_ms: ClassVar[float] = 5.0

    max_pairs = Option(int, 64, min=1, help="most (query, passage) pairs per forward pass")
    max_passages = Option(int, 1000, min=1,
                          help="most passages in one request (more: BadRequest), so that one "
                               "request cannot hold up its batch")
    max_length = Option(int, None, min=1,
                        help="truncate a pair at this many tokens (default: the model's "
                             "limit); the result says which passages it cut")
    activation = Option(str, "none", choices=("none", "sigmoid"),
                        help="the score of a one-label model: none, its logit; sigmoid, "
                             "in (0, 1). A two-label model's is the softmax of label 1")

    def setup(self, device: Any) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification

        self.device = torch.device(device) if isinstance(device, str) else device
        self.tokenizer = prepare_tokenizer(load_tokenizer(self))
        self.net = load_pretrained(AutoModelForSequenceClassification, self, self.device)
        labels = self.net.config.num_labels
        if labels not in (1, 2):
            raise ConfigError(f"{self.model!r} has {labels} labels: a cross encoder scores "
                              "with one (a relevance logit) or two (not relevant, relevant)")
        self.limit = choose_limit(self.max_length, self.tokenizer, self.net.config, self.model,
                                  pair=True)
        self.inputs = forward_inputs(self.net)

    def predict(self, batch: list[Any]) -> list[Any]:
        out: list[Any] = [None] * len(batch)
        requests: list[tuple[int, Rerank]] = []
        for i, payload in enumerate(batch):
            try:
                requests.append((i, Rerank(payload, self.max_passages)))
            except BadRequest as exc:  # this one fails alone; the others run
                out[i] = exc
        queries = [r.query for _, r in requests for _ in r.passages]
        passages = [p for _, r in requests for p in r.passages]
        scores, tokens, cut = self.score(queries, passages) if passages else ([], [], [])
        at = 0
        for i, r in requests:
            n = len(r.passages)
            mine = scores[at:at + n]
            ranking = sorted(range(n), key=lambda j: -mine[j])
            used = sum(tokens[at:at + n])
            out[i] = mtq.Costed({"scores": mine, "ranking": ranking[:r.top_n],
                                 "tokens": used, "truncated": cut[at:at + n]}, cost=used)
            at += n
        return out

    def score(self, queries: list[str], passages: list[str]
              ) -> tuple[list[float], list[int], list[bool]]:
        """Score each (query, passage) pair: (scores, tokens, truncated), in the order
        given, in passes of at most ``max_pairs``."""
        n = len(queries)
        order = list(range(n))
        if n > self.max_pairs:  # like lengths together: each pass pads to its longest
            order.sort(key=lambda k: len(queries[k]) + len(passages[k]))
        scores: list[float] = [0.0] * n
        tokens: list[int] = [0] * n
        cut: list[bool] = [False] * n
        for start in range(0, n, self.max_pairs):
            part = order[start:start + self.max_pairs]
            qs, ps = [queries[k] for k in part], [passages[k] for k in part]
            s, t, c = self._pass(qs, ps)
            for k, sk, tk, ck in zip(part, s, t, c):
                scores[k], tokens[k], cut[k] = sk, tk, ck
        return scores, tokens, cut

    def _pass(self, queries: list[str], passages: list[str]
              ) -> tuple[list[float], list[int], list[bool]]:
        import torch

        enc = self.tokenizer(queries, passages, padding=True,
                             truncation="longest_first" if self.limit is not None else False,
                             max_length=self.limit, return_tensors="pt")
        cut = overflowed(self.tokenizer, enc, self.limit, queries, passages)
        tokens = enc["attention_mask"].sum(dim=1).tolist()
        with torch.inference_mode():
            inputs = {k: v.to(self.device) for k, v in enc.items() if k in self.inputs}
            logits = self.net(**inputs).logits.float()
            if logits.shape[-1] == 2:
                s = torch.softmax(logits, dim=-1)[:, 1]
            else:
                s = logits[:, 0]
                if self.activation == "sigmoid":
                    s = torch.sigmoid(s)
            scores = s.cpu().tolist()
        return scores, tokens, cut
