"""Engines: the bugs a review of issue 44 found (in-process, real redis-server)."""

from __future__ import annotations

import threading

import pytest

import mtq
from mtq.workers.host import Host
from tests import engine_models as em
from tests.integration.test_engines import FLOATS, _counters, engine, result

pytestmark = pytest.mark.timeout(90)
__all__ = ["_counters"]


@pytest.mark.parametrize("declared", [False, True])
def test_host_setup_of_engines_bigger_than_the_budget_does_not_hang(
        declared: bool, qname: str, redis_url: str) -> None:
    """Two engines loaded at start whose real size passes the budget (not known from
    the host file): no engine's model thread runs yet, so none can unload for room;
    setup must not wait for that forever."""
    qa, qb = qname, qname + "-b"
    a = engine(qa, redis_url, "a")
    b = engine(qb, redis_url, "b", memory_bytes=FLOATS * 4 if declared else None)
    host = Host([a, b], memory_budget=int(FLOATS * 4 * 1.5))
    done = threading.Event()
    errors: list[BaseException] = []

    def setup() -> None:
        try:
            host.setup()
        except BaseException as exc:
            errors.append(exc)
        done.set()

    threading.Thread(target=setup, daemon=True).start()
    finished = done.wait(10)
    if not finished:
        host.stop()  # (make_room gives up on a stop)
        done.wait(10)
    assert finished, "Host.setup() hung waiting for an engine to unload for room"
    assert not errors, errors
    assert em.SETUPS == {"a": 1, "b": 1} and a.loaded and b.loaded
    t = threading.Thread(target=host.run, daemon=True)
    t.start()
    try:
        assert result(mtq.Queue(qa, redis_url), 1)["tag"] == "a"
        assert result(mtq.Queue(qb, redis_url), 2)["tag"] == "b"
    finally:
        host.stop()
        t.join(30)
