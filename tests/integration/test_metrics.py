"""``mtq metrics serve`` as a real subprocess against a real redis-server, scraped over
real HTTP (httpx) and parsed with prometheus_client's own parser: the counters of a
known workload run by a real ``mtq worker run``, an outage of Redis (``mtq_up 0``,
then 1 again), and the bad-input exits (unknown queue 3, port in use 2)."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import mtq
from tests.conftest import PY, RedisServer, free_port, wait_for

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
