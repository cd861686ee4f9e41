"""The dashboard against real Redis: what a snapshot costs, and the live screen in
tmux (figures that move, Redis going away and coming back, q, Ctrl-C, a small
terminal)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from rich.console import Console

import mtq
from mtq.admin import snapshot
from mtq.dashboard.app import run
from mtq.dashboard.view import DASH, queue_columns
from tests.support.paths import PY, ROOT
from tests.support.servers import RedisServer
from tests.support.waits import wait_for

needs_tmux = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")


# -- what a snapshot costs ---------------------------------------------------------
def _commands(client: redis.Redis) -> dict[str, int]:
    stats = client.info("commandstats")
    return {name: v["calls"] for name, v in stats.items()
            if name not in ("cmdstat_config|resetstat", "cmdstat_info", "cmdstat_config")}


def _counted_snapshot(client: redis.Redis, queue: str) -> tuple[dict[str, int], float]:
    client.config_resetstat()
    t = time.perf_counter()
    snap = snapshot(client, [queue])
    elapsed = time.perf_counter() - t
    assert snap.queue(queue) is not None
    return _commands(client), elapsed


def test_a_snapshot_costs_the_same_for_100k_tasks_as_for_one(tmp_path: Path) -> None:
    # a server of its own: command counts are server-wide
    server = RedisServer(tmp_path)
    server.start()
    client = redis.Redis.from_url(server.url)
    try:
        big = mtq.Queue("big", client=client)
        for chunk in range(100):
            big.submit_many([mtq.Request({"i": i}, stream=f"s{i % 10_000}")
                             for i in range(chunk * 1000, (chunk + 1) * 1000)])
        mtq.Queue("small", client=client).submit({"i": 0})
        for name in ("big", "small"):  # connections opened, scripts loaded
            snapshot(client, [name])

        big_cmds, big_s = _counted_snapshot(client, "big")
        small_cmds, small_s = _counted_snapshot(client, "small")
        view = snapshot(client, ["big"]).queue("big")
        assert view is not None and (view.waiting, view.streams) == (100_000, 10_000)
        assert big_cmds == small_cmds, (big_cmds, small_cmds)
        assert sum(big_cmds.values()) <= 12, big_cmds  # O(1) reads, no SCAN, no KEYS
        assert big_s < 0.25, f"a snapshot of 100 000 tasks took {big_s:.3f}s"
    finally:
        big.hub.close_all()
        client.close()
        server.stop()


# -- one frame, in this process ----------------------------------------------------
def test_once_prints_one_frame(r: redis.Redis, redis_url: str, qname: str) -> None:
    queue = mtq.Queue(qname, client=r)
    queue.submit_many([{"i": i} for i in range(3)], stream="a")
    queue.hub.close_all()  # the submit's reply listener: not needed here
    console = Console(record=True, width=120, height=40, color_system=None)
    assert run(redis_url, [qname], once=True, console=console) == 0
    text = console.export_text()
    assert qname in text and "refresh every 1 s" in text and "Redis unreachable" not in text
    assert "quits" not in text  # nothing to quit
    row = next(x for x in text.splitlines() if x.startswith(qname))
    assert row.split()[1] == "3"


def test_once_without_redis_shows_the_banner_and_fails(unreachable_url: str) -> None:
    console = Console(record=True, width=100, height=30, color_system=None)
    assert run(unreachable_url, once=True, console=console) == 1
    assert "Redis unreachable; retrying (no snapshot yet): cannot reach Redis" in \
        console.export_text()


# -- the live screen, in tmux ------------------------------------------------------
class Tmux:
    """One dashboard in a detached tmux session on a private tmux server."""

    def __init__(self, tmp: Path, env: dict[str, str], width: int, height: int,
                 args: list[str]) -> None:
        self.socket = "mtq-test-" + uuid.uuid4().hex[:10]
        self.exit_file = tmp / "exit-code"
        self.err_file = tmp / "stderr"
        self.stty_file = tmp / "stty"
        dash = " ".join(shlex.quote(a) for a in [PY, "-m", "mtq", "dashboard", *args])
        # the exit code and the terminal's mode once the dashboard is gone
        script = (f"cd {shlex.quote(str(ROOT))}; {dash} 2>{shlex.quote(str(self.err_file))}; "
                  f"echo $? > {shlex.quote(str(self.exit_file))}; "
                  f"stty -a > {shlex.quote(str(self.stty_file))}")
        self.tmux("new-session", "-d", "-s", "dash", "-x", str(width), "-y", str(height),
                  "bash -c " + shlex.quote(script), env=env)

    def tmux(self, *args: str, env: dict[str, str] | None = None,
             check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["tmux", "-L", self.socket, *args], env=env, check=check,
                              capture_output=True, text=True, timeout=10)

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "dash", check=False).stdout

    def alive(self) -> bool:
        return self.tmux("has-session", "-t", "dash", check=False).returncode == 0

    def wait(self, ok: Callable[[str], bool], timeout: float, what: str) -> str:
        """Capture the screen until ``ok(screen)``; fail with ``what`` and the last
        screen after ``timeout``."""
        last = [""]

        def check() -> bool:
            last[0] = self.screen()
            return ok(last[0])

        try:
            wait_for(check, timeout, what, interval=0.1)
        except pytest.fail.Exception:
            pytest.fail(f"timed out after {timeout}s: {what}; stderr: {self.stderr()!r}; "
                        f"last screen:\n{last[0]}")
        return last[0]

    def wait_screen(self, needle: str, timeout: float = 15.0, absent: bool = False) -> str:
        if absent:
            return self.wait(lambda s: needle not in s, timeout, f"{needle!r} stays on screen")
        return self.wait(lambda s: needle in s, timeout, f"{needle!r} never on screen")

    def stderr(self) -> str:
        return self.err_file.read_text() if self.err_file.exists() else ""

    def wait_exit(self, timeout: float = 10.0) -> int:
        wait_for(lambda: self.exit_file.exists() and self.exit_file.read_text().strip(),
                 timeout, f"the dashboard did not exit; screen:\n{self.screen()}")
        wait_for(lambda: not self.alive(), timeout, "the tmux session did not end")
        return int(self.exit_file.read_text())

    def kill(self) -> None:
        self.tmux("kill-server", check=False)


@pytest.fixture
def tmux_dashboard(tmp_path: Path) -> Iterator[list[Tmux]]:
    started: list[Tmux] = []
    yield started
    for t in started:
        t.kill()


def queue_row(screen: str, name: str) -> dict[str, str]:
    """The queues table's row for ``name``, by column (the 120-column layout shows
    every column)."""
    headers = [c.header for c in queue_columns({})]
    line = next((x for x in screen.splitlines() if x.startswith(name + " ")), None)
    assert line is not None, f"no row for {name} on the screen:\n{screen}"
    return dict(zip(headers, line.split()))


def terminal_restored(t: Tmux) -> None:
    wait_for(t.stty_file.exists, 5, "the shell did not record the terminal's mode")
    modes = t.stty_file.read_text().split()
    assert "icanon" in modes and "echo" in modes, modes  # cbreak mode undone


@needs_tmux
@pytest.mark.timeout(90)
def test_live_figures_redis_restart_and_q(tmp_path: Path, subprocess_env: dict[str, str],
                                          qname: str, tmux_dashboard: list[Tmux]) -> None:
    server = RedisServer(tmp_path, appendonly=True)  # keeps its data across the restart
    server.start()
    env = {**subprocess_env, "MTQ_REDIS_URL": server.url}
    client = redis.Redis.from_url(server.url)
    queue = mtq.Queue(qname, client=client)
    worker: subprocess.Popen[bytes] | None = None
    try:
        queue.submit_many([{"i": i} for i in range(20)])
        # refreshes twice a second (the default, once a second: test_once_prints_one_frame);
        # no retries of a refused connection (MTQ_REDIS_RETRIES=0), so Redis stopped is
        # on screen at the next refresh rather than after the retries' ~3 s
        t = Tmux(tmp_path, {**env, "MTQ_REDIS_RETRIES": "0"}, 120, 40,
                 ["--redis", server.url, "--refresh", "0.5"])
        tmux_dashboard.append(t)
        screen = t.wait_screen(qname)
        assert "refresh every 0.5 s" in screen and "q quits" in screen
        first = queue_row(screen, qname)
        assert (first["waiting"], first["workers"]) == ("20", "0"), first

        worker = subprocess.Popen(
            [PY, "-m", "mtq", "worker", "run", "tests.models:Probe", "--queue", qname,
             "--redis", server.url], env=env, cwd=ROOT,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # ~40 tasks/s (4 per 0.1 s batch) for ~3 s: several refreshes see them
        burst = queue.submit_many([{"i": i, "sleep": 0.025} for i in range(120)])
        screen = t.wait_screen("probe/h-", timeout=30)  # the workers table (version computed)
        assert "cpu" in screen
        seen: set[str] = set()  # the waiting figures shown

        def shows(ok: Callable[[dict[str, str]], bool]) -> Callable[[str], bool]:
            def check(screen: str) -> bool:
                now = queue_row(screen, qname)
                seen.add(now["waiting"])
                return ok(now)
            return check

        t.wait(shows(lambda q: q["workers"] == "1" and q["tasks/s"] != DASH
                     and float(q["tasks/s"]) > 1), 20, "no throughput on the dashboard")
        t.wait(shows(lambda q: q["waiting"] == "0"), 30, "the queue never showed empty")
        assert len(seen) >= 3, seen  # the figures moved between refreshes
        screen = t.screen()
        spark = next(x for x in screen.splitlines() if x.startswith("throughput"))
        assert any(b in spark for b in "▂▃▄▅▆▇█"), spark

        for task in burst:  # all done: none is claimed ahead, to be given back at the stop
            task.result(timeout=30)
        worker.terminate()
        worker.wait(20)
        queue.hub.close_all()  # its reply listener would complain of the stop
        server.stop()
        screen = t.wait_screen("Redis unreachable")
        assert qname in screen  # the last good snapshot stays on screen
        server.start()
        screen = t.wait_screen("Redis unreachable", absent=True)
        assert queue_row(screen, qname)["waiting"] == "0"

        t.tmux("send-keys", "-t", "dash", "q")
        assert t.wait_exit() == 0
        assert "Traceback" not in t.stderr(), t.stderr()
        terminal_restored(t)
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
            worker.wait(10)
        queue.hub.close_all()
        client.close()
        server.stop()


@needs_tmux
@pytest.mark.timeout(60)
def test_a_small_terminal_and_ctrl_c(tmp_path: Path, subprocess_env: dict[str, str],
                                     r: redis.Redis, qname: str,
                                     tmux_dashboard: list[Tmux]) -> None:
    queue = mtq.Queue(qname, client=r)
    queue.submit_many([{"i": i} for i in range(5)], stream="x")
    queue.hub.close_all()
    t = Tmux(tmp_path, subprocess_env, 50, 12, ["--queue", qname, "--refresh", "0.5"])
    tmux_dashboard.append(t)
    screen = t.wait_screen(qname)
    assert "1 queue · 5 waiting" in screen, screen
    assert "Traceback" not in screen
    t.tmux("send-keys", "-t", "dash", "C-c")
    assert t.wait_exit() == 0
    assert "Traceback" not in t.stderr(), t.stderr()
    terminal_restored(t)
