"""Output a person can read: ``--follow`` on a real terminal (a pseudo-terminal) and
into a pipe, task data never read as markup, ``mtq status`` at 80 columns, a worker
start without torch's numpy warning, the embedded server left alone by the commands
that only look, and the demo's length said the same way everywhere."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
import threading
import tty
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import mtq
from mtq.broker.consumer import Outcome
from mtq.broker.embedded import EmbeddedServer
from mtq.cli.common import printable
from mtq.cli.main import cli
from mtq.cli.tasks import STATUS_COLUMNS, compact_count
from mtq.settings import QueueSettings
from mtq.workers.worker import Worker
from tests.support.paths import ROOT
from tests.support.waits import wait_for
from tests.support.workers import serving

pytestmark = pytest.mark.timeout(90)

#: what the reference generator's byte tokens can hold, and worse
CHUNKS = ["Hi\x01", "\x1a\r", "\x0c", "\x1b[2J", "tab\tnew\nline", "\u202eevil", " é 👍"]
#: how a terminal shows them
ESCAPED = "Hi\\x01\\x1a\\r\\x0c\\x1b[2Jtab\tnew\nline\\u202eevil é 👍"
#: rich markup, and a closing tag that matches nothing (which rich refuses to print)
MARKUP = "[SSL: CERTIFICATE_VERIFY_FAILED] [bold]no[/bold] [/] [link=x]y"


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MTQ_HOME", str(tmp_path / "mtq-home"))
    monkeypatch.delenv("MTQ_REDIS_URL", raising=False)


class Terminal:
    """A command run with its stdout on a pseudo-terminal (in raw mode: the bytes it
    writes arrive unchanged) and its stderr on a pipe, both read as they come."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        master, slave = pty.openpty()
        tty.setraw(slave)
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=slave,
                                     stderr=subprocess.PIPE, env=env)
        os.close(slave)
        self.screen = bytearray()
        self.errors: list[str] = []
        self._master = master

        def read_screen() -> None:
            while True:
                try:
                    data = os.read(master, 4096)
                except OSError:  # EIO: the command's end of the terminal closed
                    return
                if not data:
                    return
                self.screen += data

        def read_errors() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.errors.append(line.decode(errors="replace"))

        self._threads = [threading.Thread(target=read_screen, daemon=True),
                         threading.Thread(target=read_errors, daemon=True)]
        for t in self._threads:
            t.start()

    def finish(self, timeout: float = 30) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            pytest.fail(f"the command did not finish within {timeout} s; stderr: "
                        f"{''.join(self.errors)[-2000:]}")
        for t in self._threads:
            t.join(10)
            assert not t.is_alive(), "the terminal's output was not read to its end"
        os.close(self._master)
        return code


def mtq_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "mtq", *args]


