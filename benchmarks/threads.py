"""Where a round trip's CPU goes, thread by thread: the worker's model thread, fetcher
and publisher, the client's calling thread and its reply listener, each read from the
thread's own CPU clock (``time.pthread_getcpuclockid``: exact, where /proc's per-thread
figures are sampled at the scheduler's tick), over 2,000 round trips of a no-op task
on a warm worker, as ``benchmarks.hotpath`` times them (redis-server pinned to one
CPU, the client and the worker to the other).

``--against REV`` measures a git revision's tree the same way in the same run, passes
alternating between the trees (this machine's speed swings 2-4x within minutes), and
prints the medians and their ratio.

    python -m benchmarks.threads                         # this tree
    python -m benchmarks.threads --against 2f99451       # and a revision, 8 passes
    python -m benchmarks.threads --against REV --docs    # rewrites "## Round trip CPU by thread"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from benchmarks.broker import ROOT, compile_tree, write_docs
from benchmarks.instructions import export

#: the worker, in a process that writes each thread's CPU time to a file on SIGUSR1
WORKER = r'''
import signal, sys, threading, time
out = sys.argv[1]

def dump(*_):
    clocks = {}
    for t in threading.enumerate():
        try:
            clocks[t.name] = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        except (OSError, TypeError):  # a thread that just ended
            pass
    with open(out, "a") as f:
        f.write(repr(clocks) + "\n")

signal.signal(signal.SIGUSR1, dump)
sys.argv = ["mtq", "worker", "run", "benchmarks.noop:handle", "--queue", sys.argv[2]]
from mtq.cli.main import main
main()
'''

#: run with ``python -c`` in the tree measured; prints one JSON line of figures
CHILD = r'''
import ast, json, os, signal, subprocess, sys, tempfile, threading, time
import redis, mtq
from benchmarks.broker import Server
from benchmarks.hotpath import wait_worker, worker_env, _stop
worker_code, n = sys.argv[1], int(sys.argv[2])
cpus = sorted(os.sched_getaffinity(0))
server = Server()
server.start()
if len(cpus) >= 2:
    os.sched_setaffinity(server.proc.pid, {cpus[0]})
    os.sched_setaffinity(0, {cpus[1]})
r = redis.Redis.from_url(server.url)
q = mtq.Queue("threads", client=r)
clocks = tempfile.mktemp(prefix="mtq-threads-")
proc = subprocess.Popen([sys.executable, "-c", worker_code, clocks, "threads"],
                        env=worker_env(server), stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL, start_new_session=True)

def worker_clocks(seen):
    proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while True:  # the handler appends one line: there is nothing to block on
        try:
            lines = open(clocks).read().splitlines()
        except FileNotFoundError:
            lines = []
        if len(lines) > seen:
            return ast.literal_eval(lines[-1])
        if time.monotonic() > deadline:
            raise SystemExit("the worker did not report its threads' CPU")
        time.sleep(0.005)

def own_clocks():
    return {t.name: time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            for t in threading.enumerate()}

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
'''

#: (field, what it is): the threads that take part in a round trip, in its order
ROWS = (
    ("client MainThread", "client: the calling thread (submit, result)"),
    ("worker mtq-fetcher", "worker: fetcher (BLPOP, the hand-off)"),
    ("worker MainThread", "worker: model thread (runs the task)"),
    ("worker mtq-publisher", "worker: publisher (the ack)"),
    ("client mtq-replies", "client: reply listener (the completion event)"),
    ("worker mtq-heartbeat", "worker: heartbeat (once a second; batch records)"),
)


def measure(tree: Path, n: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD, WORKER, str(n)], env=env, cwd=tree,
                         check=True, capture_output=True, text=True, timeout=900).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def _med(runs: list[dict[str, float]], field: str) -> float:
    return statistics.median(r.get(field, 0.0) for r in runs)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", metavar="REV", help="a git revision to measure alongside")
    ap.add_argument("--passes", type=int, default=8)
    ap.add_argument("-n", type=int, default=2000, help="round trips a pass")
    ap.add_argument("--docs", action="store_true",
                    help='rewrite "## Round trip CPU by thread" in docs/benchmarks.md')
    args = ap.parse_args(argv)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="mtq-rev-") as tmp:
        trees = [("now", ROOT)]
        name = ""
        if args.against:
            name = export(args.against, Path(tmp))
            trees.insert(0, ("ref", Path(tmp)))
        for _, tree in trees:
            compile_tree(tree)  # as installed (see compile_tree)
        runs: dict[str, list[dict[str, float]]] = {which: [] for which, _ in trees}
        for i in range(args.passes):
            for which, tree in trees:
                runs[which].append(measure(tree, args.n))
                print(f"pass {i + 1}/{args.passes} {which}: {runs[which][-1]}", flush=True)
    now = runs["now"]
    ref = runs.get("ref")
    head = f"| thread | `{name}` | this tree | ratio |\n|---|---:|---:|---:|" if ref else \
        "| thread | this tree |\n|---|---:|"
    lines = [head]
    fields = [*((f, f"{label} (us)") for f, label in ROWS), ("", "all of them (us)"),
              ("p50_ms", "round trip p50 (ms)"), ("p99_ms", "round trip p99 (ms)")]
    total_now = sum(_med(now, f) for f, _ in ROWS)
    total_ref = sum(_med(ref, f) for f, _ in ROWS) if ref else 0.0
    for field, label in fields:
        b = _med(now, field) if field else total_now
        fmt = "{:.3f}" if field.endswith("_ms") else "{:.1f}"
        if ref:
            a = _med(ref, field) if field else total_ref
            ratio = f"{b / a:.2f}x" if a else "-"
            lines.append(f"| {label} | {fmt.format(a)} | {fmt.format(b)} | {ratio} |")
        else:
            lines.append(f"| {label} | {fmt.format(b)} |")
    text = "\n".join(lines)
    print(text)
    if args.docs:
        heading = "## Round trip CPU by thread"
        cmd = "python -m benchmarks.threads" + (f" --against {args.against}" if ref else "")
        write_docs(ROOT / "docs" / "benchmarks.md", "\n".join([
            heading, "",
            f"{date.today().isoformat()}, `{cmd} --passes {args.passes} --docs` in "
            f"{time.time() - started:.0f} s: each thread's CPU per round trip (its own CPU "
            f"clock), {args.n:,} round trips of a no-op task a pass, medians of the passes"
            + (" (alternating between the trees)" if ref else "") + ". See the module "
            "docstring.", "", text, ""]), heading=heading)


if __name__ == "__main__":
    main()
