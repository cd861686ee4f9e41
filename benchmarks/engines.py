#!/usr/bin/env python
"""Engines: several models in one worker process, on the CPU.

    python -m benchmarks.engines            # ~2.5 minutes on 2 cores; writes the engines block
    python -m benchmarks.engines --quick    # ~40 s, prints only

Every process runs torch with one intra-op thread (``OMP_NUM_THREADS=1``,
``MKL_NUM_THREADS=1`` in its environment): a torch op runs on the thread that calls
it, so a busy model takes one core, whether it is a process of its own or an engine
(a thread) in a host process. Host processes are started by
``python -m benchmarks.children.host`` (a :class:`~mtq.workers.host.Host` of
:class:`~mtq.workers.worker.Worker` s); the models are benchmarks/children/engines.py's.

1. **a fast model beside a slow one**: the fast model is the reference TinyGPT
   (``FastGPT``: the streaming benchmarks' shape, float64), one greedy request of 32
   tokens at a time; the slow one (``Slow``) runs batches of 12 products of 1024 x
   1024 float32 matrices (~0.2 s each, the GIL released in each product), kept busy
   by two clients. The fast model's time to first token and request latency (submit
   to result, as a client sees them) p50/p99: (a) alone in its own process (``mtq
   worker run``: one model per process, the baseline), (b) with the slow model busy
   in a separate process, (c) with the slow model busy as another engine of the same
   process. Configurations in turns, each turn in a rotated order, so that a change of
   load hits all three. Target: (c) within 1.2x of (a), p99; (b) is the floor (the
   same contention from separate processes). The fast model's tokens in (c) must
   equal those in (a);
2. **LRU under a budget**: three models (``Weights``, 32 MiB each, loaded on demand)
   in a host process with ``max_loaded=2``, two clients cycling them: loads,
   evictions, the wait of tasks that paid a load against those that did not, nothing
   lost;
3. **commands under load**: unload, load, reload with new options, reset, and a
   code reload of a batch model, and unload --now, load, reset of a generator, in a
   host process, while tasks stream in: the time each took, 0 lost, 0 run twice
   (completions counted per task id from the models' run log).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import engine_parts as parts
from benchmarks.harness.meters import CpuMeter, machine_info, torch_info
from benchmarks.harness.report import Results, cli_parser, docs_of, write_block
from benchmarks.harness.server import Server, compile_tree


@dataclass(frozen=True)
class Sizes:
    requests: int     # fast requests per configuration per turn
    turns: int        # turns of the three configurations
    lru_tasks: int    # tasks of the LRU workload (two clients)
    rounds: int       # rounds of the command sequence
    quiet_s: float    # longest wait for a quiet machine before each step


FULL = Sizes(requests=50, turns=6, lru_tasks=240, rounds=3, quiet_s=10)
QUICK = Sizes(requests=25, turns=1, lru_tasks=60, rounds=1, quiet_s=1)

PARTS = ("two", "lru", "commands")


def run(quick: bool, only: Sequence[str], res: Results) -> dict[str, Any]:
    s = QUICK if quick else FULL
    compile_tree()
    tmp = Path(tempfile.mkdtemp(prefix="mtq-bench-engines-"))
    server = Server()
    server.start()
    out: dict[str, Any] = {"quick": quick}
    started = time.perf_counter()
    try:
        env = parts.bench_env(server.url, tmp)
        r = server.client()
        r.flushall()
        meter = CpuMeter()
        steps = {
            "two": ("a fast model beside a slow one",
                    lambda: parts.bench_two(server, r, env, s.requests, s.turns, s.quiet_s,
                                            res, out)),
            "lru": ("LRU under a budget",
                    lambda: parts.bench_lru(server, r, env, s.lru_tasks, res, out)),
            "commands": ("commands under load",
                         lambda: parts.bench_commands(server, r, env, s.rounds, res, out)),
        }
        meter.run([steps[k] for k in PARTS if k in only], s.quiet_s)
        out["seconds"] = time.perf_counter() - started
        out["other_processes_cpu"] = meter.share()
        out["machine"] = machine_info(r, torch_info(), "1 intra-op thread per process",
                                      f"other processes {meter.share():.0%} of the CPU")
        return out
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.update(parts.THREADS)  # this process's torch too (torch_info)
    ap = cli_parser(__doc__, "~40 s")
    ap.add_argument("--json", type=Path, default=None, help="write the figures there")
    ap.add_argument("--only", choices=PARTS, action="append",
                    help="run only these parts (repeatable); the docs block is written "
                         "only by a run of all three")
    args = ap.parse_args(argv)
    only = args.only or list(PARTS)
    docs = docs_of(args) if len(only) == len(PARTS) else None
    res = Results(unjudged=args.quick)
    out = run(args.quick, only, res)
    res.print(f"mtq engines ({'quick' if args.quick else 'full'} run, {out['seconds']:.0f} s), "
              f"{out['machine']}")
    if args.json:
        out["rows"] = [vars(row) for row in res.rows]
        out["targets"] = res.targets
        args.json.write_text(json.dumps(out, indent=1, default=str))
    if docs is not None:
        command = "python -m benchmarks.engines" + (" --quick" if args.quick else "")
        write_block("engines", res.markdown(), command, out["machine"], out["seconds"], docs)
    # exit 1 when what is wrong is not a time: outputs differ, a task lost or run twice
    wrong = [what for what, met, _ in res.targets if met is False and " p99 " not in what]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
