"""Child processes of a benchmark, and waits that end with a message."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness.server import ROOT


def worker_env(url: str, **extra: str) -> dict[str, str]:
    """The environment of a worker or client process: the server, this tree first on the
    import path, no bytecode written (see :func:`~benchmarks.harness.server.compile_tree`),
    no model downloads."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "MTQ_REDIS_URL": url, "PYTHONPATH": path,
            "PYTHONDONTWRITEBYTECODE": "1", "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", **extra}


def spawn(args: Sequence[str], env: dict[str, str], cpu: int | None = None,
          log: Path | None = None) -> subprocess.Popen[bytes]:
    """``python -m mtq ARGS`` in a session of its own (``cpu``: pinned with taskset),
    its output to ``log`` or nowhere."""
    cmd = [sys.executable, "-m", "mtq", *args]
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu), *cmd]
    out: Any = open(log, "ab") if log else subprocess.DEVNULL
    try:
        return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    finally:
        if log:
            out.close()


def stop(proc: subprocess.Popen[Any], timeout: float = 30) -> None:
    """SIGTERM (a graceful stop), then SIGKILL if it has not exited in ``timeout``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait(10)


def kill_group(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL the process's whole session (a supervisor and its children), and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


#: what :class:`Proc` runs by default: ``python -m mtq``
MTQ = (sys.executable, "-m", "mtq")


class Proc:
    """``python -m mtq ARGS`` (or ``program ARGS``) whose output goes to a temporary file,
    shown when it fails."""

    def __init__(self, args: Sequence[str], env: dict[str, str],
                 program: Sequence[str] = MTQ) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="mtq-bench-", suffix=".log", delete=False)
        self.argv = [*program, *args]
        self.proc = subprocess.Popen(self.argv, env=env, cwd=ROOT, stdout=self.log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def fail(self, why: str) -> SystemExit:
        self.kill()
        tail = "\n".join(self.output().splitlines()[-40:])
        return SystemExit(f"{why}\n$ {' '.join(self.argv)}\n{tail}")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise self.fail(f"still running after {timeout:.0f} s") from None

    def stop(self, timeout: float = 60) -> None:
        stop(self.proc, timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def close(self) -> None:
        self.kill()
        self.log.close()
        os.unlink(self.log.name)


def wait_for(what: str, cond: Callable[[], Any], timeout: float, procs: Sequence[Proc] = (),
             every: float = 0.02) -> Any:
    """Poll ``cond`` until it is truthy and return its value; fail with a message (and a
    child's output) after ``timeout`` or when one of ``procs`` exits."""
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        for p in procs:
            if p.proc.poll() is not None:
                raise p.fail(f"exited ({p.proc.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            if procs:
                raise procs[0].fail(f"timed out after {timeout:.0f} s waiting for {what}")
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)
    return value
