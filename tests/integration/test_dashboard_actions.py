"""The web dashboard's access rules and actions (mtq.dashboard.web.auth, .actions) over
HTTP: the real Starlette routes (in the small app of tests/support/dashboard_access.py) through
httpx's TestClient, a real redis-server, and a real ``mtq workers start`` supervisor
whose pause, resume and scale are seen in the worker registry. What must not happen
is checked where it would show: the queue's control channel (subscribed), the dead
letters, the task."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from starlette.testclient import TestClient

import mtq
from mtq.broker.consumer import Outcome
from mtq.broker.keys import QueueKeys, dashboard_session
from mtq.client import apikeys
from mtq.dashboard.web import auth, sessions
from mtq.errors import ConfigError
from mtq.settings import QueueSettings
from tests.support.dashboard_access import make_app
from tests.support.paths import PY, ROOT
from tests.support.supervisors import Sup, wait_workers
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(60)

NO_RETRY = QueueSettings(max_retries=0, retry_backoff_ms=0, lease_ms=2000)
CSRF = re.compile(r'name="csrf" value="([^"]*)"')


# -- fixtures ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Sup]]:
    """A queue served by a real supervisor (one Counter worker) for the whole module."""
    queue = "dash-" + uuid.uuid4().hex[:8]
    log = tmp_path_factory.mktemp("sup") / "supervisor.log"
    env = {**os.environ, "MTQ_REDIS_URL": redis_url, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [PY, "-m", "mtq", "workers", "start", "tests.models:Counter", "--queue", queue,
             "--devices", "cpu", "--replicas", "1", "--standby", "0", "--lease-ms", "2000",
             "--redis", redis_url], env=env, cwd=ROOT, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True)
    sup = Sup(proc, log)
    r = redis.Redis.from_url(redis_url)
    try:
        wait_workers(r, queue, 1, sup)
        yield queue, sup
    finally:
        r.close()
        sup.kill()


@pytest.fixture
def tenant() -> str:
    return "dash-" + uuid.uuid4().hex[:8]


@pytest.fixture
def admin_key(client: redis.Redis, tenant: str) -> tuple[str, apikeys.ApiKey]:
    return apikeys.create(client, tenant, admin=True, name="ops")


@pytest.fixture
def web(client: redis.Redis) -> Iterator[TestClient]:
    with TestClient(make_app(client), follow_redirects=False) as tc:
        yield tc


class Listen:
    """The queue's control channel, subscribed: what the dashboard published on it."""

    def __init__(self, r: redis.Redis, queue: str) -> None:
        self.r, self.channel = r, QueueKeys(queue).control
        self.ps = r.pubsub(ignore_subscribe_messages=True)
        self.ps.subscribe(self.channel)
        wait_for(lambda: self.ps.get_message(timeout=0.1) is None and
                 self.ps.subscribed, 5, "subscribed to the control channel")

    def messages(self) -> list[dict[str, Any]]:
        """Every message up to now: a marker is published and read back, so all sent
        before it have arrived."""
        mark = uuid.uuid4().hex
        self.r.publish(self.channel, json.dumps({"mark": mark}))
        got: list[dict[str, Any]] = []

        def read() -> bool:
            m = self.ps.get_message(timeout=0.2)
            if m is not None:
                got.append(json.loads(m["data"]))
            return bool(got) and got[-1].get("mark") == mark

        wait_for(read, 5, "the marker came back on the control channel")
        return got[:-1]

    def close(self) -> None:
        self.ps.close()


@pytest.fixture
def listen(r: redis.Redis, qname: str) -> Iterator[Listen]:
    ls = Listen(r, qname)
    yield ls
    ls.close()


