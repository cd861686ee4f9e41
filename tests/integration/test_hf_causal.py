"""hf:CausalLM (mtq.backends.hf.causal) against a real redis-server, on tiny Llama models
built in the test session (tests/hf_causal.py: random weights, a byte-level BPE
tokenizer trained here, loaded by path through from_pretrained).

Covered: greedy decoding equal to transformers' own ``generate``, alone and batched;
each sampling option; logprobs; stop tokens, EOS and stop strings across token
boundaries; text pieces that never split a character; chat templates; bad payloads
failing alone while the rest of the batch completes; a cancel freeing its slot at the
next step; a worker process killed mid-generation whose client sees ``restarted`` and
then the whole text; the same seed giving the same tokens alone and batched; a
bfloat16 run on the device (marked cuda: scripts/gpu-check).

Most tests compute in float64, where a request's tokens do not depend on the batch
(docs/models.md, "Determinism").
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

import mtq
from mtq.broker.protocol import TERMINAL
from mtq.reference.gpt import generate
from mtq.settings import QueueSettings
from mtq.workers import control, devices
from mtq.workers.registry import list_workers
from mtq.workers.worker import Worker
from tests.hf_causal import CHAT_TEMPLATE, CONTEXT, build
from tests.support.waits import Reader, wait_for
from tests.support.workers import serving

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(90)

FAST = QueueSettings(lease_ms=1500, retry_backoff_ms=0)
PROMPTS = ["Hello, world", "Once upon a time there was", "A",
           "Paris is the capital of France; Berlin is"]
DEVICE = os.environ.get("MTQ_TEST_CUDA_DEVICE", "cuda:0")


@pytest.fixture(scope="session")
def lm_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("hf-causal"))


@pytest.fixture(scope="session")
def lm(lm_path: Path) -> Any:
    """The backend, set up on the CPU in float64 (shared: generate() leaves it empty)."""
    from mtq.backends.hf.causal import CausalLM

    model = CausalLM().set_options(model=str(lm_path), dtype="float64")
    model.setup("cpu")
    return model


@pytest.fixture(scope="session")
def hf(lm_path: Path) -> tuple[Any, Any]:
    """transformers' own model and tokenizer of the same folder, float64."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(lm_path, dtype=torch.float64).eval()
    return model, AutoTokenizer.from_pretrained(lm_path)


def greedy(hf: tuple[Any, Any], ids: list[int], n: int, **kw: Any) -> list[int]:
    """transformers' ``generate`` without sampling: the ``n`` token ids after ``ids``."""
    import torch

    model, tok = hf
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=tok.pad_token_id, **kw)
    return [int(t) for t in out[0, len(ids):]]


def logits_along(hf: tuple[Any, Any], ids: list[int], new: list[int]) -> Any:
    """The model's logits [len(new), vocab] at each generated position (float64)."""
    import torch

    with torch.inference_mode():
        out = hf[0](torch.tensor([ids + new]))
    return out.logits[0, len(ids) - 1:len(ids) + len(new) - 1]


def text_of(hf: tuple[Any, Any], ids: list[int]) -> str:
    return str(hf[1].decode(ids, skip_special_tokens=True))


def prompt_ids(hf: tuple[Any, Any], prompt: str) -> list[int]:
    return list(hf[1](prompt)["input_ids"])


def worker(lm_path: Path, qname: str, url: str, cls: Any = None, **options: Any) -> Worker:
    from mtq.backends.hf.causal import CausalLM

    model = (cls or CausalLM)().set_options(model=str(lm_path), dtype="float64", **options)
    return Worker(model, qname, url=url, settings=FAST)


def tokens_of(events: list[mtq.Event]) -> list[Any]:
    toks = [e for e in events if e.kind == "token"]
    assert [e.index for e in toks] == list(range(len(toks))), [e.index for e in toks]
    return [e.data for e in toks]


