"""``mtq submit --wait/--follow`` on a queue no worker serves: the task id comes
first (so the user can find or cancel the task), ``--timeout`` bounds the wait
(exit 6), Ctrl-C stops waiting, or
submitting a file (exit 130); either way what was submitted goes on."""

from __future__ import annotations

import json
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import mtq
from tests.support.processes import ctrl_c_default
from tests.support.waits import wait_for

PY = sys.executable


@pytest.mark.parametrize("how", [["--wait"], ["--follow"]])
def test_timeout_prints_the_id_first_and_exits_6(how: list[str], redis_url: str,
                                                 qname: str) -> None:
    done = subprocess.run([PY, "-m", "mtq", "submit", qname, '{"a": 1}', *how, "--timeout",
                           "0.5", "--redis", redis_url], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 6, done
    first = done.stderr.splitlines()[0]
    assert first.startswith("task ") and f"queued on {qname!r}" in first, done.stderr
    task_id = first.split()[1]
    assert f"no worker serves {qname!r}" in done.stderr, done.stderr
    assert f"mtq cancel {task_id}" in done.stderr, done.stderr
    assert mtq.Queue(qname, redis_url).task(task_id).status() == "queued"  # it goes on


def test_ctrl_c_stops_waiting_with_exit_130(redis_url: str, qname: str) -> None:
    proc = subprocess.Popen([PY, "-m", "mtq", "submit", qname, "{}", "--wait", "--redis",
                             redis_url], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=ctrl_c_default)
    assert proc.stderr is not None
    ready, _, _ = select.select([proc.stderr], [], [], 30)
    assert ready, "no line from mtq submit within 30 s"
    first = proc.stderr.readline()           # printed before the wait begins
    task_id = first.split()[1]
    q = mtq.Queue(qname, redis_url)
    wait_for(lambda: q.stats()["waiting"] == 1, 10, "the task was not queued")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, (out, err)
    assert f"stopped waiting; task {task_id} goes on" in err and "Traceback" not in err, err
    assert q.task(task_id).status() == "queued"


def test_a_file_that_is_not_utf8_is_bad_input(redis_url: str, qname: str,
                                              tmp_path: Path) -> None:
    f = tmp_path / "requests.jsonl"
    f.write_bytes(b'{"a": 1}\n{"b": "\xff\xfe"}\n')
    done = subprocess.run([PY, "-m", "mtq", "submit", qname, "--file", str(f), "--redis",
                           redis_url], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "not UTF-8" in done.stderr, done
    assert "Traceback" not in done.stderr and mtq.Queue(qname, redis_url).stats()[
        "submitted"] == 0


def test_ctrl_c_while_waiting_for_a_file_exits_130(redis_url: str, qname: str,
                                                   tmp_path: Path) -> None:
    f = tmp_path / "requests.jsonl"
    f.write_text('{"a": 1}\n{"a": 2}\n')
    proc = subprocess.Popen([PY, "-m", "mtq", "submit", qname, "--file", str(f), "--wait",
                             "--json", "--redis", redis_url], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=ctrl_c_default)
    q = mtq.Queue(qname, redis_url)
    wait_for(lambda: q.stats()["waiting"] == 2, 20, "the tasks were not queued")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, (out, err)
    assert "stopped waiting; the 2 task(s) go on" in err and "Traceback" not in err, err
    assert len(json.loads(out)["ids"]) == 2, out


def test_ctrl_c_while_submitting_a_file_says_what_was_submitted_and_exits_130(
        redis_url: str, qname: str, tmp_path: Path) -> None:
    """A Ctrl-C in the middle of sending a file (chunks of FILE_CHUNK, one round trip
    each): exit 130, never click's "Aborted!"; the user is told how many were
    submitted, and --json lists them: each is queued, and nothing else was sent but,
    at most, the chunk in flight."""
    from mtq.cli.tasks import FILE_CHUNK

    total = 120 * FILE_CHUNK
    f = tmp_path / "requests.jsonl"
    f.write_text('{"a": 1}\n' * total)
    proc = subprocess.Popen([PY, "-m", "mtq", "submit", qname, "--file", str(f), "--json",
                             "--redis", redis_url], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=ctrl_c_default)
    q = mtq.Queue(qname, redis_url)
    # the second chunk's script runs only once the first one's reply is read: from then
    # on, the client knows at least one chunk is in
    wait_for(lambda: q.stats()["waiting"] >= 2 * FILE_CHUNK, 60, "two chunks were not sent")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out[-300:], err)
    assert "Aborted" not in err and "Traceback" not in err, err
    listed = json.loads(out)
    ids, waiting = listed["ids"], q.stats()["waiting"]
    assert listed["interrupted"] and listed["submitted"] == len(ids), listed.keys()
    assert FILE_CHUNK <= len(ids) < total and len(ids) <= waiting <= len(ids) + FILE_CHUNK
    assert f"stopped submitting; {len(ids)} of {total} task(s) were submitted" in err, err
    assert {q.task(i).status() for i in ids[:: FILE_CHUNK // 5]} == {"queued"}
