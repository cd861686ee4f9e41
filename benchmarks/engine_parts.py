"""The parts of benchmarks/engines.py (its docstring says what each measures), and the
helpers the engine tests that start processes share with it: host processes, engine
commands with their answers, the models' run log."""

from __future__ import annotations

import collections
import itertools
import json
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

import mtq
from benchmarks import targets
from benchmarks.children.engines import RUNLOG
from benchmarks.harness.meters import cpu_mark, foreign, median, our_cpu, pct, wait_quiet
from benchmarks.harness.procs import Proc, wait_for, worker_env
from benchmarks.harness.report import Results
from benchmarks.harness.server import Server, uniq
from benchmarks.harness.streams import wait_ready
from mtq.broker import answers
from mtq.broker.keys import QueueKeys
from mtq.trace import parse_record

FAST = "benchmarks.children.engines:FastGPT"
SLOW = "benchmarks.children.engines:Slow"
WEIGHTS = "benchmarks.children.engines:Weights"
#: one intra-op thread per process, in every configuration (the workers and hosts
#: inherit it; so does this process)
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
HOST = (sys.executable, "-m", "benchmarks.children.host")
#: the fast model's requests: greedy, 32 tokens, prompts of 6 to 60 bytes
TOKENS = 32
PROMPTS = ["Hello.", "It is a truth universally acknowledged",
           "The weather in Oslo today", "Once upon a time, in a small village by the sea,",
           "She said", "A queue of tasks for a model on a device, served in batches",
           "Numbers: 1 2 3 4 5", "Why?"]


def bench_env(url: str, tmp: Path) -> dict[str, str]:
    """The environment of every process of the benchmark: one torch thread, the run
    log, the fast model's random reference weights (made here, in ``tmp``)."""
    from benchmarks.children.gen import BENCH
    from mtq.reference.gpt import make_weights

    weights = make_weights(tmp / "tinygpt.pt", BENCH)
    return worker_env(url, **THREADS, **{RUNLOG: str(tmp / "runlog.txt")},
                      MTQ_REFERENCE_WEIGHTS=str(weights))


# -- processes and commands -------------------------------------------------------------
def start_host(url: str, env: dict[str, str], engines: list[dict[str, Any]],
               **limits: Any) -> Proc:
    """A host process (benchmarks.children.host) serving ``engines``."""
    return Proc([json.dumps({"url": url, "engines": engines, **limits})], env, program=HOST)


def start_worker(url: str, env: dict[str, str], target: str, queue: str) -> Proc:
    """``mtq worker run TARGET``: one model in its own process."""
    return Proc(["worker", "run", target, "--queue", queue, "--redis", url], env)


def command(r: redis.Redis, queue: str, cmd: str, timeout_s: float = 120, **fields: Any
            ) -> tuple[dict[str, Any], float]:
    """Publish engine command ``cmd`` to ``queue``'s engines and wait for one answer;
    returns (the answer, seconds from publish to answer)."""
    rid = answers.new_id()
    t0 = time.perf_counter()
    if r.publish(QueueKeys(queue).control, json.dumps({"cmd": cmd, "reply": rid, **fields})) < 1:
        raise SystemExit(f"nobody listens to the control channel of {queue}")
    got = answers.collect(r, queue, rid, 1, timeout_s)
    if not got:
        raise SystemExit(f"no answer to {cmd} on {queue} within {timeout_s:.0f} s")
    return got[0], time.perf_counter() - t0


def run_counts(path: Path, events: bool = False) -> collections.Counter[str]:
    """Completions per task id from the models' run log (``<tag> <id>`` lines); with
    ``events``, the setups and teardowns begun instead (``@setup``, ``@teardown``)."""
    if not path.exists():
        return collections.Counter()
    ids = (line.split(" ", 1)[1] for line in path.read_text().splitlines() if " " in line)
    return collections.Counter(i for i in ids if i.startswith("@") == events)


def fast_payload(k: int, seed: int) -> dict[str, Any]:
    return {"prompt": PROMPTS[k % len(PROMPTS)], "max_tokens": TOKENS, "temperature": 0,
            "stop_at_eos": False, "seed": seed}


