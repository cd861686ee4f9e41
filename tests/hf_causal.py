"""Tiny causal language models for the tests of mtq.backends.hf's CausalLM: built
here, never downloaded.

A byte-level BPE tokenizer trained with ``tokenizers`` on :data:`CORPUS` (every UTF-8
text encodes; the characters it never saw, such as CJK or emoji, stay split into
their bytes, so a character spans several tokens), a BOS added to every prompt, an
EOS, and a small chat template (:data:`CHAT_TEMPLATE`); and a Llama of two layers
with random weights from a fixed seed, saved with ``save_pretrained`` into a folder
the backend loads with ``from_pretrained`` (the real loading path). Building one
takes well under a second once transformers is imported.

* :func:`build` (``python -m tests.hf_causal FOLDER``): the folder of a model
  (``--set model=FOLDER``); its context is
  :data:`CONTEXT` tokens unless told otherwise. ``width``/``layers`` make a larger one
  (the benchmark's few-million-parameter model).

Each is built once per folder: call it with a session's temporary folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: the model's max_position_embeddings: prompt + generated tokens at most
CONTEXT = 256
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
#: a chat as ``<|role|>content`` lines, then ``<|assistant|>`` when a reply is asked for
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CORPUS = [
    "Once upon a time there was a little queue that held many tasks.",
    "The workers claimed the tasks one by one and answered them quickly.",
    "Hello, world! How are you today? I am fine, thank you.",
    "A model reads a prompt and writes the next token, then the next one.",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "<|user|>What is the weather like?\n<|assistant|>It is sunny and warm.\n",
    "<|system|>You are a helpful assistant.\n<|user|>Say hello.\n<|assistant|>Hello!\n",
    "numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "café, naïve, déjà vu: a few accents.",
]


def tokenizer() -> Any:
    """A fast byte-level BPE tokenizer (BOS prepended, EOS and PAD known, the chat
    template set) trained on :data:`CORPUS`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(
        vocab_size=400, special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1",
        special_tokens=[(BOS, tok.token_to_id(BOS))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD, chat_template=CHAT_TEMPLATE,
                                   model_max_length=CONTEXT)


def build(root: Path, seed: int = 0, *, width: int = 64, layers: int = 2,
          context: int = CONTEXT, name: str | None = None) -> Path:
    """``root/NAME`` (default ``llama-SEED-WIDTHxLAYERS``): a ``LlamaForCausalLM`` of
    ``layers`` layers of width ``width`` with random weights from ``seed`` and
    :func:`tokenizer`, saved with ``save_pretrained``; made once per folder."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    path = root / (name or f"llama-{seed}-{width}x{layers}-{context}")
    if (path / "config.json").exists():
        return path
    tok = tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=width, intermediate_size=2 * width,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=context, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         tie_word_embeddings=True, initializer_range=0.2)
    with torch.random.fork_rng(devices=[]):  # the global RNG is left as it was
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id,
                                               eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    tok.save_pretrained(path)
    model.save_pretrained(path)
    return path


def main(argv: list[str]) -> int:
    """``python -m tests.hf_causal FOLDER``: build the tiny model in FOLDER (docs/models.md
    serves it); prints the folder."""
    import sys

    if len(argv) != 2:
        print("usage: python -m tests.hf_causal FOLDER", file=sys.stderr)
        return 2
    folder = Path(argv[1]).resolve()
    print(build(folder.parent, name=folder.name))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv))
