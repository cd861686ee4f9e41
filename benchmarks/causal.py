#!/usr/bin/env python
"""hf:CausalLM served through the queue, against the model called directly.

    python -m benchmarks.causal            # ~3 minutes on 2 cores
    python -m benchmarks.causal --quick    # ~1 minute

The model: a Llama of 4 layers of width 256 (2.5 M parameters, context 1024) with
random weights and the byte-level BPE tokenizer of tests/hf_causal.py, loaded from a
temporary folder by ``--set model=FOLDER``, float32, one thread per process, on the CPU.
Everything in one run, each figure beside its baseline from the same run:

1. continuous against static batching (``--set continuous=false``) on a mixed
   workload (three in four requests of 8 tokens, one in four of 128, max_running 16,
   submitted at once), and the same schedules run in one process without a queue
   (``benchmarks.children.gen.schedule_rate``): the model's own ceiling;
2. tokens/s delivered to 8 reader threads (``Task.events``) against the raw decode
   rate of 8 running requests (``mtq.reference.gpt.decode_rate`` on the backend's
   prefill/decode, in a process with the worker's thread settings): target >= 95 %;
3. token latency (publish -> receipt) p50/p99 and time to first token (submit ->
   receipt of token 0, 8 requests submitted at once) from the runs of 2.

:func:`run` returns the figures as a dict (benchmarks/models.py calls it); ``main``
prints the table. The streaming helpers are benchmarks/streaming.py's.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

import mtq
from benchmarks import targets
from benchmarks.children.gen import RawDecoder
from benchmarks.harness.meters import CpuMeter, machine_info, median, ms_stats, pct, torch_info
from benchmarks.harness.procs import Proc, worker_env
from benchmarks.harness.report import Results, cli_args
from benchmarks.harness.server import Server, compile_tree, uniq
from benchmarks.harness.streams import Stream, read_requests, wait_ready, worker_entry
from benchmarks.streaming import (
    PROMPT,
    THREADS,
    Run,
    mixed_payloads,
    mixed_run,
    runs_of,
    stream_run,
)

#: the benchmark model (tests.hf_causal.build's arguments)
MODEL = {"width": 256, "layers": 4, "context": 1024}
#: the worker's --set options besides the model
OPTIONS = {"dtype": "float32", "max_running": "16"}
#: the payload field that keeps a request running to its max_tokens
NO_EOS = {"ignore_eos": True}
TARGET = "hf:CausalLM"


@dataclass(frozen=True)
class Sizes:
    max_tokens: int   # tokens per request in 2./3.
    start: int        # the steady window opens at this token index
    reps8: int        # (raw, served) turns at 8 requests
    mixed_n: int      # requests of the mixed workload
    mixed_reps: int   # (continuous, static) turns
    quiet_s: float    # longest wait for a quiet machine before each step


FULL = Sizes(max_tokens=200, start=20, reps8=5, mixed_n=64, mixed_reps=3, quiet_s=10)
QUICK = Sizes(max_tokens=120, start=10, reps8=2, mixed_n=32, mixed_reps=1, quiet_s=1)


def causal_tokens(result: Any) -> int:
    return int(result["usage"]["completion_tokens"])


def build_model(root: Path) -> Path:
    """The benchmark model's folder under ``root`` (built there once)."""
    from tests.hf_causal import build

    return build(root, width=MODEL["width"], layers=MODEL["layers"], context=MODEL["context"])


def parameters(folder: Path) -> int:
    """The parameters of a model saved in ``folder`` (its safetensors)."""
    from math import prod

    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "np") as f:
        return sum(prod(f.get_slice(k).get_shape()) for k in f.keys())


def start_worker(server: Server, queue: str, model: Path, env: dict[str, str],
                 **options: str) -> Proc:
    sets = [x for k, v in {"model": str(model), **OPTIONS, **options}.items()
            for x in ("--set", f"{k}={v}")]
    return Proc(["worker", "run", TARGET, "--queue", queue, "--redis", server.url, *sets], env)


