"""mtq.trace's pure conversion: batch records and trace lines -> Chrome trace events."""

from __future__ import annotations

import json

import pytest

from mtq.trace import chrome_trace, parse_line, parse_record, parse_since, task_segments

W = "host-a:4242:abc123"


def _check(doc: dict) -> list[dict]:
    assert doc["displayTimeUnit"] == "ms"
    events = doc["traceEvents"]
    json.dumps(doc)  # serialisable
    for e in events:
        assert e["ph"] in ("X", "i", "M"), e
        for field in ("ts", "pid", "tid"):
            assert isinstance(e[field], int), (field, e)
        if e["ph"] == "X":
            assert isinstance(e["dur"], int) and e["dur"] >= 0, e
    return events


@pytest.mark.parametrize("text, seconds", [
    ("500ms", 0.5), ("90s", 90), ("5m", 300), ("2h", 7200), ("60", 60), ("1.5", 1.5),
    (" 10s ", 10),
])
def test_parse_since(text, seconds):
    assert parse_since(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "abc", "5x", "-3s", "0", "1d", "s", "5 m s", "nan"])
def test_parse_since_refuses(text):
    with pytest.raises(ValueError, match="--since"):
        parse_since(text)


def test_parse_record_and_line():
    rec = parse_record(b'{"w":"x","h":"h","p":1,"k":"batch","t0":5,"t1":9,"ids":["a"]}')
    assert rec is not None and rec["t0"] == 5 and rec["ids"] == ["a"]
    assert parse_record(b"not json") is None
    assert parse_record(b'{"t0": 1}') is None
    assert parse_line(b"1000|started|delivery 1 on w") == (1000, "started", "delivery 1 on w")
    assert parse_line(b"1000|queued|") == (1000, "queued", "")
    assert parse_line(b"x|queued|") is None


def test_two_tasks_one_batch_lanes_and_units():
    records = [{"w": W, "h": "host-a", "p": 4242, "k": "batch", "t0": 1010, "t1": 1030,
                "ids": ["a", "b"]}]
    traces = {
        "a": [(1000, "queued", "stream s1"), (1005, "started", f"delivery 1 on {W}"),
              (1040, "succeeded", "")],
        "b": [(1001, "queued", "stream s2"), (1006, "started", f"delivery 1 on {W}"),
              (1041, "succeeded", "")],
    }
    events = _check(chrome_trace("q", records, traces, since_ms=900, now_ms=2000))
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert "queue q" in names and any("host-a" in n and "4242" in n for n in names)
    batch = next(e for e in events if e.get("cat") == "batch")
    assert (batch["ts"], batch["dur"], batch["tid"]) == (1_010_000, 20_000, 0)
    assert batch["args"]["ids"] == ["a", "b"]
    tasks = [e for e in events if e.get("cat") == "task" and e["ph"] == "X"]
    assert {t["args"]["id"] for t in tasks} == {"a", "b"}
    assert all(t["pid"] == batch["pid"] and t["args"]["batch"] == 0 for t in tasks)
    assert len({t["tid"] for t in tasks}) == 2  # they overlap: two lanes
    a = next(t for t in tasks if t["args"]["id"] == "a")
    assert (a["ts"], a["dur"]) == (1_005_000, 35_000)
    assert a["args"] == {"id": "a", "stream": "s1", "delivery": 1, "status": "succeeded",
                         "worker": W, "batch": 0}
    waits = [e for e in events if e.get("cat") == "queue"]
    assert len(waits) == 2 and {w["pid"] for w in waits} == {1}
    assert len({w["tid"] for w in waits}) == 2
    assert all(w["args"]["status"] == "started" for w in waits)


def test_sequential_slices_share_a_lane():
    traces = {
        "a": [(1000, "queued", ""), (1001, "started", f"delivery 1 on {W}"),
              (1002, "succeeded", "")],
        "b": [(1003, "queued", ""), (1004, "started", f"delivery 1 on {W}"),
              (1005, "succeeded", "")],
    }
    events = _check(chrome_trace("q", [], traces, since_ms=0, now_ms=2000))
    tasks = [e for e in events if e.get("cat") == "task" and e["ph"] == "X"]
    assert {t["tid"] for t in tasks} == {1}
    waits = [e for e in events if e.get("cat") == "queue"]
    assert {w["tid"] for w in waits} == {1}


