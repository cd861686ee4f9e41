"""Where a round trip's CPU goes, thread by thread (each thread's own CPU clock), over
2,000 round trips of a no-op task on a warm worker (``children/threads_tree.py``);
``--against REV`` measures a git revision's tree in the same run, passes alternating.

    python -m benchmarks.threads                         # this tree
    python -m benchmarks.threads --against 2f99451       # and a revision, 8 passes
    python -m benchmarks.threads --against REV --docs    # writes its block
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

from benchmarks.harness.meters import machine_info, median
from benchmarks.harness.report import write_block
from benchmarks.harness.server import ROOT, compile_tree
from benchmarks.instructions import export

#: run by path in the tree measured (see its docstring); prints one JSON line of figures
CHILD = Path(__file__).resolve().parent / "children" / "threads_tree.py"

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
    out = subprocess.run([sys.executable, "-P", str(CHILD), str(n)], env=env, cwd=tree,
                         check=True, capture_output=True, text=True, timeout=900).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def _med(runs: list[dict[str, float]], field: str) -> float:
    return median([r.get(field, 0.0) for r in runs])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", metavar="REV", help="a git revision to measure alongside")
    ap.add_argument("--passes", type=int, default=8)
    ap.add_argument("-n", type=int, default=2000, help="round trips a pass")
    ap.add_argument("--docs", action="store_true",
                    help="write the threads block of docs/benchmarks.md")
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
        cmd = "python -m benchmarks.threads" + (f" --against {args.against}" if ref else "")
        write_block("threads", text.splitlines(), f"{cmd} --passes {args.passes} --docs",
                    machine_info(), time.time() - started)


if __name__ == "__main__":
    main()
