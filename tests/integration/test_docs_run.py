"""Docs that run: every command of the ```sh blocks of README.md and docs/*.md runs,
for real, in the order of its page, and exits as the page says (0 unless a tag says
``exits: N``), within a time limit.

Each page gets a redis-server of its own (``MTQ_REDIS_URL``; ``MTQ_HOME`` and ``HOME``
point into the test's directory, so no command touches a shared embedded server or
the user's files), ``mtq`` and ``python`` are this checkout's (``PYTHONPATH`` is the
repository root), and each line runs in its own ``bash -eo pipefail`` from the
repository root. The tags (docs/cli.md, "Commands in these docs"; parsed by
tests/support/doc_commands.py) say what does not run:

- ``needs: gpu|docker|zsh`` and ``not run: installs``: skipped;
- ``runs: service``: a long-running command. A worker (``mtq workers start``,
  ``mtq worker run``) is started in the background when a later line of its page
  runs (that line may need it: "in another shell"), and only then; before the next
  line that is not a service runs, the test waits until it serves its queue (services
  on consecutive lines start side by side), and at the end of the page stops it with
  SIGTERM, upon which it must exit 0. Web servers on their ports likewise. Other
  services (the live dashboard) are not run.
"""

from __future__ import annotations

import os
import shlex
import signal
import site
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from mtq.workers.hostfile import load as load_host
from mtq.workers.registry import list_workers
from tests.support.cli_parse import parse_mtq
from tests.support.doc_commands import Command, commands, pages, tag_problem
from tests.support.paths import ROOT
from tests.support.servers import RedisServer

pytestmark = pytest.mark.timeout(180)

LINE_TIMEOUT_S = 60.0      # one command
READY_TIMEOUT_S = 60.0     # a worker service until it serves its queue
STOP_TIMEOUT_S = 30.0      # a worker service after SIGTERM
WORKER_SERVICES = (("mtq", "workers", "start"), ("mtq", "worker", "run"))
#: HTTP servers a page may start, and the port each listens on by default
WEB_SERVICES = {"uvicorn": 8000, "gunicorn": 8000, "flask": 5000, "mtq metrics serve": 9808,
                "mtq serve": 8000}


def web_port(argv: list[str]) -> int | None:
    """The port a web server command line listens on (``--port N``, ``--bind
    host:port``, ``-b``, ``-p``), its default otherwise; None if it is not one."""
    name = " ".join(argv[:3]) if argv[:3] == ["mtq", "metrics", "serve"] else (
        "mtq serve" if argv[:2] == ["mtq", "serve"] else argv[0] if argv else "")
    if name not in WEB_SERVICES:
        return None
    for i, arg in enumerate(argv[:-1]):
        if arg in ("--port", "-p"):
            return int(argv[i + 1])
        if arg in ("--bind", "-b"):
            return int(argv[i + 1].rsplit(":", 1)[1])
    for arg in argv:
        if arg.startswith("--port="):
            return int(arg.split("=", 1)[1])
        if arg.startswith("--bind="):
            return int(arg.rsplit(":", 1)[1])
    return WEB_SERVICES[name]


def accepts(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0

PAGES = [p for p in pages() if commands(p)]


def tail(path: Path, n: int = 3000) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-n:] if text.strip() else "(nothing)"


def runnable(cmd: Command) -> bool:
    return not cmd.skipped and not cmd.service


def test_every_page_tags_its_commands_correctly() -> None:
    """Tags are well formed, and the commands that must not run here carry one."""
    problems = []
    for page in pages():
        for cmd in commands(page):
            problem = tag_problem(cmd)
            if problem:
                problems.append(problem)
            words = cmd.code.split()
            untagged = not cmd.kind
            if untagged and ("pip install" in cmd.code or "install-system-deps" in cmd.code):
                problems.append(f"{cmd.where}: installs packages: tag it '# not run: installs'")
            if untagged and "docker" in words:
                problems.append(f"{cmd.where}: needs docker: tag it '# needs: docker'")
            long_running = ("mtq workers start" in cmd.code or "mtq demo" in cmd.code
                            or ("mtq worker run" in cmd.code and "--burst" not in words)
                            or ("mtq dashboard" in cmd.code and "--once" not in words)
                            or words[:1] in (["uvicorn"], ["gunicorn"])
                            or words[:3] == ["mtq", "metrics", "serve"]
                            or (words[:1] == ["flask"] and "run" in words))
            if untagged and long_running:
                problems.append(f"{cmd.where}: runs until stopped: tag it '# runs: service'")
    assert not problems, "\n".join(problems)
    assert len(PAGES) >= 3, [str(p) for p in PAGES]


