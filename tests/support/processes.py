"""Processes the tests start: free loopback ports, ``mtq worker run`` processes, the
gated handler's worker (``tests.handlers:gated``) and its tasks."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.harness.server import free_port as free_port
from tests.support.paths import PY


def worker_process(args: list[str], env: dict[str, str], log: Any) -> subprocess.Popen[bytes]:
    """A real ``mtq worker run ARGS`` process, its output into ``log`` (a file)."""
    return subprocess.Popen([PY, "-m", "mtq", "worker", "run", *args],
                            env=env, stdout=log, stderr=subprocess.STDOUT)


def kill_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``proc`` if it still runs, and reap it."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


@contextmanager
def gated_worker(qname: str, env: dict[str, str], *args: str
                 ) -> Iterator[subprocess.Popen[bytes]]:
    """A real ``mtq worker run tests.handlers:gated`` on ``qname`` (``args`` added to its
    command line); stopped with SIGTERM on the way out, its clean exit asserted."""
    proc = subprocess.Popen([PY, "-m", "mtq", "worker", "run", "tests.handlers:gated", "-q",
                             qname, *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        yield proc
    except BaseException:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        raise
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(20) == 0, proc.stderr.read().decode()[-2000:] if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def gated_task(q: Any, tmp_path: Path, i: int, gate: str = "gate") -> tuple[Path, Any]:
    """A task of ``q`` (an mtq.Queue) for tests.handlers:gated, whose handler waits while
    the returned gate file exists; it echoes ``i``."""
    path = tmp_path / gate
    path.touch()
    return path, q.submit({"i": i, "gate": str(path)})


def ctrl_c_default() -> None:
    """``preexec_fn`` of a process a test sends Ctrl-C (SIGINT) to: SIGINT back to its
    default, as in a terminal. A test run started in the background by a shell without
    job control inherits SIGINT ignored, and so would the process, which would then
    never see the Ctrl-C the test sends."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
