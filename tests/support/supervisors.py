"""A worker supervisor in a subprocess (:class:`Sup`, started by the ``supervise``
fixture of ``tests/integration/conftest.py``), the registry's view of its workers, and
the call log the test models write (``tests/models.py``: one line per setup, predict
start and predict return)."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from mtq.workers.registry import list_workers
from tests.support.waits import wait_for

#: runs a Supervisor with settings the CLI does not expose (max_deliveries);
#: events go to stdout, the children's logs to stderr
LAUNCHER = r"""
import json, sys
from mtq.settings import QueueSettings
from mtq.workers.supervisor import Supervisor
cfg = json.loads(sys.argv[1])
settings = QueueSettings(**cfg.pop("settings"))
sup = Supervisor(cfg.pop("target"), cfg.pop("queue"), settings=settings,
                 on_event=lambda m: print("mtq:", m, flush=True), **cfg)
print("mtq: supervisor", sup.id, flush=True)
sys.exit(sup.run())
"""


@dataclass
class Sup:
    """A supervisor subprocess, leader of its own process group."""

    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        """What it printed, with rich's line wrapping undone (words joined by one space)."""
        return " ".join(self.log.read_text(errors="replace").split())

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait_exit(self, timeout: float, what: str) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"supervisor did not exit within {timeout} s {what}:\n{self.output()}")

    def group_alive(self) -> bool:
        """True while any process of its group (the supervisor or a worker) runs. A
        zombie does not count: a child the supervisor left when it exited is reaped by
        init, which takes its time (about 1.5 s on the test machines' init); it runs
        nothing and holds nothing meanwhile."""
        if not os.path.isdir("/proc/self"):  # no /proc: any process, zombies too
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return False
            return True
        self.proc.poll()  # the supervisor itself: reaped here, not a zombie of ours
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # gone meanwhile
            state, pgrp = fields[0], int(fields[2])
            if pgrp == self.proc.pid and state != "Z":
                return True
        return False

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
            pass


#: what the ``supervise`` fixture gives a test:
#: ``supervise(target, queue, *cli options, env=..., settings=..., **launcher)``
StartFn = Callable[..., Sup]


def pid_exists(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


@dataclass(frozen=True)
class Call:
    """One line of a model's call log (see tests/models.py)."""

    tag: str         # S: setup started, B: predict started, D: predict returned
    t: float         # time.time() in the worker
    pid: int
    keys: tuple[str, ...]


def read_log(path: Path) -> list[Call]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        tag, t, pid, *keys = line.split()
        out.append(Call(tag, float(t), int(pid), tuple(keys)))
    return out


def workers_of(r: redis.Redis, queue: str, live_only: bool = False) -> list[dict[str, Any]]:
    """The registry's serving workers of ``queue`` (not a quarantine process);
    ``live_only``: those whose process exists (a killed worker's entry stays until its
    TTL runs out, a few seconds)."""
    ws = [w for w in list_workers(r, queue) if w.get("role", "serving") == "serving"]
    return [w for w in ws if pid_exists(w["pid"])] if live_only else ws


def wait_workers(r: redis.Redis, queue: str, n: int, sup: Sup, timeout: float = 30,
                 check: Callable[[dict[str, Any]], bool] = lambda w: True,
                 live_only: bool = True) -> list[dict[str, Any]]:
    """Wait until exactly ``n`` workers of ``queue`` are registered (only live processes
    counted, unless ``live_only`` is False) and all pass ``check``."""
    def ok() -> list[dict[str, Any]] | None:
        assert sup.running(), f"supervisor exited:\n{sup.output()}"
        ws = workers_of(r, queue, live_only)
        return ws if len(ws) == n and all(check(w) for w in ws) else None

    return wait_for(ok, timeout, f"{n} worker(s) of {queue} in the registry: "
                                 f"{workers_of(r, queue)}\n{sup.output()}")
