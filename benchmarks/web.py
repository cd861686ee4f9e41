#!/usr/bin/env python
"""Web (SSE): tokens to an HTTP client through mtq.contrib.asgi.

    python -m benchmarks.web            # ~2 minutes on 2 cores, writes the web block
    python -m benchmarks.web --quick    # ~50 s, prints only (add --docs to write)

One uvicorn process serves benchmarks/children/web_app.py; ``mtq worker run
benchmarks.children.web_client:Paced`` workers give one token per running request per
step at a fixed pace. (1) the latency SSE adds: the same tasks read at once by an SSE
client and by ``Task.aevents()`` in another process, per token; (2) 500 streams on the
one process: all complete, none loses a token, latency against ``Task.aevents()``, the
server's CPU, RSS and Redis connections; (3) the floor: a bare ``StreamingResponse``
of pre-made events read by the same client.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
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
from mtq.workers.registry import list_workers

TARGET = "benchmarks.children.web_client:Paced"


@dataclass(frozen=True)
class Sizes:
    lat_tasks: int       # 1. tasks read by both readers at once
    lat_tokens: int
    lat_step_ms: float
    lat_runs: int
    many: int            # 2. concurrent streams
    many_tokens: int
    many_step_ms: float
    stages: tuple[int, ...]
    workers: int
    bare_tokens: int     # 3.
    quiet_s: float


FULL = Sizes(lat_tasks=8, lat_tokens=200, lat_step_ms=20, lat_runs=3, many=500,
             many_tokens=60, many_step_ms=100, stages=(1, 100, 500), workers=2,
             bare_tokens=200, quiet_s=15)
QUICK = Sizes(lat_tasks=8, lat_tokens=100, lat_step_ms=20, lat_runs=1, many=500,
              many_tokens=30, many_step_ms=100, stages=(1, 100, 500), workers=2,
              bare_tokens=100, quiet_s=2)


# -- the web server ------------------------------------------------------------------
class Uvicorn:
    """``python -m uvicorn benchmarks.children.web_app:app``, one process, on a free port."""

    def __init__(self, env: dict[str, str]) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.name = "mtqbench-web-" + uuid.uuid4().hex[:8]
        self.app = Proc(["benchmarks.children.web_app:app", "--host", "127.0.0.1", "--port",
                         str(self.port), "--log-level", "warning", "--no-access-log",
                         "--timeout-graceful-shutdown", "2"],
                        dict(env, MTQ_BENCH_CLIENT_NAME=self.name),
                        program=(sys.executable, "-m", "uvicorn"))
        self.pid = 0

        def up() -> bool:
            try:
                self.pid = int(httpx.get(self.base + "/healthz", timeout=2).json()["pid"])
            except httpx.TransportError:
                return False
            return True

        wait_for("uvicorn to answer", up, 30, [self.app])
        self.ps = psutil.Process(self.pid)

    def conns(self, r: redis.Redis) -> tuple[int, int]:
        """(all, pub/sub) Redis connections this process holds (CLIENT LIST by name)."""
        mine = [c for c in r.client_list() if c.get("name") == self.name]
        return len(mine), sum(1 for c in mine if "P" in str(c.get("flags", "")))

    def rss_mib(self) -> float:
        return float(self.ps.memory_info().rss) / 2**20

    def cpu_s(self) -> float:
        t = self.ps.cpu_times()
        return float(t.user + t.system)

    def threads_cpu_s(self) -> tuple[float, float]:
        """CPU seconds of (the event loop's thread, every other thread: the reply hub's
        listener, the default executor's)."""
        main = other = 0.0
        for t in self.ps.threads():
            if t.id == self.pid:
                main += t.user_time + t.system_time
            else:
                other += t.user_time + t.system_time
        return main, other

    def stop(self) -> None:
        self.app.stop(10)
        self.app.close()


class Sampler:
    """The server's RSS, sampled every 50 ms in a thread (the peak of a run)."""

    def __init__(self, web: Uvicorn) -> None:
        self.web = web
        self.peak = web.rss_mib()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.peak = max(self.peak, self.web.rss_mib())
            except psutil.Error:
                return

    def stop(self) -> float:
        self._stop.set()
        self._thread.join(2)
        self.peak = max(self.peak, self.web.rss_mib())
        return self.peak


# -- one run: readers open in stages, then the tokens go ------------------------------
@dataclass
class Run:
    recs: dict[str, list[dict[str, Any]]]   # mode -> one record per task
    conns: list[tuple[int, int, int]] = field(default_factory=list)  # (streams, all, pubsub)
    cmds: dict[str, int] = field(default_factory=dict)
    rss: tuple[float, float, float] = (0.0, 0.0, 0.0)  # before, peak, after (MiB)
    cpu_s: float = 0.0      # the server's CPU while the tokens flowed
    loop_cpu_s: float = 0.0  # ... of which its event loop's thread
    wall_s: float = 0.0     # gate open -> every reader done


def client(mode: str, where: str, queue: str, ids: Sequence[str], stages: Sequence[int],
           tmp: Path, env: dict[str, str]) -> tuple[subprocess.Popen[str], Path]:
    ids_file = tmp / f"{mode}-{uuid.uuid4().hex[:6]}.ids"
    ids_file.write_text("\n".join(ids))
    out = tmp / f"{mode}-{uuid.uuid4().hex[:6]}.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.children.web_client", mode, where, queue, str(ids_file),
         str(out), ",".join(map(str, stages))],
        cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return proc, out


