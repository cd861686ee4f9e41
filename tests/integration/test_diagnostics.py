"""A queue's diagnostics (the batch log, the latency and failures lists, the histograms)
are bounded by count, bytes and age, set per queue (docs/operations.md, "Diagnostics
kept in Redis"); what reads them works on what is kept."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest
import redis
from click.testing import CliRunner

import mtq
from benchmarks.control import measure_memory
from mtq.broker import config
from mtq.broker.consumer import default_worker_id
from mtq.broker.keys import QueueKeys
from mtq.broker.protocol import Broker
from mtq.broker.records import Claimed
from mtq.cli.main import cli
from mtq.errors import ConfigError
from mtq.trace import parse_record
from mtq.workers.batchlog import BatchLog, entry_bytes
from tests.support.processes import kill_process, worker_process
from tests.support.waits import wait_for


def _records(r: redis.Redis, queue: str) -> list[dict]:
    out = []
    for raw in r.lrange(QueueKeys(queue).batches, 0, -1):
        rec = parse_record(raw)
        assert rec is not None, raw
        out.append(rec)
    return out


def _worker(qname: str, env: dict[str, str], tmp_path, *args: str) -> subprocess.Popen[bytes]:
    with open(tmp_path / "worker.log", "ab") as log:
        return worker_process(["tests.handlers:fail_if", "--queue", qname, "--batch-size", "1",
                               *args], env, log)


def _settle(tasks: list[mtq.Task], timeout: float = 60) -> None:
    """Wait for each task's outcome (a failure is one)."""
    for t in tasks:
        try:
            t.result(timeout=timeout)
        except mtq.TaskFailed:
            pass


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            kill_process(proc)


def test_the_batch_log_and_latencies_keep_the_count_set_and_the_readers_read_them(
        redis_url, r, client, qname, subprocess_env, tmp_path):
    q = mtq.Queue(qname, redis_url, client=client)
    q.configure(batch_log_max=5, latency_keep=10, max_retries=0)
    k = QueueKeys(qname)
    proc = _worker(qname, subprocess_env, tmp_path)
    try:
        tasks = q.submit_many([{"i": i, "fail": i % 10 == 0} for i in range(30)])
        _settle(tasks)
        last = tasks[-1].id
        wait_for(lambda: any(last in rec["ids"] for rec in _records(r, qname)), 15,
                 "the worker's beat did not write the last task's batch record")
        assert r.llen(k.batches) == 5  # 30 batches of one task ran
        wait_for(lambda: r.llen(k.latency) == 10, 10,
                 f"the latency list was not trimmed to 10: {r.llen(k.latency)}")
        # the readers: the queue's snapshot (mtq status, dashboards), mtq trace
        pipe = client.pipeline(transaction=False)
        q.broker.snapshot_into(pipe)
        snap = Broker.parse_snapshot(pipe.execute())
        assert len(snap["latency_ms"]) == 10 and snap["failures"]
        out = tmp_path / "trace.json"
        result = CliRunner().invoke(cli, ["trace", qname, "--since", "60s", "-o", str(out),
                                          "--redis", redis_url])
        assert result.exit_code == 0, result.output
        events = json.loads(out.read_text())["traceEvents"]
        batches = [e for e in events if e.get("cat") == "batch"]
        assert 1 <= len(batches) <= 5, batches
    finally:
        _stop(proc)


def test_the_batch_log_keeps_to_its_bytes(redis_url, r, client, qname, subprocess_env,
                                          tmp_path):
    budget = 6000
    q = mtq.Queue(qname, redis_url, client=client)
    q.configure(batch_log_bytes=budget)
    k = QueueKeys(qname)
    proc = _worker(qname, subprocess_env, tmp_path)
    try:
        tasks = q.submit_many([{"i": i} for i in range(300)])
        _settle(tasks)
        last = tasks[-1].id
        wait_for(lambda: any(last in rec["ids"] for rec in _records(r, qname)), 15,
                 "the worker's beat did not write the last task's batch record")
        kept = r.llen(k.batches)
        used = r.memory_usage(k.batches, samples=0)
        assert used <= budget, (used, kept)
        assert 40 <= kept < 300, kept  # the budget is used, not the count
    finally:
        _stop(proc)


