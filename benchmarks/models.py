#!/usr/bin/env python
"""Real models: the Hugging Face backends and out-of-memory handling, in one run.

    python -m benchmarks.models            # ~5 minutes on 2 cores; writes the models block
    python -m benchmarks.models --quick    # ~2 minutes, prints only

Each figure beside its baseline from the same run:

1. ``hf:Embedder`` (MiniLM, batch 32) through the queue against the same model called
   directly with batches of 32 (benchmarks/hf_embed.py): target >= 95 %;
2. ``hf:CausalLM`` (benchmarks/causal.py): continuous against static batching on a
   mixed short/long workload, with the model's own ceiling; tokens delivered to
   clients against the raw decode rate at 8 running requests (target >= 95 %); token
   latency p50/p99 and time to first token;
3. good-task throughput while one task in every 50 runs out of memory, against the
   same work with none (benchmarks/oom.py): target >= 80 %.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import causal, hf_embed, oom, targets
from benchmarks.harness.meters import machine_info, torch_info
from benchmarks.harness.report import Results, cli_parser, docs_of, write_block

#: the targets of the figures judged here
EMBED_TARGET = targets.HF_EMBEDDER
OOM_TARGET = oom.TARGET


def bench_embed(res: Results, quick: bool, out: dict[str, Any]) -> None:
    res.section = "hf:Embedder (MiniLM-L6, float32, batch 32): through the queue vs direct"
    e = hf_embed.run(n=160 if quick else 320, pairs=2 if quick else 5)
    out["embed"] = e
    res.add("called directly, batches of 32", e["direct"], "sentences/s")
    res.add("through the queue (a worker process, 1 thread)", e["queue"], "sentences/s",
            f"other processes took at most {e['foreign']:.0%} of the machine in a pair kept")
    res.add("  through the queue / direct (median of paired turns)", 100 * e["ratio"], "%",
            f"target >= {100 * EMBED_TARGET:.0f} %")
    res.target(f"hf:Embedder through the queue >= {100 * EMBED_TARGET:.0f} % of direct",
               e["ratio"] >= EMBED_TARGET, f"{100 * e['ratio']:.1f} %")


def bench_oom(res: Results, quick: bool, out: dict[str, Any]) -> None:
    res.section = "out of memory: one task in 50 raises torch.OutOfMemoryError"
    o = oom.run(good=3000 if quick else 8000, turns=2 if quick else 3)
    out["oom"] = {k: v for k, v in o.items() if k != "turns"}
    res.add("good tasks/s, no task runs out of memory", o["clean_per_s"], "tasks/s",
            "a torch MLP, ~4 ms a batch of 32")
    res.add("good tasks/s, one in 50 runs out of memory (3 retries each)",
            o["poisoned_per_s"], "tasks/s")
    res.add("  with / without", 100 * o["ratio"], "%", f"target >= {100 * OOM_TARGET:.0f} %")
    res.add("  worker CPU per good task, without / with", 100 * o["cpu_ratio"], "%",
            "less moved by other processes than wall-clock time")
    res.target(f"good-task throughput with OOMs >= {100 * OOM_TARGET:.0f} % of without",
               o["ratio"] >= OOM_TARGET, f"{100 * o['ratio']:.1f} %")


def main(argv: Sequence[str] | None = None) -> int:
    ap = cli_parser(__doc__, "~3 minutes")
    ap.add_argument("--json", type=Path, default=None, help="write the figures there")
    ap.add_argument("--only", choices=("embed", "causal", "oom"), action="append",
                    help="run only these parts (repeatable); the docs block is written "
                         "only by a run of all three")
    args = ap.parse_args(argv)
    parts = args.only or ["embed", "causal", "oom"]
    docs = docs_of(args) if len(parts) == 3 else None
    res = Results(unjudged=args.quick)
    out: dict[str, Any] = {}
    started = time.perf_counter()
    if "embed" in parts:
        bench_embed(res, args.quick, out)
    if "causal" in parts:
        c = causal.run(args.quick, res)
        out["causal"] = {k: v for k, v in c.items() if k != "table"}
    if "oom" in parts:
        bench_oom(res, args.quick, out)
    seconds = time.perf_counter() - started
    machine = machine_info(None, torch_info())
    res.print(f"mtq models ({'quick' if args.quick else 'full'} run, {seconds:.0f} s), {machine}")
    if args.json:
        out["rows"] = [vars(row) for row in res.rows]
        out["targets"] = res.targets
        args.json.write_text(json.dumps(out, indent=1, default=str))
    if docs is not None:
        command = "python -m benchmarks.models" + (" --quick" if args.quick else "")
        write_block("models", res.markdown(), command, machine, seconds, docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
