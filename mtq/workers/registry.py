"""The worker registry; the code lives in :mod:`mtq.broker.registry` (every key mtq
reads or writes is the broker's), and this path keeps working."""

from mtq.broker.registry import beat, list_workers, remove

__all__ = ["beat", "list_workers", "remove"]
