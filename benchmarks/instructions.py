"""Redis's own work per task in CPU instructions: redis-server under valgrind's callgrind,
counted only while the measured loop runs (``children/callgrind_tree.py``). The counts
repeat to about 0.1 %, so two trees compare where timings cannot: 5,000 tasks submitted
with ``submit_many``; 3,200 claimed and acked in batches of 64; 200 round trips of one
task; 200 round trips to a sleeping worker.

    python -m benchmarks.instructions                   # this tree, prints
    python -m benchmarks.instructions --against HEAD~3  # and another revision (git archive)
    python -m benchmarks.instructions --against REV --docs   # writes its block

Needs ``valgrind``; the redis-server is the embedded one or ``$MTQ_BENCH_REDIS_SERVER``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.harness.meters import machine_info
from benchmarks.harness.report import write_block
from benchmarks.harness.server import ROOT, callgrind_total

#: run by path with the measured tree first on PYTHONPATH (see its docstring)
CHILD = Path(__file__).resolve().parent / "children" / "callgrind_tree.py"

CASES = (("submitted task (submit_many of 1,000)", "submit", 5000),
         ("drained task (batch 64)", "drain", 3200), ("round trip (one task)", "roundtrip", 200),
         ("round trip to a sleeping worker (one task)", "sleeping", 200))


def count(tree: Path, what: str, n: int) -> float:
    """redis-server instructions per unit of one case of ``children/callgrind_tree.py``
    (``n`` units), with mtq imported from ``tree``."""
    with tempfile.TemporaryDirectory(prefix="mtq-cg-") as tmp:
        dump = Path(tmp) / f"{what}.out"
        env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
        subprocess.run([sys.executable, "-P", str(CHILD), what, str(dump), str(n)], env=env,
                       check=True, cwd=tmp, timeout=900)
        return callgrind_total(dump) / n


def measure(tree: Path) -> dict[str, float]:
    """Instructions per unit for each case, with mtq imported from ``tree``."""
    return {label: count(tree, what, n) for label, what, n in CASES}


def have_valgrind() -> bool:
    return bool(shutil.which("valgrind") and shutil.which("callgrind_control"))


def export(rev: str, into: Path) -> str:
    """The tree of ``rev`` under ``into``; returns its short commit id."""
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    archive = subprocess.run(["git", "archive", sha], cwd=ROOT, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return sha


def table(now: dict[str, float], ref: dict[str, float] | None, ref_name: str) -> str:
    if ref is None:
        rows = ["| redis-server instructions per | this tree |", "|---|---:|"]
        rows += [f"| {label} | {now[label]:,.0f} |" for label, _, _ in CASES]
    else:
        rows = [f"| redis-server instructions per | {ref_name} | this tree | change |",
                "|---|---:|---:|---:|"]
        rows += [f"| {label} | {ref[label]:,.0f} | {now[label]:,.0f} | "
                 f"{100 * (now[label] / ref[label] - 1):+.1f} % |" for label, _, _ in CASES]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", metavar="REV", help="a git revision to measure alongside")
    ap.add_argument("--docs", action="store_true",
                    help="write the instructions block of docs/benchmarks.md")
    args = ap.parse_args(argv)
    if not have_valgrind():
        raise SystemExit("valgrind is not installed (Debian: apt-get install valgrind)")
    ref, ref_name = None, ""
    if args.against:
        with tempfile.TemporaryDirectory(prefix="mtq-rev-") as tmp:
            ref_name = f"`{export(args.against, Path(tmp))}`"
            ref = measure(Path(tmp))
    now = measure(ROOT)
    text = table(now, ref, ref_name)
    print(text)
    if args.docs:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True).stdout.strip()
        cmd = "python -m benchmarks.instructions" + (f" --against {args.against}"
                                                     if args.against else "") + " --docs"
        write_block("instructions", text.splitlines(), cmd,
                    machine_info(None, f"this tree `{head}`"))


if __name__ == "__main__":
    main()
