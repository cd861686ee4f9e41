"""Worker target of the fault benchmarks (benchmarks/faults.py) and fault tests."""

from __future__ import annotations

import ctypes
import os
import time
from typing import Any

import mtq


class Busy(mtq.Model):
    """Small batches that take a little time: the fetcher claims every few
    milliseconds, so a kill often lands just after a claim. A payload's ``"sleep"``
    (default 1 ms) is spent per item; ``"exit": true`` ends the process with
    ``os._exit(1)``, ``"segv": true`` crashes it with a segmentation fault."""

    max_batch_size = 4
    max_wait_ms = 2
    name = "busy"

    def predict(self, batch: list[Any]) -> list[Any]:
        out = []
        for p in batch:
            if p.get("exit"):
                os._exit(1)
            if p.get("segv"):
                ctypes.string_at(0)  # reads address 0: SIGSEGV
            time.sleep(float(p.get("sleep", 0.001)))
            out.append(p.get("i"))
        return out
