"""benchmarks.limits' producer process: THREADS threads submit tasks of one tenant to a
queue with a rate limit, each as often as every PAUSE_MS, for SECONDS; it prints one JSON
line: how many were accepted, and the latency of each refused submit (ms).

    python -m benchmarks.children.rate_producer URL QUEUE TENANT THREADS SECONDS PAUSE_MS
"""

from __future__ import annotations

import json
import sys
import threading
import time

import mtq


def main() -> None:
    url, queue, tenant = sys.argv[1], sys.argv[2], sys.argv[3]
    threads, seconds, pause = int(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6]) / 1000
    q = mtq.Queue(queue, url)
    assert q.settings.tenant_rpm  # the stored limit, read before the clock starts
    accepted, refused = [0], []
    lock = threading.Lock()
    start = time.monotonic()
    end = start + seconds

    def run() -> None:
        while time.monotonic() < end:
            t0 = time.perf_counter()
            try:
                q.submit(0, tenant=tenant)
                with lock:
                    accepted[0] += 1
            except mtq.RateLimited:
                with lock:
                    refused.append((time.perf_counter() - t0) * 1000)
            time.sleep(pause)  # a client retries later, it does not spin

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    print(json.dumps({"accepted": accepted[0], "refused_ms": refused}))


if __name__ == "__main__":
    main()