# -- generation and sampling ----------------------------------------------------------------
def test_greedy_equals_transformers_generate_alone_and_batched(lm: Any, hf: Any) -> None:
    payloads = [{"prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
                for p in PROMPTS]
    batched = generate(lm, payloads)  # prompts of 4 lengths in one batch: left padding
    for p, res in zip(PROMPTS, batched):
        ids = prompt_ids(hf, p)
        expected = greedy(hf, ids, 24)
        assert res["text"] == text_of(hf, expected), p
        assert res["finish_reason"] == "length"
        assert res["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 24}
        assert generate(lm, [payloads[PROMPTS.index(p)]])[0] == res  # alone: the same
    assert not lm.rows and len(lm.batch) == 0 and lm.batch.cache is None  # all released


def drive(model: Any, payloads: list[Any]) -> list[tuple[dict[str, Any], list[int]]]:
    """Like mtq.reference.gpt.generate (one static batch, no queue), with each request's
    generated token ids beside its result."""
    reqs = [mtq.Generation(f"run-{k}", p) for k, p in enumerate(payloads)]
    try:
        for r in reqs:
            model.admit(r)
        running = reqs
        tokens = model.prefill(reqs)
        while running:
            for r, t in zip(running, tokens):
                r.tokens.append(t)
            running = [r for r in running if not r.finished]
            tokens = model.decode(running) if running else []
        return [(model.result(r), list(r.state.token_ids)) for r in reqs]
    finally:
        model.release(reqs)


def test_each_sampling_option(lm: Any, hf: Any) -> None:
    import torch

    prompt = "Once upon a time"
    ids = prompt_ids(hf, prompt)
    base = {"prompt": prompt, "max_tokens": 30, "ignore_eos": True, "logprobs": True}
    want_greedy = greedy(hf, ids, 30)
    hot = {**base, "temperature": 5.0}
    out = drive(lm, [
        {**base, "temperature": 0},
        {**base, "temperature": 1.0, "top_k": 1},
        {**base, "temperature": 1.0, "top_p": 1e-9},
        {**hot, "seed": 1}, {**hot, "seed": 1}, {**hot, "seed": 2},
        {**hot, "top_k": 3, "seed": 3},
        {**hot, "top_p": 0.05, "seed": 4},
        {**base, "temperature": 0, "repetition_penalty": 1.5},
    ])
    # temperature 0, top_k 1 and a tiny top_p all pick the most likely token
    assert out[0][1] == out[1][1] == out[2][1] == want_greedy
    assert out[0][0]["text"] == text_of(hf, want_greedy)
    # a seed gives its tokens; another seed others
    assert out[3] == out[4] and out[3][1] != out[5][1]
    # logprobs: the model's own log-probability of each token generated
    lp = torch.log_softmax(logits_along(hf, ids, want_greedy), -1)
    assert out[0][0]["logprobs"] == pytest.approx(
        [float(lp[k, t]) for k, t in enumerate(want_greedy)], abs=1e-9)

    def ranks(new: list[int]) -> list[int]:
        logits = logits_along(hf, ids, new)
        return [int((logits[j] > logits[j, t]).sum()) for j, t in enumerate(new)]

    # top_k 3 at a high temperature: every token among the 3 most likely; without it,
    # some are not (so the check can fail)
    assert max(ranks(out[6][1])) < 3, ranks(out[6][1])
    assert max(ranks(out[5][1])) >= 3, ranks(out[5][1])
    # top_p 0.05 at temperature 5: every token in its step's nucleus (the tokens more
    # likely than it hold less than 0.05); at top_p 1, not so
    for res, inside in ((out[7][1], True), (out[5][1], False)):
        probs = torch.softmax(logits_along(hf, ids, res) / 5.0, -1)
        before = [float(probs[j][probs[j] > probs[j, t]].sum()) for j, t in enumerate(res)]
        assert (max(before) < 0.05) is inside, before
    # repetition penalty: as transformers applies it
    assert out[8][1] == greedy(hf, ids, 30, repetition_penalty=1.5) != want_greedy


def test_stop_tokens_and_eos_end_the_request_without_their_text(lm: Any, hf: Any) -> None:
    prompt = "Hello, world"
    ids = prompt_ids(hf, prompt)
    new = greedy(hf, ids, 40)
    stop = new[12]
    first = new.index(stop)
    (res,) = generate(lm, [{"prompt": prompt, "max_tokens": 40, "temperature": 0,
                            "stop_token_ids": [stop], "ignore_eos": True}])
    assert res["finish_reason"] == "stop"
    assert res["usage"]["completion_tokens"] == first + 1  # the stop token counts
    assert res["text"] == text_of(hf, new[:first])
    # EOS: the model's end-of-sequence token (here: told which) ends it the same way,
    # unless the payload says ignore_eos
    eos = lm.eos_ids
    lm.eos_ids = frozenset({stop})
    try:
        a, b = generate(lm, [{"prompt": prompt, "max_tokens": 40, "temperature": 0},
                             {"prompt": prompt, "max_tokens": 40, "temperature": 0,
                              "ignore_eos": True}])
    finally:
        lm.eos_ids = eos
    assert (a["finish_reason"], a["text"]) == ("stop", res["text"])
    assert (b["finish_reason"], b["usage"]["completion_tokens"]) == ("length", 40)


def test_text_pieces_never_split_a_character(lm: Any, hf: Any) -> None:
    from mtq.backends.hf.text import TextStream

    tok = hf[1]
    text = "日本語 🙂 café, naïve — ok"
    ids = list(tok(text, add_special_tokens=False)["input_ids"])
    assert len(ids) > len(text)  # the tokenizer splits characters into bytes
    stream = TextStream(tok, prompt_ids(hf, "Say:"))
    pieces = [stream.push(t) for t in ids] + [stream.finish()]
    assert "".join(pieces) == text
    assert "\ufffd" not in "".join(pieces)
    assert sum(1 for p in pieces if p == "") >= 5  # held back while a character was incomplete
    # served: a random model's pieces, joined, are the decode of all its tokens at once
    for seed in range(3):
        ((res, new),) = drive(lm, [{"prompt": "日本", "max_tokens": 60, "seed": seed,
                                    "ignore_eos": True}])
        assert len(new) == 60
        assert res["text"] == tok.decode(new, skip_special_tokens=True)


def test_stop_strings_across_token_boundaries(lm: Any, hf: Any, qname: str,
                                              redis_url: str, lm_path: Path) -> None:
    from mtq.backends.hf.text import TextStream

    tok = hf[1]
    # the text streamed while the stop string may still come is held back; it is cut
    # where the stop string starts, even one that spans three tokens
    text = "the queue held many tasks"
    ids = list(tok(text, add_special_tokens=False)["input_ids"])
    pieces = [tok.decode([t]) for t in ids]
    at = next(k for k in range(1, len(ids) - 2) if len(pieces[k]) >= 1)
    stop = pieces[at][-1] + pieces[at + 1] + pieces[at + 2][:1]  # spans three tokens
    stream = TextStream(tok, [0], [stop, "never there"])
    got = [stream.push(t) for t in ids]
    assert stream.stopped
    assert "".join(got) == text[:text.index(stop)]
    # a string that starts like the stop string but is not it comes out whole, late
    stream = TextStream(tok, [0], ["many tasks!"])
    got = [stream.push(t) for t in ids]
    assert "".join(got) == text[:text.index("many")] and not stream.stopped
    assert stream.finish() == "many tasks"

    # served: the stream and the result stop at the same place, the stop string not in it
    base = {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    (full,) = generate(lm, [base])
    whole = full["text"]
    stop = whole[10:14]
    assert stop not in whole[:10]
    q = mtq.Queue(qname, redis_url, settings=FAST)
    with serving(worker(lm_path, qname, redis_url)) as run:
        t = q.submit({**base, "stop": ["zzzz-never", stop]})
        streamed = "".join(t.tokens(timeout=30))
        res = t.result(timeout=5)
        run.stop()
    assert res["finish_reason"] == "stop"
    assert streamed == res["text"] == whole[:10]


def test_chat_messages_are_rendered_with_the_template(
        lm: Any, hf: Any, tmp_path: Path) -> None:
    from mtq.backends.hf.causal import CausalLM

    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Say hello."}]
    rendered = hf[1].apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|assistant|>")
    ids = list(hf[1](rendered, add_special_tokens=False)["input_ids"])
    (res,) = generate(lm, [{"messages": messages, "max_tokens": 16, "temperature": 0,
                            "ignore_eos": True}])
    assert res["usage"]["prompt_tokens"] == len(ids)
    assert res["text"] == text_of(hf, greedy(hf, ids, 16))
    # --set chat_template=FILE replaces the tokenizer's
    path = tmp_path / "chat.jinja"
    path.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    other = CausalLM().set_options(model=lm.model, dtype="float64", chat_template=str(path))
    other.setup("cpu")
    (res2,) = generate(other, [{"messages": messages, "max_tokens": 4, "temperature": 0}])
    want = "[system] You are a helpful assistant.\n[user] Say hello.\n"
    assert res2["usage"]["prompt_tokens"] == len(hf[1](want, add_special_tokens=False)
                                                 ["input_ids"])
    assert other.template != CHAT_TEMPLATE


# -- bad payloads ---------------------------------------------------------------------------
BAD = {
    "unknown field": ({"prompt": "hi", "max_tokens": 4, "colour": "red"}, "unknown payload"),
    "max_tokens 0": ({"prompt": "hi", "max_tokens": 0}, "'max_tokens' must be"),
    "max_tokens past the context": ({"prompt": "hi", "max_tokens": CONTEXT}, "past the model's"),
    "prompt longer than the context": ({"prompt": "word " * CONTEXT, "max_tokens": 4},
                                       f"the model's context is {CONTEXT}"),
    "non-text message": ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]}]},
        "must be text"),
    "no prompt": ({"max_tokens": 3}, "exactly one of 'prompt'"),
    "bad temperature": ({"prompt": "hi", "temperature": "hot"}, "'temperature' must be"),
    "bad stop": ({"prompt": "hi", "stop": [1, 2]}, "'stop' must be"),
    "not a dict": ("hello", "send a dict"),
    "megabytes of prompt": ({"prompt": "x" * (40 * CONTEXT), "max_tokens": 4},
                            "far past the model's context"),
    "repetition_penalty out of range": ({"prompt": "hi", "repetition_penalty": 1e-300},
                                        "'repetition_penalty' must be"),
    "a message's name not text": ({"messages": [{"role": "user", "content": "hi",
                                                 "name": {"x": 1}}]}, "['name'] must be a str"),
}