# -- 2./3. token streams -------------------------------------------------------------
def bench_streams(server: Server, r: redis.Redis, s: Sizes, res: Results, env: dict[str, str],
                  raw: RawDecoder, model: Path, out: dict[str, Any]) -> None:
    q = mtq.Queue(uniq("causal"), client=r)
    steps = s.max_tokens - 1 - s.start
    proc = start_worker(server, q.name, model, env)
    runs: list[Run] = []
    raws: list[float] = []
    streams: list[Stream] = []
    try:
        wait_ready(r, [(proc, q.name)])
        read_requests(q, [{"prompt": PROMPT, "max_tokens": 2 * s.start + 2, **NO_EOS}] * 8,
                      proc)  # warm-up
        before = worker_entry(r, q.name, proc)
        for _ in range(s.reps8):  # in turns, so that a change of load hits both
            raw0 = raw.rate(8, steps, PROMPT)
            runs.append(stream_run(r, q, 8, s.max_tokens, s.start, proc, NO_EOS, streams))
            raws.append((raw0 + raw.rate(8, steps, PROMPT)) / 2)
        after = worker_entry(r, q.name, proc)
        proc.stop()
    finally:
        proc.close()
        r.flushdb()
    rate, raw_rate = median([x.rate for x in runs]), median(raws)
    ratios = [x.rate / rw for x, rw in zip(runs, raws)]
    k = median(ratios)
    work = {key: float(after[key]) - float(before[key]) for key in ("predict_s", "batches")}
    res.section = (f"2. delivered tokens/s vs raw decode, 8 requests (window: token {s.start} -> "
                   f"the first request's last, {steps} steps)")
    res.add("raw decode_rate(CausalLM, 8), 1 thread", raw_rate, "tokens/s",
            f"baseline; {8 / raw_rate * 1000:.2f} ms/step; {runs_of(raws)}")
    res.add("delivered to 8 reader threads", rate, "tokens/s",
            f"{k:.1%} of raw (paired, {min(ratios):.0%}-{max(ratios):.0%}); "
            + res.target(f"hf:CausalLM delivered >= {targets.DELIVERED:.0%} of the raw decode "
                         "rate at 8 running", k >= targets.DELIVERED,
                         f"{k:.1%}: {rate:,.0f} vs {raw_rate:,.0f} tokens/s"))
    res.add("  worker: model thread in prefill/decode per step",
            work["predict_s"] / max(work["batches"], 1) * 1000, "ms",
            f"raw {8 / raw_rate * 1000:.2f} ms; {work['batches']:.0f} steps (worker registry)")
    lat = [v for x in runs for v in x.lat_ms]
    ttft = [(x.tokens[0][2] - x.submitted) * 1000 for x in streams if x.tokens]
    res.section = "3. token latency and time to first token (the runs of 2.)"
    res.add("token latency, publish -> Task.events(), p50", pct(lat, 50), "ms",
            f"{ms_stats(lat)}; {len(lat):,} live tokens")
    res.add("  p99", pct(lat, 99), "ms", f"max {max(lat):.2f} ms")
    res.add("time to first token, submit -> token 0 received, p50", pct(ttft, 50), "ms",
            f"8 requests submitted at once, prefilled together; {ms_stats(ttft)}")
    res.add("  p99", pct(ttft, 99), "ms", "")
    out.update(raw_decode_tps=raw_rate, delivered_tps=rate, delivered_ratio=k,
               delivered_target=targets.DELIVERED, delivered_met=k >= targets.DELIVERED,
               token_latency_ms={"p50": pct(lat, 50), "p99": pct(lat, 99)},
               ttft_ms={"p50": pct(ttft, 50), "p99": pct(ttft, 99)},
               step_ms=work["predict_s"] / max(work["batches"], 1) * 1000)


