"""The Flask integration (mtq.contrib.flask) under a real gunicorn process (threaded
workers, tests/flask_app.py), read by a real HTTP client (httpx, streaming) against a
real redis-server and a real in-process Worker; ``flask mtq`` as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import mtq
from mtq.settings import QueueSettings
from mtq.workers.worker import Worker
from tests.models import Counter
from tests.support.paths import ROOT
from tests.support.waits import wait_for
from tests.support.web import GunicornServer, Stream, events, read
from tests.support.workers import serving

pytestmark = pytest.mark.timeout(90)

FAST = QueueSettings(lease_ms=1500, retry_backoff_ms=0)
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


def worker(qname: str, redis_url: str) -> Worker:
    return Worker(Counter(), qname, url=redis_url, settings=FAST)


def post(http: httpx.Client, qname: str, payload: Any) -> dict[str, Any]:
    r = http.post(f"/q/{qname}/tasks", json=payload)
    assert r.status_code == 202, r.text
    return dict(r.json())


def test_submit_into_the_session_stream_and_tokens_arrive_progressively(
        qname: str, redis_url: str, http: httpx.Client) -> None:
    with serving(worker(qname, redis_url)) as run:
        task = post(http, qname, {"n": 30, "step_ms": 20})
        with http.stream("GET", task["events"]) as resp:
            assert resp.status_code == 200
            h = resp.headers
            assert h["content-type"] == "text/event-stream; charset=utf-8"
            assert (h["cache-control"], h["x-accel-buffering"]) == ("no-cache", "no")
            got = Stream(list(events(resp)))
        run.stop()
    assert got.events[0].retry == 1000
    assert got.tokens() == [(i, i) for i in range(30)]
    done = got.last
    assert done.event == "done"
    result = mtq.Queue(qname, redis_url).task(task["id"]).result(timeout=5)
    assert done.json() == {"status": "succeeded", "result": result}
    assert result["tokens"] == list(range(30))
    chunks = {e.chunk for e in got.of("token")}
    assert len(chunks) > 5, chunks  # many network reads, not one at the end
    # the session's stream: FIFO per browser (the cookie), another browser has its own
    assert task["stream"].startswith("session:")
    assert mtq.Queue(qname, redis_url).task(task["id"]).info().stream == task["stream"]
    assert post(http, qname, {"n": 1})["stream"] == task["stream"]
    with httpx.Client(base_url=str(http.base_url), timeout=10) as other:
        assert post(other, qname, {"n": 1})["stream"] != task["stream"]


def test_reconnect_with_last_event_id_resumes_without_gap_or_repeat(
        qname: str, redis_url: str, http: httpx.Client) -> None:
    with serving(worker(qname, redis_url)) as run:
        task = post(http, qname, {"n": 40, "step_ms": 20})
        first = read(http, task["events"], until=9)
        assert first.tokens() == [(i, i) for i in range(10)]
        second = read(http, task["events"], headers={"Last-Event-ID": "9"})
        assert first.tokens() + second.tokens() == [(i, i) for i in range(40)]
        assert second.last.json()["status"] == "succeeded"
        third = read(http, task["events"] + "?last_event_id=34")
        assert third.tokens() == [(i, i) for i in range(35, 40)]
        both = read(http, task["events"] + "?last_event_id=3", headers={"Last-Event-ID": "37"})
        assert both.tokens() == [(38, 38), (39, 39)]  # the header wins
        run.stop()


def test_unknown_task_is_404_and_a_malformed_last_event_id_is_400(
        qname: str, http: httpx.Client) -> None:
    for path in (f"/q/{qname}/tasks/NoSuchTask123/events", f"/q/{qname}/tasks/bad%21id/events"):
        r = http.get(path)
        assert r.status_code == 404, (path, r.text)
        assert r.headers["content-type"] == "application/json"
        assert r.json()["error"] == "not_found", r.text
    task = post(http, qname, {"n": 3})
    for bad in ("abc", "-1", "1.5", "9" * 19):
        r = http.get(task["events"], headers={"Last-Event-ID": bad})
        assert (r.status_code, r.json()["error"]) == (400, "bad_last_event_id"), (bad, r.text)
    assert http.get(task["events"] + "?last_event_id=x").status_code == 400


def test_a_full_queue_answers_503_with_retry_after(
        qname: str, http: httpx.Client, redis_url: str) -> None:
    mtq.Queue(qname, redis_url).configure(max_length=2)
    for i in range(2):
        post(http, qname, {"n": 1, "i": i})
    t0 = time.monotonic()
    r = http.post(f"/q/{qname}/tasks", json={"n": 1})
    assert time.monotonic() - t0 < 2.0
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == "2"
    assert r.json()["error"] == "queue_full" and "max_length is 2" in r.json()["detail"]
    assert mtq.Queue(qname, redis_url).stats()["waiting"] == 2


def test_a_client_that_goes_away_cancels_its_task(
        qname: str, redis_url: str, http: httpx.Client) -> None:
    task = post(http, qname, {"n": 3})  # no worker: it waits, the stream sends keep-alives
    with http.stream("GET", "/qc" + task["events"].removeprefix("/q")) as resp:
        for ev in events(resp):
            if ev.comment == "keep-alive":
                break
    t = mtq.Queue(qname, redis_url).task(task["id"])
    wait_for(lambda: t.status() == "cancelled", 10,
             "the task was not cancelled after its client closed the stream (the server's "
             "close() did not reach the EventStream)")


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
    # and the command line's wins over the app's
    out = flask("status", "--redis", "redis://127.0.0.1:1/0")
    assert out.returncode == 5 and "cannot reach Redis" in out.stderr, out
    out = flask("workers", "--help")
    assert out.returncode == 0 and "--queue" in out.stdout and "TARGET" in out.stdout, out
    # --queue defaults to the app's MTQ_QUEUE: what is missing is the target's module
    name = "no_such_module_" + uuid.uuid4().hex[:6]
    out = flask("workers", name + ":M")
    assert out.returncode == 2 and name in out.stderr, (out.returncode, out.stderr)
    assert "--queue" not in out.stderr, out.stderr
