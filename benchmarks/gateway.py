#!/usr/bin/env python
"""Gateway: OpenAI-style streamed chat completions through ``mtq serve``.

    python -m benchmarks.gateway            # ~80 s on 2 cores, writes the gateway block
    python -m benchmarks.gateway --quick    # ~30 s, prints only (add --docs to write)

One ``mtq serve`` process (uvicorn) in front of ``mtq worker run
benchmarks.children.gw_client:GwPaced`` workers, which give one token per running
request per step at a fixed pace, and hold every token until a gate file exists. N
clients (one asyncio process, a raw socket each: the cheapest reader) each ``POST
/v1/chat/completions`` with ``stream: true``; once every stream has its first chunk (its task's id), another process reads
the same tasks with ``Task.aevents()`` (mtq's in-process reader) and then the gate
opens: each token is read by both at once. Per token, the gateway's added latency is
its arrival at the HTTP client less its arrival at the in-process reader. Every
stream must end with ``[DONE]`` and its text equal its task's result. The gateway's
Redis connections (CLIENT LIST, by its client name) are counted with 1, 50 and N
streams open. Then the same with the tokens spread over the step (each stream's
token in one of 10 sub-steps, as streams that did not start in the same instant).
Beside each of those two, the floor: the same streams, pace and client served by
``benchmarks.children.sse_floor``, a bare Starlette SSE app under uvicorn with no mtq
and no Redis, whose tokens are made in its own process; its added latency (HTTP
arrival less the token's hand-over in that process) is what one Python process
writing these chunks costs. Last, the N streams again read by httpx's async client
(what an application would use), whose own CPU on these 2 cores is part of its figure.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import redis

import mtq
from benchmarks import targets
from benchmarks.harness.meters import CpuMeter, commandstats, machine_info, ms_stats, pct
from benchmarks.harness.procs import Proc, wait_for, worker_env
from benchmarks.harness.report import Results, cli_args, write_block
from benchmarks.harness.server import ROOT, Server, free_port, uniq
from benchmarks.web import client as inproc_client
from benchmarks.web import expect
from mtq.workers.registry import list_workers

TARGET = "benchmarks.children.gw_client:GwPaced"
#: the floor: the same streams from a bare Starlette SSE app (no mtq, no Redis)
FLOOR = "benchmarks.children.sse_floor"
#: the gateway's client name in CLIENT LIST (mtq.cli.serve)
GATEWAY_NAME = "mtq-gateway"
#: 2b.: the steps of 2. cut in this many, each stream given a token in one of them
SPREAD = 10


@dataclass(frozen=True)
class Sizes:
    lat_tasks: int       # 1. streams read by both readers, light load
    lat_tokens: int
    lat_step_ms: float
    many: int            # 2. concurrent streams
    many_tokens: int
    many_step_ms: float
    stages: tuple[int, ...]
    workers: int
    quiet_s: float


FULL = Sizes(lat_tasks=8, lat_tokens=200, lat_step_ms=20, many=500, many_tokens=40,
             many_step_ms=100, stages=(1, 50, 500), workers=2, quiet_s=15)
QUICK = Sizes(lat_tasks=8, lat_tokens=60, lat_step_ms=20, many=500, many_tokens=15,
              many_step_ms=100, stages=(1, 50, 500), workers=2, quiet_s=2)


class Gateway:
    """``mtq serve`` on a free port (one uvicorn process)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = Proc(["serve", "--port", str(self.port), "--log-level", "warning"], env)
        wait_for("mtq serve to answer", lambda: _answers(self.base), 30, [self.proc])
        self.ps = psutil.Process(self.proc.proc.pid)

    def conns(self, r: redis.Redis) -> tuple[int, int]:
        """(all, pub/sub) Redis connections of the gateway (CLIENT LIST by name)."""
        mine = [c for c in r.client_list() if c.get("name") == GATEWAY_NAME]
        return len(mine), sum(1 for c in mine if "P" in str(c.get("flags", "")))

    def cpu_s(self) -> float:
        t = self.ps.cpu_times()
        return float(t.user + t.system)

    def stop(self) -> None:
        self.proc.stop(10)
        self.proc.close()


