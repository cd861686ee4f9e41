"""The reference generator (mtq.reference): tokenizer, KV cache, batch-invariant
seeded sampling, slots, payload checks, the weights files (random and the shipped
trained ones) and the training code. No Redis; a small config keeps most of it
fast on CPU."""

from __future__ import annotations

import fnmatch
import math
import os
import random
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import mtq  # noqa: E402
from mtq.errors import ConfigError  # noqa: E402
from mtq.reference import gpt, train  # noqa: E402
from mtq.reference import weights as weights_mod  # noqa: E402
from mtq.reference.gpt import GPTConfig, TinyGPT, decode_rate, generate  # noqa: E402
from mtq.reference.tokenizer import (  # noqa: E402
    BOS,
    EOS,
    VOCAB_SIZE,
    StreamDecoder,
    decode,
    encode,
)

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
SMALL = GPTConfig(d_model=32, n_layer=2, n_head=2, max_seq=96)


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gpt.make_weights(tmp_path_factory.mktemp("w") / "small.pt", SMALL)


@pytest.fixture
def model(weights: Path) -> TinyGPT:
    m = TinyGPT(SMALL, weights)
    m.setup("cpu")
    return m


def request(i: int | str, prompt: str = "hi", seed: int = 0, **kw: Any) -> mtq.Generation:
    return mtq.Generation(f"r{i}", {"prompt": prompt, **kw}, seed)


def step(fn: Callable[[list[mtq.Generation]], Any], reqs: list[mtq.Generation]) -> list[Any]:
    """Call prefill/decode and append the tokens afterwards, as the engine does."""
    out = fn(reqs)
    for r, t in zip(reqs, out):
        r.tokens.append(t)
    return out


def ids(r: mtq.Generation) -> list[int]:
    return list(r.state.token_ids)


# -- tokenizer ---------------------------------------------------------------------


def test_tokenizer_round_trip_and_split_characters() -> None:
    text = "héllo wörld € 😀 ok"
    assert decode(encode(text)) == text
    assert all(0 <= t < 256 for t in encode(text)) and VOCAB_SIZE == 258
    assert decode([BOS, *encode("a"), EOS]) == "a"
    sd = StreamDecoder()
    pieces = [sd.push(t) for t in encode("😀")]
    assert pieces == ["", "", "", "😀"]  # held back until the character is whole
    sd = StreamDecoder()
    assert "".join(sd.push(t) for t in [BOS, *encode(text), EOS]) + sd.flush() == text
    sd = StreamDecoder()
    assert sd.push(0xE2) == "" and sd.flush() == "\ufffd"  # a cut character is replaced
    rng = random.Random(0)
    for _ in range(300):
        seq = [rng.choice([0x41, 0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0x80, 0xFF, BOS, EOS])
               for _ in range(rng.randint(0, 10))]
        sd = StreamDecoder()
        assert "".join(sd.push(t) for t in seq) + sd.flush() == decode(seq)
    with pytest.raises(ValueError):
        decode([258])


# -- the model ---------------------------------------------------------------------


