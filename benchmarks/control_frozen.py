"""The ``frozen`` section of ``python -m benchmarks.control``: a supervised worker
under load with one child frozen (SIGSTOP) for three leases, then resumed (SIGCONT).

``mtq workers start benchmarks.children.calllog:CallLog --replicas 2 --lease-ms
2000`` (batches of up to 4, 30 ms an item); 96 tasks over 8 streams submitted at once;
one worker process stopped inside a predict call, left stopped for three leases, then
sent SIGCONT. From the model's call log (each call's start and return, with the streams
of its batch) and the queue: calls per stream that started while an earlier call of the
stream still ran (a call that never returned ran until its process was stopped: it was
killed before it could run again), tasks lost, tasks run to the end twice, the time from
the SIGSTOP to the process's death (its fence, mtq.workers.fencing.fence_s, plus up to
one beat), and
from its death to the first call of any task of the frozen call running again (suspects,
run alone in the quarantine process) and of any of its streams' tasks.

The functions here are shared with tests/integration/test_fencing.py.
"""

from __future__ import annotations

import os
import signal
import statistics
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

import mtq
from benchmarks.children.calllog import LOG_ENV
from benchmarks.harness import procs
from benchmarks.harness.procs import Proc, worker_env
from benchmarks.harness.server import Server, uniq
from mtq.workers.fencing import fence_s
from mtq.workers.registry import list_workers

#: (pid, start, end or None: it never returned, stream keys "s:i")
Span = tuple[int, float, float | None, tuple[str, ...]]
#: wait(what, condition, timeout) -> the condition's truthy value (the caller's own wait)
Wait = Callable[[str, Callable[[], Any], float], Any]


def calls_of(log: Path) -> list[Span]:
    """Each predict call of a call log (B and D lines, see benchmarks.children.calllog)."""
    out: list[Span] = []
    started: dict[int, tuple[float, tuple[str, ...]]] = {}
    if not log.exists():
        return out
    for line in log.read_text().splitlines():
        tag, t, pid, *keys = line.split()
        if tag == "B":
            started[int(pid)] = (float(t), tuple(keys))
        elif tag == "D":
            b, ks = started.pop(int(pid))
            out.append((int(pid), b, float(t), ks))
    out += [(pid, b, None, ks) for pid, (b, ks) in started.items()]
    return out


def overlaps_per_stream(log: Path, frozen: dict[int, float]) -> dict[str, int]:
    """stream -> its predict calls that started while an earlier one still ran. A call
    that never returned ran until ``frozen[pid]`` (when its process was stopped, or now
    if it may still run)."""
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for pid, start, end, keys in calls_of(log):
        if end is None:
            if pid not in frozen:
                raise AssertionError(f"process {pid} left a call open but was not frozen")
            end = frozen[pid]
        for s in {k.split(":")[0] for k in keys}:
            spans[s].append((start, end))
    out: dict[str, int] = {}
    for s, xs in spans.items():
        n, until = 0, float("-inf")
        for start, end in sorted(xs):
            n += start < until
            until = max(until, end)
        out[s] = n
    return out


def gone(pid: int) -> bool:
    """``pid`` exited (or was killed), reaped or not yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] in "ZX"
    except OSError:
        return True


def stop_in_call(log: Path, wait: Wait, pids: set[int] | None = None
                 ) -> tuple[int, tuple[str, ...], float]:
    """SIGSTOP a worker process (one of ``pids``) inside a predict call; returns its pid,
    that call's keys and the time it was stopped."""
    def open_call() -> tuple[int, tuple[str, ...]] | None:
        return next(((p, ks) for p, _, end, ks in calls_of(log)
                     if end is None and (pids is None or p in pids)), None)

    pid, keys = wait("a predict call started", open_call, 30)
    os.kill(pid, signal.SIGSTOP)
    return pid, keys, time.time()