# -- 1. a fast model beside a slow one -----------------------------------------------------
@dataclass
class Fast:
    """What a client saw of the fast model's requests in one configuration."""

    ttft_ms: list[float] = field(default_factory=list)
    latency_ms: list[float] = field(default_factory=list)
    gaps_ms: list[float] = field(default_factory=list)
    tokens: dict[int, list[list[int]]] = field(default_factory=dict)  # prompt -> token ids
    foreign: list[float] = field(default_factory=list)  # other processes' share, per turn
    cores: list[float] = field(default_factory=list)  # cores the benchmark's processes used
    slow_rate: list[float] = field(default_factory=list)  # slow batches/s meanwhile


class Feeder:
    """Keeps a slow queue busy: ``clients`` threads, each submitting one task and
    waiting for its result, again and again (one runs while the next waits)."""

    def __init__(self, q: mtq.Queue, clients: int = 2) -> None:
        self.q, self.stop = q, threading.Event()
        self.done: list[float] = []
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True)
                        for i in range(clients)]
        self.ids = itertools.count()

    def _loop(self, i: int) -> None:
        while not self.stop.is_set():
            try:
                self.q.submit({"i": f"slow-{self.q.name}-{next(self.ids)}"}).result(timeout=60)
                self.done.append(time.perf_counter())
            except Exception as exc:  # reported by the caller
                self.errors.append(repr(exc))
                return

    def __enter__(self) -> Feeder:
        for t in self.threads:
            t.start()
        wait_for("the slow model's first batch", lambda: self.done or self.errors, 60)
        return self

    def rate(self, t0: float, t1: float) -> float:
        n = sum(1 for d in self.done if t0 < d <= t1)
        return n / (t1 - t0)

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(90)
        if self.errors:
            raise SystemExit(f"the slow model's client failed: {self.errors[:2]}")


def fast_requests(q: mtq.Queue, n: int, seeds: itertools.count[int], into: Fast,
                  procs: Sequence[Proc]) -> None:
    """``n`` fast requests, one at a time, each read as a client reads it."""
    for k in range(n):
        payload = fast_payload(k, next(seeds))
        t0 = time.perf_counter()
        task = q.submit(payload)
        times: list[float] = []
        end = kind = None
        for ev in task.events(timeout=120):
            if ev.kind == "token":
                times.append(time.perf_counter())
            elif ev.terminal:
                end, kind = time.perf_counter(), ev.kind
        if kind != "succeeded" or end is None or len(times) != TOKENS:
            raise procs[0].fail(f"fast request {task.id} ended {kind} with {len(times)} tokens")
        into.ttft_ms.append((times[0] - t0) * 1000)
        into.latency_ms.append((end - t0) * 1000)
        into.gaps_ms += [(b - a) * 1000 for a, b in itertools.pairwise(times)]
        into.tokens.setdefault(k % len(PROMPTS), []).append(task.result(timeout=10)["tokens"])


