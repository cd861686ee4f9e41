"""The hot path of this tree next to a git revision's, in one run: the drains, the round
trip and their Redis figures of each tree's own ``benchmarks.hotpath``
(``children/hotpath_tree.py`` runs it with the tree first on the import path), passes
alternating between the trees and which goes first. Timings here swing 2-4x within
minutes, so the table gives medians and the median of the per-pass ratios.

    python -m benchmarks.against REV              # 3 passes, prints
    python -m benchmarks.against REV --docs       # and writes the against block
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness.meters import machine_info, median, paired_ratio
from benchmarks.harness.report import write_block
from benchmarks.harness.server import ROOT, compile_tree
from benchmarks.instructions import export

#: run by path in the tree measured (see its docstring); prints one JSON line of figures
CHILD = Path(__file__).resolve().parent / "children" / "hotpath_tree.py"

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
    ("steady1", "steady drain, `--max-batch-size 1`, 10,000 tasks (tasks/s)", "{:,.0f}", True),
    ("cpu1_us", "Redis CPU per task, submit + drain of 10,000, `--max-batch-size 1` (us)",
     "{:.1f}", False),
    ("cmds1", "Redis commands per drained task, `--max-batch-size 1`", "{:.2f}", False),
)


def measure(tree: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    out = subprocess.run([sys.executable, "-P", str(CHILD)], env=env, cwd=tree, check=True,
                         capture_output=True, text=True, timeout=900).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev", help="the git revision to measure alongside this tree")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--docs", action="store_true",
                    help="write the against block of docs/benchmarks.md")
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
        ref = median([r[field] for r in runs["ref"]])
        now = median([r[field] for r in runs["now"]])
        ratio = paired_ratio([n[field] for n in runs["now"]], [r[field] for r in runs["ref"]])
        lines.append(f"| {label} | {fmt.format(ref)} | {fmt.format(now)} | {ratio:.2f}x |")
    print("\n".join(lines))
    if args.docs:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True).stdout.strip()
        write_block("against", lines, f"python -m benchmarks.against {args.rev} --passes "
                    f"{args.passes} --docs", machine_info(None, f"this tree `{head}`"),
                    time.time() - started)


if __name__ == "__main__":
    main()