def freeze_one(log: Path, q: mtq.Queue, lease_ms: int, wait: Wait, *, streams: int = 8,
               per_stream: int = 12, sleep: float = 0.03) -> dict[str, Any]:
    """The case (see the module's docstring) on a running supervisor whose model writes
    ``log``; returns its figures (``fence_s`` None: the process was never killed)."""
    reqs = [mtq.Request({"s": f"s{s}", "i": i, "sleep": sleep}, stream=f"s{s}")
            for i in range(per_stream) for s in range(streams)]
    before = q.stats()["succeeded"]
    tasks = q.submit_many(reqs)
    pid, keys, stopped = stop_in_call(log, wait)
    resume_at = stopped + 3 * lease_ms / 1000
    killed: float | None = None
    while time.time() < resume_at:  # three leases (polled every 5 ms: it may be killed)
        if killed is None and gone(pid):
            killed = time.time()
        time.sleep(0.005)
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
    wait("every task done", lambda: q.stats()["succeeded"] - before >= len(tasks), 60)
    calls = calls_of(log)
    done = Counter(k for _, _, end, ks in calls if end is not None for k in ks)
    stats = q.stats()
    out: dict[str, Any] = {
        "overlaps": overlaps_per_stream(log, {pid: stopped if killed else time.time()}),
        "lost": len(tasks) - (stats["succeeded"] - before), "stats": stats, "pid": pid,
        "twice": sum(1 for n in done.values() if n > 1), "tasks": list(zip(reqs, tasks)),
        "fence_s": None, "recovery_s": None, "streams_back_s": None}
    if killed is not None:
        mine = {k.split(":")[0] for k in keys}
        later = [(start, ks) for p, start, _, ks in calls if p != pid and start > stopped]
        rerun = [start for start, ks in later if set(ks) & set(keys)]
        back = [start for start, ks in later if {k.split(":")[0] for k in ks} & mine]
        out.update(fence_s=killed - stopped,
                   recovery_s=(min(rerun) - killed) if rerun else None,
                   streams_back_s=(min(back) - killed) if back else None)
    return out


def measure_frozen(quick: bool = False, *, lease_ms: int = 2000,
                   rounds: int | None = None) -> dict[str, Any]:
    """The rows of the ``frozen`` section."""
    rounds = rounds or (1 if quick else 3)
    server = Server()
    server.start()
    name = uniq("frozen")
    r = redis.Redis.from_url(server.url)
    figs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="mtq-bench-frozen-") as d:
        log = Path(d) / "calls.log"
        p = Proc(["workers", "start", "benchmarks.children.calllog:CallLog", "--queue", name,
                  "--redis", server.url, "--replicas", "2", "--lease-ms", str(lease_ms)],
                 worker_env(server.url, **{LOG_ENV: str(log)}))

        def wait(what: str, cond: Callable[[], Any], timeout: float) -> Any:
            return procs.wait_for(what, cond, timeout, [p], every=0.01)

        def serving() -> bool:
            ws = [w for w in list_workers(r, name) if w.get("role", "serving") == "serving"]
            return len([w for w in ws if not gone(int(w["pid"]))]) == 2

        try:
            q = mtq.Queue(name, client=r)
            for _ in range(rounds):
                wait("2 serving workers", serving, 120)
                log.unlink(missing_ok=True)
                figs.append(freeze_one(log, q, lease_ms, wait))
        finally:
            p.stop()
            p.close()
            mtq.replies.hub_of(r).close_all()
            r.close()
            server.stop()
    overlaps = [sum(f["overlaps"].values()) for f in figs]
    fence = [f["fence_s"] for f in figs if f["fence_s"] is not None]
    rec = [f["recovery_s"] for f in figs if f["recovery_s"] is not None]
    back = [f["streams_back_s"] for f in figs if f["streams_back_s"] is not None]

    def runs(xs: list[float]) -> str:
        return ", ".join(f"{x:.2f}" for x in xs)

    def med(xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None

    n = len(figs)
    reclaim = lease_ms / 1000 - min(1.0, lease_ms / 3000)  # the earliest, after a freeze
    rows: list[tuple[str, float | None, str, str]] = [
        (f"one of 2 processes SIGSTOPped mid-call for 3 leases (--lease-ms {lease_ms}), "
         f"8 streams x 12 tasks: calls overlapping on a stream", max(overlaps), "calls",
         f"most of {n} runs (target 0; 80 before the fence, issue 46)"),
        ("  tasks lost / run to the end twice", max(f["lost"] + f["twice"] for f in figs),
         "tasks", f"most of {n} runs"),
        ("  SIGSTOP to the process killed (the fence)", med(fence), "s",
         f"median of {n}: {runs(fence)}; fence {fence_s(lease_ms / 1000):g} s plus up to a "
         f"0.1 s beat; a reclaim could come {reclaim:.2f} s after the last extend"),
        ("  kill to its streams running again", med(back), "s",
         f"median of {n}: {runs(back)}"),
        ("  kill to the frozen call's tasks running again (suspects: each alone)",
         med(rec), "s", f"median of {n}: {runs(rec)}; target < 1 s"),
    ]
    met = bool(figs) and max(overlaps) == 0 and len(rec) == n and max(rec) < 1.0 and \
        all(f["lost"] == 0 and f["twice"] == 0 for f in figs)
    return {"rows": rows, "figures": [{k: v for k, v in f.items() if k != "tasks"}
                                      for f in figs],
            "targets": [("a frozen child: 0 overlaps per stream, 0 lost, 0 twice, its "
                         "tasks running again within 1 s of the fence", met,
                         f"{n} runs", True)]}