def test_bad_payloads_fail_alone_while_the_batch_completes(
        qname: str, redis_url: str, lm_path: Path) -> None:
    q = mtq.Queue(qname, redis_url, settings=FAST.replace(max_retries=2))
    good = [{"prompt": p, "max_tokens": 12, "seed": k, "ignore_eos": True}
            for k, p in enumerate(PROMPTS)]
    payloads: list[Any] = []
    for k, (payload, _) in enumerate(BAD.values()):
        payloads += [good[k % len(good)], payload]
    tasks = q.submit_many(payloads)
    with serving(worker(lm_path, qname, redis_url)) as run:
        wait_for(lambda: all(t.status() in TERMINAL for t in tasks), 60,
                 "the tasks did not settle")
        run.stop()
    for k, (name, (_, says)) in enumerate(BAD.items()):
        ok, bad = tasks[2 * k], tasks[2 * k + 1]
        assert ok.result(timeout=1)["usage"]["completion_tokens"] == 12, name
        info = bad.info()
        assert (info.status, info.attempts) == ("failed", 1), (name, info)
        assert "BadRequest" in (info.error or "") and says in (info.error or ""), (name, info.error)


# -- the engine: cancel, determinism, a killed worker ---------------------------------------
def _slow_class() -> Any:
    from mtq.backends.hf.causal import CausalLM

    class Slow(CausalLM):
        """Each decode step takes 10 ms more, and records which requests it ran."""

        def setup(self, device: Any = "cpu") -> None:
            super().setup(device)
            self.steps: list[set[str]] = []
            self.prefills: list[list[str]] = []

        def prefill(self, requests: list[mtq.Generation]) -> list[Any]:
            self.prefills.append([r.id for r in requests])
            return super().prefill(requests)

        def decode(self, requests: list[mtq.Generation]) -> list[Any]:
            time.sleep(0.01)
            self.steps.append({r.id for r in requests})
            return super().decode(requests)

    return Slow


