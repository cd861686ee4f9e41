"""The fault benchmark's worker target, kept under this name for the tests'
``benchmarks.faults_targets:Busy``; it lives in benchmarks/children/busy.py."""

from benchmarks.children.busy import Busy

__all__ = ["Busy"]