def doc_env(tmp: Path, url: str) -> dict[str, str]:
    """The environment of a page's commands: this checkout's mtq and python first on
    PATH, its own Redis, its own MTQ_HOME and HOME."""
    bin_dir, home = tmp / "bin", tmp / "home"
    bin_dir.mkdir()
    home.mkdir()
    # a script, not a symlink: a venv's python found through a link of a link (a venv
    # made by `python -m venv`, whose python is itself a link) no longer sees its venv
    python = bin_dir / "python"
    python.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    python.chmod(0o755)
    for tool in ("mtq", *WEB_SERVICES):
        script = bin_dir / tool
        script.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m {tool} "$@"\n')
        script.chmod(0o755)
    env = dict(os.environ)
    env.update(PATH=os.pathsep.join([str(bin_dir), env.get("PATH", "")]),
               PYTHONPATH=str(ROOT), MTQ_REDIS_URL=url, MTQ_HOME=str(home / "mtq"),
               HOME=str(home), PYTHONUSERBASE=site.getuserbase(), COLUMNS="120")
    return env


class Page:
    """Runs one page's commands in order; keeps the services it started."""

    def __init__(self, tmp: Path, env: dict[str, str], url: str) -> None:
        self.tmp, self.env = tmp, env
        self.client = redis.Redis.from_url(url)
        self.services: list[tuple[Command, subprocess.Popen[bytes], Path]] = []
        self.starting: list[Callable[[], None]] = []
        self.ran: list[str] = []

    def run(self, cmd: Command) -> None:
        out = self.tmp / f"line{cmd.lineno}.out"
        with open(out, "wb") as sink:
            proc = subprocess.Popen(["bash", "-eo", "pipefail", "-c", cmd.code], env=self.env,
                                    cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                rc = proc.wait(LINE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
                pytest.fail(f"{cmd.where}: `{cmd.code}` did not finish within "
                            f"{LINE_TIMEOUT_S:g} s; its output:\n{tail(out)}")
        assert rc == cmd.exit_code, (
            f"{cmd.where}: `{cmd.code}` exited {rc}, the page implies {cmd.exit_code}; "
            f"its output:\n{tail(out)}")
        self.ran.append(cmd.code)

    def start(self, cmd: Command) -> None:
        argv = shlex.split(cmd.code)
        port = web_port(argv)
        if port is not None:
            self.start_web(cmd, port)
            return
        parsed = parse_mtq(argv, cmd.where) if argv[:1] == ["mtq"] else None
        if parsed is None or parsed.path not in WORKER_SERVICES:
            pytest.fail(f"{cmd.where}: later lines of the page run, but the test can start "
                        f"only a worker service ({WORKER_SERVICES}), not `{cmd.code}`; "
                        "teach tests/integration/test_docs_run.py when it is ready")
        queues = [parsed.params["queue"]]
        if parsed.params.get("config"):  # a host file: every queue of it
            queues = [e.queue for e in load_host(str(ROOT / parsed.params["config"])).engines]
        log = self.tmp / f"service{cmd.lineno}.log"
        with open(log, "wb") as sink:
            proc = subprocess.Popen(["bash", "-c", "exec " + cmd.code], env=self.env, cwd=ROOT,
                                    stdout=sink, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self.services.append((cmd, proc, log))
        deadline = time.monotonic() + READY_TIMEOUT_S

        def ready() -> None:
            while not all(list_workers(self.client, queue) for queue in queues):
                if proc.poll() is not None:
                    pytest.fail(f"{cmd.where}: `{cmd.code}` exited {proc.returncode} before "
                                f"serving queues {queues}; its output:\n{tail(log)}")
                if time.monotonic() > deadline:
                    pytest.fail(f"{cmd.where}: `{cmd.code}` registered no worker on each of "
                                f"{queues} within {READY_TIMEOUT_S:g} s; its output:\n"
                                f"{tail(log)}")
                time.sleep(0.05)

        self.starting.append(ready)
        self.ran.append(cmd.code + "  (started)")

    def start_web(self, cmd: Command, port: int) -> None:
        """A web server: started, then waited for until its port accepts connections."""
        if accepts(port):
            pytest.fail(f"{cmd.where}: port {port} of `{cmd.code}` is taken by another "
                        "process; free it to run this page's commands")
        log = self.tmp / f"service{cmd.lineno}.log"
        with open(log, "wb") as sink:
            proc = subprocess.Popen(["bash", "-c", "exec " + cmd.code], env=self.env, cwd=ROOT,
                                    stdout=sink, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self.services.append((cmd, proc, log))
        deadline = time.monotonic() + READY_TIMEOUT_S

        def ready() -> None:
            while not accepts(port):
                if proc.poll() is not None:
                    pytest.fail(f"{cmd.where}: `{cmd.code}` exited {proc.returncode} before "
                                f"listening on port {port}; its output:\n{tail(log)}")
                if time.monotonic() > deadline:
                    pytest.fail(f"{cmd.where}: `{cmd.code}` did not listen on port {port} "
                                f"within {READY_TIMEOUT_S:g} s; its output:\n{tail(log)}")
                time.sleep(0.05)

        self.starting.append(ready)
        self.ran.append(cmd.code + "  (started)")

    def wait_ready(self) -> None:
        """Wait until each service started since the last call serves (a worker: in
        the registry on each of its queues; a web server: its port accepts): services
        on consecutive lines start side by side, and each is ready before the next
        command line runs."""
        while self.starting:
            self.starting.pop(0)()

    def stop_services(self) -> None:
        """SIGTERM each service, newest first, all at once (each drains and exits on
        its own, so they stop side by side): each must exit 0."""
        for _cmd, proc, _log in reversed(self.services):
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while self.services:
            cmd, proc, log = self.services.pop()
            try:
                rc = proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
                pytest.fail(f"{cmd.where}: `{cmd.code}` did not exit within "
                            f"{STOP_TIMEOUT_S:g} s of SIGTERM; its output:\n{tail(log)}")
            # uvicorn re-raises the SIGTERM it handled once it shut down cleanly
            clean = (0, -signal.SIGTERM) if web_port(shlex.split(cmd.code)) else (0,)
            assert rc in clean, (f"{cmd.where}: `{cmd.code}` exited {rc} after SIGTERM, not "
                                 f"{' or '.join(map(str, clean))}; its output:\n{tail(log)}")

    def kill_all(self) -> None:
        for _cmd, proc, _log in self.services:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        self.client.close()


@pytest.fixture
def page_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server for one page, so its queues (``tiny``, ``chat``) are its own."""
    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


#: README.md's commands that run (the quick start: a supervisor, ``mtq submit --follow``,
#: ``mtq status``) are run by tests/integration/test_readme.py's
#: test_the_quick_start_works too, which asserts what they print and the Ctrl-C drain
#: besides: the page's run here is a slow test (make test-slow)
SLOW_PAGES = {"README.md"}


@pytest.mark.parametrize("page", [
    pytest.param(p, marks=pytest.mark.slow) if p.name in SLOW_PAGES and p.parent == ROOT else p
    for p in PAGES], ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_the_commands_of_the_page_run(page: Path, page_redis: RedisServer,
                                      tmp_path: Path) -> None:
    cmds = commands(page)
    assert all(tag_problem(c) is None for c in cmds), [tag_problem(c) for c in cmds]
    run = Page(tmp_path, doc_env(tmp_path, page_redis.url), page_redis.url)
    try:
        for i, cmd in enumerate(cmds):
            if cmd.service:
                if any(runnable(later) for later in cmds[i + 1:]):
                    run.start(cmd)
            elif runnable(cmd):
                run.wait_ready()
                run.run(cmd)
        run.wait_ready()
        run.stop_services()
    finally:
        run.kill_all()
    if not run.ran:
        pytest.skip(f"every command of {page.name} is tagged not to run here")