def test_kv_cache_decode_matches_full_recompute(model: TinyGPT,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    reqs = [request(i, "x" * n, seed=i, max_tokens=20, stop_at_eos=False)
            for i, n in enumerate([0, 5, 17])]
    for r in reqs:
        model.admit(r)
    step(model.prefill, reqs)
    for j, r in enumerate(reqs):
        full = model.forward_full(r.state.prompt_ids)[-1]
        assert torch.allclose(model.last_logits[j], full, rtol=0, atol=1e-9)
    full_forward = model.forward_full
    monkeypatch.setattr(model, "forward_full", lambda *a, **k: pytest.fail("decode recomputed"))
    # in slot order, out of order, and subsets leaving holes in the slot range
    for order in [[0, 1, 2], [2, 0, 1], [1, 2, 0], [2, 0], [0], [2], [1, 0, 2]] * 2:
        batch = [reqs[i] for i in order]
        seqs = [r.state.prompt_ids + ids(r) for r in batch]
        step(model.decode, batch)
        for j, seq in enumerate(seqs):
            full = full_forward(seq)[-1]
            assert torch.allclose(model.last_logits[j], full, rtol=0, atol=1e-9)
    # the cache is really read: spoil request 1's keys and its logits change
    before = full_forward(reqs[1].state.prompt_ids + ids(reqs[1]))[-1]
    for k in model.k_pool:
        k[reqs[1].state.slot].normal_()
    model.decode(reqs)
    assert not torch.allclose(model.last_logits[1], before, rtol=0, atol=1e-3)
    model.release(reqs)


PROMPTS = ["", "Hello", "The quick brown fox jumps", "é😀€", "a" * 40, "Once upon a time"]


def test_same_seed_same_tokens_alone_or_batched_in_any_order(model: TinyGPT) -> None:
    payloads = [{"prompt": p, "max_tokens": 24} for p in PROMPTS]
    seeds = [11, 22, 33, 44, 55, 66]
    alone = [generate(model, [p], [s])[0] for p, s in zip(payloads, seeds)]
    assert generate(model, payloads, seeds) == alone
    order = [3, 0, 5, 1, 4, 2]
    shuffled = generate(model, [payloads[i] for i in order], [seeds[i] for i in order])
    assert shuffled == [alone[i] for i in order]
    assert {r["finish_reason"] for r in alone} <= {"stop", "length"}


def test_same_tokens_when_others_join_midway(model: TinyGPT) -> None:
    def solo(i: int, prompt: str) -> list[int]:
        out = generate(model, [{"prompt": prompt, "max_tokens": 20, "stop_at_eos": False}], [i])
        return list(out[0]["tokens"])

    a, b, c = (request(i, p, seed=i, max_tokens=20, stop_at_eos=False)
               for i, p in enumerate(["Alpha", "b", "Gamma ray burst"]))
    for r in (a, b, c):
        model.admit(r)
    step(model.prefill, [a])
    for _ in range(3):
        step(model.decode, [a])
    step(model.prefill, [b])
    for _ in range(2):
        step(model.decode, [a, b])
    step(model.prefill, [c])
    running = [c, a, b]  # any order
    while running:
        step(model.decode, running)
        model.release([r for r in running if r.finished])
        running = [r for r in running if not r.finished]
    assert ids(a) == solo(0, "Alpha") and ids(b) == solo(1, "b")
    assert ids(c) == solo(2, "Gamma ray burst")
    assert a.tokens == a.state.pieces and all(isinstance(t, str) for t in a.tokens)


def test_seeds_matter_and_greedy_is_deterministic(model: TinyGPT) -> None:
    p = {"prompt": "seed test", "max_tokens": 16, "stop_at_eos": False}
    first, second, again = generate(model, [p, p, p], [1, 2, 1])
    assert first == again and first["tokens"] != second["tokens"]
    g = {**p, "temperature": 0}
    greedy = generate(model, [g, g, {**g, "top_k": 3}], [1, 2, 3])
    assert greedy[0] == greedy[1] == greedy[2]
    seq = [BOS, *encode("seed test")]
    for t in greedy[0]["tokens"]:  # each token is the argmax of a full recompute
        assert t == int(model.forward_full(seq)[-1].argmax())
        seq.append(t)
    top1 = generate(model, [{**p, "top_k": 1}], [9])[0]
    assert top1["tokens"] == greedy[0]["tokens"]


def test_tokens_result_and_finish(model: TinyGPT, monkeypatch: pytest.MonkeyPatch) -> None:
    r = request("one", "héllo", max_tokens=1)
    model.admit(r)
    assert (r.prompt_tokens, r.max_tokens) == (len("héllo".encode()) + 1, 1)
    step(model.prefill, [r])
    assert r.finished and model.result(r)["finish_reason"] == "length"
    res = model.result(r)
    assert res == {"text": r.tokens[0], "tokens": res["tokens"], "finish_reason": "length",
                   "prompt_tokens": 7} and len(res["tokens"]) == 1
    model.release([r])
    # multi-byte output: the streamed pieces add up to the result text
    out = generate(model, [{"prompt": "x", "max_tokens": 30, "temperature": 5.0}], [4])[0]
    assert out["text"] == decode(out["tokens"])
    # EOS: emitted as "" and the request finishes in the same call
    real = model._sample
    monkeypatch.setattr(model, "_sample", lambda lg, st: [EOS if len(s.token_ids) == 2 else t
                                                          for s, t in zip(st, real(lg, st))])
    r = request("eos", "abc", max_tokens=10)
    model.admit(r)
    step(model.prefill, [r])
    step(model.decode, [r])
    assert not r.finished
    assert step(model.decode, [r]) == [""] and r.finished
    assert model.result(r)["finish_reason"] == "stop" and model.result(r)["tokens"][-1] == EOS
    model.release([r])
    r = request("noeos", "abc", max_tokens=4, stop_at_eos=False)
    model.admit(r)
    step(model.prefill, [r])
    while not r.finished:
        step(model.decode, [r])
    assert EOS in ids(r) and model.result(r)["finish_reason"] == "length" and len(ids(r)) == 4
    model.release([r])


def test_release_frees_slots(weights: Path) -> None:
    class Two(TinyGPT):
        max_running = 2

    m = Two(SMALL, weights)
    m.setup("cpu")
    payloads = [{"prompt": "p" * i, "max_tokens": 6 + i, "stop_at_eos": False} for i in range(5)]
    reqs = [mtq.Generation(f"t{i}", p, i) for i, p in enumerate(payloads)]
    for r in reqs:
        m.admit(r)
    m.release([mtq.Generation("never", {"prompt": ""})])  # no state at all: a no-op
    m.release(reqs[4:])  # admitted, never prefilled
    running: list[mtq.Generation] = []
    waiting = list(reqs)
    while waiting or running:
        while waiting and len(running) < 2:
            step(m.prefill, [waiting[0]])
            running.append(waiting.pop(0))
        if waiting:
            with pytest.raises(RuntimeError, match="slots are in use"):
                m.prefill([waiting[0]])
            waiting[0].state.slot = None
        step(m.decode, running)
        done = [r for r in running if r.finished]
        m.release(done)
        m.release(done)  # twice is harmless
        running = [r for r in running if not r.finished]
    assert m.used == 0
    # slots were compacted while others ran: the outputs are those of solo runs
    for r, p, i in zip(reqs, payloads, range(5)):
        assert m.result(r) == generate(m, [p], [i])[0]


def test_prefill_again_restarts_the_request(model: TinyGPT) -> None:
    """The engine bisects a failed prefill: a request may be prefilled twice."""
    r = request("again", "bisect me", max_tokens=5)
    model.admit(r)
    first = model.prefill([r])
    slot = r.state.slot
    assert model.prefill([r]) == first and r.state.slot == slot and model.used == 1
    assert len(r.state.token_ids) == 1
    model.release([r])
    assert model.used == 0


@pytest.mark.parametrize("payload, match", [
    (["hi"], "dict"),
    ({"text": "hi"}, "'prompt'"),
    ({"prompt": 3}, "'prompt'"),
    ({"prompt": "hi", "max_token": 3}, "unknown payload keys"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "9"}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 95}, "max_seq"),
    ({"prompt": "x" * 90, "max_tokens": 10}, "prompt of at most"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "temperature": float("nan")}, "temperature"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "top_k": 0}, "top_k"),
    ({"prompt": "hi", "top_k": 2.5}, "top_k"),
    ({"prompt": "hi", "seed": "s"}, "seed"),
    ({"prompt": "hi", "stop_at_eos": 1}, "stop_at_eos"),
])
def test_bad_payloads_fail_permanently(model: TinyGPT, payload: Any, match: str) -> None:
    with pytest.raises(mtq.PermanentError, match=match):
        model.admit(mtq.Generation("bad", payload, 0))