def test_a_batch_log_of_mixed_records_stays_under_its_bytes(r, qname):
    """A worker's writes, beat after beat, of records of growing size (batches of 1 to
    64 tasks): the list never goes over its byte budget by more than a record's worth
    and stays under the count."""
    k = QueueKeys(qname)
    log = BatchLog(k.batches, default_worker_id(), qname)
    log.settings = log.settings.replace(batch_log_bytes=20_000, batch_log_max=400)
    def claimed(n: int, beat: int) -> list[Claimed]:
        return [Claimed(id=f"task{beat:04d}x{i:05d}", token="t", payload=b"", stream=None,
                        attempts=0, deliveries=1, retries=None) for i in range(n)]

    for beat in range(60):
        for _ in range(5):
            log.start(claimed(1 + beat, beat))
            log.end()
        pipe = r.pipeline(transaction=False)
        log.write(pipe)
        pipe.execute()
        log.written()
        used = r.memory_usage(k.batches, samples=0)
        assert used <= 20_000 + entry_bytes(len(log._encode(("batch", 0, 0, [
            c.id for c in claimed(1 + beat, beat)])))), (beat, used)
        assert r.llen(k.batches) <= 400
        assert 0 < r.pttl(k.batches) <= 24 * 3600 * 1000


def test_diagnostics_expire_once_no_worker_writes_them(redis_url, r, client, qname,
                                                      subprocess_env, tmp_path):
    q = mtq.Queue(qname, redis_url, client=client)
    q.configure(diagnostics_ttl_s=2, max_retries=0)
    k = QueueKeys(qname)
    keys = (k.batches, k.latency, k.failures, k.hist)
    proc = _worker(qname, subprocess_env, tmp_path)
    try:
        tasks = q.submit_many([{"i": i, "fail": i == 3} for i in range(8)])
        _settle(tasks)
        wait_for(lambda: all(r.exists(key) for key in keys), 15,
                 "the worker did not write its batch log, latencies, failures and "
                 f"histograms: {[r.exists(key) for key in keys]}")
        for key in keys:  # each expires (-2: gone already), none is kept for good (-1)
            assert r.pttl(key) == -2 or 0 <= r.pttl(key) <= 2000, key
        # the worker still runs, idle: nothing refreshes them
        wait_for(lambda: not any(r.exists(key) for key in keys), 15,
                 f"diagnostics still there: {[r.exists(key) for key in keys]}")
        assert proc.poll() is None
        # and they come back with work
        q.submit({"i": 99}).result(timeout=30)
        wait_for(lambda: r.exists(k.batches) and r.exists(k.latency), 15,
                 "a new task's batch record and latency were not written")
    finally:
        _stop(proc)


@pytest.mark.parametrize("name, value, said", [
    ("batch_log_max", "-1", "batch_log_max must be in [0, "),
    ("batch_log_bytes", "lots", "batch_log_bytes takes a whole number"),
    ("latency_keep", "5000", "latency_keep must be in [1, 1000]"),
    ("latency_keep", "0", "latency_keep must be in [1, 1000]"),
    ("diagnostics_ttl_s", "0", "diagnostics_ttl_s must be in [1, "),
])
def test_bad_diagnostics_settings_are_named(redis_url, r, qname, name, value, said):
    with pytest.raises(ConfigError, match=said.replace("[", r"\[")):
        config.store(r, qname, {name: value})
    assert not r.exists(QueueKeys(qname).config)  # nothing stored
    result = CliRunner().invoke(cli, ["queue", "config", "--redis", redis_url, "--", qname,
                                      name, value])
    assert result.exit_code == 2 and name in result.output, result.output