class Floor(Gateway):
    """The floor: ``benchmarks.children.sse_floor`` (a bare Starlette SSE app under
    uvicorn: no mtq, no Redis, its tokens made in-process) on a free port."""

    def __init__(self, env: dict[str, str]) -> None:  # (not Gateway's: another program)
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = Proc([str(self.port)], env, [sys.executable, "-m", FLOOR])
        wait_for("the floor app to answer", lambda: _answers(self.base), 30, [self.proc])
        self.ps = psutil.Process(self.proc.proc.pid)


def _answers(base: str) -> bool:
    try:
        return httpx.get(base + "/v1/models", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def floor_run(n: int, tokens: int, step_ms: float, every: int, tmp: Path,
              env: dict[str, str]) -> tuple[list[float], int, float]:
    """The same streams, pace and client against the floor app: (ms per token, HTTP
    arrival less its push in the app; streams complete with every token; the app's
    CPU s while the tokens flowed)."""
    fl = Floor(env)
    gate = tmp / f"gate-{uuid.uuid4().hex[:8]}"
    out = tmp / f"floor-{uuid.uuid4().hex[:6]}.json"
    prompt = f"n={tokens} step_ms={step_ms:g} every={every} gate={gate}"
    client = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.children.gw_client", "raw", fl.base, "floor",
         prompt, str(n), str(out), str(n)],
        cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        expect(client, f"opened {n}")
        expect(client, "ids")
        cpu0 = fl.cpu_s()
        gate.touch()
        if client.wait(300):
            raise SystemExit(f"the floor's client exited with {client.returncode}")
        cpu = fl.cpu_s() - cpu0
        pushes = httpx.get(fl.base + "/pushes", timeout=30).json()
    finally:
        if client.poll() is None:
            client.kill()
            client.wait(10)
        fl.stop()
    add: list[float] = []
    complete = 0
    for rec in json.loads(out.read_text())["streams"]:
        pushed = {i: ts for i, ts in pushes.get(rec["id"], [])}
        complete += bool(rec["complete"] and [i for i, _, _ in rec["tokens"]]
                         == list(range(tokens)))
        add += [(arr - pushed[i]) * 1000 for i, arr, _ in rec["tokens"] if i in pushed]
    return add, complete, cpu


def floor_rows(res: Results, n: int, tokens: int, step_ms: float, every: int, tmp: Path,
               env: dict[str, str], gwl: list[float], gw_cpu_us: float) -> None:
    """The floor's rows beside the gateway's (section 2 and 2b); ``gwl``: the gateway's
    publish -> HTTP arrival, the like of the floor's push -> HTTP arrival."""
    fadd, complete, cpu = floor_run(n, tokens, step_ms, every, tmp, env)
    if complete != n:
        raise SystemExit(f"the floor app completed {complete} of {n} streams")
    res.add("floor: a bare Starlette/uvicorn SSE app (no mtq, no Redis), the same streams, "
            "pace and client: HTTP arrival - in-process push, p50", pct(fadd, 50), "ms",
            f"{ms_stats(fadd)}; what one Python process writing these chunks adds; the "
            f"gateway's publish -> arrival above it: p50 {pct(gwl, 50) - pct(fadd, 50):+.3f}"
            f" ms, p99 {pct(gwl, 99) - pct(fadd, 99):+.3f} ms (Redis and the reply "
            "subscription included)")
    res.add("  p99", pct(fadd, 99), "ms", f"{complete} of {n} streams complete")
    res.add("  the floor app's CPU per token", cpu / max(len(fadd), 1) * 1e6, "us",
            f"{cpu:.2f} CPU s; mtq serve {gw_cpu_us:.1f} us per token")


