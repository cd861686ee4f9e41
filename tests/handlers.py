"""Small worker targets for subprocess tests (``tests.handlers:<name>``).

Kept free of numpy/torch imports so a worker using them starts fast.
"""

from __future__ import annotations

import os
from typing import Any


def double(payload: dict[str, Any]) -> Any:
    """``{"x": n}`` -> ``2 * n``."""
    return payload["x"] * 2


def boom(payload: Any) -> Any:
    """Always fails with a ValueError naming the payload."""
    raise ValueError(f"boom on {payload!r}")


def record(payload: Any) -> dict[str, Any]:
    """Echo the payload with the worker's pid, to see who ran what."""
    return {"pid": os.getpid(), "payload": payload}


def identity(payload: Any) -> Any:
    """Return the payload unchanged."""
    return payload
