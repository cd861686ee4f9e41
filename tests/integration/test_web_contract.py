"""The web contract every framework integration keeps, one suite over all of them:
FastAPI (tests/web_app.py, mtq.contrib.asgi under uvicorn), Flask (tests/flask_app.py,
mtq.contrib.flask under gunicorn's threaded workers) and Django (tests/django_project,
mtq.contrib.django: its sync views under gunicorn, WSGI, and its async views under
uvicorn, ASGI). Each is the real application under its real server, read by a real
HTTP client (httpx, streaming) against the session's redis-server and a real
in-process Worker.

The contract: tokens arrive progressively and the stream ends with the task's result;
a reconnect with ``Last-Event-ID`` (or ``?last_event_id=``) resumes without gap or
repeat; an unknown task is a JSON 404 and a malformed ``Last-Event-ID`` a JSON 400; a
full queue answers 503 with ``Retry-After`` at once; a client that goes away cancels
its task on the cancelling route, and only there; a submit is its user's tenant, at
``interactive`` priority unless ``X-Mtq-Priority`` says otherwise (a bad value: 400),
with ``X-Mtq-Deadline``'s deadline; a tenant over its rate limit gets 429 and a
deadline that cannot be met 503, both with ``Retry-After``. Where the integrations
differ, the :class:`Framework` row of each says so. What only one framework offers is
tested in its own file (test_web_asgi.py, test_web_flask.py, test_web_django.py).
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import redis

import mtq
from mtq.workers.worker import Worker
from tests.models import Counter
from tests.support.waits import wait_for
from tests.support.web import (
    DjangoAsgiServer,
    DjangoWsgiServer,
    GunicornServer,
    Stream,
    WebServer,
    events,
    read,
)
from tests.support.workers import FAST, serving

pytestmark = pytest.mark.timeout(90)

#: seconds between keep-alive comments in the test servers
KEEPALIVE = 0.5


@dataclass(frozen=True)
class Framework:
    """One integration under its server, and where it differs from the others."""

    name: str
    server: type[WebServer]
    #: the first segment of the task routes: ``/{prefix}/<queue>/tasks``; the cancelling
    #: events route is ``/{prefix}c/...``
    prefix: str = "q"
    #: headers of a submit: FastAPI's TaskRoutes mounts take the stream from ``X-User``
    #: (the Flask and Django views put a task into the session's stream)
    submit_headers: dict[str, str] = field(default_factory=dict)
    #: TaskRoutes (FastAPI) also serves the task itself (``GET`` its result, ``DELETE``
    #: cancels it), answers a body that is not JSON with 400 ``bad_json`` and a bad
    #: ``?wait=`` with 400 ``bad_wait``
    task_routes: bool = False
    #: the event stream's response says ``Connection: keep-alive`` (Django's async views
    #: under uvicorn send no Connection header)
    says_keep_alive: bool = True
    #: more paths that must answer 404 ``not_found`` for an unknown task
    more_not_found: tuple[str, ...] = ()
    #: the server's environment beyond the Redis URL and the keep-alive period
    env: dict[str, str] = field(default_factory=dict)


FRAMEWORKS = [
    Framework("fastapi", WebServer, submit_headers={"x-user": "u1"}, task_routes=True,
              more_not_found=("/chat/NoSuchTask123/events",),
              env={"MTQ_WEB_CHAT_QUEUE": "chat-" + uuid.uuid4().hex[:8]}),
    Framework("flask", GunicornServer),
    Framework("django-wsgi", DjangoWsgiServer),
    Framework("django-asgi", DjangoAsgiServer, prefix="aq", says_keep_alive=False),
]


@pytest.fixture(scope="module", params=FRAMEWORKS, ids=[f.name for f in FRAMEWORKS])
def web(request: pytest.FixtureRequest, redis_url: str,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Framework, WebServer]]:
    """The framework's application under its server (one at a time: pytest runs the
    tests of one framework before it starts the next)."""
    fw: Framework = request.param
    server = fw.server(redis_url, tmp_path_factory.mktemp(fw.name) / "server.log",
                       MTQ_WEB_KEEPALIVE=str(KEEPALIVE), **fw.env)
    server.start()
    yield fw, server
    server.stop()


@dataclass
class Site:
    """A client of one framework's server."""

    fw: Framework
    http: httpx.Client

    def tasks(self, qname: str) -> str:
        return f"/{self.fw.prefix}/{qname}/tasks"

    def cancelling(self, events_path: str) -> str:
        """The events URL of the same task, cancelled on disconnect."""
        return f"/{self.fw.prefix}c" + events_path.removeprefix(f"/{self.fw.prefix}")

    def submit(self, qname: str, payload: Any,
               headers: dict[str, str] | None = None) -> httpx.Response:
        """POST a task; ``headers``: these instead of the framework's own."""
        return self.http.post(self.tasks(qname), json=payload,
                              headers=self.fw.submit_headers if headers is None else headers)

    def post(self, qname: str, payload: Any,
             headers: dict[str, str] | None = None) -> dict[str, Any]:
        r = self.submit(qname, payload, headers)
        assert r.status_code == 202, r.text
        return dict(r.json())


