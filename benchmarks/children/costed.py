"""Worker target of benchmarks/scheduling.py: work whose time is proportional to its cost.

:func:`work` sleeps 0.1 ms per cost unit (a token, say) of its payload ``{"c": cost,
"g": group, "k": index, "s": submitted}`` and appends one line per task to the file
``$MTQ_BENCH_LOG``: ``start end group cost submitted index``, times from ``time.time()`` (the
clock the benchmark submits by). The line is written and flushed after the sleep, before
the task is acked: the benchmark reads the file while the worker runs.
"""

from __future__ import annotations

import os
import time
from typing import Any

#: seconds of work per cost unit
PER_COST_S = 0.0001

_LOG = os.environ.get("MTQ_BENCH_LOG", "")
_out = open(_LOG, "a", encoding="utf-8", buffering=1) if _LOG else None


def work(payload: dict[str, Any]) -> None:
    """Sleep ``cost`` x 0.1 ms, and log when."""
    t0 = time.time()
    cost = float(payload["c"])
    time.sleep(cost * PER_COST_S)
    if _out is not None:
        _out.write(f"{t0:.6f} {time.time():.6f} {payload['g']} {cost:g} "
                   f"{float(payload.get('s', 0)):.6f} {payload.get('k', 0)}\n")