def bench_two(server: Server, r: redis.Redis, env: dict[str, str], n: int, turns: int,
              quiet_s: float, res: Results, out: dict[str, Any]) -> None:
    url = server.url
    names = {"fast": uniq("fast"), "slow": uniq("slow"), "hfast": uniq("hfast"),
             "hslow": uniq("hslow")}
    procs = {"fast": start_worker(url, env, FAST, names["fast"]),
             "slow": start_worker(url, env, SLOW, names["slow"]),
             "host": start_host(url, env, [{"queue": names["hfast"], "target": FAST},
                                           {"queue": names["hslow"], "target": SLOW}])}
    qs = {k: mtq.Queue(v, client=r) for k, v in names.items()}
    # configuration -> (the fast queue, the slow queue kept busy or None, its process)
    configs = {"a": ("fast", None, procs["fast"]), "b": ("fast", "slow", procs["fast"]),
               "c": ("hfast", "hslow", procs["host"])}
    seen = {k: Fast() for k in configs}
    seeds = itertools.count(1)
    try:
        wait_ready(r, [(procs["fast"], names["fast"]), (procs["slow"], names["slow"]),
                       (procs["host"], names["hfast"]), (procs["host"], names["hslow"])])
        for k in ("fast", "hfast"):  # warm-up
            fast_requests(qs[k], len(PROMPTS), seeds, Fast(), list(procs.values()))
        for k in ("slow", "hslow"):
            qs[k].submit({"i": f"warm-{k}"}).result(timeout=60)
        for turn in range(turns):
            order = list(configs)[turn % 3:] + list(configs)[:turn % 3]
            for c in order:
                fast, slow, proc = configs[c]
                wait_quiet(quiet_s)
                feeder = Feeder(qs[slow]) if slow else None
                if feeder:
                    feeder.__enter__()
                try:
                    mark = cpu_mark()
                    t0 = time.perf_counter()
                    fast_requests(qs[fast], n, seeds, seen[c], [proc])
                    t1 = time.perf_counter()
                    wall, share = foreign(mark)
                    seen[c].foreign.append(share)
                    seen[c].cores.append((our_cpu() - mark[2]) / wall)
                finally:
                    if feeder:
                        feeder.__exit__(None, None, None)
                if feeder:
                    seen[c].slow_rate.append(feeder.rate(t0, t1))
                print(f"  turn {turn + 1} ({c}): fast p99 latency "
                      f"{pct(seen[c].latency_ms[-n:], 99):.1f} ms", flush=True)
        for p in procs.values():
            p.stop()
    finally:
        for p in procs.values():
            p.close()
        r.flushdb()
    report_two(seen, n * turns, res, out)


def report_two(seen: dict[str, Fast], n: int, res: Results, out: dict[str, Any]) -> None:
    a, c = seen["a"], seen["c"]
    res.section = (f"1. the fast model (TinyGPT, 1 greedy request of {TOKENS} tokens at a time, "
                   f"{n} per configuration) beside the slow one (batches of 12 products of "
                   "1024 x 1024 float32, kept busy)")
    labels = {"a": "(a) alone in its own process (mtq worker run): baseline",
              "b": "(b) the slow model busy in a separate process",
              "c": "(c) the slow model busy as another engine of the same process"}
    figures: dict[str, dict[str, float]] = {}
    for k, f in seen.items():
        figures[k] = {"ttft50": pct(f.ttft_ms, 50), "ttft99": pct(f.ttft_ms, 99),
                      "lat50": pct(f.latency_ms, 50), "lat99": pct(f.latency_ms, 99),
                      "gap99": pct(f.gaps_ms, 99), "foreign": max(f.foreign),
                      "cores": median(f.cores),
                      "slow_rate": median(f.slow_rate) if f.slow_rate else 0.0}
    base = figures["a"]
    for k in ("a", "b", "c"):
        fg = figures[k]
        vs = "" if k == "a" else (f"{fg['lat99'] / base['lat99']:.2f}x (a)"
                                  + (f", {fg['lat99'] / figures['b']['lat99']:.2f}x (b)"
                                     if k == "c" else "") + "; ")
        res.add(labels[k] + ", request latency p99", fg["lat99"], "ms",
                f"{vs}p50 {fg['lat50']:.1f} ms; token gap p99 {fg['gap99']:.2f} ms; the "
                f"benchmark's processes used {fg['cores']:.2f} of the 2 cores, other "
                f"processes at most {fg['foreign']:.0%} of the CPU in a turn")
        ttft_vs = "" if k == "a" else (f"{fg['ttft99'] / base['ttft99']:.2f}x (a)"
                                       + (f", {fg['ttft99'] / figures['b']['ttft99']:.2f}x (b)"
                                          if k == "c" else "") + "; ")
        res.add("  time to first token p99", fg["ttft99"], "ms", f"{ttft_vs}p50 "
                f"{fg['ttft50']:.1f} ms")
        if k != "a":
            res.add("  the slow model's batches/s meanwhile", fg["slow_rate"], "batches/s",
                    f"{1000 / fg['slow_rate']:.0f} ms a batch (what a fast request would wait "
                    "behind one, served by the same thread); "
                    + ("its own process" if k == "b" else "an engine of the fast model's process"))
    limit = targets.ENGINE_P99
    for what, key in (("request latency", "lat99"), ("time to first token", "ttft99")):
        ratio = figures["c"][key] / base[key]
        floor = figures["b"][key] / base[key]
        res.target(f"fast model's {what} p99 with the slow one busy in its process within "
                   f"{limit}x of alone", ratio <= limit,
                   f"{ratio:.2f}x (floor, separate processes: {floor:.2f}x)")
    differ = sum(1 for p, toks in c.tokens.items() for t in toks if t != a.tokens[p][0])
    differ += sum(1 for p, toks in a.tokens.items() for t in toks if t != toks[0])
    total = sum(len(t) for t in c.tokens.values())
    res.add("fast model's requests in (c) whose tokens differ from (a)", differ, "requests",
            f"greedy; of {total} " + res.target("the fast model's tokens in (c) equal (a)'s",
                                                differ == 0, f"{differ} differ",
                                                comparable=True))
    out["two"] = {**figures, "differ": differ,
                  "ratio_c_a": {k: figures["c"][k] / base[k] for k in ("lat99", "ttft99")},
                  "ratio_b_a": {k: figures["b"][k] / base[k] for k in ("lat99", "ttft99")}}