@pytest.fixture
def site(web: tuple[Framework, WebServer]) -> Iterator[Site]:
    fw, server = web
    with httpx.Client(base_url=server.base, timeout=httpx.Timeout(10.0)) as c:
        yield Site(fw, c)


def worker(qname: str, redis_url: str) -> Worker:
    return Worker(Counter(), qname, url=redis_url, settings=FAST)


# -- the stream ------------------------------------------------------------------------
def test_tokens_arrive_progressively_and_the_stream_ends_with_the_result(
        qname: str, redis_url: str, site: Site) -> None:
    with serving(worker(qname, redis_url)) as run:
        task = site.post(qname, {"n": 30, "step_ms": 20})
        assert task["events"] == f"{site.tasks(qname)}/{task['id']}/events"
        with site.http.stream("GET", task["events"]) as resp:
            assert resp.status_code == 200
            h = resp.headers
            assert h["content-type"] == "text/event-stream; charset=utf-8"
            assert (h["cache-control"], h["x-accel-buffering"]) == ("no-cache", "no")
            if site.fw.says_keep_alive:
                assert h["connection"] == "keep-alive"
            got = Stream(list(events(resp)))
        run.stop()
    assert got.events[0].retry == 1000
    assert got.tokens() == [(i, i) for i in range(30)]  # id = index, in order, once
    done = got.last
    assert done.event == "done" and done.id is None
    result = mtq.Queue(qname, redis_url).task(task["id"]).result(timeout=5)
    assert result == {"tokens": list(range(30)), "s": None, "i": None}
    assert done.json() == {"status": "succeeded", "result": result}
    # "started" is live news: a stream opened after the worker took the task has none
    assert [e.json()["delivery"] for e in got.of("started")] in ([1], []), got.of("started")
    # progressive: the tokens came in many network reads, not one at the end
    chunks = {e.chunk for e in got.of("token")}
    assert len(chunks) > 5, chunks
    if site.fw.task_routes:  # the result endpoint says the same
        res = site.http.get(task["result"]).json()
        assert res == {"id": task["id"], "status": "succeeded", "result": result}


def test_reconnect_with_last_event_id_resumes_without_gap_or_repeat(
        qname: str, redis_url: str, site: Site) -> None:
    with serving(worker(qname, redis_url)) as run:
        task = site.post(qname, {"n": 40, "step_ms": 20})
        first = read(site.http, task["events"], until=9)
        assert first.tokens() == [(i, i) for i in range(10)]
        # what an EventSource does: the same URL, Last-Event-ID = the last id it saw
        second = read(site.http, task["events"], headers={"Last-Event-ID": "9"})
        assert second.tokens()[0] == (10, 10), second.tokens()[:3]
        assert first.tokens() + second.tokens() == [(i, i) for i in range(40)]
        assert second.last.json()["status"] == "succeeded"
        # after the end: a reload that remembered its place (query parameter), and a
        # reconnect at the last token (only the end is left)
        third = read(site.http, task["events"] + "?last_event_id=34")
        assert third.tokens() == [(i, i) for i in range(35, 40)]
        fourth = read(site.http, task["events"], headers={"Last-Event-ID": "39"})
        assert fourth.tokens() == [] and fourth.last.event == "done"
        # the header wins over the query (a reconnect of a page opened with ?last_event_id)
        fifth = read(site.http, task["events"] + "?last_event_id=3",
                     headers={"Last-Event-ID": "37"})
        assert fifth.tokens() == [(38, 38), (39, 39)]
        run.stop()


