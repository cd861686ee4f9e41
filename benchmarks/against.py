"""The hot path of this tree next to a git revision's, in one run: the drains, the
round trip and their Redis figures of ``benchmarks.hotpath`` (a drain with
``--batch-size 1`` too), measured for each tree in
turn (passes alternate), client and worker alike running the tree's own code.

Timings on this machine swing 2-4x within minutes, so a figure is only compared with
the other tree's in the same run, pass by pass: the table gives medians and the median
of the per-pass ratios. Which tree a pass measures first alternates.

Each tree is measured by its own ``benchmarks/hotpath.py`` (``drain`` and
``roundtrips``, which every tree since the hot-path work has), in a child process with
the tree first on its import path: its redis-server pinned to one CPU, the child and its
worker to the other, as ``python -m benchmarks.hotpath`` does.

    python -m benchmarks.against REV              # 3 passes, prints
    python -m benchmarks.against REV --docs       # and rewrites "## Hot path: against REV"
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

#: run with ``python -c`` in the tree measured; prints one JSON line of figures
CHILD = r'''
import json, os, subprocess, sys
from benchmarks import hotpath
from benchmarks.broker import Server
from benchmarks.hotpath import drain, roundtrips


def batch1(server, queue, target, cpu, env, *extra):
    # hotpath.spawn_worker with --batch-size 1, for a tree whose drain() takes no more
    # of the worker's command line
    cmd = [sys.executable, "-m", "mtq", "worker", "run", target, "--queue", queue,
           "--batch-size", "1"]
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu), *cmd]
    return subprocess.Popen(cmd, env=env, cwd=hotpath.ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


cpus = sorted(os.sched_getaffinity(0))
server = Server()
server.start()
worker = cpus[1] if len(cpus) >= 2 else None
if worker is not None:
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
'''

#: (field, what it is, format, higher is better)
ROWS = (
    ("p50_ms", "round trip p50 (ms)", "{:.3f}", False),
    ("p99_ms", "round trip p99 (ms)", "{:.3f}", False),
    ("steady", "steady drain, 1 worker, 20,000 tasks (tasks/s)", "{:,.0f}", True),
    ("with_startup", "drain of 5,000 incl. start-up (tasks/s)", "{:,.0f}", True),
    ("startup_s", "worker start-up to first task (s)", "{:.3f}", False),
    ("cpu_us", "Redis CPU per task, submit + drain of 20,000 (us)", "{:.1f}", False),
    ("cmds_drain", "Redis commands per drained task", "{:.2f}", False),
    ("rt_cmds", "Redis commands per round trip", "{:.2f}", False),
    ("steady1", "steady drain, `--batch-size 1`, 10,000 tasks (tasks/s)", "{:,.0f}", True),
    ("cpu1_us", "Redis CPU per task, submit + drain of 10,000, `--batch-size 1` (us)",
     "{:.1f}", False),
    ("cmds1", "Redis commands per drained task, `--batch-size 1`", "{:.2f}", False),
)


def measure(tree: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=tree, check=True,
                         capture_output=True, text=True, timeout=900).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev", help="the git revision to measure alongside this tree")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--docs", action="store_true",
                    help='rewrite "## Hot path: against REV" in docs/benchmarks.md')
    args = ap.parse_args(argv)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="mtq-rev-") as tmp:
        name = export(args.rev, Path(tmp))
        for tree in (Path(tmp), ROOT):  # as installed (see compile_tree)
            compile_tree(tree)
        runs: dict[str, list[dict[str, float]]] = {"ref": [], "now": []}
        for i in range(args.passes):
            # which tree goes first alternates: a pass's first child meets the machine at
            # another moment than its second (a figure of one tree a pass apart from the
            # other's swung by a third within one run, always the same way)
            order = (("ref", Path(tmp)), ("now", ROOT))
            for which, tree in order if i % 2 == 0 else order[::-1]:
                runs[which].append(measure(tree))
                print(f"pass {i + 1}/{args.passes} {which}: {runs[which][-1]}", flush=True)
    lines = [f"| figure | `{name}` | this tree | this tree / `{name}` (median of the "
             "passes' ratios) |", "|---|---:|---:|---:|"]
    for field, label, fmt, _higher in ROWS:
        ref = statistics.median(r[field] for r in runs["ref"])
        now = statistics.median(r[field] for r in runs["now"])
        ratio = statistics.median(n[field] / r[field] for n, r in zip(runs["now"], runs["ref"])
                                  if r[field])
        lines.append(f"| {label} | {fmt.format(ref)} | {fmt.format(now)} | {ratio:.2f}x |")
    text = "\n".join(lines)
    print(text)
    if args.docs:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True).stdout.strip()
        heading = "## Hot path: against a revision"
        write_docs(ROOT / "docs" / "benchmarks.md", "\n".join([
            heading, "",
            f"{date.today().isoformat()}, `python -m benchmarks.against {args.rev} "
            f"--passes {args.passes} --docs` in {time.time() - started:.0f} s (this tree: "
            f"`{head}` and its working changes). Each tree's own client, worker and "
            "benchmark code; passes alternate between the trees, medians. See the module "
            "docstring.", "", text, ""]), heading=heading)


if __name__ == "__main__":
    main()
