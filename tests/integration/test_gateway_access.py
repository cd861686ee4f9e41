"""Who may use the gateway, and how much: ``mtq serve --host 0.0.0.0`` (API keys
required) on a redis-server of its own, a real EchoChat worker, read by the official
``openai`` SDK and raw HTTP. Missing, wrong and revoked keys (also revoked while in
use), a key's requests and tokens per minute, a tenant's rate limit of the queue's
scheduling, the SDK honouring ``Retry-After`` until its retry succeeds, and that no
route reads a task by its id (another tenant's, or one's own)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import httpx
import pytest
import redis

import mtq
from mtq.client import apikeys
from tests.support.gateway import (
    env_for,
    new_task_keys,
    serve,
    stop,
    task_keys,
    workers,
)
from tests.support.processes import free_port
from tests.support.servers import RedisServer
from tests.support.waits import wait_for

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(120)

#: the tenant whose requests the echo queue limits (its scheduling's tenant_rpm)
CAPPED = "capped"
#: its requests per minute: one every 3 s, a burst of one
CAPPED_RPM = 20
MSGS = [{"role": "user", "content": "x"}]


@dataclass
class Keyed:
    base: str
    url: str
    echo: str
    keys: ModuleType
    r: redis.Redis
    token: str       # tenant "acme", no limits
    key_id: str
    slow: str        # tenant "slow", rpm=1
    revoked: str     # a revoked key
    #: every HTTP response the SDK got (its retries too), with when it came
    seen: list[tuple[float, Any]] = field(default_factory=list)

    def client(self, token: str, max_retries: int = 0) -> Any:
        """The SDK with ``token``, each response it gets kept in :attr:`seen`."""
        self.seen.clear()

        def keep(resp: Any) -> None:
            self.seen.append((time.monotonic(), resp))

        http = openai.DefaultHttpxClient(event_hooks={"response": [keep]})
        return openai.OpenAI(base_url=self.base + "/v1", api_key=token,
                             max_retries=max_retries, timeout=30, http_client=http)

    def tenant_of(self, answer_id: str) -> str | None:
        """The tenant stored with the task of an answer (``chatcmpl-<task id>``)."""
        q = mtq.Queue(self.echo, client=self.r)
        raw = self.r.hget(q.broker.keys.task(answer_id.split("-", 1)[1]), "tenant")
        return raw.decode() if isinstance(raw, bytes) else raw

    def key(self, tenant: str, **limits: Any) -> tuple[str, Any]:
        return self.keys.create(self.r, tenant, **limits)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Keyed]:
    keys = apikeys
    tmp = tmp_path_factory.mktemp("keyed")
    (tmp / "redis").mkdir()
    server = RedisServer(tmp / "redis")
    server.start()
    env = env_for(server.url, tmp)
    r = redis.Redis.from_url(server.url)
    echo = "gw-keyed-echo"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        token, key = keys.create(r, "acme", name="test")
        slow, _ = keys.create(r, "slow", rpm=1)
        revoked, gone = keys.create(r, "acme")
        assert keys.revoke(r, gone.id)
        # the tenant limit of the queue's scheduling, before the gateway's first submit
        mtq.Queue(echo, client=r).configure(tenant_rpm=f"{CAPPED}={CAPPED_RPM}")
        procs.append(workers(env, tmp / "workers.log", "tests.models:EchoChat", echo))
        port = free_port()
        procs.append(serve(env, tmp / "serve.log", port, "--host", "0.0.0.0"))
        base = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            for p in procs:
                assert p.poll() is None, f"{p.args} exited: see {tmp}"
            try:
                resp = httpx.get(base + "/v1/models",
                                 headers={"authorization": f"Bearer {token}"})
            except httpx.TransportError:
                return False
            return echo in {m["id"] for m in resp.json().get("data", [])}

        wait_for(ready, 90, "the keyed gateway or its worker did not come up")
        yield Keyed(base, server.url, echo, keys, r, token, key.id, slow, revoked)
    finally:
        for p in procs:
            stop(p)
        r.close()
        server.stop()


def _refusal(resp: httpx.Response, status: int, code: str) -> float:
    """The seconds a refusal says to wait (``retry-after-ms``), checked against its
    ``Retry-After`` (whole seconds, rounded up)."""
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["code"] == code, resp.text
    ms = int(resp.headers["retry-after-ms"])
    assert int(resp.headers["retry-after"]) == max(1, -(-ms // 1000)), resp.headers
    return ms / 1000


# -- keys ------------------------------------------------------------------------------------
def test_keys_missing_or_wrong_is_401(keyed: Keyed) -> None:
    with httpx.Client(base_url=keyed.base, timeout=10) as h:
        resp = h.post("/v1/completions", json={"model": keyed.echo, "prompt": "x"})
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "missing_api_key"
    for token in ("sk-wrong", keyed.revoked):
        with keyed.client(token) as c, pytest.raises(openai.AuthenticationError) as info:
            c.completions.create(model=keyed.echo, prompt="x", max_tokens=1)
        assert info.value.body["code"] == "invalid_api_key"  # type: ignore[index]


def test_a_key_runs_in_its_stream_as_its_tenant(keyed: Keyed) -> None:
    with keyed.client(keyed.token) as c:
        out = c.completions.create(model=keyed.echo, prompt="hello key", max_tokens=2)
    assert out.choices[0].text == "hello key"
    info = mtq.Queue(keyed.echo, keyed.url).task(out.id.split("-", 1)[1]).info()
    assert info.stream == f"key:{keyed.key_id}"
    assert keyed.tenant_of(out.id) == "acme"


def test_a_key_revoked_while_in_use_gets_401_on_its_next_request(keyed: Keyed) -> None:
    token, key = keyed.key("acme")
    with keyed.client(token) as c:
        assert c.completions.create(model=keyed.echo, prompt="before",
                                    max_tokens=1).choices[0].text == "before"
        stream = c.chat.completions.create(model=keyed.echo, messages=MSGS, max_tokens=3,
                                           stream=True)
        first = next(iter(stream))
        assert keyed.keys.revoke(keyed.r, key.id)
        # the stream it opened before goes on to its end (it was admitted)
        rest = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        assert first.choices[0].delta.role == "assistant" and rest == "x x x"
        before = task_keys(keyed.r)
        with pytest.raises(openai.AuthenticationError) as info:
            c.completions.create(model=keyed.echo, prompt="after", max_tokens=1)
    assert info.value.status_code == 401
    assert info.value.body["code"] == "invalid_api_key"  # type: ignore[index]
    assert key.id in info.value.body["message"] and "revoked" in info.value.body["message"]  # type: ignore[index]
    assert token.split("-", 2)[2] not in info.value.body["message"]  # type: ignore[index]
    assert new_task_keys(keyed.r, before) == set()


def test_an_admin_key_acts_as_its_tenant(keyed: Keyed) -> None:
    token, _ = keyed.key("ops", admin=True)
    with keyed.client(token) as c:
        out = c.completions.create(model=keyed.echo, prompt="admin key", max_tokens=2)
    assert out.choices[0].text == "admin key" and keyed.tenant_of(out.id) == "ops"


# -- rate limits -------------------------------------------------------------------------------
def test_a_key_over_its_rate_is_429_with_retry_after(keyed: Keyed) -> None:
    with keyed.client(keyed.slow) as c:
        c.completions.create(model=keyed.echo, prompt="one", max_tokens=1)
        with pytest.raises(openai.RateLimitError) as info:
            c.completions.create(model=keyed.echo, prompt="two", max_tokens=1)
    assert 1 <= int(info.value.response.headers["retry-after"]) <= 60
    assert info.value.body["code"] == "rate_limit_exceeded"  # type: ignore[index]


def test_a_key_over_its_tokens_is_429_and_the_sdk_retry_succeeds_after_the_wait(
        keyed: Keyed) -> None:
    """A request counts its prompt (about 4 characters a token: 400 characters, 101
    tokens) and its max_tokens against the key's tpm. At 6,000 a minute (100 a second)
    the first takes the whole minute's budget (101 + 5,899); the second (101 + 99)
    must wait for 200 tokens to come back, 2 s less the time between the two. Without
    the prompt counted it would fit at once. The SDK waits what ``retry-after-ms``
    says, and its retry is admitted."""
    token, _ = keyed.key("tpm-" + str(time.monotonic_ns()), tpm=6000)
    prompt = "a b " + "c" * 396  # EchoChat stops at "b": the second token
    assert len(prompt) // 4 + 1 == 101
    with keyed.client(token, max_retries=2) as c:
        t0 = time.monotonic()
        first = c.chat.completions.create(
            model=keyed.echo, messages=[{"role": "user", "content": prompt}],
            max_tokens=5899, stop=["b"])
        assert first.choices[0].message.content == "a "
        second = c.chat.completions.create(
            model=keyed.echo, messages=[{"role": "user", "content": prompt}],
            max_tokens=99, stop=["b"])
    assert second.choices[0].message.content == "a "
    assert [resp.status_code for _, resp in keyed.seen] == [200, 429, 200]
    (refused_at, refused), (answered_at, _) = keyed.seen[1:]
    wait = _refusal(refused, 429, "rate_limit_exceeded")
    # 2 s less the time between the two admissions (at most t0 -> the refusal)
    assert 2 - (refused_at - t0) - 0.005 <= wait <= 2.0, (wait, refused_at - t0)
    assert answered_at - refused_at >= wait, "the SDK retried before the wait it was given"


def test_a_tenant_over_its_queues_rate_limit_is_429_and_the_sdk_retry_succeeds(
        keyed: Keyed) -> None:
    """The echo queue limits tenant "capped" to 20 requests a minute (its scheduling's
    tenant_rpm; a burst of one): the key has no limit of its own, the queue refuses
    (mtq.RateLimited), and nothing of the refused request is queued."""
    token, _ = keyed.key(CAPPED)
    headers = {"authorization": f"Bearer {token}"}
    with keyed.client(token, max_retries=2) as c, \
            httpx.Client(base_url=keyed.base, timeout=10, headers=headers) as h:
        assert c.chat.completions.create(model=keyed.echo, messages=MSGS,
                                         max_tokens=1).choices[0].message.content == "x"
        before = task_keys(keyed.r)
        refused = h.post("/v1/chat/completions",
                         json={"model": keyed.echo, "messages": MSGS, "max_tokens": 1})
        wait = _refusal(refused, 429, "rate_limited")
        assert 0 < wait <= 60 / CAPPED_RPM
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert new_task_keys(keyed.r, before) == set()
        # the SDK's next request is refused too, waits what it is told, and goes in
        out = c.chat.completions.create(model=keyed.echo, messages=MSGS, max_tokens=1)
    assert out.choices[0].message.content == "x"
    assert [resp.status_code for _, resp in keyed.seen] == [200, 429, 200]
    (refused_at, again), (answered_at, _) = keyed.seen[1:]
    assert answered_at - refused_at >= _refusal(again, 429, "rate_limited")
    assert keyed.tenant_of(out.id) == CAPPED


# -- tasks are not read by id ------------------------------------------------------------------
def test_no_route_reads_a_task_by_id_not_even_another_tenants(keyed: Keyed) -> None:
    """The gateway answers a request with its own task's result and nothing else: no
    route takes a task id (OpenAI's stored-completion routes included), so another
    tenant's key, or the owner's, asking for one gets OpenAI's 404 and not a byte of it."""
    other, _ = keyed.key("other")
    with keyed.client(keyed.token) as c:
        mine = c.completions.create(model=keyed.echo, prompt="secret words", max_tokens=2)
    task_id = mine.id.split("-", 1)[1]
    paths = [f"/v1/chat/completions/{mine.id}", f"/v1/chat/completions/{task_id}",
             f"/v1/chat/completions/{mine.id}/messages", f"/v1/completions/{mine.id}",
             f"/v1/responses/{task_id}", f"/v1/tasks/{task_id}", f"/v1/models/{task_id}"]
    for token in (other, keyed.token):
        with keyed.client(token) as c, pytest.raises(openai.NotFoundError) as info:
            c.chat.completions.retrieve(mine.id)
        assert info.value.body["code"] == "unknown_url"  # type: ignore[index]
        with httpx.Client(base_url=keyed.base, timeout=10,
                          headers={"authorization": f"Bearer {token}"}) as h:
            for path in paths:
                resp = h.get(path)
                assert resp.status_code == 404, (path, resp.text)
                err = resp.json()["error"]
                assert set(err) == {"message", "type", "param", "code"}, err
                assert err["code"] in ("unknown_url", "model_not_found"), err
                assert "secret" not in resp.text, resp.text


# -- bad input with keys --------------------------------------------------------------------------
def test_refused_keys_write_nothing_and_the_gateway_keeps_serving(keyed: Keyed) -> None:
    body = {"model": keyed.echo, "messages": MSGS, "max_tokens": 1}
    before = task_keys(keyed.r)
    rates = set(keyed.r.scan_iter(match="mtq:apikey:*:rate", count=10_000))
    with httpx.Client(base_url=keyed.base, timeout=10) as h:
        for auth, code in [(None, "missing_api_key"), ("Bearer", "missing_api_key"),
                           ("Basic dXNlcjpwdw==", "missing_api_key"),
                           ("Bearer sk-not-ours", "invalid_api_key"),
                           ("Bearer mtq-0123456789ab-" + "A" * 43, "invalid_api_key"),
                           (f"Bearer {keyed.revoked}", "invalid_api_key")]:
            resp = h.post("/v1/chat/completions", json=body,
                          headers={"authorization": auth} if auth else {})
            assert resp.status_code == 401, (auth, resp.text)
            assert resp.json()["error"]["code"] == code, (auth, resp.text)
        assert new_task_keys(keyed.r, before) == set()
        assert set(keyed.r.scan_iter(match="mtq:apikey:*:rate", count=10_000)) == rates
        ok = h.post("/v1/chat/completions", json=body,
                    headers={"authorization": f"Bearer {keyed.token}"})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "x"


def test_a_malformed_request_does_not_count_against_the_key(keyed: Keyed) -> None:
    token, key = keyed.key("acme", rpm=1)
    headers = {"authorization": f"Bearer {token}"}
    before = task_keys(keyed.r)
    with httpx.Client(base_url=keyed.base, timeout=10, headers=headers) as h:
        good = {"model": keyed.echo, "messages": MSGS, "max_tokens": 1}
        for resp in (h.post("/v1/chat/completions", content=b"{oops"),
                     h.post("/v1/chat/completions", json={"model": keyed.echo}),
                     h.post("/v1/chat/completions", json={**good, "n": 3}),
                     h.post("/v1/chat/completions", json=good,
                            headers={"X-Mtq-Priority": "vip"}),
                     h.post("/v1/chat/completions", json=good,
                            headers={"X-Mtq-Deadline": "-5"}),
                     h.post("/v1/embeddings", json={"model": keyed.echo, "input": "x"},
                            headers={"X-Mtq-Deadline": "soon"})):
            assert resp.status_code == 400, resp.text
        assert new_task_keys(keyed.r, before) == set()
        assert not keyed.r.exists(f"mtq:apikey:{{{key.id}}}:rate")
        # its one request a minute is still there
        ok = h.post("/v1/chat/completions", json=good)
        assert ok.status_code == 200, ok.text


def test_require_keys_on_loopback_behind_a_proxy(keyed: Keyed, tmp_path_factory: Any) -> None:
    """``mtq serve --require-keys`` on 127.0.0.1 (a reverse proxy's upstream): a request
    without a key is refused, as beyond loopback."""
    tmp = tmp_path_factory.mktemp("proxied")
    port = free_port()
    proc = serve(env_for(keyed.url, tmp), tmp / "serve.log", port, "--require-keys")
    base = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            assert proc.poll() is None, f"mtq serve --require-keys exited: see {tmp}"
            try:
                return httpx.get(base + "/v1/models", headers={
                    "authorization": f"Bearer {keyed.token}"}).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, 60, "mtq serve --require-keys did not come up")
        with httpx.Client(base_url=base, timeout=10) as h:
            body = {"model": keyed.echo, "messages": MSGS, "max_tokens": 1}
            refused = h.post("/v1/chat/completions", json=body,
                             headers={"X-Forwarded-For": "203.0.113.9"})
            assert refused.status_code == 401, refused.text
            assert refused.json()["error"]["code"] == "missing_api_key"
            ok = h.post("/v1/chat/completions", json=body,
                        headers={"authorization": f"Bearer {keyed.token}"})
            assert ok.status_code == 200, ok.text
    finally:
        stop(proc)


def test_the_mounted_dashboard_shows_no_text_of_a_task_to_a_plain_key(keyed: Keyed) -> None:
    """``/dashboard`` of a gateway that requires keys shows a task's page (its status and
    timeline, read-only) but its payload, result and tokens to signed-in admins only:
    another tenant's key, or the owner's, gets none of its text."""
    other, _ = keyed.key("other")
    with keyed.client(keyed.token) as c:
        mine = c.completions.create(model=keyed.echo, prompt="secret words", max_tokens=2)
    task_id = mine.id.split("-", 1)[1]
    for token in (other, keyed.token):
        with httpx.Client(base_url=keyed.base, timeout=10,
                          headers={"authorization": f"Bearer {token}"}) as h:
            page = h.get(f"/dashboard/tasks/{task_id}", params={"queue": keyed.echo})
            assert page.status_code == 200, page.text
            assert task_id in page.text and "secret" not in page.text
            tokens = h.get(f"/dashboard/tasks/{task_id}/stream", params={"queue": keyed.echo})
            assert tokens.status_code == 403 and "secret" not in tokens.text, tokens.text