@dataclass
class Run:
    gw: list[dict[str, Any]]
    inproc: dict[str, dict[str, Any]]                  # task id -> record
    conns: list[tuple[int, int, int]] = field(default_factory=list)  # (streams, all, pubsub)
    cmds: dict[str, int] = field(default_factory=dict)
    cpu_s: float = 0.0          # the gateway's CPU while the tokens flowed
    client_cpu_s: float = 0.0   # the HTTP client process's CPU, its whole life
    wall_s: float = 0.0


def stream_run(r: redis.Redis, gw: Gateway, q: mtq.Queue, server: Server, n: int,
               tokens: int, step_ms: float, stages: Sequence[int], tmp: Path,
               env: dict[str, str], workers: Sequence[Proc], kind: str = "raw",
               every: int = 1) -> Run:
    gate = tmp / f"gate-{uuid.uuid4().hex[:8]}"
    out = tmp / f"gw-{uuid.uuid4().hex[:6]}.json"
    prompt = f"n={tokens} step_ms={step_ms:g} every={every} gate={gate}"
    gwp = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.children.gw_client", kind, gw.base, q.name, prompt,
         str(n), str(out), ",".join(map(str, stages))],
        cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    procs = [gwp]
    conns: list[tuple[int, int, int]] = []
    try:
        for k, stage in enumerate(stages):
            expect(gwp, f"opened {min(stage, n)}")
            conns.append((min(stage, n), *gw.conns(r)))
            if k < len(stages) - 1:
                assert gwp.stdin is not None
                gwp.stdin.write("next\n")
                gwp.stdin.flush()
        expect(gwp, "ids")
        ids = Path(str(out) + ".ids").read_text().split()
        inp, in_out = inproc_client("inproc", server.url, q.name, ids, (n,), tmp, env)
        procs.append(inp)
        expect(inp, f"opened {n}")
        r.config_resetstat()
        cpu0, t0 = gw.cpu_s(), time.perf_counter()
        gate.touch()
        for p in procs:
            try:
                p.wait(300)
            except subprocess.TimeoutExpired:
                raise SystemExit("a client did not finish its streams in 300 s") from None
            if p.returncode:
                raise SystemExit(f"a client exited with {p.returncode}")
        got = json.loads(out.read_text())
        run = Run(got["streams"],
                  {rec["id"]: rec for rec in json.loads(in_out.read_text())}, conns)
        run.wall_s, run.cpu_s = time.perf_counter() - t0, gw.cpu_s() - cpu0
        run.client_cpu_s = float(got["cpu_s"])
        run.cmds = commandstats(r)
        for w in workers:
            if w.proc.poll() is not None:
                raise w.fail("a worker exited during the run")
        return run
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def check(run: Run, tokens: int) -> tuple[int, int, list[str]]:
    """(streams ended with a finish_reason and [DONE], streams whose tokens are
    gapless and whose text equals the task's result, the first problems)."""
    complete = exact = 0
    problems: list[str] = []
    for rec in run.gw:
        if rec["error"] or not rec["complete"] or rec["done"] is None:
            problems.append(f"{rec['id']}: {rec['error'] or 'no [DONE] or finish_reason'}")
            continue
        complete += 1
        base = run.inproc.get(rec["id"])
        result = json.loads(base["done"]) if base and base["done"] else {}
        text = "".join(t for _, _, t in rec["tokens"])
        indices = [i for i, _, _ in rec["tokens"]]
        if (indices == list(range(tokens)) and result.get("status") == "succeeded"
                and text == result["result"]["text"]):
            exact += 1
        else:
            problems.append(f"{rec['id']}: {len(indices)} tokens, result {result}"[:200])
    return complete, exact, problems[:3]


