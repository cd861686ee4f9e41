"""The gateway tests' helpers (tests/integration/test_gateway*.py): ``mtq serve`` and
``mtq workers start`` as real processes, their environment, and what a refused request
must leave unwritten (the task keys in Redis)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import redis

from tests.support.paths import ROOT


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL its process group after 15 s; reaped."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def env_for(redis_url: str, tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(MTQ_REDIS_URL=redis_url, MTQ_HOME=str(tmp / "home"),
               MTQ_REFERENCE_WEIGHTS=str(tmp / "tinygpt.pt"),
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    return env


def serve(env: dict[str, str], log: Path, port: int, *args: str) -> subprocess.Popen[bytes]:
    """``mtq serve --port PORT ARGS`` (uvicorn), its output into ``log``."""
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "mtq", "serve", "--port", str(port),
                                 "--log-level", "warning", *args], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def workers(env: dict[str, str], log: Path, target: str, queue: str
            ) -> subprocess.Popen[bytes]:
    """``mtq workers start TARGET --queue QUEUE`` on the CPU, one replica."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "mtq", "workers", "start", target, "--queue", queue,
             "--devices", "cpu", "--replicas", "1"], cwd=ROOT, env=env, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True)


def task_keys(r: redis.Redis) -> set[Any]:
    """Every task's hash in this Redis (``mtq:{queue}:task:<id>``), whatever its queue."""
    return set(r.scan_iter(match="mtq:{*}:task:*", count=1000))


def new_task_keys(r: redis.Redis, before: set[Any]) -> set[Any]:
    """The task hashes made since ``before`` (:func:`task_keys`)."""
    return task_keys(r) - before