def expect(proc: subprocess.Popen[str], what: str, timeout: float = 150) -> None:
    """Wait for the line ``what`` from a client process."""
    assert proc.stdout is not None
    box: list[str] = []
    th = threading.Thread(target=lambda: box.append(proc.stdout.readline()),  # type: ignore[union-attr]
                          daemon=True)
    th.start()
    th.join(timeout)
    if not box or box[0].strip() != what:
        proc.kill()
        raise SystemExit(f"a client did not print {what!r} (got {box!r})")


def stream_run(r: redis.Redis, web: Uvicorn, q: mtq.Queue, server: Server, n: int,
               tokens: int, step_ms: float, modes: Sequence[str], stages: Sequence[int],
               tmp: Path, env: dict[str, str], workers: Sequence[Proc]) -> Run:
    gate = tmp / f"gate-{uuid.uuid4().hex[:8]}"
    tasks = q.submit_many([{"n": tokens, "step_ms": step_ms, "gate": str(gate)}
                           for _ in range(n)])
    ids = [t.id for t in tasks]
    before = web.rss_mib()
    sampler = Sampler(web)
    procs = {m: client(m, web.base if m == "sse" else server.url, q.name, ids, stages, tmp,
                       env) for m in modes}
    run = Run({})
    try:
        for k, stage in enumerate(stages):
            for p, _ in procs.values():
                expect(p, f"opened {min(stage, n)}")
            if "sse" in modes:
                run.conns.append((min(stage, n), *web.conns(r)))
            if k < len(stages) - 1:
                for p, _ in procs.values():
                    assert p.stdin is not None
                    p.stdin.write("next\n")
                    p.stdin.flush()
        r.config_resetstat()
        cpu0, loop0, t0 = web.cpu_s(), web.threads_cpu_s()[0], time.perf_counter()
        gate.touch()
        for p, _ in procs.values():
            try:
                p.wait(300)
            except subprocess.TimeoutExpired:
                raise SystemExit("a client did not finish its streams in 300 s") from None
            if p.returncode:
                raise SystemExit(f"a client exited with {p.returncode}")
        run.wall_s, run.cpu_s = time.perf_counter() - t0, web.cpu_s() - cpu0
        run.loop_cpu_s = web.threads_cpu_s()[0] - loop0
        run.cmds = commandstats(r)
        for w in workers:
            if w.proc.poll() is not None:
                raise w.fail("a worker exited during the run")
        peak = sampler.stop()
        time.sleep(1.0)
        run.rss = (before, peak, web.rss_mib())
        for m, (_, out) in procs.items():
            run.recs[m] = json.loads(out.read_text())
    finally:
        sampler.stop()
        for p, _ in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
    return run