def sign_in(web: TestClient, token: str, nxt: str = "/queues/q") -> str:
    """Sign in as a browser does (the sign-in page, then its form); the session's
    CSRF token, as the pages give it."""
    page = web.get("/login", params={"next": nxt})
    assert page.status_code == 200 and "mtq_login" in web.cookies
    login_csrf = CSRF.search(page.text).group(1)  # type: ignore[union-attr]
    resp = web.post("/login", data={"key": token, "csrf": login_csrf, "next": nxt})
    assert resp.status_code == 303, resp.text
    assert resp.headers["location"].startswith(nxt + "?flash=")
    return CSRF.search(web.get("/queues/q").text).group(1)  # type: ignore[union-attr]


def follow(web: TestClient, resp: Any) -> str:
    """The page a 303 sends the browser to, as it shows."""
    assert resp.status_code == 303, resp.text
    return str(web.get(resp.headers["location"]).text)


def make_dead(qname: str, url: str, n: int) -> list[mtq.Task]:
    q = mtq.Queue(qname, url, settings=NO_RETRY)
    tasks = q.submit_many([{"i": i} for i in range(n)])
    c = mtq.Consumer(qname, url, settings=NO_RETRY)
    for claimed in c.claim(n):
        c.settle([Outcome(claimed, ok=False, error="ValueError: bad")])
    assert all(t.status() == "dead" for t in tasks)
    return tasks


# -- actions on a real supervisor ------------------------------------------------------------
def test_pause_resume_scale_with_a_session_and_with_a_bearer_key(
        web: TestClient, served: tuple[str, Sup], r: redis.Redis,
        admin_key: tuple[str, apikeys.ApiKey], caplog: pytest.LogCaptureFixture) -> None:
    queue, sup = served
    token, key = admin_key
    caplog.set_level(logging.INFO, "mtq.dashboard.web")
    csrf = sign_in(web, token, f"/queues/{queue}")
    resp = web.post(f"/queues/{queue}/pause", data={"csrf": csrf, "next": f"/queues/{queue}"})
    assert "pause: sent to 1 supervisor(s)" in follow(web, resp)
    wait_workers(r, queue, 1, sup, check=lambda w: w["state"] == "paused")
    resp = web.post(f"/queues/{queue}/resume", data={"csrf": csrf, "next": f"/queues/{queue}"})
    assert "resume: sent to 1" in follow(web, resp)
    wait_workers(r, queue, 1, sup, check=lambda w: w["state"] != "paused")

    bearer = {"Authorization": f"Bearer {token}"}
    resp = web.post(f"/queues/{queue}/scale", data={"replicas": "2"}, headers=bearer)
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"ok": True, "action": "scale", "queue": queue, "command": "scale",
                           "supervisors": 1, "replicas": 2,
                           "message": f"scale to 2 per device: sent to 1 supervisor(s) of "
                                      f"queue {queue}"}
    wait_workers(r, queue, 2, sup)
    resp = web.post(f"/queues/{queue}/pause", headers=bearer)
    assert resp.status_code == 200 and resp.json()["supervisors"] == 1
    wait_workers(r, queue, 2, sup, check=lambda w: w["state"] == "paused")
    resp = web.post(f"/queues/{queue}/resume", json={}, headers=bearer)
    assert resp.status_code == 200, resp.text
    resp = web.post(f"/queues/{queue}/scale", json={"replicas": 1}, headers=bearer)
    assert resp.status_code == 200, resp.text
    wait_workers(r, queue, 1, sup, check=lambda w: w["state"] != "paused")

    lines = [rec.getMessage() for rec in caplog.records]
    assert any(f"pause by admin key {key.id} (session)" in ln for ln in lines), lines
    assert any(f"scale by admin key {key.id} (bearer)" in ln for ln in lines), lines
    assert not [ln for ln in lines if token in ln or token.split("-", 2)[2] in ln]