def test_a_cancelled_request_frees_its_slot_at_the_next_step(
        qname: str, redis_url: str, r: redis.Redis, lm_path: Path) -> None:
    q = mtq.Queue(qname, redis_url, settings=FAST)
    long, short = q.submit_many([
        {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True},
        {"prompt": "Hello", "max_tokens": 5, "ignore_eos": True}])
    w = worker(lm_path, qname, redis_url, cls=_slow_class(), max_running=1)
    heard: list[int] = []
    model: Any = w.model

    def on_control(msg: dict[str, Any]) -> None:  # the supervisor's job, done here
        if msg.get("cmd") == "cancel":
            heard.append(len(model.steps))
        w.command(msg)

    listener = control.Listener(r, qname, on_control)
    listener.start()
    try:
        with serving(w) as run:
            got, end = [], None
            for ev in long.events(timeout=30):
                if ev.kind == "token":
                    got.append(ev.data)
                    if len(got) == 5:
                        assert long.cancel() is False  # running: its worker is told
                elif ev.terminal:
                    end = ev
            assert end is not None and end.kind == "cancelled", end
            res = short.result(timeout=10)
            run.stop()
    finally:
        listener.close()
    assert res["usage"]["completion_tokens"] == 5
    assert heard, "the worker was not told of the cancel"
    ran = [k for k, step in enumerate(model.steps) if long.id in step]
    # the step running when the cancel was heard may finish; none after it
    assert max(ran) <= heard[0], (ran, heard)
    assert len(ran) < 150
    # the short request was prefilled the step after: the slot was free at once
    first_short = next(k for k, step in enumerate(model.steps) if short.id in step)
    assert first_short <= max(ran) + 2, (first_short, max(ran))
    assert all(len(step) == 1 for step in model.steps)
    with pytest.raises(mtq.TaskCancelled):
        long.result(timeout=1)


