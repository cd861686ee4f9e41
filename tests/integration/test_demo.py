"""The demo (the README's first command) against the test server: real supervisors,
a real SIGKILL, and no process left behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mtq.demo import Tick, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]


def processes_naming(text: str) -> list[int]:
    """Live processes whose command line contains ``text`` (not this one)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmd and state != "Z":
            found.append(int(d.name))
    return found


def test_demo_checks_everything_it_promises(redis_url: str, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MTQ_HOME", str(tmp_path / "home"))  # weights made on first use
    ticks: list[Tick] = []
    messages: list[str] = []
    started = time.monotonic()
    report = run(redis_url, users=8, chats_per_user=2, embeds_per_user=3, duration_s=5,
                 on_tick=ticks.append, progress=messages.append)
    took = time.monotonic() - started
    assert not report.skipped
    assert report.ok, (report.order_errors, report.chat, report.embed, report.log)
    assert (report.chat.tasks, report.embed.tasks) == (16, 24 + 8)  # + the kill's burst
    assert report.tokens == 16 * 40
    assert report.killed_pid is not None
    # the tasks the killed worker held were given back and all completed (none, if the
    # kill landed just after its batch finished)
    assert report.killed_worker.split(":")[1] == str(report.killed_pid)
    assert report.killed_held_done == report.killed_held <= report.embed.tasks
    assert report.checks() == dict.fromkeys(report.checks(), True)
    assert report.processes >= 6 and report.processes_left == []
    assert not Path(f"/proc/{report.killed_pid}").exists() or \
        "Z" in Path(f"/proc/{report.killed_pid}/stat").read_text()
    # on_tick saw the work flow, about once a second, and user-0's chat streamed
    assert ticks and ticks[-1].finished == ticks[-1].total
    assert any(0 < t.finished < t.total for t in ticks)
    assert any("> " in t.live_text for t in ticks)
    assert any("killed embedding worker" in m for m in messages)
    assert took < 60, f"the demo took {took:.0f} s"


def test_mtq_demo_command_finishes_in_time_and_leaves_nothing(
        redis_url: str, subprocess_env: dict[str, str], tmp_path: Path) -> None:
    env = dict(subprocess_env, MTQ_HOME=str(tmp_path / "home"), COLUMNS="120")
    started = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "mtq", "demo", "--redis", redis_url,
                          "--users", "6", "--duration", "4"],
                         env=env, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    out = " ".join(res.stdout.split())
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for line in ("tasks lost │ none (60 of 60 succeeded)", "tasks finished twice │ none",
                 "order per user stream │ kept: each stream's tasks ran one at a time, in "
                 "submit order", "streamed tokens │ spell the result of each of the 18 chats",
                 "processes left behind │ none (0 of "):
        assert line in out, out[-2000:]
    killed = re.search(r"worker killed │ pid \d+ \(SIGKILL\); (it held (\d+) tasks?: given "
                       r"back, run again, all (\d+) completed|it held no task at that moment)",
                       out)
    assert killed and killed[2] == killed[3], out[-2000:]
    assert res.stdout.rstrip().splitlines()[-1] == "All 5 checks passed.", res.stdout[-2000:]
    assert "yes" not in out.split("what happened", 1)[1]  # each row says what it found
    assert "killed embedding worker" in out  # not a terminal: progress lines, no dashboard
    assert took < 60, f"mtq demo took {took:.0f} s"
    assert processes_naming(redis_url) == [], "processes of the demo outlived it"
