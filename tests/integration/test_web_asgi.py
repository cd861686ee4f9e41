"""The SSE helper and the ASGI integration (mtq.contrib.sse, mtq.contrib.asgi) under a
real uvicorn process (tests/web_app.py), read by a real HTTP client (httpx, streaming)
against a real redis-server and real workers: in-process Workers where the test is
about the HTTP side, supervised worker processes (``mtq workers start``) where a
cancel must reach a worker or a worker is killed. The web contract every framework
keeps (the stream, resume with Last-Event-ID, 404/400, 503, cancel on disconnect) is
tested, for FastAPI too, in test_web_contract.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

import mtq
from mtq.broker import lane
from mtq.broker.keys import QueueKeys
from mtq.settings import QueueSettings
from mtq.workers.registry import list_workers
from mtq.workers.worker import Worker
from tests.models import Counter
from tests.support.servers import RedisServer
from tests.support.waits import wait_for
from tests.support.web import SSE, Stream, WebServer, events, read
from tests.support.workers import serving

pytestmark = pytest.mark.timeout(90)

FAST = QueueSettings(lease_ms=1500, retry_backoff_ms=0)
#: seconds between keep-alive comments in the test server
KEEPALIVE = 0.5


@pytest.fixture(scope="module")
def web(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebServer]:
    server = WebServer(redis_url, tmp_path_factory.mktemp("web") / "uvicorn.log",
                       MTQ_WEB_KEEPALIVE=str(KEEPALIVE),
                       MTQ_WEB_CHAT_QUEUE="chat-" + uuid.uuid4().hex[:8])
    server.start()
    yield server
    server.stop()


@pytest.fixture
def http(web: WebServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=web.base, timeout=httpx.Timeout(10.0)) as c:
        yield c


def worker(qname: str, redis_url: str, model: Any = None) -> Worker:
    return Worker(model or Counter(), qname, url=redis_url, settings=FAST)


def post(http: httpx.Client, path: str, payload: Any, user: str = "u1") -> dict[str, Any]:
    r = http.post(path, json=payload, headers={"x-user": user})
    assert r.status_code == 202, r.text
    return dict(r.json())


def supervisor(qname: str, redis_url: str, env: dict[str, str], log: Path, target: str,
               *extra: str) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "mtq", "workers", "start", target, "--queue", qname,
             "--redis", redis_url, "--devices", "cpu", "--replicas", "1", *extra],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def live_workers(r: redis.Redis, qname: str, sup: subprocess.Popen[bytes], log: Path
                 ) -> list[dict[str, Any]]:
    assert sup.poll() is None, f"supervisor exited:\n{log.read_text()[-3000:]}"
    return [w for w in list_workers(r, qname) if Path(f"/proc/{w['pid']}").exists()]


def stop_supervisor(sup: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(sup.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    sup.wait(10)


def server_conns(r: redis.Redis, name: str, kind: str | None = None) -> list[dict[str, Any]]:
    """The connections of the web server process (named ``name``) Redis sees."""
    conns = r.client_list(_type=kind) if kind else r.client_list()
    return [c for c in conns if c.get("name") == name]


# -- the stream ------------------------------------------------------------------------
def test_keep_alive_comments_while_nothing_happens_and_a_cancel_ends_the_stream(
        qname: str, http: httpx.Client) -> None:
    task = post(http, f"/q/{qname}/tasks", {"n": 3})  # no worker serves this queue
    got = Stream()
    t0 = time.monotonic()
    with http.stream("GET", task["events"]) as resp:
        for ev in events(resp):
            got.events.append(ev)
            if ev.comment == "keep-alive" and \
                    len([e for e in got.events if e.comment == "keep-alive"]) == 3:
                r = http.delete(task["result"])
                assert r.json() == {"id": task["id"], "cancelled": True}
    assert time.monotonic() - t0 >= 3 * KEEPALIVE * 0.9
    assert [e.comment for e in got.events if e.comment] == ["keep-alive"] * 3
    assert got.last.event == "done"
    assert got.last.json() == {"status": "cancelled", "error": None}


# -- streams and users ---------------------------------------------------------------------
def test_fastapi_endpoints_and_fifo_per_user(web: WebServer, http: httpx.Client,
                                             redis_url: str) -> None:
    """The FastAPI app's own endpoints (the submitter dependency, an EventStreamResponse)
    and TaskRoutes: each user's tasks go to that user's stream, a session's to its own."""
    chat = web.env["MTQ_WEB_CHAT_QUEUE"]
    ids = [http.post("/chat", json={"n": 2, "start": 10 * i},
                     headers={"x-user": "ann" if i % 2 else "bob"}).json()["id"]
           for i in range(4)]
    q = mtq.Queue(chat, redis_url)
    assert [q.task(i).info().stream for i in ids] == ["bob", "ann", "bob", "ann"]
    with serving(worker(chat, redis_url)) as run:
        got = read(http, f"/chat/{ids[3]}/events")
        run.stop()
    assert got.tokens() == [(0, 30), (1, 31)]
    # the default stream of TaskRoutes: the session (SessionMiddleware), kept in a cookie
    with httpx.Client(base_url=web.base) as browser:
        a = browser.post(f"/s/{chat}/tasks", json={"n": 1}).json()
        b = browser.post(f"/s/{chat}/tasks", json={"n": 1}).json()
    other = http.post(f"/s/{chat}/tasks", json={"n": 1}).json()
    assert a["stream"] == b["stream"] and a["stream"].startswith("session:")
    assert other["stream"] != a["stream"]
    assert q.task(a["id"]).info().stream == a["stream"]
    for t in (a, b, other):
        q.task(t["id"]).cancel()