def test_the_same_seed_gives_the_same_tokens_alone_and_batched(
        qname: str, redis_url: str, lm_path: Path, lm: Any) -> None:
    probe = {"prompt": "Once upon a time", "max_tokens": 40, "seed": 7, "temperature": 1.0,
             "top_p": 0.95, "ignore_eos": True}
    others = [{"prompt": p * (k + 1), "max_tokens": 20 + 7 * k, "seed": 100 + k,
               "temperature": 0.8, "ignore_eos": True}
              for k, p in enumerate(PROMPTS + PROMPTS[:3])]
    q = mtq.Queue(qname, redis_url, settings=FAST)
    w = worker(lm_path, qname, redis_url, cls=_slow_class())
    model: Any = w.model
    with serving(w) as run:
        alone = q.submit(probe).result(timeout=30)
        # the probe joins a running batch of seven (continuous batching) while they decode
        tasks = q.submit_many(others)
        wait_for(lambda: all(q.redis.llen(q.broker.keys.out(t.id)) >= 3 for t in tasks), 30,
                 "the seven did not start")
        tasks.append(q.submit(probe))
        batched = [t.result(timeout=60) for t in tasks]
        run.stop()
    assert batched[-1] == alone
    # it did run with others, joining after they had started
    ran = [k for k, step in enumerate(model.steps) if tasks[-1].id in step]
    assert max(len(model.steps[k]) for k in ran) > 1, [model.steps[k] for k in ran]
    assert ran[0] > next(k for k, step in enumerate(model.steps) if tasks[0].id in step)
    assert alone["usage"]["completion_tokens"] == 40
    assert generate(lm, [probe])[0] == alone  # without a queue: the same
    assert len({x["text"] for x in batched}) == len(batched)