def added(run: Run) -> tuple[list[float], list[float], list[float]]:
    """ms per token: (in-process publish -> arrival, gateway publish -> arrival,
    gateway arrival - in-process arrival); live tokens only."""
    inproc: list[float] = []
    gwl: list[float] = []
    add: list[float] = []
    for rec in run.gw:
        base = run.inproc.get(rec["id"])
        if base is None:
            continue
        got = {i: (arr, ts) for i, arr, _, ts in base["tokens"]}
        for i, arr, _ in rec["tokens"]:
            if i not in got or got[i][1] <= 0:  # replayed from the stored state
                continue
            in_arr, ts = got[i]
            inproc.append((in_arr - ts) * 1000)
            gwl.append((arr - ts) * 1000)
            add.append((arr - in_arr) * 1000)
    return inproc, gwl, add


def judge(res: Results, label: str, add: list[float], inproc: list[float],
          gwl: list[float]) -> None:
    for name, q_, target in (("p50", 50, targets.GATEWAY_ADDED_MS[0]),
                             ("p99", 99, targets.GATEWAY_ADDED_MS[1])):
        v = pct(add, q_)
        note = res.target(f"{label}: gateway added latency {name} <= {target:g} ms",
                          v <= target, f"{v:.3f} ms over {len(add):,} tokens (in-process "
                          f"{pct(inproc, q_):.3f} ms, gateway {pct(gwl, q_):.3f} ms)")
        res.add(f"added by the gateway: HTTP arrival - in-process arrival, {name}" if q_ == 50
                else f"  {name}", v, "ms", (ms_stats(add) + "; " if q_ == 50 else "") + note)


def bench_added(r: redis.Redis, gw: Gateway, q: mtq.Queue, server: Server, s: Sizes,
                res: Results, tmp: Path, env: dict[str, str], workers: Sequence[Proc]) -> None:
    run = stream_run(r, gw, q, server, s.lat_tasks, s.lat_tokens, s.lat_step_ms,
                     (s.lat_tasks,), tmp, env, workers)
    _, exact, problems = check(run, s.lat_tokens)
    if exact != s.lat_tasks:
        raise SystemExit(f"{exact} of {s.lat_tasks} streams exact: {problems}")
    inproc, gwl, add = added(run)
    res.section = (f"1. added latency, light load: {s.lat_tasks} streams x {s.lat_tokens} "
                   f"tokens, one step every {s.lat_step_ms:g} ms, each token read by both "
                   "readers at once")
    res.add("in-process Task.aevents(), publish -> arrival, p50", pct(inproc, 50), "ms",
            f"baseline; {ms_stats(inproc)}")
    res.add("gateway stream (raw socket), publish -> arrival, p50", pct(gwl, 50), "ms",
            ms_stats(gwl))
    judge(res, f"{s.lat_tasks} streams", add, inproc, gwl)


