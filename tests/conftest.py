"""Fixtures: a real redis-server on a free port for the session, a fresh queue per test.

The helpers the tests import live in ``tests/support/``; this module holds fixtures only."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import redis

from tests.support.paths import ROOT
from tests.support.servers import RedisServer


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
    from mtq.client.replies import hub as replies

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