def test_edge_payloads_are_accepted(model: TinyGPT) -> None:
    ok = [{"prompt": ""}, {"prompt": "x" * 60, "max_tokens": 34, "temperature": 1, "top_k": 500,
                          "seed": -5, "stop_at_eos": False}]
    out = generate(model, ok, [None, None])
    assert out[0]["prompt_tokens"] == 1 and len(out[1]["tokens"]) == 34


# -- weights -----------------------------------------------------------------------


def test_weights_file_created_once_and_reloaded(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MTQ_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(gpt.WEIGHTS_ENV, raising=False)
    path = gpt.weights_path(SMALL)
    assert path.parent == tmp_path / "home" / "reference"
    assert path.name == f"tinygpt-{SMALL.digest()}-seed0.pt"
    assert SMALL.digest() != GPTConfig().digest()
    rng = torch.random.get_rng_state()
    m1 = TinyGPT(SMALL)
    m1.setup("cpu")
    assert torch.equal(rng, torch.random.get_rng_state()), "the global RNG was used"
    assert path.exists() and list(path.parent.iterdir()) == [path]  # no temp file left
    stamp = path.stat().st_mtime_ns
    m2 = TinyGPT(SMALL)
    m2.setup("cpu")
    assert path.stat().st_mtime_ns == stamp
    p = [{"prompt": "same weights", "max_tokens": 10}]
    assert generate(m1, p, [3]) == generate(m2, p, [3])
    # the environment variable wins, read at setup
    other = tmp_path / "elsewhere" / "w.pt"
    monkeypatch.setenv(gpt.WEIGHTS_ENV, str(other))
    m3 = TinyGPT(SMALL)
    m3.setup("cpu")
    assert other.exists() and generate(m3, p, [3]) == generate(m1, p, [3])
    assert gpt.make_weights(tmp_path / "s1.pt", SMALL, seed=1).exists()
    m4 = TinyGPT(SMALL, tmp_path / "s1.pt")
    m4.setup("cpu")
    assert generate(m4, p, [3]) != generate(m1, p, [3])


def test_corrupt_or_mismatched_weights_say_to_delete(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="delete") as info:
        TinyGPT(SMALL, bad).setup("cpu")
    assert str(bad) in str(info.value)
    wrong = gpt.make_weights(tmp_path / "wrong.pt", GPTConfig(d_model=16, n_layer=1, n_head=2,
                                                               max_seq=32))
    with pytest.raises(ConfigError, match="does not match") as info:
        TinyGPT(SMALL, wrong).setup("cpu")
    assert str(wrong) in str(info.value) and "delete" in str(info.value)


def test_imports_without_torch() -> None:
    code = ("import sys; sys.modules['torch'] = None\n"
            "import mtq.reference, mtq.reference.gpt, mtq.reference.tokenizer\n"
            "from mtq.reference.gpt import TinyGPT, GPTConfig\n"
            "m = TinyGPT(); m.admit(__import__('mtq').Generation('t', {'prompt': 'hi'}))\n"
            "print(GPTConfig().digest(), m.describe())")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "tinygpt" in proc.stdout


def test_decode_rate_runs(model: TinyGPT) -> None:
    assert decode_rate(model, 4, 5) > 0
    assert model.used == 0


# -- the shipped trained weights ---------------------------------------------------

COMMON = {"the", "and", "of", "to", "a", "her", "was", "in", "i", "it", "not", "be", "he",
          "she", "had", "that", "you", "his", "with", "for", "as", "is", "my", "at", "but"}


def nll(model: TinyGPT, text: str) -> float:
    """Mean negative log-likelihood (nats per byte) of ``text`` after BOS."""
    ids = [BOS, *encode(text)]
    logp = model.forward_full(ids).log_softmax(-1)
    return -float(logp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).mean())


