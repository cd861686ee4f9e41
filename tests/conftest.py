"""Fixtures: a real redis-server on a free port for the session, a fresh queue per test.

The helpers the tests import live in ``tests/support/``; this module holds fixtures and
the session's redis-server launcher (:class:`RedisServer`)."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from mtq.broker.embedded import find_redis_server
from tests.support.paths import ROOT
from tests.support.processes import free_port
from tests.support.waits import wait_for


class RedisServer:
    """A redis-server process on a free loopback port."""

    def __init__(self, tmp: Path, appendonly: bool = False) -> None:
        self.binary = find_redis_server()
        self.port = free_port()
        self.dir = tmp
        self.appendonly = appendonly
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes" if self.appendonly else "no", "--dir", str(self.dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)

        def up() -> bool:
            try:
                return bool(client.ping())
            except redis.exceptions.ConnectionError:
                assert self.proc is not None and self.proc.poll() is None, "redis-server exited"
                return False

        wait_for(up, 10, f"redis-server on port {self.port} did not accept connections")
        client.close()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


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