def test_a_running_task_cancelled_from_the_dashboard_ends_cancelled(
        web: TestClient, served: tuple[str, Sup], redis_url: str,
        admin_key: tuple[str, apikeys.ApiKey]) -> None:
    queue, _ = served
    task = mtq.Queue(queue, redis_url).submit({"n": 100000, "step_ms": 10})
    wait_for(lambda: task.status() == "running", 20, "the task started")
    csrf = sign_in(web, admin_key[0])
    resp = web.post(f"/tasks/{task.id}/cancel", data={"csrf": csrf, "next": "/queues/q"})
    assert "cancel requested" in follow(web, resp)
    with pytest.raises(mtq.TaskCancelled):
        task.result(timeout=20)
    assert task.status() == "cancelled"
    # again: it has ended, nothing to cancel (409 for a script)
    resp = web.post(f"/tasks/{task.id}/cancel",
                    headers={"Authorization": f"Bearer {admin_key[0]}"})
    assert resp.status_code == 409 and "already ended cancelled" in resp.json()["message"]


def test_cancel_a_waiting_task_and_an_unknown_one(web: TestClient, qname: str, redis_url: str,
                                                  admin_key: tuple[str, apikeys.ApiKey]) -> None:
    task = mtq.Queue(qname, redis_url).submit({"x": 1})
    bearer = {"Authorization": f"Bearer {admin_key[0]}"}
    resp = web.post(f"/tasks/{task.id}/cancel", data={"queue": qname}, headers=bearer)
    assert resp.status_code == 200 and resp.json()["outcome"] == "cancelled", resp.text
    assert task.status() == "cancelled"
    resp = web.post("/tasks/no-such-task/cancel", headers=bearer)
    assert resp.status_code == 404 and "no task 'no-such-task'" in resp.json()["error"]


def test_dead_letters_retry_chosen_and_purge_all(web: TestClient, qname: str, redis_url: str,
                                                 admin_key: tuple[str, apikeys.ApiKey]) -> None:
    dead = make_dead(qname, redis_url, 3)
    q = mtq.Queue(qname, redis_url)
    csrf = sign_in(web, admin_key[0])
    resp = web.post(f"/queues/{qname}/dead/retry",
                    data={"csrf": csrf, "next": "/queues/q", "id": [dead[0].id]})
    assert f"1 dead letter(s) of queue {qname} queued again" in follow(web, resp)
    assert dead[0].status() == "queued" and q.stats()["dead"] == 2
    resp = web.post(f"/queues/{qname}/dead/retry", json={"id": [dead[0].id]},
                    headers={"Authorization": f"Bearer {admin_key[0]}"})
    assert resp.status_code == 409 and "not dead letters" in resp.json()["message"]
    resp = web.post(f"/queues/{qname}/dead/purge", data={"csrf": csrf, "next": "/queues/q",
                                                         "id": [dead[1].id]})
    assert "1 dead letter(s)" in follow(web, resp) and q.stats()["dead"] == 1
    resp = web.post(f"/queues/{qname}/dead/purge",
                    headers={"Authorization": f"Bearer {admin_key[0]}"})
    assert resp.status_code == 200 and resp.json()["count"] == 1, resp.text
    assert q.stats()["dead"] == 0
    with pytest.raises(mtq.TaskNotFound):
        dead[2].status()


def test_no_supervisor_listening_is_said(web: TestClient, qname: str,
                                         admin_key: tuple[str, apikeys.ApiKey]) -> None:
    resp = web.post(f"/queues/{qname}/pause",
                    headers={"Authorization": f"Bearer {admin_key[0]}"})
    assert resp.status_code == 409 and resp.json()["supervisors"] == 0
    assert "no supervisor of queue" in resp.json()["message"]
    csrf = sign_in(web, admin_key[0])
    resp = web.post(f"/queues/{qname}/drain", data={"csrf": csrf, "next": "/queues/q"})
    page = follow(web, resp)
    assert 'class="warning"' in page and "no supervisor of queue" in page