# -- 1. continuous vs static ---------------------------------------------------------------
def bench_mixed(server: Server, r: redis.Redis, s: Sizes, res: Results, env: dict[str, str],
                raw: RawDecoder, model: Path, out: dict[str, Any]) -> None:
    names = {"c": uniq("cont"), "s": uniq("static")}
    procs = {"c": start_worker(server, names["c"], model, env),
             "s": start_worker(server, names["s"], model, env, continuous="false")}
    queues = {k: mtq.Queue(n, client=r) for k, n in names.items()}
    payloads = mixed_payloads(s.mixed_n, extra=NO_EOS)
    served: dict[str, list[tuple[float, float, float]]] = {"c": [], "s": []}
    alone: dict[str, list[float]] = {"c": [], "s": []}
    try:
        wait_ready(r, [(procs[k], names[k]) for k in names])
        for k in names:  # warm-up
            mixed_run(queues[k], mixed_payloads(16, seed=3, extra=NO_EOS), procs[k],
                      causal_tokens)
        for _ in range(s.mixed_reps):  # in turns, so that a change of load hits all four
            for k in names:
                served[k].append(mixed_run(queues[k], payloads, procs[k], causal_tokens))
            for k in names:
                raw.ask_mixed(payloads, k == "c")
                alone[k].append(raw.rate())
        for p in procs.values():
            p.stop()
    finally:
        for p in procs.values():
            p.close()
        r.flushdb()
    n_long = s.mixed_n // 4
    res.section = (f"1. continuous vs static batching: {s.mixed_n} requests ({s.mixed_n - n_long}"
                   f" x 8 tokens, {n_long} x 128, shuffled), max_running 16, submitted at once")
    cont, stat = (median([x[0] for x in served[k]]) for k in ("c", "s"))
    ceil_c, ceil_s = median(alone["c"]), median(alone["s"])
    ceiling = median([c / st for c, st in zip(alone["c"], alone["s"])])
    for k, label in (("s", "static batching (--set continuous=false)"),
                     ("c", "continuous batching")):
        v = cont if k == "c" else stat
        kept = median([x[0] / a for x, a in zip(served[k], alone[k])])
        res.add(label, v, "tokens/s",
                (f"{cont / stat:.2f}x static; " if k == "c" else "baseline; ")
                + f"{kept:.0%} of the same schedule without a queue (paired); mean latency "
                f"{median([x[1] for x in served[k]]):.2f} s (8-token requests "
                f"{median([x[2] for x in served[k]]):.2f} s); "
                f"{runs_of([x[0] for x in served[k]])}")
    for k, label in (("s", "static"), ("c", "continuous")):
        res.add(f"  {label}, the same schedule in one process without a queue",
                median(alone[k]), "tokens/s", "the model's own ceiling: schedule_rate, the "
                f"backend's prefill/decode called directly; {runs_of(alone[k])}")
    res.add("  the model's own continuous / static ratio (no queue)", ceiling, "x",
            f"served: {cont / stat:.2f}x")
    out.update(continuous_tps=cont, static_tps=stat, continuous_over_static=cont / stat,
               ceiling_continuous_tps=ceil_c, ceiling_static_tps=ceil_s,
               ceiling_ratio=ceiling,
               mean_latency_s={k: median([x[1] for x in served[k]]) for k in ("c", "s")},
               short_latency_s={k: median([x[2] for x in served[k]]) for k in ("c", "s")})


# -- the run ---------------------------------------------------------------------------------
def run(quick: bool = False, res: Results | None = None) -> dict[str, Any]:
    """Every figure of this benchmark in one run (see the module doc), as a dict:
    tokens/s continuous, static and their ceilings; delivered vs raw decode at 8
    running; token latency and time to first token (ms); the machine and its load.
    ``res``: the table to add the rows to (a new one by default; ``"table"`` in the
    dict)."""
    s = QUICK if quick else FULL
    res = res if res is not None else Results(unjudged=quick)
    compile_tree()
    tmp = Path(tempfile.mkdtemp(prefix="mtq-bench-causal-"))
    server = Server()
    server.start()
    raw: RawDecoder | None = None
    started = time.perf_counter()
    out: dict[str, Any] = {"target": TARGET, "quick": quick}
    try:
        model = build_model(tmp)
        out["model"] = {**MODEL, **OPTIONS, "params": parameters(model)}
        env = worker_env(server.url, TRANSFORMERS_VERBOSITY="error", **THREADS)
        raw = RawDecoder(env, ["target", TARGET, json.dumps({"model": str(model), **OPTIONS}),
                               json.dumps(NO_EOS)])
        r = server.client()
        r.flushall()
        meter = CpuMeter()
        meter.run([
            ("mixed workload", lambda: bench_mixed(server, r, s, res, env, raw, model, out)),
            ("token streams", lambda: bench_streams(server, r, s, res, env, raw, model, out)),
        ], s.quiet_s)
        out["seconds"] = time.perf_counter() - started
        out["machine"] = machine_info(r, torch_info(),
                                      f"other processes {meter.share():.0%} of the CPU")
        out["other_processes_cpu"] = meter.share()
        out["table"] = res
        return out
    finally:
        if raw is not None:
            raw.close()
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    quick, _docs = cli_args(argv, __doc__, "~1 minute")
    out = run(quick)
    out["table"].print(f"mtq hf:CausalLM ({'quick' if quick else 'full'} run, "
                       f"{out['seconds']:.0f} s), {out['machine']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
