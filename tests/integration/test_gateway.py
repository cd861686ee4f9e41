"""The OpenAI-compatible gateway (``mtq serve``, mtq.gateway) under uvicorn, read by
the official ``openai`` SDK (sync and async) and by raw HTTP (httpx), against a real
redis-server and real supervised workers (``mtq workers start``): the reference
TinyGPT (the ``reference`` payload dialect), the reference embedder, and
tests.models:EchoChat (``hf:CausalLM``'s payload, slow enough to leave mid-stream).
One server and one set of workers for the module."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

import mtq
from mtq.broker.registry import list_workers
from tests.support.gateway import env_for, new_task_keys, serve, stop, task_keys, workers
from tests.support.paths import ROOT
from tests.support.processes import free_port
from tests.support.servers import RedisServer
from tests.support.waits import wait_for

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(120)
#: the gateway's --timeout (seconds a request waits for its task)
TIMEOUT = 5


@dataclass
class Stack:
    base: str
    url: str
    gpt: str      # queue of the reference TinyGPT (served as itself and as "tiny")
    emb: str      # queue of the reference embedder
    echo: str     # queue of tests.models:EchoChat
    idle: str     # a queue no worker serves (mapped as "idle")
    late: str     # another (mapped as "late"; its settings never change)
    log: Path

    def client(self, **kw: object) -> openai.OpenAI:
        kw.setdefault("max_retries", 0)
        return openai.OpenAI(base_url=self.base + "/v1", api_key="unused",
                             timeout=30, **kw)  # type: ignore[arg-type]

    def aclient(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base + "/v1", api_key="unused",
                                  max_retries=0, timeout=30)

    def task(self, queue: str, answer_id: str) -> mtq.Task:
        return mtq.Queue(queue, self.url).task(answer_id.split("-", 1)[1])


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # a Redis of its own: the gateway on loopback checks a key once any key exists
    # there, and other tests' keys (the dashboard's admins) are none of its business
    tmp = tmp_path_factory.mktemp("gateway")
    (tmp / "redis").mkdir()
    server = RedisServer(tmp / "redis")
    server.start()
    redis_url = server.url
    env = env_for(redis_url, tmp)
    tag = uuid.uuid4().hex[:6]
    gpt, emb, echo = f"gw-gpt-{tag}", f"gw-emb-{tag}", f"gw-echo-{tag}"
    idle, late = f"gw-idle-{tag}", f"gw-late-{tag}"
    procs = []
    r = redis.Redis.from_url(redis_url)
    try:
        for target, q in (("mtq.reference.gpt:TinyGPT", gpt),
                          ("mtq.reference.embedder:TinyEmbedder", emb),
                          ("tests.models:EchoChat", echo)):
            procs.append(workers(env, tmp / f"{q}.log", target, q))
        port = free_port()
        log = tmp / "serve.log"
        procs.append(serve(env, log, port, "--model", f"tiny={gpt}", "--model",
                           f"idle={idle}", "--model", f"late={late}", "--timeout",
                           str(TIMEOUT)))
        base = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            for p in procs:
                assert p.poll() is None, f"{p.args} exited: see {tmp}"
            if len({w["queue"] for w in list_workers(r) if w.get("queue") in
                    (gpt, emb, echo)}) < 3:
                return False
            try:
                ids = {m["id"] for m in httpx.get(base + "/v1/models").json()["data"]}
            except httpx.TransportError:
                return False
            return {gpt, emb, echo, "tiny"} <= ids

        wait_for(ready, 90, "the workers or the gateway did not come up")
        yield Stack(base, redis_url, gpt, emb, echo, idle, late, log)
    finally:
        for p in procs:
            stop(p)
        r.close()
        server.stop()


# -- the happy paths -----------------------------------------------------------------------
def test_models_lists_served_queues_and_mapped_names(stack: Stack) -> None:
    with stack.client() as c:
        models = {m.id: m for m in c.models.list()}
        assert {stack.gpt, stack.emb, stack.echo, "tiny"} <= set(models)
        assert models["tiny"].model_extra["queue"] == stack.gpt  # type: ignore[index]
        assert c.models.retrieve("tiny").id == "tiny"
        with pytest.raises(openai.NotFoundError):
            c.models.retrieve("no-such-model")


def test_chat_completion_reference_model(stack: Stack) -> None:
    with stack.client() as c:
        out = c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=12,
            temperature=0, seed=3)
    assert out.object == "chat.completion" and out.model == "tiny"
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    result = stack.task(stack.gpt, out.id).result(timeout=5)
    assert choice.message.content == result["text"]
    # the chat became TinyGPT's prompt: role lines, then "assistant:"
    assert out.usage is not None
    assert out.usage.prompt_tokens == len(b"user: Hello\nassistant:") + 1
    assert 1 <= out.usage.completion_tokens <= 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_chat_streamed_with_usage_equals_the_task_result(stack: Stack) -> None:
    with stack.client() as c:
        chunks = list(c.chat.completions.create(
            model=stack.echo, messages=[{"role": "user", "content": "one two three"}],
            max_tokens=7, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == "one two three one two three one"
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert [f.choices[0].finish_reason for f in finals] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (4, 7)
    assert stack.task(stack.echo, chunks[0].id).result(timeout=5)["text"] == text
    assert all(ch.id == chunks[0].id for ch in chunks)


def test_hf_dialect_passes_messages_stop_top_p(stack: Stack) -> None:
    with stack.client() as c:
        out = c.chat.completions.create(
            model=stack.echo, messages=[{"role": "system", "content": "x"},
                                        {"role": "user", "content": "alpha beta gamma"}],
            max_tokens=20, stop=["gamma"], top_p=0.5, temperature=0.3, seed=1, user="ann")
    assert out.choices[0].message.content == "alpha beta "
    assert out.choices[0].finish_reason == "stop"
    assert stack.task(stack.echo, out.id).info().stream == "user:ann"  # the user's stream


def test_text_completion_streamed_and_not(stack: Stack) -> None:
    with stack.client() as c:
        out = c.completions.create(model=stack.echo, prompt="red green", max_tokens=3)
        assert out.object == "text_completion"
        assert out.choices[0].text == "red green red"
        assert out.usage is not None and out.usage.completion_tokens == 3
        streamed = list(c.completions.create(model=stack.gpt, prompt="Once", max_tokens=6,
                                             stream=True, temperature=0))
    text = "".join(ch.choices[0].text for ch in streamed if ch.choices)
    assert text == stack.task(stack.gpt, streamed[0].id).result(timeout=5)["text"]
    assert streamed[-1].choices[0].finish_reason in ("stop", "length")


def test_embeddings(stack: Stack) -> None:
    with stack.client() as c:
        out = c.embeddings.create(model=stack.emb, input=["a cat", "a dog", "a cat"])
    assert [d.index for d in out.data] == [0, 1, 2]
    vecs = [d.embedding for d in out.data]
    assert len({len(v) for v in vecs}) == 1 and len(vecs[0]) > 8
    assert all(abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-3 for v in vecs)
    assert vecs[0] == vecs[2] and vecs[0] != vecs[1]
    assert out.usage.prompt_tokens == 3 * 6  # one token a byte, plus BOS


def test_async_client_streams_and_answers(stack: Stack) -> None:
    async def main() -> tuple[str, str, int]:
        async with stack.aclient() as c:
            stream = await c.chat.completions.create(
                model=stack.echo, messages=[{"role": "user", "content": "hi there"}],
                max_tokens=4, stream=True)
            text = "".join([ch.choices[0].delta.content or "" async for ch in stream
                            if ch.choices])
            plain, emb = await asyncio.gather(
                c.completions.create(model=stack.echo, prompt="x y", max_tokens=2),
                c.embeddings.create(model=stack.emb, input="z"))
            return text, plain.choices[0].text, len(emb.data)

    assert asyncio.run(main()) == ("hi there hi there", "x y", 1)


def test_langchain_chat_openai_invokes_and_streams(stack: Stack) -> None:
    """LangChain's ChatOpenAI (langchain-openai, over the openai SDK), as docs/gateway.md
    shows it: an answer, a stream, usage."""
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(base_url=stack.base + "/v1", api_key="unused", model=stack.echo,
                        max_tokens=5, temperature=0, max_retries=0, timeout=30)
    out = llm.invoke("one two")
    assert out.content == "one two one two one"
    assert out.usage_metadata["output_tokens"] == 5  # type: ignore[index]
    assert out.response_metadata["finish_reason"] == "length"
    assert stack.task(stack.echo, out.response_metadata["id"]).result(timeout=5)["text"] \
        == out.content
    pieces = [ch.content for ch in llm.stream([("system", "be brief"), ("user", "a b")])]
    assert "".join(pieces) == "a b a b a" and len([p for p in pieces if p]) == 5  # type: ignore[misc]


def test_client_closing_mid_stream_cancels_its_task(stack: Stack) -> None:
    start = time.monotonic()
    with stack.client() as c:
        stream = c.chat.completions.create(
            model=stack.echo, messages=[{"role": "user", "content": "go on and on"}],
            max_tokens=400, stream=True)  # 400 * 50 ms: 20 s unless cancelled
        got = []
        for ch in stream:
            got.append(ch)
            if len(got) == 3:
                break
        stream.close()
    task = stack.task(stack.echo, got[0].id)
    wait_for(lambda: task.status() == "cancelled", 10,
             "the task of the client that went away was not cancelled")
    assert time.monotonic() - start < TIMEOUT - 0.5  # not the gateway's time limit


def test_client_leaving_a_non_streamed_request_cancels_its_task(stack: Stack) -> None:
    q = mtq.Queue(stack.echo, stack.url)
    assert q.stats()["running"] == 0
    start = time.monotonic()
    with httpx.Client(base_url=stack.base, timeout=httpx.Timeout(10, read=1.5)) as h, \
            pytest.raises(httpx.ReadTimeout):  # 400 * 50 ms: 20 s unless cancelled
        h.post("/v1/completions", json={"model": stack.echo, "prompt": "slow",
                                        "max_tokens": 400})
    wait_for(lambda: q.stats()["running"] == 0, 8,
             "the task of the client that went away was not cancelled")
    # by the client's leaving, not by the gateway's own time limit
    assert time.monotonic() - start < TIMEOUT - 0.5
    assert q.stats()["waiting"] == 0


# -- errors ----------------------------------------------------------------------------------
@pytest.mark.parametrize("extra", [
    {"n": 2}, {"tools": [{"type": "function", "function": {"name": "f"}}]},
    {"extra_body": {"frobnicate": 1}}, {"max_tokens": "many"}, {"temperature": 7},
    {"presence_penalty": 0.5}, {"logit_bias": {"1": 2}},
])
def test_what_cannot_be_honoured_is_a_400(stack: Stack, extra: dict[str, object]) -> None:
    with stack.client() as c, pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model=stack.echo, messages=[{"role": "user", "content": "x"}],
                                  **extra)  # type: ignore[arg-type]
    body = info.value.body
    assert isinstance(body, dict) and body["type"] == "invalid_request_error", body
    assert body["message"] and body["code"]


def test_reference_model_refuses_what_it_cannot_do(stack: Stack) -> None:
    with stack.client() as c:
        for extra in ({"stop": ["x"]}, {"top_p": 0.5}, {"logprobs": True}):
            with pytest.raises(openai.BadRequestError, match="not supported"):
                c.chat.completions.create(model="tiny", messages=[{"role": "user",
                                                                   "content": "x"}],
                                          **extra)  # type: ignore[arg-type]
        # a payload the worker refuses (a prompt over the context) is the client's error
        with pytest.raises(openai.BadRequestError, match="max_seq"):
            c.completions.create(model="tiny", prompt="x" * 5000, max_tokens=4)


def test_unknown_model_is_404(stack: Stack) -> None:
    with stack.client() as c, pytest.raises(openai.NotFoundError) as info:
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert info.value.body["code"] == "model_not_found"  # type: ignore[index]


def _chunked(size: int) -> Iterator[bytes]:
    """A body sent chunked (no Content-Length): the gateway must count as it reads."""
    for _ in range(size // 65536):
        yield b"x" * 65536


def test_bad_input_is_a_named_error_writes_nothing_and_the_gateway_keeps_serving(
        stack: Stack) -> None:
    msgs = [{"role": "user", "content": "x"}]
    chat = {"model": stack.echo, "messages": msgs}
    r = redis.Redis.from_url(stack.url)
    q = mtq.Queue(stack.echo, stack.url)
    before, stats = task_keys(r), q.stats()
    with httpx.Client(base_url=stack.base, timeout=10) as h:
        cases = [
            # malformed JSON
            (h.post("/v1/chat/completions", content=b"{not json",
                    headers={"content-type": "application/json"}), 400, "invalid_json"),
            (h.post("/v1/chat/completions", content=b'{"model": "\xc3\x28"}'), 400, "invalid_json"),
            (h.post("/v1/completions", content=b""), 400, "invalid_json"),
            # wrong types
            (h.post("/v1/chat/completions", json=[1, 2]), 400, "invalid_type"),
            (h.post("/v1/chat/completions", json={"model": 5, "messages": msgs}), 400,
             "invalid_type"),
            (h.post("/v1/chat/completions", json={"messages": msgs}), 400,
             "missing_required_parameter"),
            (h.post("/v1/chat/completions", json={**chat, "messages": "hi"}), 400,
             "invalid_type"),
            (h.post("/v1/chat/completions", json={**chat, "max_tokens": "many"}), 400,
             "invalid_type"),
            (h.post("/v1/chat/completions", json={**chat, "stream": "yes"}), 400,
             "invalid_type"),
            (h.post("/v1/chat/completions", json={**chat, "temperature": "hot"}), 400,
             "invalid_value"),
            (h.post("/v1/completions", json={"model": stack.echo, "prompt": [1, 2]}), 400,
             "invalid_type"),
            (h.post("/v1/embeddings", json={"model": stack.emb, "input": [["a"]]}), 400,
             "invalid_type"),
            (h.post("/v1/chat/completions", json=chat, headers={"X-Mtq-Priority": "vip"}),
             400, "bad_priority"),
            (h.post("/v1/chat/completions", json=chat, headers={"X-Mtq-Deadline": "soon"}),
             400, "bad_deadline"),
            # oversized bodies: announced, and sent chunked without a length
            (h.post("/v1/embeddings", content=b"x" * (2 << 20)), 413, "request_too_large"),
            (h.post("/v1/chat/completions", content=_chunked(2 << 20)), 413,
             "request_too_large"),
            # unknown routes, wrong methods
            (h.get("/v1/nothing"), 404, "unknown_url"),
            (h.post("/v1/responses", json=chat), 404, "unknown_url"),
            (h.get("/v1/chat/completions"), 405, "method_not_allowed"),
            (h.delete("/v1/models"), 405, "method_not_allowed"),
        ]
        for resp, status, code in cases:
            assert resp.status_code == status, (resp.request.url, resp.text)
            err = resp.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, err
            assert err["code"] == code and err["message"], (resp.request.url, err)
            assert err["type"] == "invalid_request_error", err
        # nothing was written: no task made, nothing queued
        assert new_task_keys(r, before) == set()
        after = q.stats()
        assert (after["waiting"], after["running"]) == (stats["waiting"], stats["running"])
        # and it keeps serving
        ok = h.post("/v1/completions", json={"model": stack.echo, "prompt": "ok",
                                             "max_tokens": 1})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "ok"
    r.close()


def test_deadline_header_reaches_the_task(stack: Stack) -> None:
    with stack.client(default_headers={"X-Mtq-Deadline": "30",
                                       "X-Mtq-Priority": "batch"}) as c:
        out = c.completions.create(model=stack.echo, prompt="a", max_tokens=1)
    info = stack.task(stack.echo, out.id).info()
    assert info.deadline is not None and info.created is not None
    assert 0 < info.deadline - info.created <= 30_000  # ms


def test_full_queue_is_503_with_retry_after(stack: Stack) -> None:
    q = mtq.Queue(stack.idle, stack.url)
    q.configure(max_length=1)
    waiting = q.submit({"prompt": "fills the queue"})
    try:
        with stack.client() as c, pytest.raises(openai.InternalServerError) as info:
            c.completions.create(model="idle", prompt="x", max_tokens=1)
        assert info.value.status_code == 503
        assert int(info.value.response.headers["retry-after"]) >= 1
        assert info.value.body["code"] == "queue_full"  # type: ignore[index]
        # the SDK honours Retry-After: one retry, that long later
        start = time.monotonic()
        with stack.client(max_retries=1) as c, pytest.raises(openai.InternalServerError):
            c.completions.create(model="idle", prompt="x", max_tokens=1)
        assert time.monotonic() - start >= int(info.value.response.headers["retry-after"])
    finally:
        waiting.cancel()
        q.configure(max_length=0)


def test_a_deadline_that_cannot_be_met_is_503_with_retry_after(stack: Stack) -> None:
    """The queue's measured service rate is 1 task a second (set as its workers' claims
    would measure it) and 20 tasks wait ahead in the request's band: it would start in
    about 22 s (the 10 % margin included), so a 5 s deadline is refused, nothing queued."""
    q = mtq.Queue(stack.late, stack.url)
    r = redis.Redis.from_url(stack.url)
    backlog = [q.submit({"prompt": f"ahead {i}"}, priority="interactive") for i in range(20)]
    r.hset(q.broker.keys.sched + "vt", "~rate", 1)
    try:
        before = task_keys(r)
        with stack.client(default_headers={"X-Mtq-Deadline": "5"}) as c, \
                pytest.raises(openai.InternalServerError) as info:
            c.completions.create(model="late", prompt="late", max_tokens=1)
        err = info.value
        assert err.status_code == 503 and err.body["code"] == "would_miss_deadline", err.body  # type: ignore[index]
        assert err.body["type"] == "server_error"  # type: ignore[index]
        assert 15 <= int(err.response.headers["retry-after"]) <= 18, err.response.headers
        assert 15_000 <= int(err.response.headers["retry-after-ms"]) <= 18_000
        assert new_task_keys(r, before) == set() and q.stats()["waiting"] == 20
        # a deadline the backlog leaves room for is admitted (and queued)
        with httpx.Client(base_url=stack.base, timeout=httpx.Timeout(10, read=1)) as h, \
                pytest.raises(httpx.ReadTimeout):
            h.post("/v1/completions", json={"model": "late", "prompt": "in time",
                                            "max_tokens": 1}, headers={"X-Mtq-Deadline": "60"})
        assert len(new_task_keys(r, before)) == 1
    finally:
        r.hdel(q.broker.keys.sched + "vt", "~rate")
        for t in backlog:
            t.cancel()
        wait_for(lambda: q.stats()["waiting"] == 0, 10, "the queue did not empty")
        r.close()


def test_no_answer_in_time_is_504_and_cancels(stack: Stack) -> None:
    with stack.client() as c, pytest.raises(openai.InternalServerError) as info:
        c.completions.create(model="idle", prompt="nobody serves this", max_tokens=1)
    assert info.value.status_code == 504
    assert info.value.body["code"] == "timeout"  # type: ignore[index]
    q = mtq.Queue(stack.idle, stack.url)
    task_id = info.value.body["message"].split("task ")[1].split()[0]  # type: ignore[index]
    wait_for(lambda: q.task(task_id).status() == "cancelled", 10,
             "the timed-out request's task was not cancelled")
    assert q.stats()["waiting"] == 0


# -- mtq serve refuses to serve beyond loopback (or --require-keys) without keys ----------
@pytest.mark.parametrize("args", [["--host", "0.0.0.0"], ["--require-keys"]])
def test_serve_needing_keys_without_any_refuses(tmp_path: Path, args: list[str]) -> None:
    (tmp_path / "redis").mkdir()
    fresh = RedisServer(tmp_path / "redis")
    fresh.start()
    try:
        env = env_for(fresh.url, tmp_path)
        proc = subprocess.run([sys.executable, "-m", "mtq", "serve", *args,
                               "--port", str(free_port())], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)
    finally:
        fresh.stop()
    assert proc.returncode == 2, proc.stderr
    assert "without API keys" in proc.stderr and "mtq keys create" in proc.stderr


def test_loopback_needs_no_key(stack: Stack) -> None:
    with httpx.Client(base_url=stack.base, timeout=10) as h:  # no Authorization at all
        resp = h.post("/v1/completions", json={"model": stack.echo, "prompt": "k",
                                               "max_tokens": 1})
    assert resp.status_code == 200, resp.text
    assert json.loads(resp.text)["choices"][0]["text"] == "k"