def test_each_control_command_goes_out_as_the_cli_sends_it(
        web: TestClient, qname: str, listen: Listen,
        admin_key: tuple[str, apikeys.ApiKey]) -> None:
    bearer = {"Authorization": f"Bearer {admin_key[0]}"}
    for cmd in ("pause", "resume", "drain"):
        resp = web.post(f"/queues/{qname}/{cmd}", headers=bearer)
        assert resp.status_code == 200 and resp.json()["supervisors"] == 1  # this listener
    resp = web.post(f"/queues/{qname}/scale", data={"replicas": "0"}, headers=bearer)
    assert resp.status_code == 200
    sent = [{"cmd": "pause"}, {"cmd": "resume"}, {"cmd": "drain"},
            {"cmd": "scale", "replicas": 0}]
    assert listen.messages() == sent
    csrf = sign_in(web, admin_key[0])
    for cmd in ("pause", "resume", "drain"):
        resp = web.post(f"/queues/{qname}/{cmd}", data={"csrf": csrf, "next": "/queues/q"})
        assert f"{cmd}: sent to 1 supervisor(s)" in follow(web, resp)
    resp = web.post(f"/queues/{qname}/scale", data={"csrf": csrf, "replicas": "0"})
    assert resp.status_code == 303
    assert listen.messages() == sent


# -- refusals: nothing sent ------------------------------------------------------------------
def every_action(qname: str, task_id: str) -> list[tuple[str, dict[str, Any]]]:
    """Each action's path with fields it would take."""
    return [(f"/queues/{qname}/pause", {}), (f"/queues/{qname}/resume", {}),
            (f"/queues/{qname}/drain", {}), (f"/queues/{qname}/scale", {"replicas": "2"}),
            (f"/tasks/{task_id}/cancel", {}), (f"/queues/{qname}/dead/retry", {}),
            (f"/queues/{qname}/dead/purge", {})]


def test_every_action_is_refused_without_an_admin_key_or_a_csrf_token_or_cross_site(
        web: TestClient, client: redis.Redis, qname: str, tenant: str, listen: Listen,
        redis_url: str, admin_key: tuple[str, apikeys.ApiKey]) -> None:
    plain, _ = apikeys.create(client, tenant)
    gone, gone_key = apikeys.create(client, tenant, admin=True)
    apikeys.revoke(client, gone_key.id)
    dead = make_dead(qname, redis_url, 1)
    waiting = mtq.Queue(qname, redis_url).submit({"x": 1})
    for path, data in every_action(qname, waiting.id):
        assert web.post(path, data=data).status_code == 401, path
        for token in (plain, gone):
            resp = web.post(path, data=data, headers={"Authorization": f"Bearer {token}"})
            assert resp.status_code == 401, (path, resp.text)
    csrf = sign_in(web, admin_key[0])
    for path, data in every_action(qname, waiting.id):
        assert web.post(path, data=data).status_code == 403, path
        assert web.post(path, data={**data, "csrf": "x" * 43}).status_code == 403, path
        resp = web.post(path, data={**data, "csrf": csrf},
                        headers={"Origin": "https://evil.example"})
        assert resp.status_code == 403, path
    assert listen.messages() == []
    assert dead[0].status() == "dead" and waiting.status() == "queued"


def test_refused_without_an_admin_key(web: TestClient, client: redis.Redis, qname: str,
                                      tenant: str, listen: Listen) -> None:
    plain, _ = apikeys.create(client, tenant)
    gone, gone_key = apikeys.create(client, tenant, admin=True)
    apikeys.revoke(client, gone_key.id)
    resp = web.post(f"/queues/{qname}/pause", data={"next": "/queues/q"})
    assert resp.status_code == 401 and "not signed in" in resp.text
    assert "/login?next=%2Fqueues%2Fq" in resp.text
    for token, said in ((plain, "is not an admin key"), (gone, "was revoked"),
                        ("mtq-0123456789ab-" + "x" * 43, "is not known"),
                        ("nonsense", "not an mtq API key")):
        resp = web.post(f"/queues/{qname}/pause", headers={"Authorization": f"Bearer {token}"})
        assert resp.status_code == 401 and said in resp.json()["error"], resp.text
    # another scheme (a proxy's Basic authentication) is no script's key: a browser's
    # request, and this one has no session
    resp = web.post(f"/queues/{qname}/pause", headers={"Authorization": "Basic eDp5"})
    assert resp.status_code == 401 and "not signed in" in resp.text
    assert listen.messages() == []


