"""The Flask integration (mtq.contrib.flask) under a real gunicorn process (threaded
workers, tests/flask_app.py), driven by a real HTTP client (httpx) against a real
redis-server; ``flask mtq`` as a real subprocess. The web contract every framework
keeps (the stream, resume with Last-Event-ID, 404/400, 503, cancel on disconnect) is
tested in test_web_contract.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import mtq
from tests.support.paths import ROOT
from tests.support.web import GunicornServer

pytestmark = pytest.mark.timeout(90)

KEEPALIVE = 0.5


@pytest.fixture(scope="module")
def web(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GunicornServer]:
    server = GunicornServer(redis_url, tmp_path_factory.mktemp("flask") / "gunicorn.log",
                            MTQ_WEB_KEEPALIVE=str(KEEPALIVE))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def http(web: GunicornServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=web.base, timeout=httpx.Timeout(10.0)) as c:
        yield c


def post(http: httpx.Client, qname: str, payload: Any) -> dict[str, Any]:
    r = http.post(f"/q/{qname}/tasks", json=payload)
    assert r.status_code == 202, r.text
    return dict(r.json())


def test_a_submit_goes_into_the_session_stream(
        qname: str, redis_url: str, http: httpx.Client) -> None:
    task = post(http, qname, {"n": 30, "step_ms": 20})
    # the session's stream: FIFO per browser (the cookie), another browser has its own
    assert task["stream"].startswith("session:")
    assert mtq.Queue(qname, redis_url).task(task["id"]).info().stream == task["stream"]
    assert post(http, qname, {"n": 1})["stream"] == task["stream"]
    with httpx.Client(base_url=str(http.base_url), timeout=10) as other:
        assert post(other, qname, {"n": 1})["stream"] != task["stream"]


def test_flask_mtq_commands(qname: str, redis_url: str) -> None:
    env = dict(os.environ, MTQ_REDIS_URL=redis_url, MTQ_QUEUE=qname,
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    mtq.Queue(qname, redis_url).submit({"n": 1})

    def flask(*args: str, extra: dict[str, str] | None = None
              ) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "flask", "--app", "tests.flask_app",
                               "mtq", *args], cwd=ROOT, env={**env, **(extra or {})},
                              capture_output=True, text=True, timeout=60)

    out = flask("status", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert qname in json.dumps(rows), out.stdout
    out = flask("status")
    assert out.returncode == 0 and qname in out.stdout, out.stdout + out.stderr
    # the app's Redis URL wins over the environment's (a URL nobody serves)
    out = flask("status", "--json", extra={"MTQ_FLASK_REDIS_URL": redis_url,
                                           "MTQ_REDIS_URL": "redis://127.0.0.1:1/0"})
    assert out.returncode == 0 and qname in out.stdout, out.stderr
    # and the command line's wins over the app's (refused at once: no retries)
    out = flask("status", "--redis", "redis://127.0.0.1:1/0",
                extra={"MTQ_REDIS_RETRIES": "0"})
    assert out.returncode == 5 and "cannot reach Redis" in out.stderr, out
    out = flask("workers", "--help")
    assert out.returncode == 0 and "--queue" in out.stdout and "TARGET" in out.stdout, out
    # --queue defaults to the app's MTQ_QUEUE: what is missing is the target's module
    name = "no_such_module_" + uuid.uuid4().hex[:6]
    out = flask("workers", name + ":M")
    assert out.returncode == 2 and name in out.stderr, (out.returncode, out.stderr)
    assert "--queue" not in out.stderr, out.stderr
    # model options are checked before Redis is waited for (the app's is unreachable)
    out = flask("workers", "tests.models:Configured", "--set", "model=/m", "--set", "nope=1",
                extra={"MTQ_FLASK_REDIS_URL": "redis://127.0.0.1:1/0",
                       "MTQ_REDIS_WAIT_S": "60"})
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert "'tests.models:Configured' has no option 'nope'" in out.stderr, out.stderr
    assert "cannot reach" not in out.stderr, out.stderr