def bench_many(r: redis.Redis, gw: Gateway, q: mtq.Queue, server: Server, s: Sizes,
               res: Results, tmp: Path, env: dict[str, str], workers: Sequence[Proc]) -> None:
    run = stream_run(r, gw, q, server, s.many, s.many_tokens, s.many_step_ms, s.stages, tmp,
                     env, workers)
    complete, exact, problems = check(run, s.many_tokens)
    inproc, gwl, add = added(run)
    tokens = sum(len(rec["tokens"]) for rec in run.gw)
    res.section = (f"2. {s.many} concurrent streamed chat completions on one mtq serve "
                   f"process: {s.many_tokens} tokens each, one step every "
                   f"{s.many_step_ms:g} ms ({s.many * 1000 / s.many_step_ms:,.0f} tokens/s "
                   "offered), each token read by both readers at once")
    res.add("streams complete (finish_reason, then [DONE])", complete, f"of {s.many}",
            res.target(f"all {s.many} streams complete", complete == s.many,
                       f"{complete} of {s.many}; {problems}", comparable=True))
    res.add("streams gapless, text equal to the task's result", exact, f"of {s.many}",
            res.target("every stream equal to its task's result", exact == s.many,
                       f"{exact} of {s.many} ({tokens:,} tokens)"
                       + (f"; {problems}" if problems else ""), comparable=True))
    res.add(f"in-process Task.aevents() x {s.many} in one process, publish -> arrival, p50",
            pct(inproc, 50), "ms", f"baseline; {ms_stats(inproc)}")
    res.add(f"gateway streams ({s.many} raw sockets in one process), publish -> arrival, p50",
            pct(gwl, 50), "ms", ms_stats(gwl))
    judge(res, f"{s.many} streams", add, inproc, gwl)
    floor_rows(res, s.many, s.many_tokens, s.many_step_ms, 1, tmp, env, gwl,
               run.cpu_s / max(tokens, 1) * 1e6)
    res.add("mtq serve process CPU per token", run.cpu_s / max(tokens, 1) * 1e6, "us",
            f"{run.cpu_s:.2f} CPU s = {run.cpu_s / run.wall_s:.0%} of a core over "
            f"{run.wall_s:.1f} s (gate open -> last stream done); every step hands all "
            f"{s.many} streams a token at once, so the last of them waits about "
            f"{s.many * run.cpu_s / max(tokens, 1) * 1000:.0f} ms of the gateway's CPU for "
            "the others' chunks: the added latency of a burst")
    res.add("  the client process's CPU per token", run.client_cpu_s / max(tokens, 1) * 1e6,
            "us", f"{run.client_cpu_s:.2f} CPU s over its whole life (opening the streams "
            "included); it shares the 2 cores with the gateway, Redis, the workers and the "
            "in-process reader, and its own delay is part of the gateway's added figure")
    (_, first, _), (most, conns, pubsub) = run.conns[0], run.conns[-1]
    opened = ", ".join(f"{c} with {n}" for n, c, _ in run.conns)
    res.add(f"Redis connections of the gateway, {most} streams open", conns, "conns",
            f"{opened} streams open; {pubsub} pub/sub (CLIENT LIST, client name "
            f"{GATEWAY_NAME}); " + res.target(
                "gateway's Redis connections constant in the number of streams",
                conns <= first + 2, f"{opened} streams open", comparable=True))
    per = {k: v / max(tokens, 1) for k, v in run.cmds.items() if k not in ("config", "info")}
    shown = sorted(((k, v) for k, v in per.items() if v >= 0.001), key=lambda kv: -kv[1])
    res.add("Redis commands per streamed token (all processes)", sum(v for _, v in shown),
            "calls", ", ".join(f"{k} {v:.3f}" for k, v in shown)
            + " (INFO commandstats over the token phase; the commands inside the workers' emit "
            "script are counted one by one: a step's tokens of many tasks are one EVALSHA)")


def bench_spread(r: redis.Redis, gw: Gateway, q: mtq.Queue, server: Server, s: Sizes,
                 res: Results, tmp: Path, env: dict[str, str], workers: Sequence[Proc]) -> None:
    every = SPREAD
    run = stream_run(r, gw, q, server, s.many, s.many_tokens, s.many_step_ms / every,
                     (s.many,), tmp, env, workers, every=every)
    complete, exact, problems = check(run, s.many_tokens)
    inproc, gwl, add = added(run)
    res.section = (f"2b. the same {s.many} streams and pace, their tokens spread: a step every "
                   f"{s.many_step_ms / every:g} ms, each stream's token every {every}th step "
                   f"(about {s.many // every // s.workers} streams a step on each of "
                   f"{s.workers} workers)")
    res.add("streams complete and equal to the task's result", exact, f"of {s.many}",
            res.target(f"all {s.many} spread streams complete and exact", exact == s.many,
                       f"{exact} of {s.many}; {complete} complete"
                       + (f"; {problems}" if problems else ""), comparable=True))
    res.add("in-process Task.aevents(), publish -> arrival, p50", pct(inproc, 50), "ms",
            f"baseline; {ms_stats(inproc)}")
    res.add("gateway streams (raw sockets), publish -> arrival, p50", pct(gwl, 50), "ms",
            ms_stats(gwl))
    judge(res, f"{s.many} spread streams", add, inproc, gwl)
    tokens = sum(len(rec["tokens"]) for rec in run.gw)
    floor_rows(res, s.many, s.many_tokens, s.many_step_ms / every, every, tmp, env, gwl,
               run.cpu_s / max(tokens, 1) * 1e6)


