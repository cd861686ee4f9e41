"""benchmarks.against's child: the hot path of the tree first on ``PYTHONPATH``, with
that tree's own ``benchmarks.hotpath`` (its ``drain``, ``roundtrips`` and
``spawn_worker``, which every tree since the hot-path work has). Prints one JSON line.

Run by file path with ``python -P`` so that this folder does not shadow the tree's
modules; it imports nothing else of this tree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from benchmarks import hotpath  # the measured tree's
from benchmarks.broker import Server
from benchmarks.hotpath import drain, roundtrips


def batch1(server: Any, queue: str, target: str, cpu: int | None, env: dict[str, str],
           *extra: str) -> subprocess.Popen[bytes]:
    """``hotpath.spawn_worker`` with ``--max-batch-size 1``, for a tree whose ``drain()``
    takes no more of the worker's command line. ``--batch-size``: the name every tree
    takes (later trees keep it as an alias of ``--max-batch-size``)."""
    cmd = [sys.executable, "-m", "mtq", "worker", "run", target, "--queue", queue,
           "--batch-size", "1"]
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu), *cmd]
    return subprocess.Popen(cmd, env=env, cwd=hotpath.ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def main() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    server = Server()
    server.start()
    worker = cpus[1] if len(cpus) >= 2 else None
    if worker is not None and server.proc is not None:
        os.sched_setaffinity(server.proc.pid, {cpus[0]})
        os.sched_setaffinity(0, {worker})
    try:
        d5, d20 = drain(server, 5000, worker), drain(server, 20000, worker)
        spawn, hotpath.spawn_worker = hotpath.spawn_worker, batch1
        try:
            d1 = drain(server, 10000, worker)
        finally:
            hotpath.spawn_worker = spawn
        rt = roundtrips(server, 300, worker)
    finally:
        server.stop()
    print(json.dumps({"startup_s": d5["startup_s"], "with_startup": d5["with_startup"],
                      "steady": d20["steady"], "cmds_drain": d5["cmds_drain"],
                      "cpu_us": d20["cpu_us"], "p50_ms": rt["p50_ms"], "p99_ms": rt["p99_ms"],
                      "rt_cmds": rt["cmds"], "steady1": d1["steady"], "cmds1": d1["cmds_drain"],
                      "cpu1_us": d1["cpu_us"]}))


if __name__ == "__main__":
    main()
