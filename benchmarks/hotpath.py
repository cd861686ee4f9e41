"""The hot path, measured as the peer harness (``../shared/bench/peers/``) measures it:
Redis work per task, one worker's drain and start-up, and the round trip, in one run.

redis-server is pinned to one CPU, this driver and the worker to the other.

* **drain**: ``submit_many`` of N no-op tasks, then one ``mtq worker run`` (batch 64)
  is spawned; its handler (``benchmarks.children.noop:marked``) stamps ``time.time()``
  at task 1 and task N. Start-up = spawn to task 1; steady = (N - 1) / (task N - task
  1); Redis commands and CPU per task from INFO over the drain (and the submit) / N.
  The same with ``--max-batch-size 1``.
* **bare**: the floor under Redis CPU per task: mtq's per-task commands sent as plain
  pipelined commands, and a queue that keeps no record of a task (:func:`bare`).
* **round trip**: ``q.submit(None).result()`` on a warm worker, idle and under a
  producer's load at half the steady rate, in blocks alternating with the floor: a
  round trip through ``benchmarks.children.echo`` on the worker's CPU.

``benchmarks.against`` runs :func:`drain` and :func:`roundtrips` of every tree (with
:func:`spawn_worker` and ``ROOT``): keep their signatures.

    python -m benchmarks.hotpath            # full run, writes the hotpath block
    python -m benchmarks.hotpath --quick    # smaller, prints only
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

import mtq
from benchmarks import targets
from benchmarks.harness import procs
from benchmarks.harness.meters import commandstats, machine_info, pct, threads_cpu
from benchmarks.harness.procs import stop
from benchmarks.harness.report import cli_parser, docs_of, write_block
from benchmarks.harness.server import ROOT, Server, compile_tree
from mtq.workers import registry

#: the environment variables the worker's handler (benchmarks.children.noop:marked) reads
MARK_DIR, MARK_N = "MTQ_BENCH_MARK_DIR", "MTQ_BENCH_N"


def _snap(r: redis.Redis) -> tuple[int, float]:
    i = r.info()
    return int(i["total_commands_processed"]), float(i["used_cpu_user"]) + float(i["used_cpu_sys"])


def worker_env(server: Server, **extra: str) -> dict[str, str]:
    return procs.worker_env(server.url, **extra)



def spawn_worker(server: Server, queue: str, target: str, cpu: int | None,
                 env: dict[str, str], *extra: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "mtq", "worker", "run", target, "--queue", queue, *extra]
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu), *cmd]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def wait_worker(r: redis.Redis, queue: str, proc: subprocess.Popen[bytes]) -> None:
    """Until the worker serving ``queue`` is in the registry (60 s at most; exits if it
    died). The registry is written once a second: there is nothing to block on."""
    deadline = time.monotonic() + 60
    while not registry.list_workers(r, queue):
        if time.monotonic() > deadline or proc.poll() is not None:
            raise SystemExit("the worker did not start")
        time.sleep(0.01)


def _read_stamp(path: Path, deadline: float) -> float:
    while True:
        try:
            return float(path.read_text())
        except (FileNotFoundError, ValueError):
            if time.monotonic() > deadline:
                raise SystemExit(f"no stamp {path.name} in time") from None
            time.sleep(0.002)


def drain(server: Server, n: int, cpu: int | None, *extra: str) -> dict[str, float]:
    """One drain of n no-op tasks by a freshly spawned worker (``extra``: more of its
    command line)."""
    r = redis.Redis.from_url(server.url)
    r.flushall()
    name = f"drain-{time.monotonic_ns()}"
    q = mtq.Queue(name, client=r)
    q.reply_channel()
    with tempfile.TemporaryDirectory() as marks:
        env = worker_env(server, **{MARK_DIR: marks, MARK_N: str(n)})
        c0, cpu0 = _snap(r)
        t = time.perf_counter()
        q.submit_many([None] * n)
        submit_s = time.perf_counter() - t
        c1, _ = _snap(r)
        u1 = commandstats(r, "usec")
        t_spawn = time.time()
        proc = spawn_worker(server, name, "benchmarks.children.noop:marked", cpu, env, *extra)
        try:
            deadline = time.monotonic() + 120
            first = _read_stamp(Path(marks) / "first", deadline)
            last = _read_stamp(Path(marks) / "last", deadline)
            # the last ack lands just after the last call: wait for it before counting
            while int(r.hget(q.broker.keys.stats, "succeeded") or 0) < n:
                if time.monotonic() > deadline:
                    raise SystemExit("the drain did not finish")
                time.sleep(0.001)
            c2, cpu2 = _snap(r)
            u2 = commandstats(r, "usec")
        finally:
            stop(proc)
            mtq.replies.hub_of(r).close_all()
            r.close()
    spent = {k: v - u1.get(k, 0) for k, v in u2.items() if k != "info"}
    scripts = spent.pop("evalsha", 0)
    return {"script_us": scripts / n, "commands_us": sum(spent.values()) / n,
            "hash_us": sum(spent.get(k, 0) for k in ("hset", "hmget", "expire")) / n,
            "submit_rate": n / submit_s, "startup_s": first - t_spawn,
            "steady": (n - 1) / (last - first) if last > first else 0.0,
            "with_startup": n / (last - t_spawn),
            "cmds_drain": (c2 - c1) / n, "cmds_submit": (c1 - c0) / n,
            "cpu_us": 1e6 * (cpu2 - cpu0) / n}


def _echo(r: redis.Redis) -> float:
    """One round trip through the echo process (s)."""
    t = time.perf_counter()
    r.rpush("bare:in", b"c")
    if r.blpop("bare:out:c", timeout=30) is None:
        raise SystemExit("the echo process did not answer in 30 s")
    return time.perf_counter() - t


def roundtrips(server: Server, count: int, cpu: int | None, load: float = 0.0
               ) -> dict[str, float]:
    """p50 / p99 of submit -> result on a warm worker, with ``load`` tasks/s of background
    work on the same queue (0: idle); and, in blocks alternating with them, of a round
    trip through the echo process (:data:`ECHO`) on the worker's CPU: the floor."""
    r = redis.Redis.from_url(server.url)
    r.flushall()
    name = f"ping-{time.monotonic_ns()}"
    q = mtq.Queue(name, client=r)
    proc = spawn_worker(server, name, "benchmarks.children.noop:handle", cpu, worker_env(server))
    echo_cmd = [sys.executable, "-m", "benchmarks.children.echo", server.url]
    echo = subprocess.Popen(["taskset", "-c", str(cpu), *echo_cmd] if cpu is not None
                            else echo_cmd, env=worker_env(server), cwd=ROOT)
    producer = None
    stop_file = tempfile.mktemp(prefix="mtq-bench-stop-")
    try:
        wait_worker(r, name, proc)
        for _ in range(20):
            q.submit(None).result(timeout=30)
            _echo(r)
        if load:
            producer = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.children.producer", server.url, name, str(load), stop_file], env=worker_env(server), cwd=ROOT)
            time.sleep(0.5)  # let the load settle
        oversleep = _oversleep_p99() if load else 0.0
        p0 = threads_cpu(producer.pid) if producer is not None else 0.0
        t0 = time.perf_counter()
        c0, cpu0 = _snap(r)
        w0, m0 = threads_cpu(proc.pid), time.process_time()
        out = []
        for _ in range(count):
            t = time.perf_counter()
            q.submit(None).result(timeout=30)
            out.append(time.perf_counter() - t)
        c1, cpu1 = _snap(r)
        w1, m1 = threads_cpu(proc.pid), time.process_time()
        elapsed = time.perf_counter() - t0
        p1 = threads_cpu(producer.pid) if producer is not None else 0.0
        # the floor, in blocks alternating with more of mtq's round trips (not counted
        # above), so that both see the same moments of this machine and of the load
        floor_rt: list[float] = []
        beside: list[float] = []
        for _ in range(10):
            for _ in range(count // 10):
                floor_rt.append(_echo(r))
            for _ in range(count // 10):
                t = time.perf_counter()
                q.submit(None).result(timeout=30)
                beside.append(time.perf_counter() - t)
    finally:
        Path(stop_file).touch()
        if producer is not None:
            producer.wait(30)
        Path(stop_file).unlink(missing_ok=True)
        r.rpush("bare:in", b"stop")
        try:
            echo.wait(30)
        except subprocess.TimeoutExpired:
            echo.kill()
        stop(proc)
        mtq.replies.hub_of(r).close_all()
        r.close()
    def ms(v: list[float], q: float) -> float:
        return 1000 * pct(v, q, nearest=True)

    return {"p50_ms": ms(out, 50), "p99_ms": ms(out, 99),
            "floor_p50_ms": ms(floor_rt, 50), "floor_p99_ms": ms(floor_rt, 99),
            "beside_p50_ms": ms(beside, 50), "beside_p99_ms": ms(beside, 99),
            "cmds": (c1 - c0) / count, "redis_us": 1e6 * (cpu1 - cpu0) / count,
            "worker_us": 1e6 * (w1 - w0) / count, "client_us": 1e6 * (m1 - m0) / count,
            # under load: the CPU this driver, the worker and the producer share
            "worker_pct": 100 * (w1 - w0) / elapsed, "producer_pct": 100 * (p1 - p0) / elapsed,
            "oversleep_p99_ms": oversleep}


def _oversleep_p99(n: int = 1000) -> float:
    """How late (ms, p99) this process wakes from a 1 ms sleep: the scheduling delay on
    its CPU, which no round trip measured on it can beat."""
    late = []
    for _ in range(n):
        t = time.perf_counter()
        time.sleep(0.001)
        late.append(time.perf_counter() - t - 0.001)
    return 1000 * pct(late, 99, nearest=True)


def bare(server: Server, n: int = 20000, batch: int = 64) -> dict[str, float]:
    """Redis CPU per task (user + sys over submit and drain / n, as :func:`drain` takes
    it) of two task lives sent as plain commands, pipelined, without a script:

    * ``record_us``: the commands mtq's scripts make for each task, with the same
      fields (submit: HSET of the task, one RPUSH a thousand; claim: LPOP of a batch,
      then HMGET and HSET of each task, one ZADD of the batch's leases; ack: HMGET,
      HSET and EXPIRE of each task, one ZREM, one PUBLISH), and nothing of what the
      scripts add around them (atomicity, fencing decisions, counters, events, replies);
    * ``lean_us``: a queue that keeps no record of a task (the shape of the leanest
      peers): the payloads RPUSHed a thousand at a time, LPOPed a batch at a time, each
      result HSET into one hash.

    The first is what a task that has its own record costs Redis before any scripting,
    the floor under mtq's figure; the second what a queue without one costs."""
    r = redis.Redis.from_url(server.url)
    payload, result, created = b"\x90", b"\xc0", "1764225000000"
    out: dict[str, float] = {}
    for name in ("record", "lean"):
        r.flushall()
        _, c0 = _snap(r)
        if name == "record":
            # a member longer than 64 bytes keeps the set a skiplist, as mtq's LEASE_MARK does
            r.zadd("leases", {"~" * 80: float("inf")})
            for lo in range(0, n, 1000):
                p = r.pipeline(transaction=False)
                ids = [f"bare-{i:016d}" for i in range(lo, min(n, lo + 1000))]
                for i in ids:
                    p.hset(f"task:{i}", mapping={"payload": payload, "status": "queued",
                                                 "created": created, "trace": "0",
                                                 "reply": "mtq:{bare}:reply:c1"})
                p.rpush("free", *ids)
                p.execute()
            while popped := r.lpop("free", batch):
                claimed: list[bytes] = list(popped)  # type: ignore[arg-type]
                p = r.pipeline(transaction=False)
                for tid in claimed:
                    p.hmget(b"task:" + tid, "status", "payload", "deadline", "deliveries",
                            "attempts", "retries", "created", "reply", "traceparent", "trace")
                    p.hset(b"task:" + tid, mapping={"status": "running", "worker": "w1",
                                                  "token": "1001", "started": created,
                                                  "deliveries": "1"})
                p.zadd("leases", {tid: 1764225030000 for tid in claimed})
                p.execute()
                p = r.pipeline(transaction=False)
                for tid in claimed:
                    p.hmget(b"task:" + tid, "reply", "created", "trace", "out", "status", "token",
                            "stream", "cache")
                    p.hset(b"task:" + tid, mapping={"status": "succeeded", "finished": created,
                                                  "result": result})
                    p.expire(b"task:" + tid, 86400)
                p.zrem("leases", *claimed)
                p.publish("mtq:{bare}:reply:c1", b"x" * 64 * len(claimed))
                p.execute()
        else:
            for lo in range(0, n, 1000):
                r.rpush("q", *[b"bare-%016d" % i for i in range(lo, min(n, lo + 1000))])
            while msgs := r.lpop("q", batch):
                r.hset("results", mapping=dict.fromkeys(msgs, result))
        _, c1 = _snap(r)
        out[f"{name}_us"] = 1e6 * (c1 - c0) / n
    r.flushall()
    r.close()
    return out


def import_floor() -> dict[str, float]:
    """The quickest of five starts of a Python that does nothing, and of one that only
    imports redis-py: the floor under a worker's start-up."""
    out: dict[str, float] = {}
    for name, code in (("python_s", "pass"), ("import_redis_s", "import redis")):
        times = []
        for _ in range(5):
            t = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True)
            times.append(time.perf_counter() - t)
        out[name] = min(times)
    return out


def lane_cost(server: Server, reps: int = 500) -> dict[str, float]:
    """Client CPU per script call (round trip included) through redis-py's
    ``execute_command`` and through ``mtq.broker.lane``: EVALSHA of ``return 1`` with the
    keys mtq's scripts take."""
    from mtq.broker import lane

    r = redis.Redis.from_url(server.url)
    k = mtq.Queue("lane", client=r).broker.keys
    args: tuple[Any, ...] = (r.script_load("return 1"), len(k.script_keys), *k.script_keys,
                             *k.channels)
    out: dict[str, float] = {}
    for name, call in (("redispy_call_us", lambda: r.evalsha(*args)),
                       ("lane_call_us", lambda: lane.exchange(r, [("EVALSHA", *args)]))):
        call()
        t = time.process_time()
        for _ in range(reps):
            call()
        out[name] = 1e6 * (time.process_time() - t) / reps
    r.close()
    return out


def server_build(url: str) -> str:
    """A server's version and allocator, as INFO tells them: ``7.0.15, jemalloc-5.3.0``."""
    client = redis.Redis.from_url(url)
    try:
        return f"{client.info('server')['redis_version']}, " \
               f"{client.info('memory')['mem_allocator']}"
    finally:
        client.close()


def main(argv: list[str] | None = None) -> None:
    ap = cli_parser(__doc__, "~1 minute")
    ap.add_argument("--no-pin", action="store_true", help="leave CPU placement to Linux")
    args = ap.parse_args(argv)
    docs = docs_of(args)
    n, passes, count = (5000, 1, 200) if args.quick else (5000, 5, 300)
    compile_tree()  # as installed: the workers it spawns do not compile mtq first
    cpus = sorted(os.sched_getaffinity(0))
    pin = not args.no_pin and len(cpus) >= 2
    server = Server()
    server.start()
    worker_cpu = cpus[1] if pin else None
    if pin and server.proc is not None:
        os.sched_setaffinity(server.proc.pid, {cpus[0]})
        os.sched_setaffinity(0, {cpus[1]})
    results: dict[str, list[dict[str, float]]] = {"drain": [], "drain20k": [], "drain1": [],
                                                  "rt": [], "load": [], "floor": [],
                                                  "bare": []}
    t_run = time.time()
    try:
        build = server_build(server.url)
        for i in range(passes):
            results["drain"].append(drain(server, n, worker_cpu))
            results["drain20k"].append(drain(server, 4 * n, worker_cpu))
            results["drain1"].append(drain(server, 2 * n, worker_cpu, "--max-batch-size", "1"))
            results["rt"].append(roundtrips(server, count, worker_cpu))
            half = statistics.median(d["steady"] for d in results["drain20k"]) / 2
            results["load"].append({**roundtrips(server, count, worker_cpu, half),
                                    "rate": half})
            results["floor"].append({**import_floor(), **lane_cost(server)})
            results["bare"].append(bare(server))
            print(f"pass {i + 1}/{passes}: " + "; ".join(
                f"{k} " + ", ".join(f"{m} {v[-1][m]:.3g}" for m in v[-1]
                                    if isinstance(v[-1][m], float))
                for k, v in results.items() if v), flush=True)
    finally:
        server.stop()

    def med(kind: str, m: str) -> float:
        return statistics.median(r[m] for r in results[kind])

    def rng(kind: str, m: str) -> str:
        v = [r[m] for r in results[kind]]
        return f"{min(v):,.3g}-{max(v):,.3g}"

    rows: list[tuple[str, str, str, str]] = [
        ("Redis commands per drained task", f"{med('drain', 'cmds_drain'):.2f}", targets.HOTPATH["cmds_drain"],
         f"5,000-task drain; range {rng('drain', 'cmds_drain')}"),
        ("Redis commands per round trip", f"{med('rt', 'cmds'):.2f}", targets.HOTPATH["cmds_rt"],
         "idle worker, heartbeats included"),
        ("Redis CPU per task: submit + claim + ack + completion event",
         f"{med('drain20k', 'cpu_us'):.2f} us", targets.HOTPATH["cpu_us"],
         f"20,000 tasks, batch 64; range {rng('drain20k', 'cpu_us')}"),
        ("Redis CPU per task, the same commands sent bare: mtq's per-task commands / a "
         "queue that keeps no record of a task",
         f"{med('bare', 'record_us'):.1f} / {med('bare', 'lean_us'):.1f} us", "",
         "20,000 tasks, batch 64, pipelined, no script; the floor under the row above "
         "for a task that has its own record (see below and `bare` in the module)"),
        ("Redis time per drained task: its scripts (EVALSHA) / the commands they call",
         f"{med('drain20k', 'script_us'):.1f} / {med('drain20k', 'commands_us'):.1f} us", "",
         f"INFO commandstats, 20,000 tasks; of the commands, the task's HSET, HMGET and "
         f"EXPIRE: {med('drain20k', 'hash_us'):.1f} us; the rest of the scripts' time is "
         "their own work (see below)"),
        ("steady drain, 1 worker (tasks/s)", f"{med('drain20k', 'steady'):,.0f}", targets.HOTPATH["steady"],
         f"20,000 tasks; range {rng('drain20k', 'steady')}"),
        ("steady drain, 1 worker, `--max-batch-size 1` (tasks/s)",
         f"{med('drain1', 'steady'):,.0f}", "",
         f"10,000 tasks, one per `predict`; range {rng('drain1', 'steady')}; Redis commands "
         f"/ CPU per task: {med('drain1', 'cmds_drain'):.2f} / {med('drain1', 'cpu_us'):.1f} "
         "us (a fast model's small batches are claimed many at a time: docs/workers.md)"),
        ("drain of 5,000 incl. start-up (tasks/s)", f"{med('drain', 'with_startup'):,.0f}",
         targets.HOTPATH["with_startup"], f"range {rng('drain', 'with_startup')}"),
        ("worker start-up to first task (s)", f"{med('drain', 'startup_s'):.3f}", targets.HOTPATH["startup_s"],
         f"range {rng('drain', 'startup_s')}; its floor: a Python that only imports "
         f"redis-py takes {med('floor', 'import_redis_s'):.3f} s "
         f"(`python -c pass`: {med('floor', 'python_s'):.3f} s)"),
        ("round trip p50 / p99 (ms)", f"{med('rt', 'p50_ms'):.3f} / {med('rt', 'p99_ms'):.3f}",
         targets.HOTPATH["rt_ms"], f"{count} round trips a pass"),
        ("floor of a round trip: the same through an echo process on the worker's CPU "
         "(BLPOP, RPUSH back; no record), p50 / p99 (ms)",
         f"{med('rt', 'floor_p50_ms'):.3f} / {med('rt', 'floor_p99_ms'):.3f}", "",
         f"{count} a pass, in 10 blocks alternating with {count} more of mtq's, which took "
         f"{med('rt', 'beside_p50_ms'):.3f} / {med('rt', 'beside_p99_ms'):.3f} ms "
         "(see `ECHO` in the module)"),
        ("round trip: CPU per round trip of the client, the worker and redis-server (us)",
         f"{med('rt', 'client_us'):.0f} / {med('rt', 'worker_us'):.0f} / "
         f"{med('rt', 'redis_us'):.0f}", "",
         "client and worker share one CPU: their sum bounds the round trip from below"),
        (f"round trip p99 at half the steady drain rate (~{med('load', 'rate'):,.0f}/s)",
         f"{med('load', 'p99_ms'):.3f} ms", targets.HOTPATH["load_p99_ms"],
         f"p50 {med('load', 'p50_ms'):.3f} ms; the CPU this driver and the worker share "
         f"also runs the producer: worker {med('load', 'worker_pct'):.0f} % + producer "
         f"{med('load', 'producer_pct'):.0f} % of it, and a 1 ms sleep on it wakes "
         f"{med('load', 'oversleep_p99_ms'):.2f} ms late at p99"),
        ("floor under that load: the echo process's round trip p50 / p99 (ms)",
         f"{med('load', 'floor_p50_ms'):.3f} / {med('load', 'floor_p99_ms'):.3f}", "",
         f"alternating with mtq's, which took {med('load', 'beside_p50_ms'):.3f} / "
         f"{med('load', 'beside_p99_ms'):.3f} ms in the same blocks"),
    ]
    rows.append(("client CPU per command: redis-py's execute_command / mtq.broker.lane",
                 f"{med('floor', 'redispy_call_us'):.1f} / {med('floor', 'lane_call_us'):.1f} us",
                 "", "EVALSHA of `return 1` with mtq's keys, round trip included"))
    table = "\n".join(["| figure | median of passes | target | notes |", "|---|---:|---|---|",
                       *(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows)])
    print(table)
    if docs is not None:
        write_block("hotpath", table.splitlines(), "python -m benchmarks.hotpath",
                    machine_info(None, f"redis-server {build}", "pinned" if pin else "not pinned"),
                    time.time() - t_run, docs)


if __name__ == "__main__":
    main()
