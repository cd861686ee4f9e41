"""The unit tests need no Redis: a test here that asks for the session's redis-server
(through ``r``, ``client``, ``redis_url`` or ``subprocess_env``) fails at set-up, before
the server starts. Such a test belongs in tests/integration/."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _no_redis(request: pytest.FixtureRequest) -> None:
    if "redis_server" in request.fixturenames:
        pytest.fail("a unit test asks for the session's redis-server: move it to "
                    "tests/integration/, or test what it tests without Redis")
