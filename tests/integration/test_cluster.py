"""mtq on a real Redis Cluster: 3 primaries and 3 replicas on loopback (tests/support/clusters.py).

The main paths of the single-Redis suite, against the cluster: submit, claim and results
through real ``mtq worker run`` processes, FIFO per stream, tokens over sharded pub/sub,
a worker killed with SIGKILL mid-task, cancel, and the commands that span queues (queues
on every shard). The failover tests (a primary killed) are in test_cluster_failover.py.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

import mtq
from mtq import admin
from mtq.broker import cluster as mcluster
from mtq.broker.connection import connect, safe_url
from mtq.broker.keys import QueueKeys
from mtq.workers import control
from mtq.workers.registry import list_workers
from tests.support.clusters import Cluster
from tests.support.processes import kill_process, worker_process
from tests.support.supervisors import read_log, wait_workers
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def the_cluster(redis_cluster: Cluster) -> Cluster:
    """The session's cluster (tests/integration/conftest.py): nodes are not killed here."""
    return redis_cluster


@pytest.fixture
def url(the_cluster: Cluster) -> str:
    return the_cluster.url


@pytest.fixture
def redis_url(url: str) -> str:
    """The cluster's URL for the conftest fixtures this module uses (subprocess_env,
    and supervise, from tests/integration/conftest.py)."""
    return url


class Workers:
    """``mtq worker run`` processes on the cluster, killed at the end."""

    def __init__(self, env: dict[str, str], tmp: Path) -> None:
        self.env, self.tmp = env, tmp
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, target: str, queue: str, *args: str, **env: str) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"worker-{len(self.procs)}.log", "wb")
        p = worker_process([target, "--queue", queue, *args], {**self.env, **env}, log)
        self.procs.append(p)
        return p

    def output(self) -> str:
        return "\n".join((self.tmp / f"worker-{i}.log").read_text(errors="replace")
                         for i in range(len(self.procs)))

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                kill_process(p)


@pytest.fixture
def workers(subprocess_env: dict[str, str], tmp_path: Path) -> Iterator[Workers]:
    # conftest's subprocess_env, with this module's redis_url: the cluster's
    w = Workers(subprocess_env, tmp_path)
    yield w
    w.stop()


def queue_on_each_shard(c: Cluster, n: int = 3) -> list[str]:
    """Queue names whose slots are served by ``n`` different primaries."""
    seen: dict[int, str] = {}
    while len(seen) < n:
        name = "c-" + uuid.uuid4().hex[:10]
        seen.setdefault(c.owner(QueueKeys(name).ready).port, name)
    return list(seen.values())


def node_calls(c: Cluster, port: int, command: str) -> int:
    node = next(n for n in c.nodes if n.port == port)
    client = node.client()
    try:
        stats = client.info("commandstats").get(f"cmdstat_{command}", {})
        return int(stats.get("calls", 0))
    finally:
        client.close()


def test_a_cluster_url_gives_a_client_of_the_queues_own_primary(the_cluster: Cluster,
                                                                url: str) -> None:
    names = queue_on_each_shard(the_cluster)
    for name in names:
        q = mtq.Queue(name, url)
        assert isinstance(q.redis, redis.Redis) and not mcluster.is_cluster(q.redis)
        assert q.redis.connection_pool.owner()[1] == the_cluster.owner(q.broker.keys.ready).port
        assert mcluster.is_cluster(q.broker.shared)
        assert mcluster.sharded(q.redis), "Redis 7: pub/sub is sharded"
    # one slot client per slot and process, shared by every queue object of it
    assert mtq.Queue(names[0], url).redis is mtq.Queue(names[0], url).redis