# -- bad input --------------------------------------------------------------------------
def test_unknown_task_is_404_and_a_malformed_last_event_id_is_400(
        qname: str, site: Site) -> None:
    tasks = site.tasks(qname)
    paths = [f"{tasks}/NoSuchTask123/events", f"{tasks}/bad%21id/events",
             *site.fw.more_not_found]
    if site.fw.task_routes:
        paths.append(f"{tasks}/NoSuchTask123")
    for path in paths:
        r = site.http.get(path)
        assert r.status_code == 404, (path, r.text)
        assert r.headers["content-type"] == "application/json"
        assert r.json()["error"] == "not_found", r.text
    task = site.post(qname, {"n": 3})
    with site.http.stream("GET", task["events"], headers={"Last-Event-ID": ""}) as resp:
        assert resp.status_code == 200  # empty: no id, a stream from the start
    for bad in ("abc", "-1", "1.5", "1e3", "9" * 19):
        r = site.http.get(task["events"], headers={"Last-Event-ID": bad})
        assert (r.status_code, r.json()["error"]) == (400, "bad_last_event_id"), (bad, r.text)
    assert site.http.get(task["events"] + "?last_event_id=x").status_code == 400
    if site.fw.task_routes:
        r = site.http.post(tasks, content=b"{not json", headers={"x-user": "u"})
        assert (r.status_code, r.json()["error"]) == (400, "bad_json")
        r = site.http.get(task["result"] + "?wait=-1")
        assert (r.status_code, r.json()["error"]) == (400, "bad_wait")
        assert site.http.delete(task["result"]).json()["cancelled"] is True


def test_a_full_queue_answers_503_with_retry_after_at_once(
        qname: str, redis_url: str, site: Site) -> None:
    mtq.Queue(qname, redis_url).configure(max_length=2)
    for i in range(2):
        site.post(qname, {"n": 1, "i": i})
    t0 = time.monotonic()
    r = site.submit(qname, {"n": 1})
    assert time.monotonic() - t0 < 2.0
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == "2"
    assert r.headers["content-type"] == "application/json"
    assert r.json()["error"] == "queue_full" and "max_length is 2" in r.json()["detail"]
    assert mtq.Queue(qname, redis_url).stats()["waiting"] == 2


# -- cancel on disconnect ------------------------------------------------------------------
def test_a_client_that_goes_away_cancels_its_waiting_task(
        qname: str, redis_url: str, site: Site) -> None:
    task = site.post(qname, {"n": 3})  # no worker: it waits, the stream sends keep-alives
    with site.http.stream("GET", site.cancelling(task["events"])) as resp:
        for ev in events(resp):
            if ev.comment == "keep-alive":
                break
    t = mtq.Queue(qname, redis_url).task(task["id"])
    wait_for(lambda: t.status() == "cancelled", 10,
             "the task was not cancelled after its client closed the stream (the server's "
             "close() did not reach the EventStream)")


def test_a_client_that_goes_away_cancels_its_running_task(
        qname: str, redis_url: str, site: Site) -> None:
    with serving(worker(qname, redis_url)) as run:
        task = site.post(qname, {"n": 500, "step_ms": 20})
        read(site.http, site.cancelling(task["events"]), until=2)  # then it hangs up
        t = mtq.Queue(qname, redis_url).task(task["id"])
        wait_for(lambda: t.status() == "cancelled", 10,
                 "the running task was not cancelled after its client closed the stream")
        run.stop()


def test_without_cancel_on_disconnect_the_task_runs_on(
        qname: str, redis_url: str, site: Site) -> None:
    with serving(worker(qname, redis_url)) as run:
        task = site.post(qname, {"n": 20, "step_ms": 10})
        read(site.http, task["events"], until=1)
        t = mtq.Queue(qname, redis_url).task(task["id"])
        assert t.result(timeout=10)["tokens"] == list(range(20))
        run.stop()


# -- tenants, priorities, deadlines ------------------------------------------------------
# Every test app logs a request with an ``X-User`` header in as that user (FastAPI:
# AuthenticationMiddleware; Flask: g.user; Django: request.user), so these read the
# default mappings: the tenant is the user, the priority interactive.
def stored(q: mtq.Queue, task_id: str, *fields: str) -> list[str | None]:
    """Fields of a task's hash (None: absent)."""
    raw = q.redis.hmget(q.broker.keys.task(task_id), fields)
    return [v.decode() if isinstance(v, bytes) else v for v in raw]


