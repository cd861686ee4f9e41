"""``mtq metrics serve`` as a real subprocess against a real redis-server, scraped over
real HTTP (httpx) and parsed with prometheus_client's own parser: the counters of a
known workload run by a real ``mtq worker run``, an outage of Redis (``mtq_up 0``,
then 1 again), and the bad-input exits (unknown queue 3, port in use 2)."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

import mtq
import mtq.workers.registry
from mtq.broker import catalogue
from mtq.broker.consumer import Consumer
from mtq.broker.keys import QueueKeys
from tests.support.paths import PY
from tests.support.processes import free_port
from tests.support.servers import RedisServer
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(60)

Samples = dict[tuple[str, str | None], float]


def scrape(port: int) -> Samples | None:
    """Every sample by (name, queue label), or None while the exporter does not answer."""
    try:
        res = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
    except httpx.TransportError:
        return None
    assert res.status_code == 200, res.text
    out: Samples = {}
    for family in text_string_to_metric_families(res.text):
        for s in family.samples:
            out[(s.name, s.labels.get("queue"))] = s.value
    return out


def start_exporter(env: dict[str, str], *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([PY, "-m", "mtq", "metrics", "serve", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.fixture
def exporter(subprocess_env: dict[str, str]) -> Iterator[tuple[int, list[subprocess.Popen[bytes]]]]:
    """A port, and the processes a test started on it (stopped with SIGTERM after)."""
    started: list[subprocess.Popen[bytes]] = []
    yield free_port(), started
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(10) == 0, "the exporter did not exit 0 on SIGTERM"


def test_counters_match_a_real_workload(qname: str, redis_url: str, exporter: tuple[
        int, list[subprocess.Popen[bytes]]], subprocess_env: dict[str, str]) -> None:
    n, m = 12, 4
    q = mtq.Queue(qname, redis_url)
    q.configure(max_retries=0, retry_backoff_ms=0)  # a failure dead-letters at once
    q.submit_many([{"i": i, "fail": i < m} for i in range(n)])
    worker = subprocess.run(
        [PY, "-m", "mtq", "worker", "run", "tests.handlers:fail_if", "-q", qname, "--burst",
         "--batch-size", "4"], env=subprocess_env, capture_output=True, timeout=40)
    assert worker.returncode == 0, worker.stderr.decode()[-2000:]

    port, started = exporter
    started.append(start_exporter(subprocess_env, "--port", str(port), "-q", qname))
    got = wait_for(lambda: scrape(port), 15, f"the exporter never answered on port {port}")
    assert got[("mtq_up", None)] == 1
    assert got[("mtq_tasks_submitted_total", qname)] == n
    assert got[("mtq_tasks_succeeded_total", qname)] == n - m
    assert got[("mtq_tasks_dead_lettered_total", qname)] == m
    assert got[("mtq_tasks_failed_total", qname)] == 0  # dead-lettered, not failed
    assert got[("mtq_tasks_retried_total", qname)] == 0
    assert got[("mtq_queue_waiting_tasks", qname)] == 0
    assert got[("mtq_queue_running_tasks", qname)] == 0
    assert got[("mtq_queue_dead_tasks", qname)] == m
    assert 0 < got[("mtq_scrape_duration_seconds", None)] < 5
    # only the queue asked for
    assert {queue for _, queue in got} == {None, qname}


def test_a_redis_outage_reads_up_0_and_the_exporter_recovers(
        tmp_path: Path, subprocess_env: dict[str, str],
        exporter: tuple[int, list[subprocess.Popen[bytes]]]) -> None:
    server = RedisServer(tmp_path)  # a private server: the session's one stays up
    server.start()
    try:
        mtq.Queue("outage", server.url).submit({"x": 1})
        env = {**subprocess_env, "MTQ_REDIS_URL": server.url}
        port, started = exporter
        started.append(start_exporter(env, "--port", str(port)))  # every queue
        got = wait_for(lambda: scrape(port), 15, "the exporter never answered")
        assert got[("mtq_up", None)] == 1 and got[("mtq_tasks_submitted_total", "outage")] == 1

        server.stop()
        got = wait_for(lambda: (s := scrape(port)) and s[("mtq_up", None)] == 0 and s, 10,
                       "no scrape answered mtq_up 0 after Redis stopped")
        assert ("mtq_tasks_submitted_total", "outage") not in got  # no stale figures

        server.start()  # the same port
        mtq.Queue("outage", server.url).submit({"x": 2})  # a fresh server: counts anew
        got = wait_for(lambda: (s := scrape(port)) and s[("mtq_up", None)] == 1 and s, 10,
                       "mtq_up did not return to 1 after Redis came back")
        assert got[("mtq_tasks_submitted_total", "outage")] == 1
    finally:
        server.stop()


def test_an_unknown_queue_exits_3_naming_it(subprocess_env: dict[str, str],
                                             qname: str) -> None:
    res = subprocess.run([PY, "-m", "mtq", "metrics", "serve", "--port", "0", "-q", qname],
                         env=subprocess_env, capture_output=True, text=True, timeout=20)
    assert res.returncode == 3, res.stderr
    assert f"no queue named '{qname}'" in res.stderr


def test_a_port_in_use_exits_2(subprocess_env: dict[str, str], exporter: tuple[
        int, list[subprocess.Popen[bytes]]]) -> None:
    port, started = exporter
    started.append(start_exporter(subprocess_env, "--port", str(port)))
    wait_for(lambda: scrape(port), 15, "the first exporter never answered")
    res = subprocess.run([PY, "-m", "mtq", "metrics", "serve", "--port", str(port)],
                         env=subprocess_env, capture_output=True, text=True, timeout=20)
    assert res.returncode == 2, res.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in res.stderr


# -- histograms and per-worker figures (issue 18) -------------------------------------

Sample = tuple[str, dict[str, str], float]


def scrape_samples(port: int) -> list[Sample] | None:
    """Every sample with all its labels, or None while the exporter does not answer."""
    try:
        res = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
    except httpx.TransportError:
        return None
    assert res.status_code == 200, res.text
    return [(s.name, dict(s.labels), s.value)
            for family in text_string_to_metric_families(res.text) for s in family.samples]


def histogram(samples: list[Sample], name: str, **labels: str) -> tuple[
        list[tuple[float, float]], float, float] | None:
    """(cumulative buckets by le, count, sum) of one series, checked well formed:
    buckets monotone and ending with +Inf == count; None when the series is absent."""
    def mine(s: Sample) -> bool:
        return all(s[1].get(k) == v for k, v in labels.items())

    buckets = sorted((float(s[1]["le"]), s[2]) for s in samples
                     if s[0] == f"{name}_bucket" and mine(s))
    count = [s[2] for s in samples if s[0] == f"{name}_count" and mine(s)]
    total = [s[2] for s in samples if s[0] == f"{name}_sum" and mine(s)]
    if not buckets:
        assert not count and not total, f"{name}: a count or sum without buckets"
        return None
    assert len(count) == 1 and len(total) == 1, f"{name} {labels}: one series expected"
    values = [v for _, v in buckets]
    assert values == sorted(values), f"{name}: buckets not cumulative: {buckets}"
    assert buckets[-1][0] == float("inf") and values[-1] == count[0], buckets
    return buckets, count[0], total[0]


def value(samples: list[Sample], name: str, **labels: str) -> float | None:
    found = [s[2] for s in samples
             if s[0] == name and all(s[1].get(k) == v for k, v in labels.items())]
    assert len(found) <= 1, f"{name} {labels}: {len(found)} samples"
    return found[0] if found else None


def test_histograms_and_worker_figures_of_a_real_worker(
        qname: str, redis_url: str, subprocess_env: dict[str, str],
        exporter: tuple[int, list[subprocess.Popen[bytes]]]) -> None:
    n, m = 14, 3  # m fail twice: a retry, then a dead letter
    q = mtq.Queue(qname, redis_url)
    q.configure(max_retries=1, retry_backoff_ms=0)
    q.submit_many([{"i": i, "fail": i < m} for i in range(n)])
    worker = subprocess.Popen(
        [PY, "-m", "mtq", "worker", "run", "tests.handlers:fail_if", "-q", qname,
         "--batch-size", "4"], env=subprocess_env, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE)
    try:
        port, started = exporter
        started.append(start_exporter(subprocess_env, "--port", str(port), "-q", qname))

        def settled() -> list[Sample] | None:
            s = scrape_samples(port)
            done = s is not None and value(s, "mtq_tasks_succeeded_total", queue=qname) == n - m \
                and value(s, "mtq_tasks_dead_lettered_total", queue=qname) == m \
                and value(s, "mtq_worker_tasks_total", queue=qname) == n + m \
                and value(s, "mtq_workers", queue=qname, state="idle") == 1  # a beat since
            return s if done else None

        got = wait_for(settled, 30, "the worker did not run every delivery (or report them)")
        # per worker, while it runs: labels, batch sizes, busy seconds
        [entry] = [w for w in mtq.workers.registry.list_workers(redis.Redis.from_url(redis_url))
                   if w["queue"] == qname]
        labels = {"queue": qname, "worker": entry["id"], "host": entry["host"],
                  "device": "cpu", "model": entry["model"]}
        batches = histogram(got, "mtq_worker_batch_size", **labels)
        assert batches is not None and batches[1] == entry["batches"] > 0
        assert batches[2] == n + m  # the sum of the batch sizes: every delivery ran
        assert dict(batches[0])[4.0] == batches[1]  # --batch-size 4: none above
        assert (value(got, "mtq_worker_busy_seconds_total", **labels) or 0) > 0
        assert value(got, "mtq_worker_restarts_total", **labels) == 0  # no supervisor
        assert value(got, "mtq_worker_device_memory_bytes", queue=qname) is None  # CPU
        assert entry["started"] <= time.time() and entry["busy_s"] > 0
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(20) == 0, worker.stderr.read().decode()[-2000:] \
            if worker.stderr else ""
    # stopped cleanly: its last observations were written on the way out
    got = wait_for(lambda: scrape_samples(port), 10, "the exporter stopped answering")
    assert value(got, "mtq_workers", queue=qname, state="idle") is None
    latency = histogram(got, "mtq_task_latency_seconds", queue=qname)
    wait = histogram(got, "mtq_queue_wait_seconds", queue=qname)
    run = histogram(got, "mtq_task_run_seconds", queue=qname)
    assert latency and wait and run
    assert latency[1] == n  # each task ended once (succeeded or dead), retries not counted
    assert wait[1] == run[1] == n + m  # per delivery
    for h in (latency, wait, run):
        assert 0 <= h[2] < 30 * h[1], f"implausible sum {h}"
    assert latency[2] >= wait[2] / 2  # a task's latency includes its last wait
    assert histogram(got, "mtq_generation_ttft_seconds", queue=qname) is None
    assert value(got, "mtq_cache_hits_total", queue=qname) == 0  # no cache: zeros
    assert value(got, "mtq_cache_entries", queue=qname) == 0


def test_generations_give_ttft_and_tokens_per_second(
        qname: str, redis_url: str, subprocess_env: dict[str, str],
        exporter: tuple[int, list[subprocess.Popen[bytes]]]) -> None:
    k = 6
    q = mtq.Queue(qname, redis_url)
    q.submit_many([{"n": 5, "start": i} for i in range(k)])
    res = subprocess.run([PY, "-m", "mtq", "worker", "run", "tests.models:Counter", "-q",
                          qname, "--burst"], env=subprocess_env, capture_output=True, timeout=60)
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    port, started = exporter
    started.append(start_exporter(subprocess_env, "--port", str(port), "-q", qname))
    got = wait_for(lambda: scrape_samples(port), 15, "the exporter never answered")
    ttft = histogram(got, "mtq_generation_ttft_seconds", queue=qname)
    rate = histogram(got, "mtq_generation_tokens_per_second", queue=qname)
    latency = histogram(got, "mtq_task_latency_seconds", queue=qname)
    assert ttft and rate and latency
    assert ttft[1] == rate[1] == latency[1] == k
    assert 0 < ttft[2] <= latency[2]
    assert rate[2] > 0


def test_metrics_false_writes_no_histograms(
        qname: str, redis_url: str, subprocess_env: dict[str, str], r: redis.Redis) -> None:
    from mtq.broker.keys import QueueKeys

    q = mtq.Queue(qname, redis_url)
    q.submit({"i": 0})
    res = subprocess.run([PY, "-m", "mtq", "queue", "config", qname, "metrics", "false"],
                         env=subprocess_env, capture_output=True, text=True, timeout=20)
    assert res.returncode == 0, res.stderr
    q.submit_many([{"i": i} for i in range(1, 5)])
    res = subprocess.run([PY, "-m", "mtq", "worker", "run", "tests.handlers:fail_if", "-q",
                          qname, "--burst"], env=subprocess_env, capture_output=True,
                         timeout=40)
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    assert q.stats()["succeeded"] == 5
    assert not r.exists(QueueKeys(qname).hist)


def test_a_failed_flush_loses_nothing_and_doubles_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mtq.broker.keys import QueueKeys
    from mtq.settings import QueueSettings
    from mtq.workers.model import FunctionModel
    from mtq.workers.worker import Worker
    from tests.handlers import identity
    from tests.support.workers import Running

    server = RedisServer(tmp_path, appendonly=True)  # what was written survives a restart
    server.start()
    client = redis.Redis.from_url(server.url)
    # the heartbeat writes at start, then not again during this test (a beat every
    # 200 s): the test drives the writes itself, around an outage
    monkeypatch.setattr("mtq.workers.heartbeat.BEAT_S", 3600.0)
    # the flush during the outage fails at once, not after a dropped connection's
    # retries (about 4 s; the flushes after it are retried by the wait below)
    monkeypatch.setenv("MTQ_REDIS_RETRIES", "0")
    settings = QueueSettings(lease_ms=600_000, retry_backoff_ms=0)
    n = 9
    running: Running | None = None
    try:
        q = mtq.Queue("flush", server.url)
        w = Worker(FunctionModel(identity), "flush", url=server.url, settings=settings)
        running = Running(w)
        wait_for(lambda: mtq.workers.registry.list_workers(client), 10,
                 "the worker's first beat did not come")  # the last one before the outage
        q.submit_many([{"i": i} for i in range(n)])
        wait_for(lambda: q.stats()["succeeded"] == n, 20, "the worker did not run the tasks")
        key = QueueKeys("flush").hist

        def count(metric: str) -> int:
            return sum(int(v) for f, v in client.hgetall(key).items()
                       if f.decode().startswith(metric + ":") and not f.endswith(b":sum"))

        def pending() -> int:
            return sum(w.stats.pending()["latency"])

        wait_for(lambda: count("latency") + pending() == n, 5,
                 "the worker did not observe every outcome")
        assert pending() > 0, "written before the outage: nothing left to test"
        count_before_outage = count("latency")
        server.stop()
        w.heartbeat.flush_stats()  # fails: Redis is away
        assert count_before_outage + pending() == n, "a failed write dropped its counts"
        server.start()  # the same port, the same data (append-only file)
        wait_for(lambda: (w.heartbeat.flush_stats(), count("latency"))[1] == n, 10,
                 "the histograms were not written once Redis came back")
        assert not any(sum(c) for c in w.stats.pending().values())
        w.heartbeat.flush_stats()  # nothing pending: nothing written twice
        running.stop()  # the last write on the way out adds nothing either
        running = None
        assert count("latency") == n and count("queue_wait") == n and count("run") == n
    finally:
        if running is not None:
            running.stop()
        client.close()
        server.stop()


def test_cache_cancel_and_expiry_figures_over_http(
        qname: str, redis_url: str, subprocess_env: dict[str, str],
        exporter: tuple[int, list[subprocess.Popen[bytes]]]) -> None:
    """A miss, a join, a hit, an entry freed by a cancel, a task expired at claim: each
    counted once, and mtq_cache_entries the one entry left."""
    client = redis.Redis.from_url(redis_url)
    q = mtq.Queue(qname, redis_url, client=client)
    q.configure(cache_ttl_s=300)
    catalogue.record(client, qname, {"event": "loaded"},
                     {"target": "t:m", "version": "v1", "kind": "function",
                      "deterministic": 0, "cacheable": 1})
    first = q.submit({"i": 1})  # a miss: runs, and owns the entry
    assert q.submit({"i": 1}).id == first.id  # joins it while it waits
    doomed = q.submit({"i": 2})  # a miss whose entry its cancel frees
    assert doomed.cancel()
    late = q.submit({"i": 3}, ttl=0.001, cache=False)
    deadline = int(client.hget(QueueKeys(qname).task(late.id), "deadline") or 0)
    assert deadline > 0
    wait_for(lambda: (lambda t: int(t[0]) * 1000 + int(t[1]) // 1000)(client.time()) > deadline,
             5, "the server's clock never passed the task's deadline")
    c = Consumer(qname, client=client)
    c.broker.model_version = "v1"
    [claimed] = c.claim(10)  # the expired one ends at claim
    assert claimed.id == first.id
    assert c.settle([mtq.Outcome(claimed, ok=True, value="r")]).succeeded == 1
    hit = q.submit({"i": 1})
    assert hit.cached and hit.result(timeout=5) == "r"

    port, started = exporter
    started.append(start_exporter(subprocess_env, "--port", str(port), "-q", qname))
    got = wait_for(lambda: scrape(port), 15, f"the exporter never answered on port {port}")
    assert got[("mtq_cache_misses_total", qname)] == 2
    assert got[("mtq_cache_joined_total", qname)] == 1
    assert got[("mtq_cache_hits_total", qname)] == 1
    assert got[("mtq_cache_entries", qname)] == 1, "the cancelled task's entry is still counted"
    assert got[("mtq_tasks_cancelled_total", qname)] == 1
    assert got[("mtq_tasks_expired_total", qname)] == 1
    assert got[("mtq_tasks_succeeded_total", qname)] == 2  # the run and the hit
