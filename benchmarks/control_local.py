"""The ``local`` section of ``python -m benchmarks.control``: what ``mtq.local`` costs
at the start and the stop of a block (docs/workers.md, "Local mode").

Each run starts ``mtq.local(benchmarks.children.nap:nap, replicas=N)`` in this process
(a redis-server in a temporary directory, the runner with its supervisor, N worker
processes), times ``start()`` (until every process is set up and registered), one
round trip (a task of 0 s), and the stop: graceful (idle workers, a normal exit of the
block) or forced (a task running, as on an exception or Ctrl-C), until every process
and the server are gone and the directory removed. The median of the runs is the
figure. The fork server imports torch for every worker process only when asked
(``preload=["torch"]``, the default when the calling process imported torch): both
starts are measured.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import mtq
from benchmarks.control_spread import NAP


def _one(replicas: int, preload: list[str], force: bool) -> tuple[float, float, float]:
    """(start, round trip, stop) in seconds."""
    t0 = time.perf_counter()
    lm = mtq.local(NAP, replicas, preload=preload)
    q = lm.start()
    started = time.perf_counter()
    q.submit({"s": 0}).result(timeout=60)
    trip = time.perf_counter()
    if force:
        q.submit({"s": 60})
        while not q.stats().get("running"):  # the long task under way
            time.sleep(0.005)
    t1 = time.perf_counter()
    lm.stop(force=force)
    return started - t0, trip - started, time.perf_counter() - t1


def _runs(text: list[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in text)


def measure_local(quick: bool = False) -> dict[str, Any]:
    """Start, first round trip and stop of ``mtq.local`` (seconds)."""
    n = 1 if quick else 5
    plain = [_one(1, [], False) for _ in range(n)]
    torch = [_one(1, ["torch"], False) for _ in range(n)]
    five = [_one(5, [], False) for _ in range(max(1, n // 2))]
    forced = [_one(1, [], True) for _ in range(n)]
    rows: list[tuple[str, float | None, str, str]] = []
    for label, runs in (("1 process, plain function", plain),
                        ("1 process, fork server importing torch", torch),
                        ("5 processes (the seed's example)", five)):
        starts = [s for s, _, _ in runs]
        rows.append((f"start to ready: {label}, median of {len(runs)}",
                     statistics.median(starts), "s", f"runs {_runs(starts)}"))
    trips = [t for _, t, _ in plain]
    rows.append((f"first round trip after the start, median of {n}",
                 statistics.median(trips) * 1000, "ms", f"runs {_runs([t * 1000 for t in trips])}"))
    graceful = [s for _, _, s in plain]
    rows.append((f"graceful stop (idle, a normal exit), to nothing left, median of {n}",
                 statistics.median(graceful), "s", f"runs {_runs(graceful)}"))
    hard = [s for _, _, s in forced]
    rows.append((f"forced stop (a task running; an exception or Ctrl-C), median of {n}",
                 statistics.median(hard), "s", f"runs {_runs(hard)}"))
    return {"rows": rows, "start_s": statistics.median(s for s, _, _ in plain)}
