"""Worker target of the spread benchmark (benchmarks/control.py, ``measure_spread``) and
its test: a plain function that sleeps, as a slow request handler does."""

from __future__ import annotations

import os
import time
from typing import Any


def nap(payload: dict[str, Any]) -> dict[str, Any]:
    """Sleep ``payload["s"]`` seconds (default 0.5); returns the process that ran it and
    when (unix time) it started and ended, with the payload's ``"i"``."""
    start = time.time()
    time.sleep(float(payload.get("s", 0.5)))
    return {"pid": os.getpid(), "i": payload.get("i"), "start": start, "end": time.time()}
