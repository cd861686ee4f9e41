"""A reference token generator: a small GPT with a real KV cache, served as an
:class:`mtq.Generator` (:class:`mtq.reference.gpt.TinyGPT`), and its byte-level
tokenizer (:mod:`mtq.reference.tokenizer`).

It exists so the continuous-batching engine, its tests and its benchmarks run a
real model (prefill, batched decode over a KV cache, seeded sampling) on CPU,
with no download: TinyGPT's default weights (0.5 MB, trained on *Pride and
Prejudice* by :mod:`mtq.reference.train`) ship in this package, so it writes
English words; random weights come from a fixed seed. Importing this package
does not import torch.
"""
