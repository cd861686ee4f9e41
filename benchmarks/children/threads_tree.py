"""benchmarks.threads' child: N round trips of a no-op task on a warm worker
(``threads_worker.py``), and each thread's CPU per round trip, of the client (this
process) and of the worker. Run by file path with ``python -P`` and the measured tree
first on ``PYTHONPATH``; it imports only what every tree has. Prints one JSON line.

    python -P threads_tree.py N
"""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import redis

import mtq
from benchmarks.broker import Server
from benchmarks.hotpath import _stop, wait_worker, worker_env

WORKER = Path(__file__).resolve().parent / "threads_worker.py"


def own_clocks() -> dict[str, float]:
    return {t.name: time.clock_gettime(time.pthread_getcpuclockid(t.ident or 0))
            for t in threading.enumerate()}


def main(n: int) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    server = Server()
    server.start()
    if len(cpus) >= 2 and server.proc is not None:
        os.sched_setaffinity(server.proc.pid, {cpus[0]})
        os.sched_setaffinity(0, {cpus[1]})
    r = redis.Redis.from_url(server.url)
    q = mtq.Queue("threads", client=r)
    clocks = tempfile.mktemp(prefix="mtq-threads-")
    proc = subprocess.Popen([sys.executable, "-P", str(WORKER), clocks, "threads"],
                            env=worker_env(server), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)

    def worker_clocks(seen: int) -> dict[str, Any]:
        proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while True:  # the handler appends one line: there is nothing to block on
            try:
                lines = Path(clocks).read_text().splitlines()
            except FileNotFoundError:
                lines = []
            if len(lines) > seen:
                return dict(ast.literal_eval(lines[-1]))
            if time.monotonic() > deadline:
                raise SystemExit("the worker did not report its threads' CPU")
            time.sleep(0.005)

    try:
        wait_worker(r, "threads", proc)
        for _ in range(50):
            q.submit(None).result(timeout=30)
        w0, c0 = worker_clocks(0), own_clocks()
        lat = []
        for _ in range(n):
            t = time.perf_counter()
            q.submit(None).result(timeout=30)
            lat.append(time.perf_counter() - t)
        c1, w1 = own_clocks(), worker_clocks(1)
    finally:
        _stop(proc)
        mtq.replies.hub_of(r).close_all()
        server.stop()
        if os.path.exists(clocks):
            os.unlink(clocks)
    lat.sort()
    out = {"p50_ms": 1000 * lat[n // 2], "p99_ms": 1000 * lat[int(n * 0.99)]}
    out.update({"worker " + k: 1e6 * (w1[k] - w0[k]) / n for k in w1 if k in w0})
    out.update({"client " + k: 1e6 * (c1[k] - c0[k]) / n for k in c1 if k in c0})
    print(json.dumps(out))


if __name__ == "__main__":
    main(int(sys.argv[1]))