def test_the_submitter_dependency_gives_the_user_s_tenant_and_the_request_s_priority(
        web: WebServer, http: httpx.Client, redis_url: str) -> None:
    """FastAPI's ``Depends(submitter(q))``: the authenticated user (X-User, through
    AuthenticationMiddleware) is the tenant, the priority interactive unless the
    X-Mtq-Priority header says otherwise; a bad header is a JSON 400."""
    q = mtq.Queue(web.env["MTQ_WEB_CHAT_QUEUE"], redis_url)
    plain = http.post("/chat", json={"n": 1}, headers={"x-user": "ann"}).json()["id"]
    batch = http.post("/chat", json={"n": 1},
                      headers={"x-user": "ann", "x-mtq-priority": "batch"}).json()["id"]
    try:
        for task_id, band in ((plain, b"i"), (batch, b"b")):
            assert q.redis.hmget(q.broker.keys.task(task_id), ["tenant", "band"]) == [
                b"ann", band]
        bad = http.post("/chat", json={"n": 1},
                        headers={"x-user": "ann", "x-mtq-priority": "now"})
        assert (bad.status_code, bad.json()["error"]) == (400, "bad_priority"), bad.text
    finally:
        for task_id in (plain, batch):
            q.task(task_id).cancel()


def test_many_streams_share_the_process_s_one_reply_subscription(
        qname: str, redis_url: str, web: WebServer, r: redis.Redis) -> None:
    """60 concurrent SSE clients on one uvicorn process: one pub/sub connection for all,
    and a number of Redis connections that does not grow with the streams."""
    q = mtq.Queue(qname, redis_url, settings=FAST)

    async def scenario() -> tuple[list[int], list[Stream]]:
        counts: list[int] = []
        async with httpx.AsyncClient(base_url=web.base, timeout=30,
                                     limits=httpx.Limits(max_connections=200)) as client:
            async def one(task_id: str, opened: asyncio.Event) -> Stream:
                got = Stream()
                async with client.stream("GET", f"/q/{qname}/tasks/{task_id}/events") as resp:
                    assert resp.status_code == 200
                    buf = ""
                    async for chunk in resp.aiter_text():
                        buf += chunk
                        while "\n\n" in buf:
                            block, buf = buf.split("\n\n", 1)
                            from tests.support.web import parse_block

                            ev = parse_block(block)
                            got.events.append(ev)
                            if ev.comment == "keep-alive":  # past its read of the task
                                opened.set()
                return got

            async def wave(n: int) -> list[asyncio.Task[Stream]]:
                tasks = q.submit_many([{"n": 5, "start": 100 * k} for k in range(n)])
                flags = [asyncio.Event() for _ in tasks]
                running = [asyncio.create_task(one(t.id, f)) for t, f in zip(tasks, flags)]
                await asyncio.wait_for(asyncio.gather(*(f.wait() for f in flags)), 30)
                return running

            first = await wave(5)
            counts.append(len(server_conns(r, web.client_name)))
            rest = await wave(55)
            counts.append(len(server_conns(r, web.client_name)))
            assert len(server_conns(r, web.client_name, "pubsub")) == 1
            with serving(worker(qname, redis_url)) as run:
                done = await asyncio.wait_for(asyncio.gather(*first, *rest), 60)
                run.stop()
            return counts, list(done)

    counts, streams = asyncio.run(scenario())
    print(f"Redis connections of the web server with 5 and 60 streams open: {counts}")
    assert len(streams) == 60
    for k, got in enumerate(streams[:5] + streams[5:]):
        base = 100 * (k if k < 5 else k - 5)
        assert got.tokens() == [(i, base + i) for i in range(5)], k
        assert got.last.json()["status"] == "succeeded"
    # the pub/sub connection plus the pool's connections, which the executor's threads
    # bound (min(32, cpus + 4)), plus those the client's hot-path lane keeps
    # (mtq.broker.lane.KEEP): not one per stream
    bound = 1 + min(32, (os.cpu_count() or 1) + 4) + 2 + lane.KEEP
    assert counts[1] <= bound, counts
    assert counts[1] <= counts[0] + min(32, (os.cpu_count() or 1) + 4) + lane.KEEP, counts


