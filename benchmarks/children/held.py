"""A plain function that holds its worker: it appends its pid to the file named by
``MTQ_BENCH_MARK`` (so the benchmark knows it runs), then sleeps ``payload["s"]``
seconds (benchmarks/control.py: a stop with tasks running)."""

from __future__ import annotations

import os
import time
from typing import Any


def hold(payload: dict[str, Any]) -> int:
    mark = os.environ.get("MTQ_BENCH_MARK")
    if mark:
        fd = os.open(mark, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{os.getpid()}\n".encode())
        finally:
            os.close(fd)
    time.sleep(float(payload.get("s", 60)))
    return os.getpid()
