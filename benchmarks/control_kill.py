"""The ``kill`` section of ``python -m benchmarks.control``: a running plain function
that ignores its stop, killed by its supervisor after the grace.

``mtq workers start benchmarks.children.nap:nap --replicas 1`` (a warm standby on
the CPU, as by default), the queue's ``cancel_grace_s`` set to 1 s. Each round submits
one task that sleeps 60 s (``time.sleep``: it never checks ``mtq.current_task()``),
waits until it runs (its worker's registry entry says ``running``), and cancels it: the figure is the time from ``Task.cancel()`` to
the task's ``cancelled`` state (the grace, then the kill and the settle), polled every
5 ms. A timeout round does the same with ``submit(..., timeout=0.5)`` and no cancel
(``max_retries`` 0): from the task's start to its end, ``failed`` with ``TaskTimeout``
(its ``started`` and ``finished`` times, Redis's clock).
Before each round the replacement process is serving.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import redis

import mtq
from benchmarks.harness.procs import Proc, wait_for, worker_env
from benchmarks.harness.server import Server, uniq
from mtq.workers.registry import list_workers

NAP = "benchmarks.children.nap:nap"
GRACE_S = 1.0
TIMEOUT_S = 0.5


def _serving(r: redis.Redis, name: str, not_pid: int | None) -> int | None:
    """The pid of a registered serving worker other than ``not_pid`` (idle), if any."""
    for w in list_workers(r, name):
        if w.get("role", "serving") == "serving" and w["pid"] != not_pid and \
                w.get("state") == "idle":
            return int(w["pid"])
    return None


def _round(r: redis.Redis, name: str, q: mtq.Queue, p: Proc, pid: int,
           kind: str) -> tuple[float, int]:
    """One round (see the module's docstring) on the serving process ``pid``: (seconds
    from the cancel, or the start, to the end; the pid of its replacement)."""
    t = q.submit({"s": 60}, timeout=TIMEOUT_S if kind == "timeout" else None)

    def started() -> bool:  # its call started: the worker's registry entry says running
        return t.status() == "running" and any(
            w["pid"] == pid and w.get("state") == "running" for w in list_workers(r, name))

    wait_for("the task running", started, 30, [p], every=0.005)
    t0 = time.monotonic()
    if kind == "cancel":
        t.cancel()
    want = "cancelled" if kind == "cancel" else "failed"
    wait_for(f"the task {want}", lambda: t.status() == want, 60, [p], every=0.005)
    took = time.monotonic() - t0
    if kind == "timeout":  # from its start (claim) to its end, on Redis's clock
        info = t.info()
        took = ((info.finished or 0) - (info.started or 0)) / 1000
    return took, wait_for("the replacement serving", lambda: _serving(r, name, pid), 120, [p])


def measure_kill(quick: bool = False, *, rounds: int | None = None) -> dict[str, Any]:
    """The rows of the ``kill`` section."""
    rounds = rounds or (1 if quick else 3)
    server = Server()
    server.start()
    name = uniq("kill")
    r = redis.Redis.from_url(server.url)
    q = mtq.Queue(name, client=r)
    q.configure(cancel_grace_s=GRACE_S, max_retries=0, dead_letter=False)
    p = Proc(["workers", "start", NAP, "--queue", name, "--redis", server.url,
              "--replicas", "1"], worker_env(server.url))
    cancel_s: list[float] = []
    timeout_s: list[float] = []
    try:
        pid = wait_for("a serving worker", lambda: _serving(r, name, None), 120, [p])
        for kind in ["cancel"] * rounds + ["timeout"] * rounds:
            took, pid = _round(r, name, q, p, pid, kind)
            (cancel_s if kind == "cancel" else timeout_s).append(took)
    finally:
        p.stop()
        p.close()
        mtq.replies.hub_of(r).close_all()
        r.close()
        server.stop()

    def runs(xs: list[float]) -> str:
        return ", ".join(f"{x:.2f}" for x in xs)

    rows: list[tuple[str, float | None, str, str]] = [
        (f"a plain function ignoring its cancel, supervised (cancel_grace_s {GRACE_S:g}): "
         "cancel to cancelled", statistics.median(cancel_s), "s",
         f"median of {len(cancel_s)}: {runs(cancel_s)}; the grace, then the kill and the "
         "settle"),
        (f"  the same with timeout={TIMEOUT_S:g} and no cancel: started to failed "
         "(TaskTimeout)", statistics.median(timeout_s), "s",
         f"median of {len(timeout_s)}: {runs(timeout_s)}; timeout + grace "
         f"= {TIMEOUT_S + GRACE_S:g} s, then the kill"),
    ]
    return {"rows": rows, "cancel_s": cancel_s, "timeout_s": timeout_s}
