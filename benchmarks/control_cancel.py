"""The ``cancel`` section of ``python -m benchmarks.control``: the time from a cancel
to the task's terminal state, for each kind of running work that stops itself, and the
lateness of a run timeout.

One bare ``mtq worker run`` per kind (benchmarks.children.cancel): a plain generator
function (a token every 10 ms), an ``mtq.Generator`` request (a decode step every
10 ms), a plain function that checks ``mtq.current_task()`` every 10 ms. Each round
submits one task, waits until it has run 0.3 s, then times ``Task.cancel()`` to the
end its client is told of (``TaskCancelled`` from ``result()``): the worker hears of
the cancel on the control channel, stops the work at its next step or check, and
settles it. The timeout row: the cooperative function submitted with ``timeout=1``;
its lateness is the run's end past 1 s, from its ``started`` and ``finished`` (Redis
server time). The kill after ``cancel_grace_s`` of a function that never checks is
the supervisor's (measured with it).
"""

from __future__ import annotations

import statistics
import time
from functools import partial
from typing import Any

import redis

import mtq
from benchmarks.harness.procs import Proc, wait_for, worker_env
from benchmarks.harness.server import Server, uniq
from mtq.workers.registry import list_workers

KINDS = {
    "plain generator function (a token every 10 ms)": "benchmarks.children.cancel:tokens",
    "mtq.Generator request (a decode step every 10 ms)": "benchmarks.children.cancel:Steps",
    "cooperative function (checks every 10 ms)": "benchmarks.children.cancel:cooperative",
}
COOPERATIVE = "benchmarks.children.cancel:cooperative"


def _cancel_once(q: mtq.Queue) -> float:
    t = q.submit({"n": 100_000, "step_ms": 10, "s": 60})
    wait_for("the task running", lambda: t.status() == "running", 30)
    time.sleep(0.3)
    t0 = time.perf_counter()
    t.cancel()
    try:
        t.result(timeout=30)
    except mtq.TaskCancelled:
        return time.perf_counter() - t0
    raise SystemExit(f"task {t.id} was not cancelled: {t.info()}")


def _late_once(q: mtq.Queue) -> float:
    t = q.submit({"s": 60}, timeout=1.0)
    try:
        t.result(timeout=30)
    except mtq.TaskFailed as exc:
        if not (exc.error or "").startswith("TaskTimeout: "):
            raise SystemExit(f"task {t.id} failed otherwise: {exc}") from None
    info = t.info()
    assert info.started is not None and info.finished is not None
    return (info.finished - info.started) / 1000 - 1.0


def measure_cancel(quick: bool = False) -> dict[str, Any]:
    runs = 3 if quick else 10
    server = Server()
    server.start()
    r = redis.Redis.from_url(server.url)
    rows: list[tuple[str, float | None, str, str]] = []
    figures: dict[str, list[float]] = {}
    try:
        for label, target in [*KINDS.items(), ("timeout", COOPERATIVE)]:
            name = uniq("cancel")
            if label == "timeout":  # (before the worker reads the settings)
                mtq.Queue(name, client=r).configure(max_retries=0, dead_letter=False)
            p = Proc(["worker", "run", target, "--queue", name, "--redis", server.url],
                     worker_env(server.url))
            try:
                wait_for(f"a worker of {target}", partial(list_workers, r, name), 120, [p])
                q = mtq.Queue(name, client=r)
                if label == "timeout":
                    took = [_late_once(q) for _ in range(runs)]
                else:
                    took = [_cancel_once(q) for _ in range(runs)]
            finally:
                p.stop()
                p.close()
            figures[label] = took
            listed = ", ".join(f"{x * 1000:.0f}" for x in took)
            if label == "timeout":
                rows.append(("timeout=1 on a cooperative function (checks every 10 ms): its "
                             f"end past 1 s, median of {runs}", statistics.median(took) * 1000,
                             "ms", f"max {max(took) * 1000:.0f} ms; runs {listed}"))
            else:
                rows.append((f"cancel to cancelled: {label}, median of {runs}",
                             statistics.median(took) * 1000, "ms",
                             f"max {max(took) * 1000:.0f} ms; runs {listed}"))
    finally:
        mtq.replies.hub_of(r).close_all()
        r.close()
        server.stop()
    return {"rows": rows, "figures": figures}
