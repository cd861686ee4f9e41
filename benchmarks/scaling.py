"""Scale-out: a cluster's Redis work per task, how queues spread over shards, what several
shards drain together, and how long a failover stops the work.

* instructions per drained task (callgrind) of one Redis 7 server and of a one-node
  cluster (slot client, SPUBLISH), 3,200 no-op tasks claimed and acked in batches of 64;
* how many of 300 queues each primary of a 3-primary cluster serves;
* 6 queues drained at once by one ``mtq worker run --burst`` each, on 1 and on 3 shards,
  passes alternating; Redis CPU per task summed over the nodes;
* failover: 3 primaries with 2 replicas each, ``cluster-node-timeout`` 1 s, a producer
  at 300 tasks/s; from the SIGKILL of the queue's primary to its next success.

    python -m benchmarks.scaling            # everything, writes the scaling block
    python -m benchmarks.scaling --quick    # fewer tasks and rounds, prints only

Needs Redis 7 (``scripts/install-system-deps``) and valgrind for the first part.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import redis

import mtq
from benchmarks import targets
from benchmarks.harness.meters import machine_info, redis_cpu
from benchmarks.harness.procs import wait_for, worker_env
from benchmarks.harness.report import cli_args, write_block
from benchmarks.harness.server import ROOT, CallgrindServer
from mtq.broker.keys import QueueKeys


def _cluster_tools() -> Any:
    sys.path.insert(0, str(ROOT))
    from tests.support import clusters

    return clusters


# -- Redis work per task ------------------------------------------------------------------

def instructions(binary: str, clustered: bool, n: int) -> float:
    """redis-server instructions per drained task (claim + ack, batch 64)."""
    from mtq.broker.connection import connect
    from mtq.broker.consumer import Consumer, Outcome

    server = CallgrindServer(binary, ("--cluster-enabled", "yes", "--cluster-config-file",
                                      "nodes.conf") if clustered else ())
    server.port = _cluster_tools().free_cluster_port()  # its bus port (+10000) free too
    server.start()
    r = redis.Redis(port=server.port)
    if clustered:
        r.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        wait_for("the cluster", lambda: r.cluster("INFO").get("cluster_state") == "ok", 60)
    client = connect(f"redis+cluster://127.0.0.1:{server.port}" if clustered else server.url)
    q = mtq.Queue("scale", client=client)
    c = Consumer("scale", client=client)
    q.submit_many([None] * 64)  # scripts loaded, keys made
    c.settle([Outcome(t, True, None) for t in c.claim(64)])
    q.submit_many([None] * n)
    server.instrument(True)
    held = c.claim(64)
    while held:
        _, held = c.settle_and_claim([Outcome(t, True, None) for t in held], 64)
    server.instrument(False)
    assert q.stats()["succeeded"] == n + 64
    mtq.replies.hub_of(q.redis).close_all()
    return server.total() / n


# -- spread ------------------------------------------------------------------------------

def spread(names: list[str]) -> list[int]:
    """Queues per primary of a 3-primary cluster with the slots split as
    ``redis-cli --cluster create`` splits them (0-5460, 5461-10922, 10923-16383)."""
    from redis.crc import key_slot

    bounds = (5460, 10922, 16383)
    count = Counter(next(i for i, b in enumerate(bounds)
                         if key_slot(QueueKeys(n).ready.encode()) <= b) for n in names)
    return [count[i] for i in range(3)]


# -- aggregate drain ---------------------------------------------------------------------


def nodes_cpu(nodes: list[Any]) -> float:
    total = 0.0
    for node in nodes:
        c = node.client()
        try:
            total += redis_cpu(c)
        finally:
            c.close()
    return total


def drain(primaries: int, queues: int, per_queue: int, tmp: Path) -> tuple[float, float]:
    """(tasks/s, Redis CPU us per task) of ``queues`` workers draining at once."""
    clusters = _cluster_tools()
    c = clusters.Cluster(tmp, primaries=primaries, replicas=0)
    c.start()
    try:
        client = mtq.broker.connection.connect(c.url)
        # the same number of queues on each primary
        by_node: dict[int, list[str]] = {n.port: [] for n in c.primaries()}
        while sum(map(len, by_node.values())) < queues:
            name = f"agg-{uuid.uuid4().hex[:8]}"
            mine = by_node[c.owner(QueueKeys(name).ready).port]
            if len(mine) < queues // primaries:
                mine.append(name)
        names = [n for ns in by_node.values() for n in ns]
        for name in names:
            mtq.Queue(name, client=client).submit_many([None] * per_queue)
        env = worker_env(c.url)
        cpu0 = nodes_cpu(c.nodes)
        t0 = time.monotonic()
        procs = [subprocess.Popen([sys.executable, "-m", "mtq", "worker", "run",
                                   "benchmarks.children.noop:handle", "--queue", n, "--burst"],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for n in names]
        ends = []
        for p in procs:
            p.wait(600)
            ends.append(time.monotonic() - t0)
        took = time.monotonic() - t0
        if os.environ.get("MTQ_BENCH_DEBUG"):
            print("worker exits (s):", [round(e, 2) for e in ends], file=sys.stderr)
        cpu = nodes_cpu(c.nodes) - cpu0
        done = sum(mtq.Queue(n, client=client).stats()["succeeded"] for n in names)
        assert done == queues * per_queue, f"{done} of {queues * per_queue} done"
        return done / took, 1e6 * cpu / done
    finally:
        c.stop()


# -- failover ----------------------------------------------------------------------------

def failovers(rounds: int, tmp: Path) -> list[float]:
    """Seconds from a primary's death to the first task completed after it, per round."""
    clusters = _cluster_tools()
    c = clusters.Cluster(tmp / "cluster", primaries=3, replicas=2)
    c.start()
    out: list[float] = []
    try:
        name = f"fo-{uuid.uuid4().hex[:8]}"
        log = tmp / "calls.log"
        env = {**worker_env(c.url), "MTQ_TEST_LOG": str(log),
               "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
        q = mtq.Queue(name, c.url)
        q.configure(lease_ms=5000)
        worker = subprocess.Popen([sys.executable, "-m", "mtq", "worker", "run",
                                   "tests.handlers:logged", "--queue", name],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        stop = threading.Event()

        def produce() -> None:
            i = 0
            while not stop.is_set():
                try:
                    q.submit({"s": "-", "i": i})
                except mtq.MtqError:
                    pass
                i += 1
                time.sleep(1 / 300)

        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        try:
            for _ in range(rounds):
                wait_for("work before the kill", lambda: _completions(log, time.time() - 1.0), 60)
                victim = c.owner(QueueKeys(name).ready)
                killed = time.monotonic()
                victim.kill()
                out.append(_first_success_after(q, killed))
                victim.start()  # rejoins as a replica of the promoted one
                c.wait_ok(60)
        finally:
            stop.set()
            producer.join(30)
            worker.send_signal(signal.SIGTERM)
            worker.wait(30)
    finally:
        c.stop()
    return out


def _first_success_after(q: mtq.Queue, killed: float, timeout: float = 60) -> float:
    """Seconds from ``killed`` until the queue's primary (the promoted replica, once it
    answers) records a task succeeded: its ``succeeded`` counter grows past what the
    replica had. Read every 10 ms (a benchmark's clock, not a worker's)."""
    base = None
    while time.monotonic() - killed < timeout:
        try:
            n = q.stats()["succeeded"]
        except mtq.MtqError:
            n = None
        if n is not None:
            if base is not None and n > base:
                return time.monotonic() - killed
            base = n if base is None else base
        time.sleep(0.01)
    raise SystemExit(f"no task succeeded within {timeout} s of the kill")


def _completions(log: Path, since: float) -> list[float]:
    if not log.exists():
        return []
    return [float(t) for tag, t, *_ in (ln.split() for ln in log.read_text().splitlines())
            if tag == "D" and float(t) > since]


# -- main --------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    quick, docs = cli_args(argv, __doc__, "~1 minute")
    clusters = _cluster_tools()
    binary = clusters.find_redis7()
    n, per_queue, rounds, passes = (1600, 2000, 2, 1) if quick else (3200, 5000, 5, 3)
    started = time.monotonic()
    rows: list[str] = []
    cg = shutil.which("valgrind") is not None
    if cg:
        one, clu = instructions(binary, False, n), instructions(binary, True, n)
        rows.append(f"| redis-server instructions per drained task (claim + ack, batch 64), "
                    f"one server | {one:,.0f} | |")
        rows.append(f"| the same, a cluster node (slot client, SPUBLISH) | {clu:,.0f} | "
                    f"{100 * (clu / one - 1):+.1f} % (target within {targets.CLUSTER_INSTRUCTIONS:.0%}) |")
    names = [f"chat-{i}" for i in range(300)]
    rand = [uuid.uuid4().hex[:12] for _ in range(300)]
    for label, ns in (("`chat-0` .. `chat-299`", names), ("300 random names", rand)):
        per = spread(ns)
        worst = max(abs(p - 100) for p in per)
        rows.append(f"| 300 queues over 3 primaries, {label} | {' / '.join(map(str, per))} | "
                    f"{worst} % from even at worst (target within {targets.SHARD_SPREAD:.0%}) |")
    with tempfile.TemporaryDirectory(prefix="mtq-scale-") as tmp:
        runs: dict[int, list[tuple[float, float]]] = {1: [], 3: []}
        for p in range(passes):
            for shards in ((1, 3) if p % 2 == 0 else (3, 1)):  # alternating order
                runs[shards].append(drain(shards, 6, per_queue, Path(tmp) / f"agg{shards}-{p}"))
        agg = {}
        for shards, rs in runs.items():
            rate = statistics.median(r for r, _ in rs)
            cpu = statistics.median(c for _, c in rs)
            agg[shards] = (rate, cpu)
            rows.append(f"| aggregate drain incl. start-up, 6 queues on {shards} shard(s), one "
                        f"worker each (tasks/s) | {rate:,.0f} | Redis CPU {cpu:.1f} us per "
                        f"task, all shards; {len(rs)} passes, rates "
                        f"{', '.join(f'{r:,.0f}' for r, _ in rs)} |")
        times = failovers(rounds, Path(tmp) / "fo")
    rows.append(f"| failover: the primary's death (SIGKILL) to the first task completed on "
                f"the promoted replica (s), cluster-node-timeout 1 s, "
                f"{len(times)} rounds | p50 {statistics.median(times):.2f}, max "
                f"{max(times):.2f} | each: {', '.join(f'{t:.2f}' for t in times)} |")
    per_shard = agg[3][1]
    for shards in (10, 30):
        rows.append(f"| projected: {shards} shards at one core each, {per_shard:.1f} us of "
                    f"Redis CPU per task | {shards * 1e6 / per_shard:,.0f} tasks/s | "
                    f"the Redis side only (1e6 / CPU per task per shard) |")
    took = time.monotonic() - started
    table = "\n".join(["| figure | measured | notes |", "|---|---:|---|", *rows])
    print(table)
    if docs is not None:
        write_block("scaling", table.splitlines(), "python -m benchmarks.scaling",
                    machine_info(None, f"Redis 7 ({binary})"), took, docs)


if __name__ == "__main__":
    main()