def refusal(resp: httpx.Response, status: int, code: str) -> int:
    """Check a JSON refusal; its Retry-After, whole seconds."""
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    assert resp.json()["error"] == code, resp.text
    after = resp.headers["retry-after"]
    assert after.isdigit(), after
    return int(after)


def test_a_submit_is_its_users_tenant_at_interactive_priority_unless_the_header_says(
        qname: str, redis_url: str, site: Site) -> None:
    q = mtq.Queue(qname, redis_url)
    ann = site.post(qname, {"n": 1}, {"X-User": "ann"})
    assert stored(q, ann["id"], "tenant", "band") == ["ann", "i"]
    batch = site.post(qname, {"n": 1}, {"X-User": "ann", "X-Mtq-Priority": "batch"})
    assert stored(q, batch["id"], "tenant", "band") == ["ann", "b"]
    std = site.post(qname, {"n": 1}, {"X-User": "bob", "X-Mtq-Priority": "Standard"})
    assert stored(q, std["id"], "tenant", "band") == ["bob", None]  # standard: no field
    anon = site.post(qname, {"n": 1}, {})
    assert stored(q, anon["id"], "tenant", "band") == [None, "i"]
    # a user name that is no valid tenant name is hashed, not refused
    long = "u" * 80
    hashed = site.post(qname, {"n": 1}, {"X-User": long})
    digest = hashlib.sha1(long.encode(), usedforsecurity=False).hexdigest()
    assert stored(q, hashed["id"], "tenant") == [f"sha1-{digest}"]


def test_a_bad_priority_or_deadline_header_is_a_400_and_queues_nothing(
        qname: str, redis_url: str, site: Site) -> None:
    for header, value, code in [("X-Mtq-Priority", "urgent", "bad_priority"),
                                ("X-Mtq-Deadline", "soon", "bad_deadline"),
                                ("X-Mtq-Deadline", "0", "bad_deadline")]:
        resp = site.submit(qname, {"n": 1}, {"X-User": "ann", header: value})
        assert resp.status_code == 400, resp.text
        assert resp.headers["content-type"] == "application/json"
        assert resp.json()["error"] == code, resp.text
        if code == "bad_priority":
            assert "interactive, standard, batch" in resp.json()["detail"], resp.text
    assert mtq.Queue(qname, redis_url).stats()["waiting"] == 0


def test_a_tenant_over_its_rate_limit_gets_429_with_retry_after(
        qname: str, redis_url: str, site: Site) -> None:
    q = mtq.Queue(qname, redis_url)
    q.configure(tenant_rpm="ann=1")  # before the server's first submit to the queue
    site.post(qname, {"n": 1}, {"X-User": "ann"})
    after = refusal(site.submit(qname, {"n": 1}, {"X-User": "ann"}), 429, "rate_limited")
    assert 1 <= after <= 60, after
    site.post(qname, {"n": 1}, {"X-User": "bob"})  # another tenant: not limited
    assert q.stats()["waiting"] == 2


def test_a_deadline_header_is_kept_and_one_that_cannot_be_met_is_503_with_retry_after(
        qname: str, redis_url: str, r: redis.Redis, site: Site) -> None:
    q = mtq.Queue(qname, redis_url)
    task = site.post(qname, {"n": 1}, {"X-User": "ann", "X-Mtq-Deadline": "30"})
    created, deadline = stored(q, task["id"], "created", "deadline")
    assert int(deadline or 0) - int(created or 0) == 30_000
    # the workers serve 1 unit of cost per second, and ann has 10^6 waiting: a task of
    # hers would start in 10^6 s (times the 1.1 margin for the rate's error), 1 099 970 s
    # after a 30 s deadline
    sched = q.broker.keys.sched
    r.hset(sched + "vt", "~rate", 1)
    r.hset(sched + "count", "i:ann|c", 1_000_000)
    late = site.submit(qname, {"n": 1}, {"X-User": "ann", "X-Mtq-Deadline": "30"})
    assert abs(refusal(late, 503, "would_miss_deadline") - 1_099_970) <= 1
    site.post(qname, {"n": 1}, {"X-User": "ann"})  # no deadline: accepted
    assert q.stats()["waiting"] == 2
