"""The ``mtq`` command: click's CliRunner in process, plus a real worker subprocess."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

import mtq
from mtq import serialization
from mtq.broker.keys import QueueKeys
from mtq.cli.main import cli
from tests.support.processes import kill_process, worker_process


def _command_paths(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = [prefix]
    ctx = click.Context(group)
    for name in group.list_commands(ctx):  # the public way: some are imported lazily
        cmd = group.get_command(ctx, name)
        assert cmd is not None, f"'{' '.join((*prefix, name))}' is listed but not found"
        if isinstance(cmd, click.Group):
            paths += _command_paths(cmd, (*prefix, name))
        else:
            paths.append((*prefix, name))
    return paths


COMMANDS = _command_paths(cli)


def flat(text: str) -> str:
    """Output with rich's line wrapping undone."""
    return " ".join(text.split())


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch, tmp_path):
    """No test here may reach the user's embedded server or an outside MTQ_REDIS_URL."""
    monkeypatch.setenv("MTQ_HOME", str(tmp_path / "mtq-home"))
    monkeypatch.delenv("MTQ_REDIS_URL", raising=False)


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def test_expected_commands_exist():
    names = {" ".join(p) for p in COMMANDS}
    assert {"server start", "server stop", "server status", "worker run", "submit",
            "demo"} <= names


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(p) or "mtq")
def test_help(runner, path):
    result = runner.invoke(cli, [*path, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output
    assert "--help" in result.output


def test_version(runner):
    result = runner.invoke(cli, ["--version"])
    assert result.exit_code == 0
    assert mtq.__version__ in result.output


# -- submit ----------------------------------------------------------------------
def test_submit_rejects_bad_json(runner, redis_url):
    result = runner.invoke(cli, ["submit", "q", "not json", "--redis", redis_url])
    assert result.exit_code == 2, result.output
    assert "JSON" in result.output
    assert "Traceback" not in result.output


def test_submit_prints_task_id(runner, redis_url, qname, r):
    result = runner.invoke(cli, ["submit", qname, '{"x": 21, "s": "é"}', "--redis", redis_url])
    assert result.exit_code == 0, result.output
    task_id = result.output.strip()
    assert task_id and "\n" not in task_id
    q = mtq.Queue(qname, redis_url)
    assert q.task(task_id).status() == "queued"
    stored = r.hget(QueueKeys(qname).task(task_id), "payload")
    assert serialization.loads(stored) == {"x": 21, "s": "é"}
    assert q.stats()["waiting"] == 1


def test_submit_with_stream(runner, redis_url, qname):
    result = runner.invoke(cli, ["submit", qname, "[1, 2]", "--stream", "user-7",
                                 "--redis", redis_url])
    assert result.exit_code == 0, result.output
    info = mtq.Queue(qname, redis_url).task(result.output.strip()).info()
    assert info.stream == "user-7" and info.status == "queued"


def test_submit_uses_mtq_redis_url(runner, redis_url, qname, monkeypatch):
    monkeypatch.setenv("MTQ_REDIS_URL", redis_url)
    result = runner.invoke(cli, ["submit", qname, "{}"])
    assert result.exit_code == 0, result.output
    assert mtq.Queue(qname, redis_url).task(result.output.strip()).status() == "queued"


def test_submit_invalid_queue_name(runner, redis_url):
    result = runner.invoke(cli, ["submit", "bad queue!", "{}", "--redis", redis_url])
    assert result.exit_code != 0
    assert "invalid queue name" in flat(result.output)
    assert "Traceback" not in result.output


def test_submit_invalid_stream_name(runner, redis_url, qname):
    result = runner.invoke(cli, ["submit", qname, "{}", "--stream", "a b", "--redis", redis_url])
    assert result.exit_code != 0
    assert "invalid stream" in flat(result.output)


def test_submit_unreachable_redis(runner, unreachable_url):
    result = runner.invoke(cli, ["submit", "q", "{}", "--redis", unreachable_url])
    assert result.exit_code != 0
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "cannot reach Redis" in flat(result.output)
    assert "Traceback" not in result.output


def test_submit_wait_times_out_cleanly(runner, redis_url, qname):
    result = runner.invoke(cli, ["submit", qname, "{}", "--timeout", "0.2", "--redis", redis_url])
    assert result.exit_code == 6, result.output  # timed out waiting
    assert "did not finish within 0.2s" in flat(result.output)


# -- worker run ------------------------------------------------------------------
def test_worker_run_unimportable_target(runner, redis_url):
    result = runner.invoke(cli, ["worker", "run", "nosuchmodule:fn", "--queue", "q",
                                 "--redis", redis_url])
    assert result.exit_code == 2, result.output
    out = flat(result.output)
    assert "cannot import 'nosuchmodule'" in out and "PYTHONPATH" in out


def test_worker_run_malformed_target(runner, tmp_path, monkeypatch):
    home = tmp_path / "mtq-home"
    monkeypatch.setenv("MTQ_HOME", str(home))
    monkeypatch.delenv("MTQ_REDIS_URL", raising=False)
    result = runner.invoke(cli, ["worker", "run", "badspec", "--queue", "q"])
    assert result.exit_code == 2, result.output
    assert "bad target 'badspec'" in flat(result.output)
    # refused before Redis is reached: no embedded server started (or left behind)
    assert not home.exists() or not any(home.iterdir()), list(home.iterdir())


@pytest.mark.parametrize("spec,expected", [
    ("tests.handlers:nope", "has no attribute 'nope'"),
    ("tests.handlers:os", "not an mtq.Model or a function"),
    (":double", "bad target"),
    ("tests.handlers:", "bad target"),
])
def test_worker_run_bad_attribute(runner, redis_url, spec, expected):
    result = runner.invoke(cli, ["worker", "run", spec, "--queue", "q", "--redis", redis_url])
    assert result.exit_code == 2, result.output
    assert expected in flat(result.output)


def test_worker_run_invalid_queue(runner, redis_url):
    result = runner.invoke(cli, ["worker", "run", "tests.handlers:double", "--queue", "a b",
                                 "--redis", redis_url])
    assert result.exit_code == 2, result.output
    assert "invalid queue name" in flat(result.output)


def test_worker_run_batch_size_out_of_range(runner, redis_url):
    result = runner.invoke(cli, ["worker", "run", "tests.handlers:double", "--queue", "q",
                                 "--batch-size", "0", "--redis", redis_url])
    assert result.exit_code == 2
    assert "batch-size" in result.output


def test_worker_run_requires_queue(runner):
    result = runner.invoke(cli, ["worker", "run", "tests.handlers:double"])
    assert result.exit_code == 2
    assert "--queue" in result.output


# -- server ----------------------------------------------------------------------
def test_server_status_not_running(runner, tmp_path, monkeypatch):
    home = tmp_path / "empty-home"
    home.mkdir()
    monkeypatch.setenv("MTQ_HOME", str(home))
    result = runner.invoke(cli, ["server", "status"])
    assert result.exit_code == 3, result.output
    assert "not running" in flat(result.output)
    assert list(home.iterdir()) == [], "status must not create files"


def test_server_status_json(runner, tmp_path, monkeypatch):
    home = tmp_path / "empty-home"
    home.mkdir()
    monkeypatch.setenv("MTQ_HOME", str(home))
    result = runner.invoke(cli, ["server", "status", "--json"])
    assert result.exit_code == 3, result.output
    data = json.loads(result.output)
    assert data["running"] is False
    assert data["pid"] is None
    assert data["state_dir"] == str(home)
    assert data["url"].startswith("unix://")


def test_server_stop_when_not_running(runner):
    result = runner.invoke(cli, ["server", "stop"])
    assert result.exit_code == 0, result.output
    assert "not running" in result.output


# -- a real worker process -------------------------------------------------------

def test_worker_subprocess_serves_and_stops_on_sigterm(redis_url, qname, subprocess_env,
                                                       tmp_path):
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        proc = worker_process(["tests.handlers:double", "--queue", qname, "--batch-size", "8"],
                       subprocess_env, log)
    try:
        q = mtq.Queue(qname, redis_url)
        tasks = q.submit_many([{"x": i} for i in range(50)])
        results = [t.result(timeout=30) for t in tasks]
        assert results == [2 * i for i in range(50)]
        stats = q.stats()
        assert stats["succeeded"] == 50 and stats["waiting"] == 0 and stats["running"] == 0

        assert proc.poll() is None, f"worker exited early:\n{log_path.read_text()}"
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pytest.fail(f"worker did not exit within 10 s of SIGTERM:\n{log_path.read_text()}")
        output = log_path.read_text()
        assert code == 0, output
        assert "worker stopped" in output
        assert "'succeeded': 50" in output
        assert "Traceback" not in output
    finally:
        kill_process(proc)


def test_an_idle_worker_stops_on_sigterm_when_its_main_thread_blocks_the_signal(
        redis_url, qname, subprocess_env, tmp_path):
    # the kernel gives the signal to another thread, and the main thread sleeps in an
    # untimed wait: the stop must not depend on the main thread receiving it
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        proc = worker_process(["tests.models:SignalBlocker", "--queue", qname], subprocess_env,
                              log)
    try:
        q = mtq.Queue(qname, redis_url)
        assert q.submit({"s": "a", "i": 0}).result(timeout=60)["i"] == 0
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"worker did not exit within 15 s of SIGTERM:\n{log_path.read_text()}")
        assert code == 0 and "worker stopped" in log_path.read_text(), log_path.read_text()
    finally:
        kill_process(proc)


def test_worker_subprocess_burst_records_failures(redis_url, qname, subprocess_env, tmp_path):
    q = mtq.Queue(qname, redis_url)
    task = q.submit({"n": 1}, retries=0)
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        proc = worker_process(["tests.handlers:boom", "--queue", qname, "--burst"], subprocess_env, log)
    try:
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"--burst worker did not exit:\n{log_path.read_text()}")
        assert code == 0, log_path.read_text()
        with pytest.raises(mtq.TaskFailed) as info:
            task.result(timeout=5)
        assert info.value.status in ("failed", "dead")
        assert "ValueError: boom on {'n': 1}" in (info.value.error or "")
    finally:
        kill_process(proc)


def test_a_worker_starts_without_the_rest_of_the_cli() -> None:
    """``mtq worker run`` imports neither rich nor the other commands' modules: they are
    loaded when a command that needs them runs (mtq.cli.main.LAZY)."""
    code = ("import sys; from mtq.cli.main import cli; "
            "print(sorted(m for m in sys.modules if m.startswith(('rich', 'mtq.cli.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "['mtq.cli.common', 'mtq.cli.main']", out