def check(recs: list[dict[str, Any]], tokens: int) -> tuple[int, int, list[str]]:
    """(streams complete and succeeded, streams whose tokens are gapless and equal the
    result, the first problems)."""
    complete = exact = 0
    problems: list[str] = []
    for rec in recs:
        if rec["error"] or rec["done"] is None:
            problems.append(f"{rec['id']}: {rec['error'] or 'no done event'}")
            continue
        done = json.loads(rec["done"])
        if done.get("status") != "succeeded":
            problems.append(f"{rec['id']}: ended {done}")
            continue
        complete += 1
        got = [json.loads(d) for _, _, d, *_ in rec["tokens"]]
        indices = [i for i, *_ in rec["tokens"]]
        if indices == list(range(tokens)) and got == done["result"]:
            exact += 1
        else:
            problems.append(f"{rec['id']}: {len(indices)} tokens, indices "
                            f"{indices[:3]}...{indices[-3:]}, equal to the result: "
                            f"{got == done['result']}")
    return complete, exact, problems[:3]


def stamp_lat(recs: list[dict[str, Any]]) -> list[float]:
    """ms from the worker's stamp (in the token) to the client's arrival."""
    return [(arr - json.loads(d)[1]) * 1000 for rec in recs for _, arr, d, *_ in rec["tokens"]]


# -- 1. added latency ---------------------------------------------------------------
def bench_added(r: redis.Redis, web: Uvicorn, q: mtq.Queue, server: Server, s: Sizes,
                res: Results, tmp: Path, env: dict[str, str], workers: Sequence[Proc]) -> None:
    inproc: list[float] = []
    sse: list[float] = []
    added: list[float] = []
    sse_stamp: list[float] = []
    n_tok = 0
    for _ in range(s.lat_runs):
        run = stream_run(r, web, q, server, s.lat_tasks, s.lat_tokens, s.lat_step_ms,
                         ("sse", "inproc"), (s.lat_tasks,), tmp, env, workers)
        for m in ("sse", "inproc"):
            _, exact, problems = check(run.recs[m], s.lat_tokens)
            if exact != s.lat_tasks:
                raise SystemExit(f"{m}: {exact} of {s.lat_tasks} streams exact: {problems}")
        got = {(rec["id"], i): (arr, ts) for rec in run.recs["inproc"]
               for i, arr, _, ts in rec["tokens"]}
        for rec in run.recs["sse"]:
            for i, arr, _ in rec["tokens"]:
                in_arr, ts = got[(rec["id"], i)]
                if ts <= 0:  # replayed from the stored state, not live
                    continue
                inproc.append((in_arr - ts) * 1000)
                sse.append((arr - ts) * 1000)
                added.append((arr - in_arr) * 1000)
        sse_stamp += stamp_lat(run.recs["sse"])
        n_tok += s.lat_tasks * s.lat_tokens
    res.section = (f"1. added latency: {s.lat_tasks} tasks x {s.lat_tokens} tokens, one step "
                   f"every {s.lat_step_ms:g} ms, x {s.lat_runs} runs, each token read by both "
                   "readers at once")
    res.add("in-process Task.aevents(), publish -> arrival, p50", pct(inproc, 50), "ms",
            f"baseline; {ms_stats(inproc)}")
    res.add("SSE via uvicorn, publish -> arrival, p50", pct(sse, 50), "ms",
            f"{ms_stats(sse)}; {pct(sse, 50) / pct(inproc, 50):.2f}x in-process")
    for label, q_, target in (("p50", 50, targets.SSE_ADDED_MS[0]),
                              ("p99", 99, targets.SSE_ADDED_MS[1])):
        v = pct(added, q_)
        note = res.target(f"SSE added latency {label} <= {target:g} ms", v <= target,
                          f"{v:.3f} ms over {len(added):,} tokens (in-process "
                          f"{pct(inproc, q_):.3f} ms, SSE {pct(sse, q_):.3f} ms)")
        res.add(f"added by SSE: SSE arrival - in-process arrival, {label}" if q_ == 50
                else f"  {label}", v, "ms",
                (ms_stats(added) + "; " if q_ == 50 else "") + note)
    res.add("SSE, worker stamp -> arrival, p99", pct(sse_stamp, 99), "ms",
            f"{ms_stats(sse_stamp)}; the stamp is taken when the step's tokens leave the "
            "handler: it adds the engine and the outlet (a trip at most every 2 ms)")