def test_behind_a_proxys_basic_authentication_an_admin_signs_in_and_acts(
        client: redis.Redis, qname: str, listen: Listen,
        admin_key: tuple[str, apikeys.ApiKey]) -> None:
    """A proxy's own authentication (docs: "the proxy's own authentication") makes the
    browser send ``Authorization: Basic`` with every request: that is no Bearer key, so
    the session and its CSRF token decide, as without it (it was taken for a script's
    key: the pages showed no admin and every sign-in was refused)."""
    basic = {"Authorization": "Basic b3BzOnNlY3JldA=="}
    with TestClient(make_app(client), follow_redirects=False, headers=basic) as browser:
        csrf = sign_in(browser, admin_key[0])
        assert f"admin {admin_key[1].id}" in browser.get("/queues/q").text
        resp = browser.post(f"/queues/{qname}/pause", data={"next": "/"},
                            headers={"Origin": "https://evil.example"})
        assert resp.status_code == 403  # cross-site, and no CSRF token: refused
        assert listen.messages() == []
        resp = browser.post(f"/queues/{qname}/pause", data={"csrf": csrf, "next": "/"})
        assert resp.status_code == 303, resp.text
        assert listen.messages() == [{"cmd": "pause"}]
        resp = browser.post("/logout", data={"csrf": csrf, "next": "/"})
        assert resp.status_code == 303 and "mtq_session" not in browser.cookies


def test_refused_without_the_sessions_csrf_token_or_from_another_site(
        web: TestClient, qname: str, listen: Listen, redis_url: str,
        admin_key: tuple[str, apikeys.ApiKey]) -> None:
    dead = make_dead(qname, redis_url, 1)
    csrf = sign_in(web, admin_key[0])
    wrong = csrf[:-1] + ("B" if csrf.endswith("A") else "A")
    for data in ({"next": "/"}, {"csrf": "", "next": "/"}, {"csrf": wrong},
                 {"csrf": [csrf, csrf]}):
        resp = web.post(f"/queues/{qname}/pause", data=data)
        assert resp.status_code == 403 and "CSRF token" in resp.text, data
        resp = web.post(f"/queues/{qname}/dead/purge", data=data)
        assert resp.status_code == 403, data
    for headers in ({"Origin": "https://evil.example"}, {"Origin": "null"},
                    {"Origin": "http://testserver:8080"},
                    {"Referer": "https://evil.example/page"}):
        resp = web.post(f"/queues/{qname}/pause", data={"csrf": csrf}, headers=headers)
        assert resp.status_code == 403 and "another site" in resp.text, headers
    assert listen.messages() == []
    assert dead[0].status() == "dead"
    # its own origin, or a Referer of its own pages, with the token: done
    resp = web.post(f"/queues/{qname}/pause", data={"csrf": csrf},
                    headers={"Origin": "http://testserver",
                             "Referer": "http://testserver/queues/q"})
    assert resp.status_code == 303
    assert listen.messages() == [{"cmd": "pause"}]


@pytest.mark.parametrize("nxt", ["https://evil.example/", "//evil.example/x", "/\\evil.example",
                                 "evil.example", "/ok\r\nSet-Cookie: x=1", "javascript:alert(1)"])
def test_an_open_redirect_is_refused(web: TestClient, qname: str, listen: Listen, nxt: str,
                                     admin_key: tuple[str, apikeys.ApiKey]) -> None:
    csrf = sign_in(web, admin_key[0])
    resp = web.post(f"/queues/{qname}/pause", data={"csrf": csrf, "next": nxt})
    assert resp.status_code == 400 and "next must be a path of this dashboard" in resp.text
    assert "location" not in resp.headers
    assert listen.messages() == []