# -- cancel on disconnect ------------------------------------------------------------------
@pytest.mark.slow
def test_a_client_that_goes_away_cancels_its_generation_and_frees_the_slot(
        qname: str, redis_url: str, r: redis.Redis, subprocess_env: dict[str, str],
        tmp_path: Path, http: httpx.Client) -> None:
    log = tmp_path / "supervisor.log"
    sup = supervisor(qname, redis_url, subprocess_env, log, "tests.models:SingleCounter")
    try:
        wait_for(lambda: live_workers(r, qname, sup, log), 60,
                 "the supervisor's worker did not register")
        long = post(http, f"/qc/{qname}/tasks", {"n": 10_000, "step_ms": 20}, user="a")
        short = post(http, f"/qc/{qname}/tasks", {"n": 3, "start": 7}, user="b")
        q = mtq.Queue(qname, redis_url)
        got = read(http, long["events"], until=9)  # then the connection closes
        left_at = time.monotonic()
        seen = len(got.tokens())
        wait_for(lambda: q.task(long["id"]).status() == "cancelled", 10,
                 "the task of the client that went away was not cancelled")
        # the slot it held goes to the request that waited
        assert q.task(short["id"]).result(timeout=10)["tokens"] == [7, 8, 9]
        assert time.monotonic() - left_at < 5
        # it stopped soon after the client left: a few 20 ms steps, not thousands
        generated = r.llen(QueueKeys(qname).out(long["id"]))
        assert generated < seen + 25, (seen, generated)
        info = q.task(long["id"]).info()
        assert info.cancel_requested
        # without cancel-on-disconnect (/q/), a client going away leaves the task alone
        other = post(http, f"/q/{qname}/tasks", {"n": 30, "step_ms": 10}, user="c")
        read(http, other["events"], until=2)
        assert q.task(other["id"]).result(timeout=10)["tokens"] == list(range(30))
    finally:
        stop_supervisor(sup)