@pytest.fixture(scope="module")
def trained() -> TinyGPT:
    m = TinyGPT()
    m.setup("cpu")
    return m


def test_the_default_model_loads_the_shipped_weights_and_writes_english(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trained: TinyGPT) -> None:
    monkeypatch.setenv("MTQ_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(gpt.WEIGHTS_ENV, raising=False)
    assert gpt.TRAINED_WEIGHTS.is_file() and gpt.TRAINED_WEIGHTS.stat().st_size < 600_000
    m = TinyGPT()
    assert m.config == GPTConfig() and m.weights_file() == gpt.TRAINED_WEIGHTS
    m.setup("cpu")
    assert not (tmp_path / "home").exists(), "the shipped weights need no file of their own"
    prompts = ["Once upon a time", "Hello there", "Tell me a story", "She said"]
    payloads = [{"prompt": p, "max_tokens": 64, "stop_at_eos": False} for p in prompts]
    seeds = [1, 2, 3, 4]
    alone = [generate(m, [p], [s])[0] for p, s in zip(payloads, seeds)]
    assert generate(m, payloads, seeds) == alone  # batched: the same tokens
    assert generate(trained, payloads[::-1], seeds[::-1]) == alone[::-1]
    assert generate(m, payloads[:1], [5]) != alone[:1]  # the seed matters
    text = "".join(r["text"] for r in alone)
    assert all(len(r["tokens"]) == 64 for r in alone) and len(text) >= 4 * 56
    assert "\ufffd" not in text
    plain = sum(c.isascii() and (c.isalnum() or c in " \n.,;:!?'\"-()") for c in text)
    assert plain >= 0.95 * len(text), text
    words = re.findall(r"[a-z]+", text.lower())
    vocab = set(re.findall(r"[a-z]+", train.CORPUS.read_text().lower()))
    assert len(words) >= 32, text
    assert sum(w in vocab for w in words) >= 0.8 * len(words), text  # real words
    assert sum(w in COMMON for w in words) >= 0.2 * len(words), text  # English ones
    # it predicts English it never saw far better than chance (ln 258 = 5.55 nats)
    assert nll(m, "It was a fine morning, and the young ladies walked to the village.") < 2.2


def test_random_weights_stay_available(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       trained: TinyGPT) -> None:
    monkeypatch.setenv("MTQ_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(gpt.WEIGHTS_ENV, raising=False)
    rnd = TinyGPT(weights="random")
    rnd.setup("cpu")
    path = gpt.random_weights_path(GPTConfig())
    assert rnd.weights_file() == path and path.exists()
    assert path.parent == tmp_path / "home" / "reference"
    sentence = "It was a fine morning, and the young ladies walked to the village."
    assert nll(rnd, sentence) > 5.0 > 2.2 > nll(trained, sentence)
    p = [{"prompt": "Once upon a time", "max_tokens": 24, "stop_at_eos": False}]
    assert generate(rnd, p, [3]) != generate(trained, p, [3])
    # the environment asks for them too, for workers built with no arguments
    monkeypatch.setenv(gpt.WEIGHTS_ENV, "random")
    env_random = TinyGPT()
    env_random.setup("cpu")
    assert env_random.weights_file() == path and generate(env_random, p, [3]) == generate(rnd, p, [3])
    # another seed, other random weights
    other = TinyGPT(weights="random", weights_seed=1)
    other.setup("cpu")
    assert generate(other, p, [3]) != generate(rnd, p, [3])


def test_missing_shipped_weights_say_to_reinstall(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gpt.WEIGHTS_ENV, raising=False)
    missing = tmp_path / "data" / "tinygpt-austen.pt"
    monkeypatch.setattr(weights_mod, "TRAINED_WEIGHTS", missing)
    monkeypatch.setattr(gpt, "TRAINED_WEIGHTS", missing)
    with pytest.raises(ConfigError, match="reinstall mtq") as info:
        TinyGPT().setup("cpu")
    assert str(missing) in str(info.value) and "random" in str(info.value)
    assert not missing.exists()  # not replaced by random weights behind the user's back


def test_the_weights_file_ships_in_the_wheel() -> None:
    tomllib = pytest.importorskip("tomllib")
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = conf["tool"]["setuptools"]["package-data"]["mtq.reference"]
    rel = gpt.TRAINED_WEIGHTS.relative_to(ROOT / "mtq" / "reference").as_posix()
    assert any(fnmatch.fnmatch(rel, pat) for pat in patterns), (rel, patterns)


def test_training_lowers_the_loss_and_matches_the_served_forward(tmp_path: Path) -> None:
    """A few steps of :mod:`mtq.reference.train` on a small shape: the loss falls, the
    saved float16 file loads into TinyGPT, whose forward is the training forward."""
    text = train.CORPUS.read_text()[:60_000]
    assert len(train.paragraphs(text)) > 50
    assert [train.window(i, 64) for i in range(1, 9)] == [16, 32, 64, 16] * 2
    module, stats = train.train(text, SMALL, steps=30, batch=4, seq=64, lr=1e-2, log=None)
    assert stats["train_loss"] < 4.0 < math.log(VOCAB_SIZE), stats  # chance: ln 258 = 5.55
    path = train.save_half(module, tmp_path / "w.pt")
    m = TinyGPT(SMALL, path)
    m.setup("cpu")
    ids = [BOS, *encode("It is a truth universally acknowledged")]
    saved = weights_mod.build_module(SMALL)
    saved.load_state_dict(torch.load(path, weights_only=True), assign=True)
    assert next(saved.parameters()).dtype == torch.float16
    ref = train.forward(saved.double(), SMALL, torch.tensor([ids]))[0]
    assert torch.allclose(m.forward_full(ids), ref, rtol=0, atol=1e-9)