@pytest.mark.slow  # ~15-35 s here: three processes import torch (worker, standby, quarantine)
@pytest.mark.timeout(120)
def test_a_worker_killed_mid_generation_restarts_and_the_client_gets_the_whole_text(
        qname: str, redis_url: str, r: redis.Redis, subprocess_env: dict[str, str],
        tmp_path: Path, lm_path: Path, lm: Any) -> None:
    payload = {"prompt": "Once upon a time", "max_tokens": 220, "seed": 11, "temperature": 1.0,
               "ignore_eos": True}
    log = tmp_path / "supervisor.log"
    env = {**subprocess_env, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as out:
        sup = subprocess.Popen(
            [sys.executable, "-m", "mtq", "workers", "start", "hf:CausalLM", "--queue", qname,
             "--redis", redis_url, "--devices", "cpu", "--replicas", "1", "--lease-ms", "1500",
             "--set", f"model={lm_path}", "--set", "dtype=float64"],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def output() -> str:
            return log.read_text(errors="replace")[-4000:]

        def one_worker() -> list[dict[str, Any]]:
            assert sup.poll() is None, f"the supervisor exited:\n{output()}"
            return [w for w in list_workers(r, qname) if Path(f"/proc/{w['pid']}").exists()]

        (first,) = wait_for(one_worker, 60, "the supervisor's worker did not register")
        q = mtq.Queue(qname, redis_url, lease_ms=1500)
        t = q.submit(payload)
        events: list[mtq.Event] = []
        for ev in t.events(timeout=60):
            events.append(ev)
            if ev.kind == "token" and ev.index == 3:
                os.kill(first["pid"], signal.SIGKILL)
        kinds = [e.kind for e in events]
        assert kinds[-1] == "succeeded", (kinds, output())
        restarted = [k for k, e in enumerate(events) if e.kind == "restarted"]
        assert len(restarted) == 1, kinds
        before = [e for e in events[:restarted[0]] if e.kind == "token"]
        assert 4 <= len(before) < 220, len(before)  # killed mid-generation
        streamed = "".join(tokens_of(events))  # each index once, in order
        result = t.result(timeout=5)
        (uninterrupted,) = generate(lm, [payload])
        assert streamed == result["text"] == uninterrupted["text"]
        assert result == uninterrupted
        assert t.info().deliveries == 2
    finally:
        try:
            os.killpg(sup.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        sup.wait(10)


# -- the examples --------------------------------------------------------------------------
def test_the_fastapi_chat_page_served_by_hf_causal_lm(
        qname: str, redis_url: str, lm_path: Path, hf: Any, tmp_path: Path) -> None:
    """examples/web/fastapi_chat.py under uvicorn with MTQ_CHAT_MESSAGES=1: the page's
    POST /chat goes to hf:CausalLM as a chat message, and its event stream carries the
    text pieces, then the result whose text they make."""
    import httpx

    from tests.support.processes import free_port
    from tests.support.web import Stream, events

    port = free_port()
    env = {**os.environ, "MTQ_REDIS_URL": redis_url, "MTQ_QUEUE": qname,
           "MTQ_CHAT_MESSAGES": "1"}
    log = tmp_path / "uvicorn.log"
    with open(log, "wb") as out:
        web = subprocess.Popen([sys.executable, "-m", "uvicorn", "examples.web.fastapi_chat:app",
                                "--host", "127.0.0.1", "--port", str(port), "--log-level",
                                "warning"], env=env, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert web.poll() is None, log.read_text(errors="replace")
        try:
            return httpx.get(base + "/", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for(up, 30, "the chat app did not answer")
        with serving(worker(lm_path, qname, redis_url)) as running, httpx.Client(
                base_url=base, timeout=30) as http:
            r = http.post("/chat", json={"prompt": "Say hello.", "max_tokens": 12})
            assert r.status_code == 202, r.text
            got = Stream()
            with http.stream("GET", r.json()["events"]) as resp:
                for ev in events(resp):
                    got.events.append(ev)
                    if ev.event == "done":
                        break
            running.stop()
    finally:
        web.terminate()
        web.wait(10)
    done = got.of("done")[0].json()
    assert done["status"] == "succeeded", done
    pieces = [tok for _, tok in got.tokens()]
    assert len(pieces) == 12 or done["result"]["finish_reason"] == "stop"
    assert "".join(pieces) == done["result"]["text"]
    chat = hf[1].apply_chat_template([{"role": "user", "content": "Say hello."}],
                                     tokenize=False, add_generation_prompt=True)
    assert done["result"]["usage"]["prompt_tokens"] == len(
        hf[1](chat, add_special_tokens=False)["input_ids"])


@pytest.mark.slow  # ~10 s: a supervisor and its worker start
def test_the_terminal_chat_example(redis_url: str, lm_path: Path,
                                   subprocess_env: dict[str, str]) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "examples.hf_chat", str(lm_path), "--prompt", "Say hello.",
         "--max-tokens", "9", "--seed", "3", "--redis", redis_url],
        env={**subprocess_env, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
        timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    # the reply streamed after the prompt, then its end: 9 tokens, or fewer at an EOS
    assert re.fullmatch(r"model> .*\n\[(length, 9|stop, [1-9]) tokens\]\n", out.stdout,
                        re.DOTALL), out.stdout


# -- on the device -------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(DEVICE.startswith("cuda") and devices.cuda_count() == 0,
                    reason="needs a CUDA device")
def test_bfloat16_on_the_device(qname: str, redis_url: str, lm_path: Path) -> None:
    """The backend on the device in bfloat16: a batch served through a worker completes,
    each stream equal to its result; a greedy request's every token is among the 3 most
    likely of transformers' own forward pass (bfloat16, the same device) over its text."""
    import torch
    from transformers import AutoModelForCausalLM

    from mtq.backends.hf.causal import CausalLM

    q = mtq.Queue(qname, redis_url, settings=FAST)
    model = CausalLM().set_options(model=str(lm_path), dtype="bfloat16")
    w = Worker(model, qname, url=redis_url, settings=FAST, device=DEVICE)
    payloads = [{"prompt": p, "max_tokens": 16 + 4 * k, "seed": k, "temperature": 0.9,
                 "top_p": 0.9, "ignore_eos": True} for k, p in enumerate(PROMPTS * 2)]
    with serving(w) as running:
        tasks = q.submit_many(payloads)
        readers = [Reader(lambda t=t: t.tokens(timeout=60)) for t in tasks]  # type: ignore[misc]
        results = [t.result(timeout=60) for t in tasks]
        running.stop()
    assert model.lm.dtype == torch.bfloat16 and model.device.type == torch.device(DEVICE).type
    for k, (res, reader) in enumerate(zip(results, readers)):
        assert res["usage"]["completion_tokens"] == 16 + 4 * k
        assert "".join(reader.join(60)) == res["text"]
    ((res, new),) = drive(model, [{"prompt": PROMPTS[3], "max_tokens": 24, "temperature": 0,
                                 "ignore_eos": True}])
    assert len(new) == 24
    ref = AutoModelForCausalLM.from_pretrained(lm_path, dtype=torch.bfloat16).to(model.device)
    ids = list(model.tokenizer(PROMPTS[3])["input_ids"])
    with torch.inference_mode():
        logits = ref(torch.tensor([ids + new], device=model.device)).logits[0, len(ids) - 1:-1]
    ranks = [int((logits[j] > logits[j, t]).sum()) for j, t in enumerate(new)]
    assert max(ranks) < 3, ranks


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "error")
    yield


def _tight_class(most: int) -> Any:
    """hf:CausalLM on a device that holds the KV cache of ``most`` decoding requests:
    the second decoder layer raises the real torch.OutOfMemoryError for a larger
    decode batch, after the first layer has appended to the cache."""
    from mtq.backends.hf.causal import CausalLM

    class Tight(CausalLM):
        def setup(self, device: Any = "cpu") -> None:
            import torch

            super().setup(device)
            self.ooms = 0
            self.decoded: list[int] = []

            def hook(_module: Any, args: Any, kwargs: Any) -> None:
                hidden = args[0] if args else kwargs["hidden_states"]
                if hidden.shape[1] == 1 and hidden.shape[0] > most:  # a decode step
                    self.ooms += 1
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate "
                                                 "2.00 MiB (the test's device)")

            self.lm.model.layers[1].register_forward_pre_hook(hook, with_kwargs=True)

        def decode(self, requests: list[mtq.Generation]) -> list[Any]:
            self.decoded.append(len(requests))
            return super().decode(requests)

    return Tight


def test_out_of_memory_in_decode_sheds_requests_and_every_text_is_whole(
        qname: str, redis_url: str, lm_path: Path, lm: Any) -> None:
    payloads = [{"prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
                for p in PROMPTS + PROMPTS[:2]]
    want = generate(lm, payloads)  # without a queue, no memory limit
    q = mtq.Queue(qname, redis_url, settings=FAST)
    w = worker(lm_path, qname, redis_url, cls=_tight_class(3), max_running=6)
    model: Any = w.model
    with serving(w) as run:
        tasks = q.submit_many(payloads)
        got = [t.result(timeout=60) for t in tasks]
        infos = [t.info() for t in tasks]
        run.stop()
    assert got == want  # the cache was cut back after the failed forward: no token lost
    assert model.ooms >= 1, model.decoded
    assert max(model.decoded[model.decoded.index(max(model.decoded)) + 1:]) <= 3
    assert all(i.deliveries <= 2 and i.attempts == 0 for i in infos), \
        [(i.deliveries, i.attempts) for i in infos]


def _drive(model: Any, payloads: list[dict[str, Any]], fail: Any) -> list[Any]:
    """Run ``payloads`` through ``model``'s prefill and decode as the engine does, one
    decode step after another; ``fail(step, running)`` may raise the real
    torch.OutOfMemoryError, after which the step is run again (the engine's retry)."""
    import torch

    gens = [mtq.Generation(f"t{i}", p) for i, p in enumerate(payloads)]
    for g in gens:
        model.admit(g)
    model.prefill(gens)
    step = 0
    while running := [g for g in gens if not g.finished]:
        step += 1
        try:
            fail(step, running)
            model.decode(running)
        except torch.OutOfMemoryError:
            continue
        model.release([g for g in running if g.finished])
    return [model.result(g) for g in gens]


def test_a_step_that_runs_out_of_memory_after_its_forward_leaves_every_request_as_it_was(
        lm_path: Path, lm: Any) -> None:
    """Out of memory in sampling, after the forward appended to the cache and before
    the tokens are taken: the step run again gives the tokens of a run without it
    (the cache cut back, each request's generator before its draw)."""
    import torch

    from mtq.backends.hf.causal import CausalLM

    payloads = [{"prompt": p, "max_tokens": 12, "seed": 3 + k, "temperature": 0.9,
                 "ignore_eos": True} for k, p in enumerate(PROMPTS)]
    want = generate(lm, payloads)

    class Picky(CausalLM):
        fails = 0

        def _pick(self, logits: Any, states: list[Any]) -> list[int]:
            tokens = super()._pick(logits, states)  # (each generator drew once)
            if logits.shape[0] == len(PROMPTS) and self.fails < 2 and len(states[0].token_ids) in (3, 7):
                self.fails += 1
                raise torch.OutOfMemoryError("CUDA out of memory (the test's sampling)")
            return tokens

    model = Picky().set_options(model=str(lm_path), dtype="float64")
    model.setup("cpu")
    assert _drive(model, payloads, lambda step, running: None) == want
    assert model.fails == 2


def test_a_release_that_runs_out_of_memory_takes_its_rows_out_at_the_next_step(
        lm_path: Path, lm: Any) -> None:
    """Cutting released requests out of the batch's cache runs out of memory: the rows
    stay until the next decode takes them out, and the others' tokens are unharmed."""
    import torch

    from mtq.backends.hf.causal import CausalLM

    payloads = [{"prompt": p, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
                for p in PROMPTS]
    want = generate(lm, payloads[1:])
    model = CausalLM().set_options(model=str(lm_path), dtype="float64")
    model.setup("cpu")
    gens = [mtq.Generation(f"t{i}", p) for i, p in enumerate(payloads)]
    for g in gens:
        model.admit(g)
    model.prefill(gens)
    model.decode(gens)
    keep = model.batch.keep

    def tight(rows: Any) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory (the test's release)")

    model.batch.keep = tight  # the first request is shed; cutting its row fails
    with pytest.raises(torch.OutOfMemoryError):
        model.release(gens[:1])
    model.batch.keep = keep
    rest = gens[1:]
    while running := [g for g in rest if not g.finished]:
        model.decode(running)
        model.release([g for g in running if g.finished])
    assert [model.result(g) for g in rest] == want
    assert len(model.rows) == 0 and len(model.batch) == 0
