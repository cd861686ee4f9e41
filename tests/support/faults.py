"""The fault harness the benchmarks and the tests share (``benchmarks/faults.py``):
tests import it from here, so a move on the benchmarks' side changes one file."""

from __future__ import annotations

from benchmarks.faults import kill_workers, pct, recovery_times

__all__ = ["kill_workers", "pct", "recovery_times"]