# -- 2. many streams ----------------------------------------------------------------
def bench_many(r: redis.Redis, web: Uvicorn, q: mtq.Queue, server: Server, s: Sizes,
               res: Results, tmp: Path, env: dict[str, str], workers: Sequence[Proc]) -> None:
    run = stream_run(r, web, q, server, s.many, s.many_tokens, s.many_step_ms, ("sse",),
                     s.stages, tmp, env, workers)
    recs = run.recs["sse"]
    complete, exact, problems = check(recs, s.many_tokens)
    lat = stamp_lat(recs)
    tokens = sum(len(rec["tokens"]) for rec in recs)
    base = stream_run(r, web, q, server, s.many, s.many_tokens, s.many_step_ms, ("inproc",),
                      (s.many,), tmp, env, workers)
    _, b_exact, _ = check(base.recs["inproc"], s.many_tokens)
    b_lat = stamp_lat(base.recs["inproc"])
    b_pub = [(arr - ts) * 1000 for rec in base.recs["inproc"] for _, arr, _, ts in rec["tokens"]]
    b_out = [(ts - json.loads(d)[1]) * 1000 for rec in base.recs["inproc"]
             for _, _, d, ts in rec["tokens"]]
    res.section = (f"2. {s.many} concurrent SSE streams on one uvicorn process: {s.many_tokens} "
                   f"tokens each, one step every {s.many_step_ms:g} ms "
                   f"({s.many * 1000 / s.many_step_ms:,.0f} tokens/s offered)")
    res.add("streams complete (done: succeeded)", complete, f"of {s.many}",
            res.target(f"all {s.many} streams complete", complete == s.many,
                       f"{complete} of {s.many}; {problems}", comparable=True))
    res.add("streams with every token, gapless, equal to the task's result", exact,
            f"of {s.many}", res.target("no token lost", exact == s.many,
                                       f"{exact} of {s.many} streams exact ({tokens:,} tokens)"
                                       + (f"; {problems}" if problems else ""),
                                       comparable=True))
    res.add("in-process Task.aevents() x 500 in one process, stamp -> arrival, p50",
            pct(b_lat, 50), "ms", f"baseline (the same tasks and pace, another run); "
            f"{ms_stats(b_lat)}; of which stamp -> publish (the worker's engine and outlet, "
            f"Redis TIME) p50 {pct(b_out, 50):.1f}, p99 {pct(b_out, 99):.1f} ms and publish -> "
            f"arrival p50 {pct(b_pub, 50):.1f}, p99 {pct(b_pub, 99):.1f} ms; {b_exact} of "
            f"{s.many} exact")
    res.add("SSE clients (one process), worker stamp -> arrival, p50", pct(lat, 50), "ms",
            f"{ms_stats(lat)}; p50 {pct(lat, 50) / pct(b_lat, 50):.2f}x, p99 "
            f"{pct(lat, 99) / pct(b_lat, 99):.2f}x in-process")
    rate = tokens / run.wall_s
    res.add("tokens delivered / s", rate, "tokens/s",
            f"{tokens:,} tokens in {run.wall_s:.2f} s (gate open -> last stream done)")
    res.add("uvicorn process CPU per token", run.cpu_s / tokens * 1e6, "us",
            f"{run.cpu_s:.2f} CPU s = {run.cpu_s / run.wall_s:.0%} of a core while tokens "
            f"flowed; its event loop's thread {run.loop_cpu_s / tokens * 1e6:.0f} us, the "
            "reply hub's listener and the executor's threads the rest (psutil, per thread)")
    before, peak, after = run.rss
    res.add("uvicorn RSS before the streams", before, "MiB", "after a warm-up run")
    res.add("  peak with 500 streams", peak, "MiB",
            f"+{peak - before:.1f} MiB, {(peak - before) * 1024 / s.many:.0f} KiB per stream "
            "(psutil, sampled every 50 ms)")
    res.add("  after they ended", after, "MiB", f"{after - before:+.1f} MiB vs before")
    (_, first, _), (most, conns, pubsub) = run.conns[0], run.conns[-1]
    opened = ", ".join(f"{c} with {n}" for n, c, _ in run.conns)
    res.add(f"Redis connections of the uvicorn process, {most} streams open", conns, "conns",
            f"{opened} streams open; {pubsub} pub/sub (CLIENT LIST by the process's client "
            "name); " + res.target("Redis connections of the server constant in the number "
                                   "of streams", conns <= first + 2, f"{opened} streams open",
                                   comparable=True))
    calls = run.cmds
    per = {k: v / tokens for k, v in calls.items() if k not in ("config", "info")}
    shown = sorted(((k, v) for k, v in per.items() if v >= 0.001), key=lambda kv: -kv[1])
    res.add("Redis commands per streamed token (all processes)", sum(v for _, v in shown),
            "calls", ", ".join(f"{k} {v:.3f}" for k, v in shown)
            + " (INFO commandstats over the token phase; the worker's emit script and its "
            "PUBLISH count, one trip carries a step's tokens of many tasks)")


