"""The operator commands against a real redis-server, through click's CliRunner:
``status``, ``task``, ``cancel``, ``dlq``, ``purge``, ``submit`` (stdin, --json,
--follow, --file) and ``completion``, each with its error cases and exit codes.
Task states are produced with a real :class:`mtq.Consumer` (claim, settle) or a
real in-process worker, never by writing hashes by hand.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import mtq
from mtq.broker.consumer import Outcome
from mtq.cli.main import cli
from mtq.settings import QueueSettings
from mtq.workers.worker import Worker
from tests.models import Counter
from tests.support.waits import wait_for
from tests.support.workers import serving

pytestmark = pytest.mark.timeout(60)

#: a failure dead-letters at once
NO_RETRY = QueueSettings(max_retries=0, retry_backoff_ms=0, lease_ms=2000)


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MTQ_HOME", str(tmp_path / "mtq-home"))
    monkeypatch.delenv("MTQ_REDIS_URL", raising=False)


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def run(runner: CliRunner, *args: str, input: str | None = None) -> Any:
    # a wide terminal, so that rich does not fold the tables' cells
    return runner.invoke(cli, list(args), input=input, catch_exceptions=False,
                         env={"COLUMNS": "200"})


def make_dead(qname: str, url: str, n: int, stream: str | None = None) -> list[mtq.Task]:
    q = mtq.Queue(qname, url, settings=NO_RETRY)
    tasks = q.submit_many([{"i": i} for i in range(n)], stream=stream)
    c = mtq.Consumer(qname, url, settings=NO_RETRY)
    for t in tasks:  # one at a time: a stream gives one task per claim
        (claimed,) = c.claim(1)
        assert claimed.id == t.id
        c.settle([Outcome(claimed, ok=False, error=f"ValueError: bad {claimed.id}")])
    assert all(t.status() == "dead" for t in tasks)
    return tasks


# -- status ------------------------------------------------------------------------
def test_status_lists_queues_with_counts(runner: CliRunner, redis_url: str, qname: str) -> None:
    q = mtq.Queue(qname, redis_url)
    q.submit_many([{"i": i} for i in range(5)], stream="a")
    q.submit_many([{"i": i} for i in range(3)], stream="b")
    c = mtq.Consumer(qname, redis_url)
    (done,) = c.claim(1)
    c.settle([Outcome(done, ok=True, value=1)])
    c.claim(1)  # one running
    res = run(runner, "status", "--redis", redis_url)
    assert res.exit_code == 0, res.output
    row = next(line for line in res.output.splitlines() if qname in line)
    cells = [c for c in row.replace("│", " ").split() if c]
    # queue, waiting, streams, running, delayed, dead, succeeded, failed, p50, p99, workers
    assert cells[:9] == [qname, "6", "2", "1", "0", "0", "1", "0", cells[8]]
    data = json.loads(run(runner, "status", qname, "--json", "--redis", redis_url).output)
    (view,) = data["queues"]
    assert (view["name"], view["waiting"], view["running"], view["succeeded"]) == (qname, 6, 1, 1)
    assert view["p50_ms"] is not None and view["p50_ms"] >= 0


def test_status_errors(runner: CliRunner, redis_url: str, qname: str,
                       unreachable_url: str) -> None:
    res = run(runner, "status", qname, "--redis", redis_url)
    assert res.exit_code == 3 and "unknown queue" in flat(res.output), res.output
    res = run(runner, "status", "bad name!", "--redis", redis_url)
    assert res.exit_code == 2 and "invalid queue name" in flat(res.output), res.output
    res = run(runner, "status", "--redis", unreachable_url)
    assert res.exit_code == 5 and "cannot reach Redis" in flat(res.output), res.output
    assert "Traceback" not in res.output


# -- task --------------------------------------------------------------------------
def test_task_shows_details_and_a_timeline_across_a_redelivery(
        runner: CliRunner, redis_url: str, qname: str) -> None:
    q = mtq.Queue(qname, redis_url)
    t = q.submit({"x": 1}, stream="user-1")
    c = mtq.Consumer(qname, redis_url)
    (first,) = c.claim(1, lease_ms=50)  # its "worker" dies: the lease runs out
    again = wait_for(lambda: c.claim(1), 10, "the expired lease was not reclaimed")
    assert again[0].id == t.id and again[0].deliveries == 2
    c.settle([Outcome(again[0], ok=True, value={"answer": 42})])
    res = run(runner, "task", t.id, "--redis", redis_url)  # found without --queue
    assert res.exit_code == 0, res.output
    out = flat(res.output)
    assert qname in out and "succeeded" in out and "user-1" in out and '"answer": 42' in out
    data = json.loads(run(runner, "task", t.id, "--queue", qname, "--json",
                          "--redis", redis_url).output)
    kinds = [e["kind"] for e in data["timeline"]]
    assert kinds == ["queued", "started", "restarted", "started", "succeeded"], kinds
    assert "delivery 2" in data["timeline"][3]["detail"]
    assert data["timeline"][2]["detail"] == "lease expired"
    assert data["result"] == {"answer": 42} and data["deliveries"] == 2
    times = [e["ts"] for e in data["timeline"]]
    assert times == sorted(times)


def test_task_shows_its_run_timeout_and_start_by(runner: CliRunner, redis_url: str,
                                                 qname: str) -> None:
    q = mtq.Queue(qname, redis_url)
    t = q.submit({"x": 1}, timeout=2.5, ttl=60)
    plain = q.submit({"x": 2})
    info = t.info()
    assert info.timeout == 2.5 and info.deadline is not None and plain.info().timeout is None
    out = flat(run(runner, "task", t.id, "--queue", qname, "--redis", redis_url).output)
    assert "│ run timeout │ 2.5 s │" in out and "start by (ttl, deadline)" in out, out
    out = flat(run(runner, "task", plain.id, "--queue", qname, "--redis", redis_url).output)
    assert "run timeout" not in out and "start by" not in out, out
    data = json.loads(run(runner, "task", t.id, "--queue", qname, "--json",
                          "--redis", redis_url).output)
    assert data["timeout"] == 2.5


def test_task_errors(runner: CliRunner, redis_url: str, qname: str,
                     unreachable_url: str) -> None:
    mtq.Queue(qname, redis_url).submit({})
    res = run(runner, "task", "nosuchtask123", "--redis", redis_url)
    assert res.exit_code == 3 and "no task 'nosuchtask123'" in flat(res.output), res.output
    res = run(runner, "task", "bad id!", "--redis", redis_url)
    assert res.exit_code == 2 and "invalid task id" in flat(res.output), res.output
    res = run(runner, "task", "abc", "--redis", unreachable_url)
    assert res.exit_code == 5, res.output


def test_task_timeline_of_a_failure_and_a_cancel(runner: CliRunner, redis_url: str,
                                                 qname: str) -> None:
    dead = make_dead(qname, redis_url, 1)[0]
    data = json.loads(run(runner, "task", dead.id, "--json", "--redis", redis_url).output)
    assert [e["kind"] for e in data["timeline"]] == ["queued", "started", "dead"]
    assert data["timeline"][-1]["detail"].startswith("ValueError: bad")
    waiting = mtq.Queue(qname, redis_url).submit({})
    assert run(runner, "cancel", waiting.id, "--redis", redis_url).exit_code == 0
    data = json.loads(run(runner, "task", waiting.id, "--json", "--redis", redis_url).output)
    assert [e["kind"] for e in data["timeline"]] == ["queued", "cancelled"]


# -- cancel ------------------------------------------------------------------------
def test_cancel_waiting_running_finished_and_missing(runner: CliRunner, redis_url: str,
                                                     qname: str) -> None:
    q = mtq.Queue(qname, redis_url)
    running, waiting = q.submit({"r": 1}), q.submit({"w": 1})
    c = mtq.Consumer(qname, redis_url)
    (claimed,) = c.claim(1)  # stream-less tasks are claimed in submit order
    assert claimed.id == running.id
    res = run(runner, "cancel", waiting.id, "--redis", redis_url)
    assert res.exit_code == 0 and "cancelled" in res.output, res.output
    assert waiting.status() == "cancelled"
    res = run(runner, "cancel", claimed.id, "--json", "--redis", redis_url)
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["outcome"] == "cancel requested"
    assert running.info().cancel_requested
    res = run(runner, "cancel", waiting.id, "--redis", redis_url)
    assert res.exit_code == 1 and "already cancelled" in flat(res.output), res.output
    res = run(runner, "cancel", "missing00000", "--redis", redis_url)
    assert res.exit_code == 3, res.output


# -- dead letters ------------------------------------------------------------------
def test_dlq_list_retry_and_purge(runner: CliRunner, redis_url: str, qname: str) -> None:
    dead = make_dead(qname, redis_url, 3, stream="s")
    res = run(runner, "dlq", "list", qname, "--redis", redis_url)
    assert res.exit_code == 0, res.output
    out = flat(res.output)
    assert "3 dead letter(s)" in out and all(t.id in out for t in dead)
    assert f"ValueError: bad {dead[0].id}" in out
    data = json.loads(run(runner, "dlq", "list", qname, "-n", "2", "--json",
                          "--redis", redis_url).output)
    assert data["dead"] == 3 and [r["id"] for r in data["tasks"]] == [dead[2].id, dead[1].id]
    # retry one: queued again with its attempts reset; a worker gets it
    later = mtq.Queue(qname, redis_url).submit({"later": 1}, stream="s")
    res = run(runner, "dlq", "retry", qname, dead[0].id, "--redis", redis_url)
    assert res.exit_code == 0 and "1 dead letter(s) queued again" in flat(res.output)
    info = dead[0].info()
    assert (info.status, info.attempts, info.error) == ("queued", 0, None)
    c = mtq.Consumer(qname, redis_url)
    order = []
    for _ in range(2):  # the stream keeps its order: what was waiting first, then the retry
        (t,) = c.claim(1)
        order.append(t.id)
        c.settle([Outcome(t, ok=True, value=None)])
    assert order == [later.id, dead[0].id]
    assert dead[0].result(timeout=5) is None
    # an id that is not a dead letter
    res = run(runner, "dlq", "retry", qname, dead[0].id, "--redis", redis_url)
    assert res.exit_code == 3 and "not dead letters" in flat(res.output), res.output
    # purge asks first; "n" aborts and keeps them
    res = runner.invoke(cli, ["dlq", "purge", qname, "--all", "--redis", redis_url], input="n\n")
    assert res.exit_code == 1 and mtq.Queue(qname, redis_url).stats()["dead"] == 2
    res = run(runner, "dlq", "purge", qname, "--all", "--yes", "--json", "--redis", redis_url)
    assert res.exit_code == 0 and json.loads(res.output)["purge"] == 2, res.output
    assert mtq.Queue(qname, redis_url).stats()["dead"] == 0
    with pytest.raises(mtq.TaskNotFound):
        dead[1].status()


def test_dlq_errors(runner: CliRunner, redis_url: str, qname: str,
                    unreachable_url: str) -> None:
    res = run(runner, "dlq", "list", qname, "--redis", redis_url)
    assert res.exit_code == 3 and "unknown queue" in flat(res.output)
    make_dead(qname, redis_url, 1)
    res = run(runner, "dlq", "retry", qname, "--redis", redis_url)
    assert res.exit_code == 2 and "or --all" in res.output
    res = run(runner, "dlq", "retry", qname, "x1", "--all", "--redis", redis_url)
    assert res.exit_code == 2
    res = run(runner, "dlq", "list", qname, "--redis", unreachable_url)
    assert res.exit_code == 5


# -- purge -------------------------------------------------------------------------
def test_purge_drops_waiting_tasks_only(runner: CliRunner, redis_url: str, qname: str) -> None:
    q = mtq.Queue(qname, redis_url)
    a = q.submit_many([{"a": i} for i in range(4)], stream="a")
    b = q.submit_many([{"b": i} for i in range(3)], stream="b")
    free = q.submit_many([{"f": i} for i in range(5)])
    c = mtq.Consumer(qname, redis_url)
    (running,) = c.claim(1)  # the head of stream a
    assert running.id == a[0].id
    res = runner.invoke(cli, ["purge", qname, "--redis", redis_url], input="n\n")
    assert res.exit_code == 1 and q.stats()["waiting"] == 11  # aborted: nothing dropped
    res = run(runner, "purge", qname, "--yes", "--json", "--redis", redis_url)
    assert res.exit_code == 0 and json.loads(res.output) == {"queue": qname, "purged": 11}
    stats = q.stats()
    assert (stats["waiting"], stats["streams"], stats["running"]) == (0, 0, 1)
    for t in a[1:] + b + free:
        assert t.status() == "cancelled"
        with pytest.raises(mtq.TaskCancelled):
            t.result(timeout=5)
    assert a[0].status() == "running"
    c.settle([Outcome(running, ok=True, value="done")])
    assert a[0].result(timeout=5) == "done"
    assert c.claim(5) == []  # nothing left behind it
    # the queue works as before
    fresh = q.submit({"after": 1}, stream="a")
    (t,) = c.claim(1)
    assert t.id == fresh.id


def test_purge_in_chunks(runner: CliRunner, redis_url: str, qname: str) -> None:
    q = mtq.Queue(qname, redis_url)
    q.submit_many([mtq.Request({"i": i}, stream=f"s{i % 700}") for i in range(2500)])
    res = run(runner, "purge", qname, "--yes", "--redis", redis_url)
    assert res.exit_code == 0 and "2,500 waiting task(s) purged" in flat(res.output)
    assert (q.stats()["waiting"], q.stats()["streams"]) == (0, 0)


def test_purge_killed_mid_way_leaves_a_consistent_queue(
        redis_url: str, qname: str, r: Any, subprocess_env: dict[str, str]) -> None:
    import signal
    import subprocess
    import sys

    q = mtq.Queue(qname, redis_url)
    tasks = q.submit_many([mtq.Request({"i": i}, stream=f"s{i % 500}") for i in range(20_000)])
    proc = subprocess.Popen([sys.executable, "-m", "mtq", "purge", qname, "--yes",
                             "--redis", redis_url], env=subprocess_env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: q.stats()["waiting"] < 20_000 or proc.poll() is not None, 30,
                 "the purge did not start")
        proc.send_signal(signal.SIGKILL)  # between two chunks, or inside Redis' atomic one
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    keys = q.broker.keys
    pipe = r.pipeline(transaction=False)
    for t in tasks:
        pipe.hget(keys.task(t.id), "status")
    statuses = [s.decode() for s in pipe.execute()]
    assert set(statuses) <= {"queued", "cancelled"}
    stats = q.stats()
    assert stats["waiting"] == statuses.count("queued")  # the counters match the tasks
    assert stats["cancelled"] == statuses.count("cancelled")
    assert q.purge() == statuses.count("queued")  # a second purge finishes the job
    assert (q.stats()["waiting"], q.stats()["streams"]) == (0, 0)
    assert mtq.Consumer(qname, redis_url).claim(10) == []


def test_purge_unknown_queue(runner: CliRunner, redis_url: str, qname: str) -> None:
    res = run(runner, "purge", qname, "--yes", "--redis", redis_url)
    assert res.exit_code == 3 and "unknown queue" in flat(res.output)


# -- submit ------------------------------------------------------------------------
def test_submit_reads_stdin_and_prints_json(runner: CliRunner, redis_url: str,
                                            qname: str) -> None:
    res = run(runner, "submit", qname, "-", "--json", "--redis", redis_url,
              input='{"prompt": "from stdin"}')
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    task = mtq.Queue(qname, redis_url).task(data["id"])
    assert data["queue"] == qname and task.status() == "queued"
    res = run(runner, "submit", qname, "--redis", redis_url)
    assert res.exit_code == 2 and "give a PAYLOAD" in res.output


def test_submit_follow_prints_tokens_live(runner: CliRunner, redis_url: str,
                                          qname: str) -> None:
    w = Worker(Counter(), qname, url=redis_url)
    with serving(w):
        res = run(runner, "submit", qname, '{"n": 5, "start": 10}', "--follow",
                  "--redis", redis_url)
        assert res.exit_code == 0, res.output
        assert "10 11 12 13 14" in res.stdout
        res = run(runner, "submit", qname, '{"n": 3}', "--follow", "--json",
                  "--redis", redis_url)
        assert res.exit_code == 0, res.output
        events = [json.loads(line) for line in res.stdout.splitlines()]
        tokens = [(e["index"], e["data"]) for e in events if e["event"] == "token"]
        assert tokens == [(0, 0), (1, 1), (2, 2)]
        assert events[-1]["event"] == "succeeded"
        res = run(runner, "submit", qname, '{"bad": true}', "--follow", "--redis", redis_url)
        assert res.exit_code == 1 and "failed" in res.output, res.output


def test_submit_follow_times_out(runner: CliRunner, redis_url: str, qname: str) -> None:
    res = run(runner, "submit", qname, "{}", "--follow", "--timeout", "0.3", "--redis", redis_url)
    assert res.exit_code == 6 and "did not finish" in flat(res.output), res.output
    assert f"no worker serves '{qname}' yet" in flat(res.output)  # a new user's hint


def test_submit_file_with_a_summary(runner: CliRunner, redis_url: str, qname: str,
                                    tmp_path: Path) -> None:
    f = tmp_path / "requests.jsonl"
    f.write_text("".join(json.dumps({"user": f"u{i % 4}", "i": i}) + "\n" for i in range(50))
                 + "\n")
    res = run(runner, "submit", qname, "--file", str(f), "--stream-from", "user", "--json",
              "--redis", redis_url)
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["submitted"] == 50 and len(data["ids"]) == 50
    q = mtq.Queue(qname, redis_url)
    infos = [q.task(i).info() for i in data["ids"]]
    assert [x.stream for x in infos] == [f"u{i % 4}" for i in range(50)]
    assert q.stats()["streams"] == 4
    res = run(runner, "submit", qname, "--file", str(f), "--redis", redis_url)
    assert res.exit_code == 0 and "50 in" in flat(res.output), res.output


def test_submit_file_with_a_bad_line_submits_nothing(runner: CliRunner, redis_url: str,
                                                     qname: str, tmp_path: Path) -> None:
    f = tmp_path / "requests.jsonl"
    f.write_text('{"ok": 1}\n{not json}\n{"ok": 3}\n')
    res = run(runner, "submit", qname, "--file", str(f), "--redis", redis_url)
    assert res.exit_code == 2, res.output
    assert "line 2: not valid JSON" in flat(res.output) and "nothing was submitted" in res.output
    assert mtq.Queue(qname, redis_url).stats()["submitted"] == 0
    f.write_text('{"user": "a"}\n{"other": 1}\n')
    res = run(runner, "submit", qname, "--file", str(f), "--stream-from", "user",
              "--redis", redis_url)
    assert res.exit_code == 2 and "line 2: no field 'user'" in flat(res.output)
    res = run(runner, "submit", qname, "{}", "--file", str(f), "--redis", redis_url)
    assert res.exit_code == 2 and "not both" in res.output


def test_submit_file_and_wait_for_the_results(runner: CliRunner, redis_url: str, qname: str,
                                              tmp_path: Path) -> None:
    f = tmp_path / "requests.jsonl"
    f.write_text("".join(json.dumps({"n": 2, "start": i}) + "\n" for i in range(20))
                 + json.dumps({"bad": True}) + "\n")
    w = Worker(Counter(), qname, url=redis_url)
    with serving(w):
        res = run(runner, "submit", qname, "--file", str(f), "--timeout", "30", "--json",
                  "--redis", redis_url)
    assert res.exit_code == 1, res.output  # one of them failed
    data = json.loads(res.output)
    assert (data["submitted"], data["succeeded"], data["failed"], data["timed_out"]) == \
        (21, 20, 1, 0)


# -- every data command takes --json; completion -------------------------------------
@pytest.mark.parametrize("path", [("status",), ("task",), ("cancel",), ("dlq", "list"),
                                  ("dlq", "retry"), ("dlq", "purge"), ("purge",), ("submit",),
                                  ("workers", "list"), ("server", "status")])
def test_json_everywhere(runner: CliRunner, path: tuple[str, ...]) -> None:
    res = run(runner, *path, "--help")
    assert res.exit_code == 0 and "--json" in res.output


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_scripts(runner: CliRunner, shell: str) -> None:
    res = run(runner, "completion", shell)
    assert res.exit_code == 0 and "_MTQ_COMPLETE" in res.output


def test_help_lists_exit_codes_and_a_start(runner: CliRunner) -> None:
    out = flat(run(runner, "--help").output)
    assert "Exit codes: 0 ok" in out and "mtq demo" in out and "--follow" in out
