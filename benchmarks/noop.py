"""A no-op worker target for the end-to-end benchmark (benchmarks/broker.py)."""

from __future__ import annotations

from typing import Any


def handle(payload: Any) -> None:
    """Do nothing: the benchmark measures the queue, not the handler."""