# -- 2. LRU under a budget -------------------------------------------------------------------
def lru_clients(qs: list[mtq.Queue], n: int, phase: int, proc: Proc
                ) -> list[tuple[str, str, float, float]]:
    """Two clients, each running ``n / 2`` tasks one at a time over the three queues,
    ``phase`` tasks to a queue before it moves to the next one (client 2 one queue
    ahead of client 1). Returns (queue, task id, submitted, done) per task (unix s)."""
    done: list[tuple[str, str, float, float]] = []
    errors: list[str] = []

    def client(j: int) -> None:
        try:
            for k in range(n // 2):
                q = qs[(k // phase + j) % len(qs)]
                t0 = time.time()
                t = q.submit({"i": f"{q.name}-{j}-{k}"})
                t.result(timeout=120)
                done.append((q.name, t.id, t0, time.time()))
        except Exception as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=client, args=(j,), daemon=True) for j in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    if errors or any(t.is_alive() for t in threads):
        raise proc.fail(f"an LRU client failed: {errors[:2]}")
    return done


def catalogue_events(r: redis.Redis, queues: Sequence[str]) -> list[dict[str, Any]]:
    """The model catalogue's events of ``queues``, oldest first."""
    from mtq.broker.keys import MODELS_HISTORY

    events = [json.loads(x) for x in r.lrange(MODELS_HISTORY, 0, -1)]
    return [e for e in reversed(events) if e.get("queue") in queues]


def load_records(r: redis.Redis, queues: Sequence[str]) -> dict[str, list[tuple[float, float]]]:
    """Per queue, the (start, end) unix s of each load an engine did for its tasks."""
    out: dict[str, list[tuple[float, float]]] = {}
    for q in queues:
        recs = [x for x in map(parse_record, r.lrange(QueueKeys(q).batches, 0, -1)) if x]
        out[q] = [(x["t0"] / 1000, x["t1"] / 1000) for x in recs if x["k"] == "load"]
    return out


def bench_lru(server: Server, r: redis.Redis, env: dict[str, str], n: int, res: Results,
              out: dict[str, Any]) -> None:
    names = [uniq(f"lru{k}") for k in "abc"]
    engines = [{"queue": q, "target": WEIGHTS, "on_demand": True,
                "options": {"tag": tag, "mb": 32, "seed": i, "work_ms": 2}}
               for i, (q, tag) in enumerate(zip(names, "abc"))]
    runlog = Path(env[RUNLOG])
    runlog.unlink(missing_ok=True)
    proc = start_host(server.url, env, engines, max_loaded=2)
    qs = [mtq.Queue(q, client=r) for q in names]
    try:
        wait_ready(r, [(proc, q) for q in names])
        t0 = time.perf_counter()
        done = lru_clients(qs, n, 5, proc)
        wall = time.perf_counter() - t0
        proc.stop()  # (its last batch records are written as it stops)
        events = catalogue_events(r, names)
        loads = load_records(r, names)
    finally:
        proc.close()
        r.flushdb()
    counts = run_counts(runlog)
    loaded: set[str] = set()
    most = 0
    for e in events:  # the engines loaded at once, replayed from the catalogue
        if e["event"] == "loaded":
            loaded.add(e["queue"])
        elif e["event"] in ("unloaded", "stopped"):
            loaded.discard(e["queue"])
        most = max(most, len(loaded))
    n_loads = sum(1 for e in events if e["event"] == "loaded")
    n_evict = sum(1 for e in events if e["event"] == "unloaded")

    def paid(q: str, t0: float, t1: float) -> bool:
        return any(a < t1 and t0 < b for a, b in loads[q])

    waited = [(t1 - t0) * 1000 for q, _, t0, t1 in done if paid(q, t0, t1)]
    free = [(t1 - t0) * 1000 for q, _, t0, t1 in done if not paid(q, t0, t1)]
    load_ms = [(b - a) * 1000 for v in loads.values() for a, b in v]
    lost = n - len(done)
    twice = sum(1 for v in counts.values() if v > 1)
    ran = len(counts)
    res.section = (f"2. LRU: three models of 32 MiB loaded on demand, max_loaded=2, two clients "
                   f"cycling them (5 tasks a model), {n} tasks in {wall:.1f} s")
    res.add("loads", n_loads, "loads", f"{len(load_ms)} for waiting tasks, median "
            f"{median(load_ms):.0f} ms each" if load_ms else "")
    res.add("evictions (least recently used idle model unloaded for room)", n_evict, "unloads",
            f"at most {most} models loaded at once (the model catalogue's events replayed)")
    res.add("wait of tasks that paid a load, p50", pct(waited, 50), "ms",
            f"submit -> result; {len(waited)} tasks; p99 {pct(waited, 99):.0f} ms")
    res.add("wait of tasks that did not, p50", pct(free, 50), "ms",
            f"{len(free)} tasks; p99 {pct(free, 99):.1f} ms")
    res.add("tasks lost / run twice", lost + twice, "tasks",
            f"{len(done)} of {n} results; {ran} ids in the run log, {twice} twice; "
            + res.target("LRU workload: 0 lost, 0 run twice, at most 2 loaded",
                         lost == 0 and twice == 0 and ran == n and most <= 2,
                         f"{lost} lost, {twice} twice, {most} loaded at most",
                         comparable=True))
    out["lru"] = {"tasks": n, "loads": n_loads, "evictions": n_evict, "most_loaded": most,
                  "load_ms_p50": median(load_ms) if load_ms else None,
                  "paid_p50": pct(waited, 50), "paid_p99": pct(waited, 99),
                  "free_p50": pct(free, 50), "free_p99": pct(free, 99),
                  "lost": lost, "twice": twice}


# -- 3. commands under load ------------------------------------------------------------------
class Stream:
    """Submits a task to ``q`` every ``every`` s (open loop) until stopped."""

    def __init__(self, q: mtq.Queue, every: float, payload: Callable[[int], Any]) -> None:
        self.q, self.every, self.payload = q, every, payload
        self.tasks: list[mtq.Task] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        k = 0
        next_at = time.perf_counter()
        while not self.stop.is_set():
            self.tasks.append(self.q.submit(self.payload(k)))
            k += 1
            next_at += self.every
            self.stop.wait(max(0.0, next_at - time.perf_counter()))

    def close(self) -> list[mtq.Task]:
        self.stop.set()
        self.thread.join(10)
        return self.tasks


def bench_commands(server: Server, r: redis.Redis, env: dict[str, str], rounds: int,
                   res: Results, out: dict[str, Any]) -> None:
    qb, qg = uniq("cmd-batch"), uniq("cmd-gen")
    runlog = Path(env[RUNLOG])
    runlog.unlink(missing_ok=True)
    proc = start_host(server.url, env, [
        {"queue": qb, "target": WEIGHTS, "options": {"tag": "a0", "mb": 32, "work_ms": 3}},
        {"queue": qg, "target": FAST}])
    took: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    bad: list[str] = []
    tags: list[tuple[float, str]] = []  # (when a reload with options answered, its tag)
    try:
        wait_ready(r, [(proc, qb), (proc, qg)])
        batch = Stream(mtq.Queue(qb, client=r), 0.025, lambda k: {"i": f"b{k}"})
        gen = Stream(mtq.Queue(qg, client=r), 0.25,
                     lambda k: {**fast_payload(k, 10_000_000 + k), "max_tokens": 24})
        try:
            for rnd in range(rounds):
                tag = f"a{rnd + 1}"
                for queue, cmd, fields in (
                        (qb, "unload", {}), (qb, "load", {}),
                        (qb, "reload", {"options": {"tag": tag, "mb": 32, "work_ms": 3,
                                                    "seed": rnd + 1}}),
                        (qb, "reset", {}), (qb, "reload", {}),
                        (qg, "unload", {"now": True}), (qg, "load", {}), (qg, "reset", {}),
                        (qg, "reload", {})):
                    time.sleep(0.5)  # tasks stream in meanwhile
                    answer, wall = command(r, queue, cmd, **fields)
                    name = f"{cmd}{' --now' if fields.get('now') else ''}" + \
                        (" (new options)" if "options" in fields else
                         " (code)" if cmd == "reload" else "") + \
                        (", generator" if queue == qg else ", batch model")
                    took[name].append((float(answer["took_s"]), wall))
                    if not answer["ok"]:
                        bad.append(f"{name}: {answer['error']}")
                    if "options" in fields:
                        tags.append((time.time(), tag))
            time.sleep(0.5)
        finally:
            tasks = batch.close() + gen.close()
        results: dict[str, Any] = {}
        for t in tasks:
            try:
                results[t.id] = t.result(timeout=120)
            except Exception as exc:
                bad.append(f"{t.id}: {exc!r}")
        infos = {t.id: t.info() for t in tasks}
        last = results.get(batch.tasks[-1].id) if batch.tasks else None
        if not last or last.get("tag") != f"a{rounds}":  # the last reload's options serve
            bad.append(f"the last batch task's result {last} is not from options a{rounds}")
        proc.stop()
    finally:
        proc.close()
        r.flushdb()
    counts = run_counts(runlog)
    ids = [f"b{k}" for k in range(len(batch.tasks))] + \
        [str(10_000_000 + k) for k in range(len(gen.tasks))]
    lost = sum(1 for t in tasks if t.id not in results)
    twice = sum(1 for i in ids if counts[i] > 1)
    unrun = sum(1 for i in ids if counts[i] == 0)
    redelivered = sum(1 for i in infos.values() if i.deliveries > 1)
    res.section = (f"3. commands under load: a batch model (32 MiB, ~40 tasks/s) and the fast "
                   f"generator (~4 requests/s) in one host process, {rounds} round(s)")
    for name, v in took.items():
        res.add(name, median([x[0] for x in v]), "s", f"the engine's took_s; command to answer "
                f"{median([x[1] for x in v]):.3f} s; max {max(x[0] for x in v):.3f} s")
    res.add("tasks lost / run twice", lost + twice, "tasks",
            f"{len(tasks)} tasks streamed in; {unrun} never ran; {redelivered} delivered "
            "twice (counted); " + res.target(
                "commands under load: 0 lost, 0 run twice, every command answered ok",
                lost == 0 and twice == 0 and unrun == 0 and not bad,
                f"{lost} lost, {twice} twice, errors {bad[:3]}", comparable=True))
    out["commands"] = {"took_s": {k: [x[0] for x in v] for k, v in took.items()},
                       "wall_s": {k: [x[1] for x in v] for k, v in took.items()},
                       "tasks": len(tasks), "lost": lost, "twice": twice, "unrun": unrun,
                       "redelivered": redelivered, "errors": bad, "tags": tags}