@pytest.mark.parametrize("path, data, said", [
    ("/queues/bad name/pause", {}, "invalid queue name"),
    ("/queues/-x/resume", {}, "invalid queue name"),
    ("/queues/{q}/scale", {}, "replicas must be a whole number from 0 to 256"),
    ("/queues/{q}/scale", {"replicas": "257"}, "replicas must be"),
    ("/queues/{q}/scale", {"replicas": "-1"}, "replicas must be"),
    ("/queues/{q}/scale", {"replicas": "2.5"}, "replicas must be"),
    ("/queues/{q}/scale", {"replicas": ["1", "2"]}, "sent 2 times"),
    ("/tasks/bad id!/cancel", {}, "invalid task id"),
    ("/tasks/abc/cancel", {"queue": "no good"}, "invalid queue name"),
    ("/queues/{q}/dead/purge", {"id": ["ok-id", "bad id"]}, "invalid task id"),
    ("/queues/{q}/dead/retry", {"id": ["x" * 65]}, "invalid task id"),
])
def test_bad_input_is_named_and_nothing_is_written(
        web: TestClient, qname: str, listen: Listen, redis_url: str, path: str,
        data: dict[str, Any], said: str, admin_key: tuple[str, apikeys.ApiKey]) -> None:
    dead = make_dead(qname, redis_url, 2)
    csrf = sign_in(web, admin_key[0])
    url = path.replace("{q}", qname)
    resp = web.post(url, data={**data, "csrf": csrf, "next": "/queues/q"})
    assert resp.status_code == 400 and said in resp.text, resp.text
    resp = web.post(url, data=data, headers={"Authorization": f"Bearer {admin_key[0]}"})
    assert resp.status_code == 400 and said in resp.json()["error"]
    assert listen.messages() == []
    assert [t.status() for t in dead] == ["dead", "dead"]
    assert mtq.Queue(qname, redis_url).stats()["dead"] == 2


def test_an_unreadable_or_oversized_body_is_refused(
        web: TestClient, qname: str, listen: Listen,
        admin_key: tuple[str, apikeys.ApiKey]) -> None:
    bearer = {"Authorization": f"Bearer {admin_key[0]}"}
    resp = web.post(f"/queues/{qname}/pause", content=b"[1]",
                    headers={**bearer, "Content-Type": "application/json"})
    assert resp.status_code == 400 and "JSON object" in resp.json()["error"]
    resp = web.post(f"/queues/{qname}/pause", content=b"x" * (300 * 1024),
                    headers={**bearer, "Content-Type": "text/plain"})
    assert resp.status_code == 413
    assert listen.messages() == []


# -- sign-in, sign-out, sessions -------------------------------------------------------------
def test_sign_in_sets_a_session_cookie_and_keeps_no_token(
        client: redis.Redis, admin_key: tuple[str, apikeys.ApiKey]) -> None:
    token, key = admin_key
    with TestClient(make_app(client), base_url="https://dash.example",
                    follow_redirects=False) as web:
        page = web.get("/login")
        login_cookie = page.headers["set-cookie"]
        assert "HttpOnly" in login_cookie and "SameSite=strict" in login_cookie
        resp = web.post("/login", data={"key": token, "next": "/queues/q",
                                        "csrf": web.cookies["mtq_login"]})
        assert resp.status_code == 303
        cookies = resp.headers.get_list("set-cookie")
        (session_cookie,) = [c for c in cookies if c.startswith("mtq_session=")]
        for attr in ("HttpOnly", "SameSite=strict", "Secure", "Path=/", "Max-Age=43200"):
            assert attr in session_cookie, session_cookie
        sid = web.cookies["mtq_session"]
        assert token not in " ".join(cookies) and token.split("-", 2)[2] not in sid
        # Redis holds the session under a digest of its id, never the id or the token
        names = [n.decode() for n in client.scan_iter(dashboard_session("*"), count=10_000)]
        mine = [n for n in names if client.hget(n, "key") == key.id.encode()]
        assert len(mine) == 1 and sid not in mine[0]
        assert 0 < client.ttl(mine[0]) <= sessions.SESSION_TTL_S
        assert token.encode() not in b"".join(client.hvals(mine[0]))
        assert "signed in with admin key" in follow(web, resp)
    with TestClient(make_app(client), follow_redirects=False) as plain:  # http: no Secure
        sign_in(plain, token)
        assert plain.cookies["mtq_session"]
    with TestClient(make_app(client), follow_redirects=False) as pasted:
        sign_in(pasted, f"  {token}\n")  # pasted with the blanks around it
        assert pasted.cookies["mtq_session"]


