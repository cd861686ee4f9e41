"""Background load: submit no-op tasks at a rate until a file exists.

    python -m benchmarks.children.producer URL QUEUE RATE STOP_FILE
"""

from __future__ import annotations

import os
import sys
import time

import mtq


def main(url: str, queue: str, rate: float, stop_file: str) -> None:
    q = mtq.Queue(queue, url)
    t0 = time.perf_counter()
    sent = 0
    while not os.path.exists(stop_file):
        due = int((time.perf_counter() - t0) * rate) - sent
        if due > 0:
            q.submit_many([None] * due)
            sent += due
        time.sleep(0.001)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4])