def test_a_script_run_on_the_cluster_client_itself_is_routed_by_its_keys(
        the_cluster: Cluster, url: str) -> None:
    """mtq passes a queue's slot client to its scripts; one given the cluster client
    (a caller of mtq.broker.protocol.read_traces, say) still runs, routed by redis-py."""
    from mtq.broker.protocol import read_traces

    for name in queue_on_each_shard(the_cluster):
        q = mtq.Queue(name, url)
        try:
            t = q.submit({"x": 1})
            assert read_traces(q.broker.shared, name, [t.id]) == \
                read_traces(q.redis, name, [t.id])
            assert [line.split(b"|")[1]
                    for line in read_traces(q.broker.shared, name, [t.id])[0]] == [b"queued"]
        finally:
            q.delete()  # the module's cluster is shared: the dashboard test counts queues


def test_submit_work_and_results_on_queues_of_every_shard(the_cluster: Cluster, url: str,
                                                          workers: Workers) -> None:
    names = queue_on_each_shard(the_cluster)
    for name in names:
        workers.start("tests.handlers:double", name)
    tasks = {name: mtq.Queue(name, url).submit_many([{"x": i} for i in range(300)])
             for name in names}
    for name, ts in tasks.items():
        assert [t.result(timeout=60) for t in ts] == [2 * i for i in range(300)], name
    # the cross-queue reads see every shard's queue
    snap = admin.snapshot(mcluster.shared(mtq.Queue(names[0], url).redis))
    for name in names:
        v = snap.queue(name)
        assert v is not None and v.succeeded == 300 and v.waiting == 0, v
    wait_for(lambda: {w["queue"] for w in list_workers(
        mtq.Queue(names[0], url).redis)} >= set(names), 20, "the workers did not register")
    out = subprocess.run([sys.executable, "-m", "mtq", "status"], env=workers.env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for name in names:
        assert name in out.stdout, out.stdout


def test_a_chain_across_three_shards_hands_off_and_streams(the_cluster: Cluster, url: str,
                                                           workers: Workers) -> None:
    """A chain whose three queues live on three primaries: each hand-off's record is in
    its acked task's slot, the next step goes to its own shard, and the streaming step's
    tokens reach the chain's reader (docs/streaming.md, "Chains")."""
    a, b, c = queue_on_each_shard(the_cluster)
    workers.start("tests.handlers:identity", a)
    workers.start("tests.handlers:chunks", b)
    workers.start("tests.handlers:identity", c)
    task = mtq.Queue(a, url).submit({"words": ["x", "y"]}, stream="u1", then=[
        mtq.Step(b, pick="words", field="chunks"), c])
    chain = task.chain()
    assert list(chain.tokens(timeout=60)) == ["x", "y"]
    assert chain.result(timeout=30) == 2
    assert [s.status for s in chain.steps()] == ["succeeded"] * 3
    assert [t.info().stream for t in chain.tasks] == ["u1"] * 3


def test_order_per_stream_holds_with_two_workers(the_cluster: Cluster, url: str,
                                                 workers: Workers, tmp_path: Path) -> None:
    name = queue_on_each_shard(the_cluster, 1)[0]
    log = tmp_path / "calls.log"
    for _ in range(2):
        workers.start("tests.handlers:logged", name, "--batch-size", "4",
                      MTQ_TEST_LOG=str(log))
    q = mtq.Queue(name, url)
    wait_for(lambda: len(list_workers(q.redis, name)) == 2, 30,
             f"the two workers did not register\n{workers.output()}")
    tasks = [q.submit({"s": f"s{i % 5}", "i": i, "sleep": 0.002}, stream=f"s{i % 5}")
             for i in range(200)]
    for t in tasks:
        t.result(timeout=60)
    calls = read_log(log)
    starts: dict[str, list[int]] = {}
    running: dict[str, str] = {}
    for c in calls:
        for k in c.keys:
            s, i = k.split(":")
            if c.tag == "B":
                assert s not in running, f"two tasks of stream {s} ran at once"
                running[s] = i
                starts.setdefault(s, []).append(int(i))
            elif c.tag == "D":
                running.pop(s, None)
    for s, order in starts.items():
        assert order == sorted(order), f"stream {s} ran out of order: {order}"
    assert len({c.pid for c in calls}) == 2, "both workers took part"


def test_a_tenant_fair_queue_on_each_shard(the_cluster: Cluster, url: str,
                                          workers: Workers) -> None:
    """Scheduling's keys (lanes, virtual times, counts) live in the queue's slot: claims
    share the served cost between tenants by weight, and a worker drains it."""
    for name in queue_on_each_shard(the_cluster):
        q = mtq.Queue(name, url, tenant_weights="a=3")
        try:
            c = mtq.Consumer(name, url, settings=q.settings, worker_id="w-" + name)
            for i in range(40):
                q.submit({"x": i}, stream=f"a{i % 8}", tenant="a", cost=10)
                q.submit({"x": i}, stream=f"b{i % 2}", tenant="b", cost=10)
            q.submit({"x": -1}, priority="interactive", tenant="b", cost=10)
            first = c.claim(1)
            assert first[0].stream is None, "the interactive task goes first"
            c.settle([mtq.Outcome(first[0], ok=True, value=0)])
            taken = []
            for _ in range(20):
                (t,) = c.claim(1)
                taken.append(t.stream[0])
                c.settle([mtq.Outcome(t, ok=True, value=0)])
            # weight 3 to 1: a takes three tasks of like cost for each of b's
            assert taken.count("a") == 15, taken
            served = {k.decode(): float(v) for k, v in
                      q.redis.hgetall(q.broker.keys.sched + "served").items()}
            assert served == {"i:b": 10.0, "s:a": 150.0, "s:b": 50.0}, served
            workers.start("tests.handlers:double", name)
            wait_for(lambda q=q: q.stats()["succeeded"] == 81, 60,
                     f"the worker did not drain {name}\n{workers.output()}")
            counts = {k.decode(): float(v) for k, v in
                      q.redis.hgetall(q.broker.keys.sched + "count").items()}
            assert counts.get("s:a|w") == counts.get("s:b|w") == 0, counts
        finally:
            workers.stop()
            workers.procs.clear()
            q.delete()


def test_tokens_stream_over_sharded_pubsub(the_cluster: Cluster, url: str,
                                           workers: Workers) -> None:
    name = queue_on_each_shard(the_cluster, 1)[0]
    owner = the_cluster.owner(QueueKeys(name).ready).port
    others = [n.port for n in the_cluster.primaries() if n.port != owner]
    before = {p: node_calls(the_cluster, p, "spublish") for p in [owner, *others]}
    published = {p: node_calls(the_cluster, p, "publish") for p in [owner, *others]}
    workers.start("tests.handlers:chunks", name)
    q = mtq.Queue(name, url)
    chunks = [f"tok{i}" for i in range(50)]
    t = q.submit({"chunks": chunks})
    assert list(t.tokens(timeout=60)) == chunks
    assert t.result(timeout=10) == 50
    assert node_calls(the_cluster, owner, "spublish") > before[owner]
    for p in others:  # nothing of this queue travelled to, or through, the other shards
        assert node_calls(the_cluster, p, "spublish") == before[p]
    for p in [owner, *others]:
        assert node_calls(the_cluster, p, "publish") - published[p] <= 2, \
            "events go out with SPUBLISH (a PUBLISH or two: the hub's own pokes)"


def test_a_worker_killed_mid_task_its_task_runs_again_and_ends_once(
        the_cluster: Cluster, url: str, workers: Workers, tmp_path: Path) -> None:
    name = queue_on_each_shard(the_cluster, 1)[0]
    log, gate = tmp_path / "calls.log", tmp_path / "gate"
    gate.touch()
    first = workers.start("tests.handlers:gated", name, "--lease-ms", "1000",
                          MTQ_TEST_LOG=str(log))
    q = mtq.Queue(name, url)
    t = q.submit({"s": "k", "i": 1, "gate": str(gate)})

    def starts() -> int:
        return sum(c.tag == "B" and "k:1" in c.keys for c in read_log(log))

    wait_for(lambda: starts() == 1, 30, f"the task did not start\n{workers.output()}")
    first.kill()
    first.wait(10)
    workers.start("tests.handlers:gated", name, MTQ_TEST_LOG=str(log))
    # its lease runs out on the shard: it runs again, on the new worker
    wait_for(lambda: starts() == 2, 30,
             f"the task of the killed worker did not run again\n{workers.output()}")
    gate.unlink()
    assert t.result(timeout=30)["i"] == 1
    assert sum(c.tag == "D" and "k:1" in c.keys for c in read_log(log)) == 1
    assert q.stats()["redelivered"] == 1
    assert [e.kind for e in t.trace()] == \
        ["queued", "started", "restarted", "started", "succeeded"]


def test_cancel_reaches_the_worker_through_the_shard(the_cluster: Cluster, url: str,
                                                    workers: Workers) -> None:
    name = queue_on_each_shard(the_cluster, 1)[0]
    workers.start("tests.models:Counter", name)
    q = mtq.Queue(name, url)
    # a generation of 500 tokens, 20 ms a step (10 s), streamed from its own outlet
    running = q.submit({"n": 500, "step_ms": 20}, stream="c")
    waiting = q.submit({"n": 2}, stream="c")  # behind it: not claimable
    tokens = running.tokens(timeout=30)
    assert [next(tokens), next(tokens)] == [0, 1], "tokens reach the client over the shard"
    assert waiting.cancel() and waiting.status() == "cancelled"
    t0 = time.monotonic()
    assert not running.cancel()  # running: its worker is told (cancel.lua SPUBLISHes)
    wait_for(lambda: running.status() == "cancelled", 5,
             "the running generator was not stopped at its next step")
    assert time.monotonic() - t0 < 5
    assert [e.kind for e in running.events(timeout=5)][-1] == "cancelled"


def test_control_commands_reach_the_workers_of_the_queue_through_its_shard(
        the_cluster: Cluster, url: str, workers: Workers) -> None:
    name = queue_on_each_shard(the_cluster, 1)[0]
    workers.start("tests.handlers:double", name)
    q = mtq.Queue(name, url)
    assert q.submit({"x": 1}).result(timeout=30) == 2

    def state() -> set[str]:
        return {w["state"] for w in list_workers(q.redis, name)}

    # SPUBLISH counts the listeners on the queue's shard: the worker's control listener
    wait_for(lambda: control.send(connect(url), name, "pause") == 1, 10,
             "the worker does not listen on the queue's shard")
    wait_for(lambda: state() == {"paused"}, 20, "the worker did not pause")
    t = q.submit({"x": 2})
    assert t.status() == "queued"
    assert control.send(connect(url), name, "resume") == 1
    assert t.result(timeout=30) == 4


def test_queue_config_and_delete_on_a_cluster(the_cluster: Cluster, url: str) -> None:
    name = queue_on_each_shard(the_cluster, 1)[0]
    q = mtq.Queue(name, url)
    assert q.configure(max_length=3).max_length == 3
    q.submit_many([{"i": i} for i in range(3)])
    with pytest.raises(mtq.QueueFull):
        q.submit({"i": 4})
    assert name in admin.queue_names(q.redis)
    assert q.broker.delete_queue() > 0
    assert name not in admin.queue_names(q.redis)


@pytest.mark.parametrize("bad", [
    "redis+cluster://",
    "redis+cluster://127.0.0.1",
    "redis+cluster://127.0.0.1:notaport",
    "redis+cluster://127.0.0.1:7000/3",
    "redis+sentinel://127.0.0.1:26379",
    "redis+cluster://127.0.0.1:7000?ssl_ca_certs=/etc/hosts",
])
def test_bad_cluster_and_sentinel_urls_are_named_errors(bad: str) -> None:
    with pytest.raises(mtq.ConfigError, match="invalid Redis URL"):
        connect(bad)


def test_an_unreachable_cluster_is_redis_unavailable() -> None:
    with pytest.raises(mtq.RedisUnavailable, match="cluster"):
        connect("redis+cluster://127.0.0.1:1,127.0.0.1:2")


def test_safe_url_hides_the_password_of_every_form() -> None:
    assert safe_url("redis+cluster://u:pw@h1:1,h2:2/0") == "redis+cluster://u:***@h1:1,h2:2/0"
    assert safe_url("redis+sentinel://:pw@h1:1,h2:2/svc") == "redis+sentinel://:***@h1:1,h2:2/svc"
    assert safe_url("redis://h:1/0") == "redis://h:1/0"



def test_the_exporter_and_the_dashboard_read_queues_of_every_shard(
        the_cluster: Cluster, url: str, workers: Workers) -> None:
    from prometheus_client import generate_latest

    from mtq.metrics import MtqCollector, exporter_client, registry_of

    names = queue_on_each_shard(the_cluster)
    for i, name in enumerate(names):
        mtq.Queue(name, url).submit_many([{"x": j} for j in range(i + 1)])
    text = generate_latest(registry_of(MtqCollector(exporter_client(url), None))).decode()
    assert "mtq_up 1.0" in text
    for i, name in enumerate(names):
        assert f'mtq_queue_waiting_tasks{{queue="{name}"}} {float(i + 1)}' in text, text[:2000]
    # a frame tall enough for every queue: the session's cluster holds other tests' too
    # (past its height the list ends with "... N more")
    out = subprocess.run([sys.executable, "-m", "mtq", "dashboard", "--once"],
                         env={**workers.env, "LINES": "1000", "COLUMNS": "160"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert not re.search(r"… \d+ more", out.stdout), out.stdout[-2000:]
    for name in names:
        assert name in out.stdout, out.stdout[-2000:]


def test_a_supervisor_gives_back_the_task_of_a_killed_worker_at_once(
        the_cluster: Cluster, url: str, supervise: Any, tmp_path: Path) -> None:
    # the supervisor waits for the dead worker's connections to the queue's node to
    # close (CLIENT LIST there), then gives its task back: no lease to wait for
    name = queue_on_each_shard(the_cluster, 1)[0]
    log, gate = tmp_path / "calls.log", tmp_path / "gate"
    gate.touch()
    sup = supervise("tests.handlers:gated", name, "--lease-ms", "60000",
                    env={"MTQ_TEST_LOG": str(log)})
    shared = connect(url)
    (w,) = wait_workers(shared, name, 1, sup)
    q = mtq.Queue(name, url)
    t = q.submit({"s": "g", "i": 1, "gate": str(gate)})
    wait_for(lambda: [c.pid for c in read_log(log) if c.tag == "B"] == [w["pid"]], 30,
             f"the task did not start\n{sup.output()}")
    os.kill(w["pid"], signal.SIGKILL)
    killed = time.monotonic()
    wait_for(lambda: sum(c.tag == "B" for c in read_log(log)) == 2, 30,
             f"the task did not run again\n{sup.output()}")
    assert time.monotonic() - killed < 15, "given back at once, not after its 60 s lease"
    gate.unlink()
    assert t.result(timeout=30)["i"] == 1
    assert sum(c.tag == "D" for c in read_log(log)) == 1


@pytest.mark.parametrize("form", ["redis+cluster://127.0.0.1:7000",
                                  "redis+sentinel://127.0.0.1:26379/main"])
def test_the_rq_bridge_refuses_a_cluster_or_sentinel_url_by_name(form: str) -> None:
    out = subprocess.run([sys.executable, "-m", "mtq", "rq", "worker", "default", "--url", form],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "RQ's keys carry no hash tags" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
def test_the_demo_runs_on_the_cluster(url: str, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # the README's main job, end to end on the cluster: two supervised models, a
    # worker SIGKILLed mid-batch, and the demo's own checks (nothing lost, nothing
    # finished twice, order per stream, tokens spell the results, no process left)
    from mtq.demo import run

    monkeypatch.setenv("MTQ_HOME", str(tmp_path / "home"))
    report = run(url, users=8, chats_per_user=2, embeds_per_user=3, duration_s=5)
    assert not report.skipped
    assert report.ok, (report.order_errors, report.chat, report.embed, report.log)
    assert report.killed_pid is not None and report.killed_held_done == report.killed_held
    assert report.checks() == dict.fromkeys(report.checks(), True)
    assert report.processes_left == []
