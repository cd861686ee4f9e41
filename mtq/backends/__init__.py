"""Model backends mtq ships: ready-made targets for models people serve.

* :mod:`mtq.backends.hf`: Hugging Face transformers models (``hf:Embedder``,
  ``hf:CrossEncoder``, ``hf:CausalLM``), under the ``hf`` extra.

Importing a backend does not import torch or transformers: a worker process does,
in the model's ``setup``.
"""
