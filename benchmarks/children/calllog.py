"""Worker target of the frozen-child benchmark (benchmarks/control_frozen.py) : a
batched model that logs each predict call's start and return with the stream keys of
its batch, as tests/models.py Probe does.

Every call appends ``B <time> <pid> <s:i> ...`` as it starts and ``D <time> <pid> <s:i>
...`` as it returns to the file named by ``MTQ_BENCH_CALL_LOG`` (one O_APPEND write a
line, so processes can share the file). Payload: ``{"s": stream, "i": index,
"sleep": seconds per item}``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import mtq

LOG_ENV = "MTQ_BENCH_CALL_LOG"


def log_call(tag: str, batch: list[Any]) -> None:
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    keys = " ".join(f"{p.get('s', '-')}:{p.get('i', '-')}" for p in batch)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{tag} {time.time():.6f} {os.getpid()} {keys}\n".encode())
    finally:
        os.close(fd)


class CallLog(mtq.Model):
    """Batches of up to 4; each item sleeps its ``sleep``; echoes ``s`` and ``i``."""

    max_batch_size = 4
    max_wait_ms = 20
    name = "calllog"

    def setup(self, device: Any) -> None:
        pass

    def predict(self, batch: list[Any]) -> list[Any]:
        log_call("B", batch)
        out = []
        for p in batch:
            time.sleep(float(p.get("sleep") or 0))
            out.append({"s": p.get("s"), "i": p.get("i"), "pid": os.getpid()})
        log_call("D", batch)
        return out
