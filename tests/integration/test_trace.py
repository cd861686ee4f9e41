"""``mtq trace`` against real worker processes: the file Perfetto opens."""

from __future__ import annotations

import json
import os
import signal

import pytest
from click.testing import CliRunner

import mtq
from mtq.broker.keys import QueueKeys
from mtq.cli.main import cli
from mtq.trace import parse_record
from tests.support.processes import kill_process, worker_process
from tests.support.waits import wait_for


def _recorded(r, queue: str) -> set[str]:
    """Task ids of the batch records in Redis."""
    ids: set[str] = set()
    for raw in r.lrange(QueueKeys(queue).batches, 0, -1):
        rec = parse_record(raw)
        assert rec is not None, raw
        ids.update(rec["ids"])
    return ids


def _trace(redis_url: str, queue: str, path, since: str = "60s") -> dict:
    result = CliRunner().invoke(cli, ["trace", queue, "--since", since, "-o", str(path),
                                      "--redis", redis_url])
    assert result.exit_code == 0, result.output
    doc = json.loads(path.read_text())
    assert doc["displayTimeUnit"] == "ms"
    for e in doc["traceEvents"]:
        assert e["ph"] in ("X", "i", "M"), e
        assert all(isinstance(e[f], int) for f in ("ts", "pid", "tid")), e
        if e["ph"] == "X":
            assert isinstance(e["dur"], int) and e["dur"] >= 0, e
    return doc


@pytest.mark.parametrize("target", ["tests.models:Probe", "tests.models:Counter"])
def test_trace_of_a_realworker_process(redis_url, r, qname, subprocess_env, tmp_path, target):
    q = mtq.Queue(qname, redis_url)
    payloads = [{"s": f"s{i % 4}", "i": i, "n": 3} for i in range(20)]
    with open(tmp_path / "worker.log", "wb") as log:
        proc = worker_process([target, "--queue", qname], subprocess_env, log)
    try:
        tasks = [q.submit(p, stream=p["s"]) for p in payloads[:10]]
        tasks += q.submit_many(payloads[10:])  # stream-less
        for t in tasks:
            t.result(timeout=30)
        ids = {t.id for t in tasks}
        wait_for(lambda: ids <= _recorded(r, qname), 10,
                 "the worker's heartbeat did not write the batch records of every task")
        late = q.submit({"s": "late", "i": 99, "n": 3, "sleep": 0}, stream="late")
        late.result(timeout=30)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        finally:
            kill_process(proc)
    # a task submitted now, with no worker: it shows waiting
    waiting = q.submit({"s": "w", "i": 100}, stream="w")
    doc = _trace(redis_url, qname, tmp_path / "trace.json")
    events = doc["traceEvents"]
    task_slices = [e for e in events if e["ph"] == "X" and e["cat"] == "task"]
    seen = {e["args"]["id"] for e in task_slices}
    assert ids | {late.id} <= seen  # the late one: written by the worker as it stopped
    batches = [e for e in events if e["ph"] == "X" and e["cat"] == "batch"]
    assert batches
    for b in batches:
        for i in b["args"]["ids"]:  # each of its tasks ran on the same track, overlapping it
            mine = [t for t in task_slices if t["args"]["id"] == i and t["pid"] == b["pid"]]
            assert any(t["ts"] <= b["ts"] + b["dur"] and b["ts"] <= t["ts"] + t["dur"]
                       for t in mine), (b, mine)
    assert {i for b in batches for i in b["args"]["ids"]} >= ids
    kinds = {b["args"]["kind"] for b in batches}
    assert kinds == ({"prefill"} if "Counter" in target else {"batch"})
    waits = [e for e in events if e["ph"] == "X" and e["cat"] == "queue"]
    assert {e["args"]["id"] for e in waits} >= ids | {waiting.id}
    assert next(e for e in waits if e["args"]["id"] == waiting.id)["args"]["status"] == "waiting"
    streams = {e["args"]["stream"] for e in task_slices if e["args"]["id"] in ids}
    assert {"s0", "s1", "s2", "s3"} <= streams
    meta = [e for e in events if e["ph"] == "M" and e["name"] == "process_name"]
    assert any(str(proc.pid) in e["args"]["name"] for e in meta), meta
    # to standard output too
    result = CliRunner().invoke(cli, ["trace", qname, "-o", "-", "--redis", redis_url])
    assert result.exit_code == 0
    assert json.loads(result.stdout)["traceEvents"]


@pytest.mark.parametrize("since", ["5x", "abc", "-1s", "0"])
def test_malformed_since_exits_2_and_writes_nothing(redis_url, qname, tmp_path, since):
    mtq.Queue(qname, redis_url).submit({"i": 1})
    out = tmp_path / "t.json"
    result = CliRunner().invoke(cli, ["trace", qname, "--since", since, "-o", str(out),
                                      "--redis", redis_url])
    assert result.exit_code == 2, result.output
    assert "--since" in result.output
    assert not out.exists()


def test_unknown_queue_exits_3(redis_url, qname, tmp_path):
    out = tmp_path / "t.json"
    result = CliRunner().invoke(cli, ["trace", qname, "-o", str(out), "--redis", redis_url])
    assert result.exit_code == 3, result.output
    assert "no queue named" in result.output
    assert not out.exists()


def test_sigkilled_worker_restart_appears(redis_url, r, qname, subprocess_env, tmp_path):
    q = mtq.Queue(qname, redis_url)
    with open(tmp_path / "w1.log", "wb") as log:
        first = worker_process(["tests.models:Probe", "--queue", qname, "--lease-ms", "1000"],
                        subprocess_env, log)
    second = None
    try:
        t = q.submit({"s": "k", "i": 0, "sleep": 1.5}, stream="k")
        wait_for(lambda: t.status() == "running", 20, "the first worker did not start the task")
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        with open(tmp_path / "w2.log", "wb") as log:
            second = worker_process(["tests.models:Probe", "--queue", qname], subprocess_env, log)
        t.result(timeout=30)
        wait_for(lambda: t.id in _recorded(r, qname), 10,
                 "the second worker did not record its batch")
    finally:
        kill_process(first)
        if second is not None:
            kill_process(second)
    doc = _trace(redis_url, qname, tmp_path / "trace.json")
    events = doc["traceEvents"]
    runs = sorted((e for e in events if e["ph"] == "X" and e["cat"] == "task"
                   and e["args"]["id"] == t.id), key=lambda e: e["ts"])
    assert [(e["args"]["delivery"], e["args"]["status"]) for e in runs] == [
        (1, "restarted"), (2, "succeeded")]
    assert runs[0]["pid"] != runs[1]["pid"]  # two worker processes, two tracks
    assert any(e["ph"] == "i" and e["name"] == "restarted" and e["args"]["id"] == t.id
               for e in events)
    waits = [e for e in events if e["ph"] == "X" and e["cat"] == "queue"
             and e["args"]["id"] == t.id]
    assert [e["args"]["after"] for e in sorted(waits, key=lambda e: e["ts"])] == [
        "queued", "restarted"]
    assert os.path.getsize(tmp_path / "trace.json") > 0
