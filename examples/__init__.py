"""Runnable examples of mtq targets (``examples.tiny:TinyClassifier`` and
``examples.embeddings:MiniLM``)."""