def test_restart_retry_and_open_segments():
    lines = [(1000, "queued", ""), (1010, "started", f"delivery 1 on {W}"),
             (1100, "restarted", "its worker died"), (1110, "started", "delivery 2 on w2:1:x"),
             (1120, "retry", "in 10 ms after: ValueError: x"),
             (1140, "started", "delivery 3 on w2:1:x")]
    waits, runs = task_segments("a", lines, now_ms=1500)
    assert [(w["start"], w["end"], w["status"]) for w in waits] == [
        (1000, 1010, "started"), (1100, 1110, "started"), (1120, 1140, "started")]
    assert [(r["start"], r["end"], r["status"], r["delivery"]) for r in runs] == [
        (1010, 1100, "restarted", 1), (1110, 1120, "retry", 2), (1140, 1500, "running", 3)]
    events = _check(chrome_trace("q", [], {"a": lines}, since_ms=1400, now_ms=1500))
    instants = [e for e in events if e["ph"] == "i"]
    assert {e["name"] for e in instants} == {"restarted", "retry"}
    pids = {e["pid"] for e in events if e.get("cat") == "task" and e["ph"] == "X"}
    assert len(pids) == 2  # two workers, two tracks


def test_window_filters_old_tasks_and_batches():
    traces = {
        "old": [(100, "queued", ""), (110, "started", f"delivery 1 on {W}"),
                (120, "succeeded", "")],
        "waiting": [(100, "queued", "stream s")],
        "new": [(1000, "queued", ""), (1010, "started", f"delivery 1 on {W}"),
                (1020, "failed", "ValueError: no")],
    }
    records = [{"w": W, "k": "batch", "t0": 105, "t1": 115, "ids": ["old"]}]
    events = _check(chrome_trace("q", records, traces, since_ms=900, now_ms=2000))
    ids = {e["args"]["id"] for e in events if e.get("cat") in ("task", "queue")}
    assert ids == {"waiting", "new"}
    assert not [e for e in events if e.get("cat") == "batch"]
    wait = next(e for e in events if e.get("cat") == "queue" and e["args"]["id"] == "waiting")
    assert wait["args"]["status"] == "waiting" and wait["ts"] + wait["dur"] == 2_000_000
    failed = next(e for e in events if e["ph"] == "X" and e["args"].get("id") == "new"
                  and e["cat"] == "task")
    assert failed["args"]["status"] == "failed" and "ValueError" in failed["args"]["detail"]
    assert any(e["ph"] == "i" and e["name"] == "failed" for e in events)


def test_expired_while_waiting():
    events = _check(chrome_trace("q", [], {"x": [(100, "queued", ""), (200, "expired", "")]},
                                 since_ms=0, now_ms=300))
    wait = next(e for e in events if e.get("cat") == "queue")
    assert wait["args"]["status"] == "expired" and wait["dur"] == 100_000


@pytest.mark.parametrize("host, ids", [
    ("host-a", ["t1"]),
    ('we"ird\\host\u00e9\u2028', ["a", "b-c_d"] * 40),
    ("h", []),
])
def test_a_batch_record_reads_back_as_its_fields(monkeypatch, host, ids):
    """A worker writes each record as a short msgpack array (mtq.workers.batchlog):
    parse_record reads back every field, whatever the host name holds, from the worker
    id when it tells host and pid (the default id), from the record when it does not;
    a batch's record is shorter than the JSON object older workers wrote."""
    import os
    import socket

    from mtq.broker.consumer import default_worker_id
    from mtq.workers.batchlog import BatchLog

    monkeypatch.setattr(socket, "gethostname", lambda: host)
    for worker in ("w-1", default_worker_id()):
        log = BatchLog("mtq:{q}:batches", worker, "q")
        for kind in ("batch", "prefill"):
            raw = log._encode((kind, 1700000000.1234, 1700000000.5, ids))
            fields = {"w": worker, "h": host, "p": os.getpid(), "k": kind,
                      "t0": 1700000000123, "t1": 1700000000500, "ids": ids}
            assert parse_record(raw) == fields
            old = json.dumps(fields, separators=(",", ":")).encode()
            assert parse_record(old) == fields  # an older worker's record
            assert len(raw) < len(old)