# -- --follow on a terminal, into a pipe ----------------------------------------------
def test_follow_on_a_terminal_escapes_what_would_drive_it(
        redis_url: str, qname: str, subprocess_env: dict[str, str], tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    payload = {"chunks": CHUNKS, "progress": f"{MARKUP} \x1b[31m", "gate": str(gate),
               "fail": f"{MARKUP} \x1b]0;title\x07"}
    env = dict(subprocess_env, COLUMNS="300")
    with serving(Worker("tests.handlers:chunks", qname, url=redis_url)):
        term = Terminal(mtq_argv("submit", qname, json.dumps(payload), "--follow",
                                 "--redis", redis_url), env)
        # progress is not stored: the handler repeats it until this client has shown it
        wait_for(lambda: any("progress:" in line for line in term.errors), 20,
                 f"no progress line on stderr: {term.errors}")
        gate.touch()
        code = term.finish()
    errors = "".join(term.errors)
    assert code == 1, errors  # the handler fails at the end
    assert term.screen.decode() == ESCAPED + "\n"
    assert "\x1b" not in errors and "\x07" not in errors
    out = flat(errors)
    assert f"progress: {MARKUP} \\x1b[31m" in out, errors  # as written, not as markup
    assert f"{MARKUP} \\x1b]0;title\\x07" in out, errors   # the failure's error, the same
    assert re.search(r"\bfailed\b", out), errors


def test_follow_raw_on_a_terminal_writes_the_tokens_as_they_came(
        redis_url: str, qname: str, subprocess_env: dict[str, str]) -> None:
    with serving(Worker("tests.handlers:chunks", qname, url=redis_url)):
        term = Terminal(mtq_argv("submit", qname, json.dumps({"chunks": CHUNKS}), "--follow",
                                 "--raw", "--redis", redis_url), subprocess_env)
        code = term.finish()
    assert code == 0, "".join(term.errors)
    assert term.screen.decode() == "".join(CHUNKS) + "\n"


def test_follow_into_a_pipe_writes_the_tokens_as_they_came(
        redis_url: str, qname: str, subprocess_env: dict[str, str]) -> None:
    with serving(Worker("tests.handlers:chunks", qname, url=redis_url)):
        res = subprocess.run(mtq_argv("submit", qname, json.dumps({"chunks": CHUNKS}),
                                      "--follow", "--redis", redis_url),
                             env=subprocess_env, capture_output=True, timeout=60)
    assert res.returncode == 0, res.stderr.decode(errors="replace")
    assert res.stdout.decode() == "".join(CHUNKS) + "\n"  # ESC and CR included
    assert b"succeeded" in res.stderr


def test_raw_goes_with_follow(redis_url: str, qname: str) -> None:
    res = CliRunner().invoke(cli, ["submit", qname, "{}", "--raw", "--redis", redis_url])
    assert res.exit_code == 2 and "--raw goes with --follow" in res.output, res.output
    assert mtq.Queue(qname, redis_url).stats()["submitted"] == 0


def test_printable_escapes_controls_and_keeps_text() -> None:
    assert printable("".join(CHUNKS)) == ESCAPED
    assert printable("\x7f\x85\x9b\u2028\u2066") == "\\x7f\\x85\\x9b\\u2028\\u2066"
    text = "naïve 日本語 👨\u200d👩\u200d👧 a\\x1b\tb\n"  # a ZWJ sequence, a literal backslash
    assert printable(text) == text
    inside = json.dumps({"s": "a\x1b\x9b\u202e"}, ensure_ascii=False)
    assert json.loads(printable(inside, json_string=True)) == {"s": "a\x1b\x9b\u202e"}


def test_task_and_dead_letters_show_errors_as_text(redis_url: str, qname: str) -> None:
    settings = QueueSettings(max_retries=0, retry_backoff_ms=0)
    task = mtq.Queue(qname, redis_url, settings=settings).submit({"x": 1})
    consumer = mtq.Consumer(qname, redis_url, settings=settings)
    (claimed,) = consumer.claim(1)
    consumer.settle([Outcome(claimed, ok=False, error=f"OSError: {MARKUP} \x1b[2J")])
    assert task.status() == "dead"
    runner = CliRunner()
    for args in (["task", task.id], ["dlq", "list", qname]):
        res = runner.invoke(cli, [*args, "--redis", redis_url], env={"COLUMNS": "300"})
        assert res.exit_code == 0, res.output
        assert "\x1b" not in res.output
        assert f"{MARKUP} \\x1b[2J" in flat(res.output), res.output


# -- mtq status at 80 columns ------------------------------------------------------
def test_status_fits_80_columns_with_every_header_readable(redis_url: str, qname: str,
                                                           r: Any) -> None:
    long_name = qname + "-with-a-rather-long-name"
    q = mtq.Queue(long_name, redis_url)
    q.submit_many([{"i": i} for i in range(1234)], stream="a")
    q.submit_many([{"i": i} for i in range(5)], stream="b")
    c = mtq.Consumer(long_name, redis_url)
    (done,) = c.claim(1)
    c.settle([Outcome(done, ok=True, value=1)])
    c.claim(1)  # one running
    res = CliRunner().invoke(cli, ["status", long_name, "--redis", redis_url],
                             env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80, res.output
    assert "…" not in res.output, res.output  # nothing cut
    header = next(line for line in lines if line.startswith("queue"))
    assert header.split() == ["queue", *STATUS_COLUMNS], res.output
    # the name folds onto a second line rather than being cut; the counts are whole
    first = lines.index(header) + 2
    row = lines[first].split()
    name = row[0]
    for line in lines[first + 1:]:
        if len(line.split()) != 1:
            break
        name += line.strip()
    assert name == long_name, res.output
    assert row[1:9] == ["1,237", "2", "1", "0", "0", "1", "0", row[8]], res.output
    legend = flat("\n".join(lines[first + 1:]))
    for explained in ("wait, run: tasks waiting, running", "strm: streams with work",
                      "retry: to be retried", "ok, fail: totals", "p50, p99: latency in ms",
                      "wkrs: workers"):
        assert explained in legend, res.output
    help_text = flat(CliRunner().invoke(cli, ["status", "--help"]).output)
    for col in ("wait tasks waiting", "strm streams with waiting work",
                "run tasks running", "retry tasks waiting to be retried", "dead dead letters",
                "ok, fail tasks succeeded, failed", "p50, p99 submit-to-finish latency in ms",
                "wkrs live worker processes"):
        assert col in help_text, help_text


@pytest.mark.parametrize(("n", "shown"), [
    (0, "0"), (9_999, "9,999"), (10_000, "10.0k"), (12_345, "12.3k"), (99_949, "99.9k"),
    (99_950, "100k"), (999_499, "999k"), (999_500, "1.0M"), (4_560_000, "4.6M"),
    (123_456_789, "123M"), (10**12, "1.0T")])
def test_counts_fit_five_characters(n: int, shown: str) -> None:
    assert compact_count(n) == shown and len(shown) <= 5


# -- a worker starts without torch's numpy warning ---------------------------------------
NO_NUMPY = '''
import sys

class NoNumpy:
    def find_spec(self, name, path=None, target=None):
        if name == "numpy" or name.startswith("numpy."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NoNumpy())
'''


def _worker_start(qname: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(mtq_argv("worker", "run", "mtq.reference.gpt:TinyGPT", "--queue",
                                   qname, "--burst"),
                          env=env, capture_output=True, text=True, timeout=120)


def test_a_worker_starts_without_a_numpy_warning(subprocess_env: dict[str, str], qname: str,
                                                 tmp_path: Path) -> None:
    env = dict(subprocess_env, MTQ_HOME=str(tmp_path / "home"))
    res = _worker_start(qname, env)
    assert res.returncode == 0, res.stderr
    assert "worker stopped" in res.stderr
    assert "Failed to initialize NumPy" not in res.stderr, res.stderr
    assert "UserWarning" not in res.stderr, res.stderr
    # what the check catches: the same start where numpy cannot be imported
    hide = tmp_path / "hide-numpy"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(NO_NUMPY)
    env["PYTHONPATH"] = os.pathsep.join([str(hide), env["PYTHONPATH"]])
    res = _worker_start(qname, env)
    assert "Failed to initialize NumPy: No module named 'numpy'" in res.stderr, res.stderr


def test_the_extras_that_bring_torch_bring_numpy() -> None:
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for name in ("workers", "demo"):
        assert any(re.match(r"numpy\b", dep) for dep in extras[name]), (name, extras[name])
    assert "mtq[workers]" in extras["examples"]


# -- the embedded server: started by commands that bring work, never by a look ---------
@pytest.mark.parametrize("args", [
    ["status"], ["status", "chat"], ["task", "abc123"], ["cancel", "abc123"],
    ["dlq", "list", "chat"], ["dlq", "retry", "chat", "--all"], ["purge", "chat", "--yes"],
    ["workers", "list"], ["workers", "pause", "-q", "chat"], ["dashboard", "--once"]])
def test_commands_that_look_do_not_start_the_embedded_server(args: list[str],
                                                              tmp_path: Path) -> None:
    home = tmp_path / "mtq-home"  # MTQ_HOME (see isolated_env)
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 3, res.output
    out = flat(res.output)
    assert "the embedded redis-server is not running" in out and "mtq server start" in out
    assert not EmbeddedServer.from_env().status().running
    assert not home.exists(), "a command that looks created the server's state"


def test_submit_starts_the_embedded_server_and_status_then_reads_it(tmp_path: Path) -> None:
    server = EmbeddedServer.from_env()
    runner = CliRunner()
    try:
        res = runner.invoke(cli, ["submit", "chat", '{"prompt": "hi"}'])
        assert res.exit_code == 0, res.output
        assert server.status().running
        res = runner.invoke(cli, ["status"], env={"COLUMNS": "80"})
        assert res.exit_code == 0 and "chat" in res.output, res.output
        stopped = runner.invoke(cli, ["server", "stop"])
        assert stopped.exit_code == 0 and "stopped" in stopped.output
        res = runner.invoke(cli, ["status"])
        assert res.exit_code == 3, res.output  # a look does not undo the stop
        assert not server.status().running
    finally:
        server.stop()


# -- the demo's length, said once ---------------------------------------------------
def test_the_demo_length_is_said_the_same_everywhere() -> None:
    runner = CliRunner()
    places = {
        "README.md": (ROOT / "README.md").read_text(),
        "docs/cli.md": (ROOT / "docs" / "cli.md").read_text(),
        "mtq --help": runner.invoke(cli, ["--help"]).output,
        "mtq demo --help": runner.invoke(cli, ["demo", "--help"]).output,
    }
    for where, text in places.items():
        text = flat(text).lower()
        assert "half a minute" in text, where
        assert not re.search(r"\b(about|in) a minute", text), where
