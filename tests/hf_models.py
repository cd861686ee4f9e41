"""Tiny Hugging Face encoder models for the tests of mtq.backends.hf: built here, never
downloaded.

A WordPiece tokenizer made with ``tokenizers`` from the words of :data:`CORPUS`,
wrapped as a transformers fast BERT tokenizer, and a 2-layer BERT of width 32 with
random weights from a fixed seed (the same model in every session), saved with
``save_pretrained`` into a folder the backends load with ``from_pretrained`` (the real
loading path). Building one takes well under a second once transformers is imported.

* :func:`encoder`: a ``BertModel`` (``hf:Embedder``), its limit :data:`POSITIONS`
  tokens from its config (its tokenizer saves none);
* :func:`reranker`: a ``BertForSequenceClassification`` with ``num_labels`` 1 or 2
  (``hf:CrossEncoder``).

Each is built once per folder: call them with a session's temporary folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: the model's max_position_embeddings: the longest input in tokens
POSITIONS = 48
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a cat sat on the mat and looked at the rain",
    "where is the nearest train station",
    "how do I reset my password",
    "the weather in oslo is cold and wet in november",
    "paris is the capital of france",
    "berlin has many museums and a large park",
    "gpus run matrix multiplications very fast",
    "a queue holds tasks until a worker claims them",
    "redis keeps its data in memory",
    "embeddings map sentences to vectors of numbers",
    "rerank the passages by their relevance to the query",
]


def vocabulary() -> dict[str, int]:
    """The WordPiece vocabulary of :data:`CORPUS`: the special tokens, every character
    (and digits and punctuation) alone and as a continuation (``##a``), and every
    word, in a fixed order. (The
    ``tokenizers`` WordPiece trainer breaks ties in a different order on each run, so
    that the token ids, and with them a seeded model's outputs, would change from one
    test session to the next.)"""
    words = sorted({w for line in CORPUS for w in line.split()})
    chars = sorted({c for w in words for c in w} | set("0123456789.,;:!?'\"-()"))
    tokens = [*SPECIAL, *chars, *(f"##{c}" for c in chars), *(w for w in words if len(w) > 1)]
    return {t: i for i, t in enumerate(tokens)}


def tokenizer(limit: int | None = None) -> Any:
    """A fast BERT tokenizer built with ``tokenizers`` (WordPiece over
    :func:`vocabulary`: a word of the corpus is one token, another word its pieces;
    lower case; ``[CLS] a [SEP] b [SEP]``); ``limit``: the model_max_length it saves
    (None: none)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertTokenizerFast

    tok = Tokenizer(models.WordPiece(vocabulary(), unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    extra = {} if limit is None else {"model_max_length": limit}
    return BertTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                             cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                             **extra)


def _config(vocab: int, **extra: Any) -> Any:
    from transformers import BertConfig

    return BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=4, intermediate_size=64,
                      max_position_embeddings=POSITIONS, **extra)


def _save(path: Path, build: Any, seed: int, tok: Any) -> Path:
    import torch

    if (path / "config.json").exists():
        return path
    with torch.random.fork_rng(devices=[]):  # the global RNG is left as it was
        torch.manual_seed(seed)
        model = build()
    tok.save_pretrained(path)
    model.save_pretrained(path)
    return path


def encoder(root: Path, seed: int = 0) -> Path:
    """``root/encoder-SEED``: a tiny ``BertModel`` and its tokenizer (no saved limit:
    the backend takes :data:`POSITIONS` from the config)."""
    from transformers import BertModel

    tok = tokenizer()
    return _save(root / f"encoder-{seed}", lambda: BertModel(_config(len(tok))), seed, tok)


def reranker(root: Path, num_labels: int = 1, seed: int = 0) -> Path:
    """``root/reranker-LABELS-SEED``: a tiny ``BertForSequenceClassification`` whose
    weights are drawn wider than BERT's default, so that random passages get scores
    far enough apart for a ranking to be tested; its tokenizer saves the limit."""
    from transformers import BertForSequenceClassification

    tok = tokenizer(POSITIONS)
    config = _config(len(tok), num_labels=num_labels, initializer_range=0.3)
    return _save(root / f"reranker-{num_labels}-{seed}",
                 lambda: BertForSequenceClassification(config), seed, tok)