def test_a_drained_queue_keeps_its_diagnostics_under_the_bound():
    """benchmarks.control's memory section, scaled down: 5,000 tasks over 250 streams
    through a real worker, drained, retention passed: every key left but the settings
    is under the batch log's budget and a few kilobytes (latencies, histograms,
    counters), where the batch log alone would hold about 90 kB unbounded."""
    budget = 24 * 1024
    t0 = time.monotonic()
    out = measure_memory(tasks=5_000, streams=250, settings={"batch_log_bytes": budget},
                         target=budget + 16 * 1024)
    assert out["kinds"]["batches"][1] <= budget, out["kinds"]
    assert out["kept"] < budget + 16 * 1024, out["kinds"]
    assert time.monotonic() - t0 < 120


def test_a_latency_or_failures_list_a_script_makes_expires(redis_url, r, qname):
    """The first finished task makes the latency list, the first failure the failures
    list: each is made with an expiry (the default diagnostics_ttl_s), so a list no
    worker's beat refreshes is not kept for good; a list that is there keeps its own."""
    q = mtq.Queue(qname, redis_url, max_retries=0, dead_letter=False)
    c = mtq.Consumer(qname, redis_url, settings=q.settings, worker_id="w1")
    k = QueueKeys(qname)
    day_ms = 24 * 3600 * 1000
    q.submit_many([{}] * 2)
    a, b = c.claim(2)
    c.settle([mtq.Outcome(a, ok=True), mtq.Outcome(b, ok=False, error="boom")])
    for key in (k.latency, k.failures):
        assert day_ms - 60_000 < r.pttl(key) <= day_ms, key
        r.pexpire(key, 50_000)  # as a beat with a shorter setting would
    q.submit_many([{}] * 2)
    a, b = c.claim(2)
    c.settle([mtq.Outcome(a, ok=True), mtq.Outcome(b, ok=False, error="boom")])
    for key in (k.latency, k.failures):  # pushed onto: the expiry stays
        assert 0 < r.pttl(key) <= 50_000, key
    assert r.llen(k.latency) == 4 and r.llen(k.failures) == 2


@pytest.mark.parametrize(("bounds", "kept"), [
    ({"batch_log_max": 0}, 0),
    ({"batch_log_max": 1}, 1),
    ({"batch_log_max": 2}, 2),
    ({"batch_log_bytes": 0}, 0),
    ({"batch_log_bytes": 1}, 0),       # less than one record: none
    ({"batch_log_bytes": "one"}, 1),   # exactly one record's cost
])
def test_the_batch_log_trim_at_its_edges(r, qname, bounds, kept):
    """The trim at its edges: a bound of 0 (or bytes under one record) keeps no list at
    all, even one another writer left; 1 keeps the newest record; every write leaves
    the newest records, newest first."""
    k = QueueKeys(qname)
    r.lpush(k.batches, b"left by another writer")
    log = BatchLog(k.batches, default_worker_id(), qname)
    ids = [f"t{i}" for i in range(6)]
    now = time.time()
    one = entry_bytes(len(log._encode(("batch", now, now + 0.001, [ids[0]]))))
    if bounds.get("batch_log_bytes") == "one":
        bounds = {"batch_log_bytes": int(one) + 1}
    log.settings = log.settings.replace(**bounds)
    for beat in range(3):  # two records a beat, one task each
        for i in ids[2 * beat:2 * beat + 2]:
            log.start([Claimed(id=i, token="t", payload=b"", stream=None, attempts=0,
                               deliveries=1, retries=None)])
            log.end()
        pipe = r.pipeline(transaction=False)
        log.write(pipe)
        pipe.execute()
        log.written()
        got = [rec["ids"] for rec in _records(r, qname)]
        newest = [[i] for i in reversed(ids[:2 * beat + 2])]
        assert got == newest[:kept], (beat, got)
        assert r.exists(k.batches) == (1 if kept else 0)