# -- 3. the floor ----------------------------------------------------------------------
def bench_floor(web: Uvicorn, s: Sizes, res: Results, tmp: Path, env: dict[str, str]) -> None:
    """Pre-made events from a bare StreamingResponse, read by the same raw-socket client."""
    rows = []
    for k, step in ((s.lat_tasks, s.lat_step_ms), (s.many, s.many_step_ms)):
        n = s.bare_tokens if k == s.lat_tasks else s.many_tokens
        out = tmp / f"bare-{k}.json"
        subprocess.run([sys.executable, "-m", "benchmarks.children.web_client", "bare",
                        "127.0.0.1", str(web.port), str(n), str(step), str(k), str(out)],
                       cwd=ROOT, env=env, check=True, timeout=300)
        rows.append((k, n, step, stamp_lat(json.loads(out.read_text()))))
    res.section = ("3. floor: a bare Starlette StreamingResponse of pre-made events (no Redis, "
                   "no mtq), same uvicorn process, same client")
    for k, n, step, lat in rows:
        res.add(f"{k} streams x {n} events, one every {step:g} ms, made -> arrival, p50",
                pct(lat, 50), "ms", ms_stats(lat))


# -- main ------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    quick, docs = cli_args(argv, __doc__, "~50 s")
    s = QUICK if quick else FULL
    server = Server()
    server.start()
    tmp = Path(tempfile.mkdtemp(prefix="mtq-bench-web-"))
    started = time.perf_counter()
    web: Uvicorn | None = None
    workers: list[Proc] = []
    try:
        r = server.client()
        r.flushall()
        env = worker_env(server.url)
        web = Uvicorn(env)
        q = mtq.Queue(uniq("web"), client=r)
        workers = [Proc(["worker", "run", TARGET, "--queue", q.name, "--redis", server.url],
                        env) for _ in range(s.workers)]
        wait_for(f"{s.workers} workers", lambda: len(list_workers(r, q.name)) >= s.workers,
                 60, workers)
        # warm-up: imports, the server's reply subscription, the workers' first steps
        stream_run(r, web, q, server, 20, 10, 10, ("sse", "inproc"), (20,), tmp, env, workers)
        res = Results()
        steps: list[tuple[str, Callable[[], Any]]] = [
            ("added latency", lambda: bench_added(r, web, q, server, s, res, tmp, env,
                                                  workers)),
            (f"{s.many} streams", lambda: bench_many(r, web, q, server, s, res, tmp, env,
                                                     workers)),
            ("floor", lambda: bench_floor(web, s, res, tmp, env)),
        ]
        meter = CpuMeter()
        meter.run(steps, s.quiet_s)
        seconds = time.perf_counter() - started
        import starlette
        import uvicorn

        machine = machine_info(r, f"uvicorn {uvicorn.__version__}, starlette "
                               f"{starlette.__version__}",
                               f"other processes {meter.share():.0%} of the CPU")
        res.print(f"mtq web/SSE ({'quick' if quick else 'full'} run, {seconds:.0f} s), {machine}")
        if docs is not None:
            command = "python -m benchmarks.web" + (" --quick" if quick else "")
            write_block("web", res.markdown(), command, machine, seconds, docs)
        return 0
    finally:
        for w in workers:
            w.stop(10)
            w.close()
        if web is not None:
            web.stop()
        server.stop()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