def bench_httpx(r: redis.Redis, gw: Gateway, q: mtq.Queue, server: Server, s: Sizes,
                res: Results, tmp: Path, env: dict[str, str], workers: Sequence[Proc]) -> None:
    run = stream_run(r, gw, q, server, s.many, s.many_tokens, s.many_step_ms, (s.many,), tmp,
                     env, workers, kind="httpx")
    complete, exact, problems = check(run, s.many_tokens)
    inproc, gwl, add = added(run)
    tokens = sum(len(rec["tokens"]) for rec in run.gw)
    res.section = (f"3. the same {s.many} streams read by httpx's async client (one process), "
                   "informational: the client's own CPU dominates on 2 shared cores")
    res.add("streams complete and equal to the task's result", exact, f"of {s.many}",
            f"{complete} complete" + (f"; {problems}" if problems else ""))
    res.add("added: httpx arrival - in-process arrival, p50", pct(add, 50), "ms",
            f"{ms_stats(add)}; in-process {ms_stats(inproc)}; httpx, publish -> arrival "
            f"{ms_stats(gwl)}")
    res.add("  the httpx client process's CPU per token", run.client_cpu_s / max(tokens, 1)
            * 1e6, "us", f"{run.client_cpu_s:.2f} CPU s over its whole life; the gateway "
            f"{run.cpu_s / max(tokens, 1) * 1e6:.0f} us per token")
    if exact != s.many:
        raise SystemExit(f"httpx: {exact} of {s.many} streams exact: {problems}")


def main(argv: Sequence[str] | None = None) -> int:
    quick, docs = cli_args(argv, __doc__, "~30 s")
    s = QUICK if quick else FULL
    server = Server()
    server.start()
    tmp = Path(tempfile.mkdtemp(prefix="mtq-bench-gw-"))
    started = time.perf_counter()
    gw: Gateway | None = None
    workers: list[Proc] = []
    try:
        r = server.client()
        r.flushall()
        env = worker_env(server.url, MTQ_HOME=str(tmp / "home"))
        q = mtq.Queue(uniq("gw"), client=r)
        workers = [Proc(["worker", "run", TARGET, "--queue", q.name, "--redis", server.url],
                        env) for _ in range(s.workers)]
        wait_for(f"{s.workers} workers", lambda: len(list_workers(r, q.name)) >= s.workers,
                 60, workers)
        gw = Gateway(env)
        # warm-up: imports, the gateway's reply subscription, the workers' first steps
        stream_run(r, gw, q, server, 20, 10, 10, (20,), tmp, env, workers)
        res = Results()
        steps: list[tuple[str, Callable[[], Any]]] = [
            ("added latency", lambda: bench_added(r, gw, q, server, s, res, tmp, env,
                                                  workers)),
            (f"{s.many} streams", lambda: bench_many(r, gw, q, server, s, res, tmp, env,
                                                     workers)),
            (f"{s.many} spread streams", lambda: bench_spread(r, gw, q, server, s, res, tmp,
                                                              env, workers)),
            (f"{s.many} httpx streams", lambda: bench_httpx(r, gw, q, server, s, res, tmp, env,
                                                            workers)),
        ]
        meter = CpuMeter()
        meter.run(steps, s.quiet_s)
        seconds = time.perf_counter() - started
        import uvicorn

        machine = machine_info(r, f"uvicorn {uvicorn.__version__}, httpx {httpx.__version__}",
                               f"other processes {meter.share():.0%} of the CPU")
        res.print(f"mtq gateway ({'quick' if quick else 'full'} run, {seconds:.0f} s), "
                  f"{machine}")
        if docs is not None:
            command = "python -m benchmarks.gateway" + (" --quick" if quick else "")
            write_block("gateway", res.markdown(), command, machine, seconds, docs)
        return 0
    finally:
        for w in workers:
            w.stop(10)
            w.close()
        if gw is not None:
            gw.stop()
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