def test_sign_in_refusals_set_nothing(web: TestClient, client: redis.Redis, tenant: str,
                                      admin_key: tuple[str, apikeys.ApiKey]) -> None:
    plain, _ = apikeys.create(client, tenant)
    gone, gone_key = apikeys.create(client, tenant, admin=True)
    apikeys.revoke(client, gone_key.id)
    web.get("/login")
    login_csrf = web.cookies["mtq_login"]
    for token, said in ((plain, "is not an admin key"), (gone, "was revoked"),
                        ("", "no API key was sent"), ("mtq-nope", "not an mtq API key")):
        resp = web.post("/login", data={"key": token, "csrf": login_csrf})
        assert resp.status_code == 401 and said in resp.text, resp.text
        assert "mtq_session" not in resp.headers.get("set-cookie", "")
    token = admin_key[0]
    for data, headers in (({"key": token}, {}), ({"key": token, "csrf": "x" * 43}, {}),
                          ({"key": token, "csrf": login_csrf},
                           {"Origin": "https://evil.example"})):
        resp = web.post("/login", data=data, headers=headers)
        assert resp.status_code == 403, resp.text
        assert "mtq_session" not in resp.headers.get("set-cookie", "")
    # a browser without the pre-session cookie gets the form again, with one
    web.cookies.clear()
    resp = web.post("/login", data={"key": token, "csrf": login_csrf})
    assert resp.status_code == 403 and "mtq_login=" in resp.headers["set-cookie"]
    assert "mtq_session" not in web.cookies
    fresh = CSRF.search(resp.text).group(1)  # type: ignore[union-attr]
    assert fresh == web.cookies["mtq_login"] != login_csrf
    resp = web.post("/login", data={"key": token, "csrf": fresh})
    assert resp.status_code == 303 and web.cookies["mtq_session"]


def test_any_page_can_carry_the_sign_in_form(web: TestClient,
                                            admin_key: tuple[str, apikeys.ApiKey]) -> None:
    page = web.get("/queues/q")  # a first visit: no cookie yet
    token = CSRF.search(page.text).group(1)  # type: ignore[union-attr]
    assert "mtq_login=" in page.headers["set-cookie"] and web.cookies["mtq_login"] == token
    again = web.get("/queues/q")
    assert "set-cookie" not in again.headers and token in again.text
    resp = web.post("/login", data={"key": admin_key[0], "csrf": token, "next": "/queues/q"})
    assert resp.status_code == 303 and "admin " + admin_key[1].id in follow(web, resp)


def test_sign_out_ends_the_session(web: TestClient, client: redis.Redis, qname: str,
                                   listen: Listen, admin_key: tuple[str, apikeys.ApiKey]) -> None:
    csrf = sign_in(web, admin_key[0])
    sid = web.cookies["mtq_session"]
    assert web.post("/logout", data={"next": "/queues/q"}).status_code == 403  # no token
    resp = web.post("/logout", data={"csrf": csrf, "next": "/queues/q"})
    assert "signed out" in follow(web, resp) and "mtq_session" not in web.cookies
    assert sessions.load(client, sid) is None
    # the old cookie, sent again, is worth nothing
    web.cookies.set("mtq_session", sid)
    resp = web.post(f"/queues/{qname}/pause", data={"csrf": csrf})
    assert resp.status_code == 401 and "session has ended" in resp.text
    assert listen.messages() == []


