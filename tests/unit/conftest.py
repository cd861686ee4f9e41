"""The unit tests need no Redis: a test here that asks for the session's redis-server
(through ``r``, ``client``, ``redis_url`` or ``subprocess_env``) fails at set-up, before
any fixture starts the server. Such a test belongs in tests/integration/."""

from __future__ import annotations

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if "redis_server" in getattr(item, "fixturenames", ()):
        pytest.fail(f"{item.nodeid} asks for the session's redis-server: a unit test needs "
                    "no Redis; move it to tests/integration/, or test what it tests without "
                    "Redis", pytrace=False)
