"""Fixtures of the integration tests beyond the session's Redis (tests/conftest.py)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.clusters import Cluster
from tests.support.paths import PY
from tests.support.processes import free_port
from tests.support.supervisors import LAUNCHER, StartFn, Sup


@pytest.fixture
def supervise(redis_url: str, subprocess_env: dict[str, str],
              tmp_path: Path) -> Iterator[StartFn]:
    """``supervise(target, queue, *cli options, env=..., settings=..., **launcher)``:
    start ``mtq workers start`` (or, given ``settings``, the launcher with those
    QueueSettings) and kill its whole process group at teardown."""
    started: list[Sup] = []

    def start(target: str, queue: str, *args: str, env: dict[str, str] | None = None,
              settings: dict[str, Any] | None = None, **launcher: Any) -> Sup:
        if settings is None:
            assert not launcher, "launcher options need settings=..."
            cmd = [PY, "-m", "mtq", "workers", "start", target, "--queue", queue,
                   "--redis", redis_url, *args]
        else:
            assert not args, "CLI options do not go to the launcher"
            cfg = {"target": target, "queue": queue, "url": redis_url, "settings": settings,
                   **launcher}
            cmd = [PY, "-c", LAUNCHER, json.dumps(cfg)]
        log = tmp_path / f"supervisor-{len(started)}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, env={**subprocess_env, **(env or {})}, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        sup = Sup(proc, log)
        started.append(sup)
        return sup

    yield start
    for sup in started:
        sup.kill()


@pytest.fixture
def engine_counters() -> Iterator[None]:
    """The engine test models' counters and gates (tests/engine_models.py) fresh for
    each test; every gate opened at its end."""
    from tests import engine_models as em

    for c in (em.SETUPS, em.TEARDOWNS, em.RESETS):
        c.clear()
    em.GATES.clear()
    em.HELD.clear()
    em.CRASHED.clear()
    yield
    for gate in em.GATES.values():
        gate.set()


@pytest.fixture
def unreachable_url(monkeypatch: pytest.MonkeyPatch) -> str:
    """A Redis URL nothing listens on, with ``MTQ_REDIS_RETRIES=0`` in this test's
    environment (os.environ: this process's clients, and the subprocesses given it): the
    refused connection is the error at once, not after the retries (about 5 s) a dropped
    connection gets, which other tests hold (a Redis restarted, connections killed). A
    port of its own, so that no client an earlier test cached for its URL is reused."""
    monkeypatch.setenv("MTQ_REDIS_RETRIES", "0")
    return f"redis://127.0.0.1:{free_port()}/0"


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A Redis Cluster (3 primaries, a replica each) for the session: test_cluster.py's
    and test_gateway_keys.py's tests share it (each its own queue names and tenants),
    rather than paying for a cluster's creation in each module. A test that kills or
    restarts nodes makes a cluster of its own (test_cluster_failover.py)."""
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    c.start()
    yield c
    c.stop()