def test_revoking_the_key_ends_its_sessions(web: TestClient, client: redis.Redis, qname: str,
                                            listen: Listen,
                                            admin_key: tuple[str, apikeys.ApiKey]) -> None:
    token, key = admin_key
    csrf = sign_in(web, token)
    sid = web.cookies["mtq_session"]
    assert 'id="who">admin' in web.get("/queues/q").text
    apikeys.revoke(client, key.id)
    resp = web.post(f"/queues/{qname}/pause", data={"csrf": csrf})
    assert resp.status_code == 401 and f"({key.id}) was revoked" in resp.text
    assert sessions.load(client, sid) is None
    assert "read-only" in web.get("/queues/q").text
    assert listen.messages() == []


def test_a_flash_shows_only_on_the_page_it_was_left_for(
        web: TestClient, qname: str, admin_key: tuple[str, apikeys.ApiKey]) -> None:
    csrf = sign_in(web, admin_key[0])
    resp = web.post(f"/queues/{qname}/pause", data={"csrf": csrf, "next": "/queues/q?x=1"})
    where = resp.headers["location"]
    assert where.startswith("/queues/q?x=1&flash=")
    assert 'id="flash"' in web.get(where).text
    assert 'id="flash"' not in web.get("/queues/q?flash=forged").text
    assert 'id="flash"' not in web.get("/queues/q").text


def test_behind_a_proxy_the_public_origin_is_the_dashboards(
        client: redis.Redis, qname: str, listen: Listen,
        admin_key: tuple[str, apikeys.ApiKey]) -> None:
    app = make_app(client, origin="https://ops.example.com/", mount="/dashboard")
    # the proxy ends TLS and passes the request on to another host name
    with TestClient(app, base_url="https://10.0.0.5:8080", follow_redirects=False) as web:
        page = web.get("/dashboard/login", params={"next": "/dashboard/queues/q"})
        assert 'action="/dashboard/login"' in page.text
        resp = web.post("/dashboard/login", data={"key": admin_key[0], "next": "/queues/q",
                                                  "csrf": web.cookies["mtq_login"]},
                        headers={"Origin": "https://ops.example.com"})
        assert resp.headers["location"].startswith("/dashboard/queues/q?flash=")
        session_cookie = next(c for c in resp.headers.get_list("set-cookie")
                          if c.startswith("mtq_session="))
        assert "Path=/dashboard" in session_cookie and "Secure" in session_cookie
        csrf = CSRF.search(web.get("/dashboard/queues/q").text).group(1)  # type: ignore[union-attr]
        refused = web.post(f"/dashboard/queues/{qname}/pause", data={"csrf": csrf},
                           headers={"Origin": "https://10.0.0.5:8080"})
        assert refused.status_code == 403 and "--origin" in refused.text
        done = web.post(f"/dashboard/queues/{qname}/pause", data={"csrf": csrf},
                        headers={"Origin": "https://ops.example.com"})
        assert done.status_code == 303 and done.headers["location"].startswith("/dashboard/")
    assert listen.messages() == [{"cmd": "pause"}]
    for bad in ("ops.example.com", "ftp://x", "https://x/path", 7):
        with pytest.raises(ConfigError):
            auth.configure(app, origin=bad)  # type: ignore[arg-type]


def test_the_pages_interface_without_redis_stays_read_only(redis_url: str) -> None:
    dead = redis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.5)
    with TestClient(make_app(dead), follow_redirects=False) as web:
        web.cookies.set("mtq_session", "a" * 43)
        start = time.monotonic()
        page = web.get("/queues/q")
        assert page.status_code == 200 and "read-only" in page.text
        resp = web.post("/queues/q/pause", data={"csrf": "x"})
        assert resp.status_code == 503 and "nothing was done" in resp.text
        assert time.monotonic() - start < 30


def test_the_support_app_matches_the_interface() -> None:
    paths = {getattr(r, "path", "") for r in auth.routes()}
    assert paths == {"/login", "/logout", "/queues/{queue}/pause", "/queues/{queue}/resume",
                     "/queues/{queue}/drain", "/queues/{queue}/scale",
                     "/tasks/{task_id}/cancel", "/queues/{queue}/dead/retry",
                     "/queues/{queue}/dead/purge"}
    assert Path(auth.__file__).read_text().count("\n") < 500