# -- faults -----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_worker_killed_mid_generation_shows_restarted_and_the_full_gapless_text(
        qname: str, redis_url: str, r: redis.Redis, subprocess_env: dict[str, str],
        tmp_path: Path, http: httpx.Client) -> None:
    log = tmp_path / "supervisor.log"
    sup = supervisor(qname, redis_url, subprocess_env, log, "tests.models:Counter",
                     "--lease-ms", "3000")
    try:
        (first,) = wait_for(lambda: live_workers(r, qname, sup, log), 60,
                            "the supervisor's worker did not register")
        task = post(http, f"/q/{qname}/tasks", {"n": 40, "step_ms": 20})
        got = Stream()
        with http.stream("GET", task["events"], timeout=60) as resp:
            for ev in events(resp):
                got.events.append(ev)
                if ev.event == "token" and ev.id == "9":
                    os.kill(first["pid"], signal.SIGKILL)
        kinds = [e.event for e in got.events if e.comment is None and e.retry is None]
        assert kinds.count("restarted") == 1, kinds
        at = kinds.index("restarted")
        assert kinds[:at].count("token") >= 10
        assert got.of("restarted")[0].json()["delivery"] == 1
        assert got.tokens() == [(i, i) for i in range(40)]  # no gap, no repeat
        assert got.last.json() == {"status": "succeeded",
                                   "result": {"tokens": list(range(40)), "s": None,
                                              "i": None}}
        assert [e.json()["delivery"] for e in got.of("started")][-1] == 2
    finally:
        stop_supervisor(sup)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_redis_stopped_mid_stream_sends_an_error_event_closes_and_resumes_after(
        qname: str, tmp_path: Path) -> None:
    server = RedisServer(tmp_path, appendonly=True)
    server.start()
    web = WebServer(server.url, tmp_path / "uvicorn.log", MTQ_WEB_KEEPALIVE="1")
    web.start()
    w = Worker(Counter(), qname, url=server.url, settings=QueueSettings(lease_ms=5000))
    try:
        with serving(w) as run, httpx.Client(base_url=web.base, timeout=30) as http:
            task = post(http, f"/q/{qname}/tasks", {"n": 200, "step_ms": 50})
            got = Stream()
            t_stop = None
            with http.stream("GET", task["events"]) as resp:
                for ev in events(resp):  # ends when the server closes the stream
                    got.events.append(ev)
                    if ev.event == "token" and ev.id == "4":
                        server.stop()
                        t_stop = time.monotonic()
            assert t_stop is not None
            closed_after = time.monotonic() - t_stop
            print(f"the stream ended {closed_after:.1f} s after Redis stopped")
            err = got.last
            assert err.event == "error", [e.event for e in got.events[-5:]]
            assert err.json()["error"] == "unavailable" and err.json()["retry"] is True
            assert closed_after < 20, closed_after
            last = int(got.of("token")[-1].id or 0)
            assert got.tokens() == [(i, i) for i in range(last + 1)]
            # while Redis is away a reconnect gets a 200 with the error event (an
            # EventSource given anything else would never try again)
            again = read(http, task["events"], headers={"Last-Event-ID": str(last)})
            assert again.last.event == "error" and again.tokens() == []
            server.start()  # same port and directory: the AOF brings the task back
            rest = Stream()

            def resumed() -> bool:
                s = read(http, task["events"], headers={"Last-Event-ID": str(last)})
                rest.events[:] = s.events
                return s.last.event == "done"

            wait_for(resumed, 60, "the stream did not resume after Redis came back")
            assert got.tokens() + rest.tokens() == [(i, i) for i in range(200)]
            assert rest.last.json()["status"] == "succeeded"
            run.stop()
    finally:
        web.stop()
        server.stop()


def test_sse_events_are_parsed_back_by_the_test_reader() -> None:
    """The reader these tests use agrees with the format (multi-line data, comments)."""
    from tests.support.web import parse_block

    ev = parse_block('id: 3\nevent: token\ndata: "a"')
    assert (ev.id, ev.event, ev.json()) == ("3", "token", "a")
    assert parse_block(": keep-alive").comment == "keep-alive"
    assert isinstance(parse_block("retry: 10"), SSE)
