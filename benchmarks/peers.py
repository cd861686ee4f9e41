"""mtq side by side with RQ, Celery, Dramatiq, arq and Huey, from one run of the shared
peer harness (``../shared/bench/peers/``: its README says what each figure is and how it
is taken). This script runs the harness (or reads a run's JSON lines) and writes the
``peers`` block of docs/benchmarks.md: for each figure, mtq's value, the best peer's in
the same run, and their ratio.

    python -m benchmarks.peers --run               # setup.sh once, then run_all.sh (PASSES=2)
    python -m benchmarks.peers results.jsonl       # a run already made
    ONLY="huey mtq" python -m benchmarks.peers --run --passes 8 \
        --block peers-huey                         # a subset, more passes, its own block
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness.report import write_block
from benchmarks.harness.server import ROOT, compile_tree

HARNESS = ROOT.parent / "shared" / "bench" / "peers"
WORK = Path(os.environ.get("BENCH_WORK", "/tmp/peerbench"))

#: (figure, measure, field, higher is better, mtq's variant). Peers: every variant of
#: every other system; the best of them is the comparison.
ROWS: list[tuple[str, str, str, bool, str]] = [
    ("enqueue, bulk (tasks/s)", "enqueue", "tasks_per_s", True, "default"),
    ("drain of 5,000 incl. start-up, 1 worker (tasks/s)", "drain", "tasks_per_s", True,
     "default"),
    ("steady drain, 1 worker (tasks/s)", "drain", "steady_tasks_per_s", True, "default"),
    ("steady drain, 1 worker, batch 1000 (tasks/s)", "drain", "steady_tasks_per_s", True,
     "batch1000"),
    ("steady drain, 1 worker, batch 1: one task per call (tasks/s)", "drain",
     "steady_tasks_per_s", True, "batch1"),
    ("round trip submit -> result p50 (ms)", "latency", "p50_ms", False, "default"),
    ("round trip submit -> result p99 (ms)", "latency", "p99_ms", False, "default"),
    ("Redis commands per drained task", "drain", "redis_cmds_per_task", False, "default"),
    ("Redis commands per round trip (idle polling included)", "latency",
     "redis_cmds_per_task", False, "default"),
    ("Redis CPU per drained task (us)", "drain", "redis_cpu_us_per_task", False, "default"),
    ("Redis CPU per drained task, batch 1 (us)", "drain", "redis_cpu_us_per_task", False,
     "batch1"),
    ("worker start-up to first task (s)", "drain", "startup_s", False, "default"),
]


def load(path: Path) -> dict[tuple[str, str, str], dict[str, list[float]]]:
    """(system, variant, measure) -> field -> every repetition's value (1-slot runs)."""
    out: dict[tuple[str, str, str], dict[str, list[float]]] = {}
    for line in path.read_text().splitlines():
        if not line.startswith("{"):
            continue
        row = json.loads(line)
        if row.get("slots", 1) != 1 or "system" not in row:
            continue
        key = (row["system"], row.get("variant", ""), row["measure"])
        fields = out.setdefault(key, {})
        for name, value in row.items():
            if isinstance(value, dict) and "runs" in value:
                fields.setdefault(name, []).extend(value["runs"])
        # the harness's PING round trip just before the measurement: the machine's speed then
        fields.setdefault("ping_rtt_us", []).extend(row.get("ping_rtt_us") or [])
    return out


def table(data: dict[tuple[str, str, str], dict[str, list[float]]]) -> str:
    lines = ["| figure | mtq | best peer in the same run | mtq / best peer | PING at mtq's / "
             "the peer's measurement (us) |", "|---|---:|---|---:|---:|"]
    for label, measure, field, higher, variant in ROWS:
        mine = data.get(("mtq", variant, measure), {}).get(field)
        peers = [(statistics.median(v[field]), system, var)
                 for (system, var, m), v in data.items()
                 if m == measure and system not in ("mtq", "redis-benchmark") and v.get(field)]
        if not mine or not peers:
            continue
        best = max(peers) if higher else min(peers)
        value = statistics.median(mine)
        pings = [data.get(k, {}).get("ping_rtt_us") for k in
                 (("mtq", variant, measure), (best[1], best[2], measure))]
        ping = " / ".join(f"{statistics.median(p):.0f}" if p else "?" for p in pings)
        lines.append(f"| {label} | {_fmt(value)} [{_fmt(min(mine))}-{_fmt(max(mine))}] | "
                     f"{best[1]} {best[2]}: {_fmt(best[0])} | {value / best[0]:.2f}x | {ping} |")
    return "\n".join(lines)


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:.2f}"


def run(passes: int) -> Path:
    # the harness's three venvs (setup.sh makes only those missing): one left from
    # another run (mtq's alone, say) must not stand for all three
    if not all((WORK / "venvs" / v / "bin" / "python").exists() for v in ("peers", "celery", "mtq")):
        subprocess.run([str(HARNESS / "setup.sh"), str(ROOT)], check=True)
    # the harness installs mtq editable (this tree) and runs with PYTHONDONTWRITEBYTECODE=1,
    # while the peers come from wheels pip compiled: mtq's bytecode as installed, too
    compile_tree(ROOT, str(WORK / "venvs" / "mtq" / "bin" / "python"))
    out = WORK / f"results-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    subprocess.run([str(HARNESS / "run_all.sh")], check=True, cwd=ROOT,
                   env={**os.environ, "PASSES": str(passes), "OUT": str(out)})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="?", type=Path, help="a run's JSON lines")
    ap.add_argument("--run", action="store_true", help="run the harness first")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--no-docs", action="store_true")
    ap.add_argument("--block", default="peers",
                    help="the block of docs/benchmarks.md to write (a subset run: its own)")
    args = ap.parse_args(argv)
    if args.run:
        path = run(args.passes)
    elif args.results:
        path = args.results
    else:
        sys.exit("give a run's JSON lines, or --run")
    data = load(path)
    envs = [json.loads(x) for x in path.read_text().splitlines()
            if x.startswith("{") and '"measure": "env"' in x]
    env = envs[0] if envs else {}
    passes = max((len(v.get("tasks_per_s", [])) for k, v in data.items()
                  if k[2] == "drain"), default=0)
    text = table(data)
    print(text)
    if args.no_docs:
        return
    other = {(s, v) for s, v, _ in data if s not in ("mtq", "redis-benchmark")}
    made = f"python -m benchmarks.peers {path.name}" + (
        f" --block {args.block}" if args.block != "peers" else "")
    machine = (f"{env.get('cpu', '')}, {env.get('nproc', '?')} CPUs, Python "
               f"{env.get('python_version', '?')}, redis-server {env.get('redis_server', '?')} "
               "pinned to CPU 0, drivers and workers to CPU 1")
    write_block(args.block, [f"{passes} interleaved passes of `run_all.sh`; peers: "
                             + ", ".join(sorted(f"{s} {v}" for s, v in other)) + ".", "",
                             *text.splitlines()], made, machine)


if __name__ == "__main__":
    main()
