"""hf:Embedder and hf:CrossEncoder (mtq.backends.hf.encoders) served by real workers
against the session's redis-server, with tiny models built here (tests/hf_models.py)
and loaded by path: results against the same model called directly, pooling,
truncation said in the result, reranking order, batching across requests, bad
payloads failing alone with BadRequest, options on the command line, costs.

The ``cuda`` test runs both in bfloat16 on ``MTQ_TEST_CUDA_DEVICE`` (default
cuda:0; scripts/gpu-check runs it, its dry run on the CPU).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

import mtq
from mtq.workers import devices
from tests import hf_models
from tests.support.paths import PY, ROOT
from tests.support.processes import kill_process, worker_process
from tests.support.workers import FAST, make_worker, serving

pytest.importorskip("transformers")

DEVICE = os.environ.get("MTQ_TEST_CUDA_DEVICE", "cuda:0")

TEXTS = ["hello world", "where is the nearest train station",
         "the quick brown fox jumps over the lazy dog " * 2, "paris", ""]
LONG = "the weather in oslo is cold and wet in november " * 12   # > 48 tokens


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def hf_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf-models")


@pytest.fixture(scope="session")
def encoder_path(hf_root: Path) -> str:
    return str(hf_models.encoder(hf_root))


@pytest.fixture(scope="session")
def reranker_path(hf_root: Path) -> str:
    return str(hf_models.reranker(hf_root))


class Direct:
    """The saved model called directly, one input at a time (no padding)."""

    def __init__(self, path: str, head: bool = False, device: str = "cpu") -> None:
        import torch
        from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(path)
        auto = AutoModelForSequenceClassification if head else AutoModel
        self.net = auto.from_pretrained(path, dtype=torch.float32).to(device).eval()
        self.device = device

    def hidden(self, text: str, max_length: int = hf_models.POSITIONS) -> Any:
        x = self.tok(text, truncation=True, max_length=max_length, return_tensors="pt")
        with self.torch.inference_mode():
            return self.net(**x.to(self.device)).last_hidden_state[0].float().cpu()

    def mean(self, text: str, max_length: int = hf_models.POSITIONS) -> list[float]:
        h = self.hidden(text, max_length).mean(0)
        return (h / h.norm()).tolist()

    def scores(self, query: str, passages: list[str]) -> list[float]:
        out = []
        for p in passages:
            x = self.tok(query, p, truncation=True, max_length=hf_models.POSITIONS,
                         return_tensors="pt")
            with self.torch.inference_mode():
                out.append(float(self.net(**x.to(self.device)).logits[0, 0]))
        return out


def close(a: list[float], b: list[float], tol: float = 1e-5) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b))


def served(r: redis.Redis, q: mtq.Queue) -> dict[str, float]:
    """The cost charged per lane, as Redis holds it (what mtq.Costed settled)."""
    return {k.decode(): float(v) for k, v in r.hgetall(q.broker.keys.sched + "served").items()}


# -- the package -------------------------------------------------------------------------
def test_importing_the_hf_backends_imports_neither_torch_nor_transformers() -> None:
    code = ("import sys, mtq.backends.hf as hf; hf.Embedder, hf.CrossEncoder; "
            "from mtq.workers.target import check_options; "
            "check_options('hf:Embedder', {'model': 'x', 'pooling': 'cls'}); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


# -- hf:Embedder -------------------------------------------------------------------------
def test_embeddings_equal_the_model_called_directly_and_cost_their_tokens(
        qname: str, redis_url: str, r: redis.Redis, encoder_path: str) -> None:
    q = mtq.Queue(qname, redis_url, settings=FAST)
    tasks = q.submit_many([mtq.Request(t if i % 2 else {"text": t}, tenant="A", cost=1000)
                           for i, t in enumerate(TEXTS)])
    w = make_worker("hf:Embedder", qname, redis_url, options={"model": encoder_path})
    with serving(w):
        results = [t.result(timeout=60) for t in tasks]
    direct = Direct(encoder_path)
    for text, res in zip(TEXTS, results):
        # alone and unpadded there, in a padded batch here: the same vector
        assert close(res["embedding"], direct.mean(text)), text
        assert res["tokens"] == len(direct.tok(text)["input_ids"]) and not res["truncated"]
        assert abs(sum(x * x for x in res["embedding"]) - 1) < 1e-5
    assert len(results[0]["embedding"]) == 32
    # each task was charged its tokens (mtq.Costed), not its estimate of 1000
    assert served(r, q) == {"s:A": float(sum(res["tokens"] for res in results))}


def test_a_text_over_the_models_limit_is_truncated_and_the_result_says_so(
        qname: str, redis_url: str, encoder_path: str) -> None:
    q = mtq.Queue(qname, redis_url, settings=FAST)
    direct = Direct(encoder_path)
    assert len(direct.tok(LONG)["input_ids"]) > hf_models.POSITIONS
    # the tokenizer saves no limit: the config's max_position_embeddings is the limit
    assert direct.tok.model_max_length > 10**6
    short, long = q.submit_many(["paris", LONG])
    with serving(make_worker("hf:Embedder", qname, redis_url, options={"model": encoder_path})):
        a, b = short.result(timeout=60), long.result(timeout=60)
    assert (a["truncated"], b["truncated"]) == (False, True)
    assert b["tokens"] == hf_models.POSITIONS
    assert close(b["embedding"], direct.mean(LONG, hf_models.POSITIONS))

    q2 = mtq.Queue(qname + "-8", redis_url, settings=FAST)
    # 8 tokens exactly (6 words, [CLS], [SEP]) is not cut; 12 is
    just, at, over = q2.submit_many(["paris", "where is the nearest train station",
                                     "the weather in oslo is cold and wet in november"])
    with serving(make_worker("hf:Embedder", q2.name, redis_url,
                             options={"model": encoder_path, "max_length": "8"})):
        c, e, d = just.result(timeout=60), at.result(timeout=60), over.result(timeout=60)
    assert (c["tokens"], c["truncated"]) == (len(direct.tok("paris")["input_ids"]), False)
    assert c["tokens"] < 8
    assert (e["tokens"], e["truncated"]) == (8, False)
    assert (d["tokens"], d["truncated"]) == (8, True)
    assert close(d["embedding"], direct.mean("the weather in oslo is cold and wet in november", 8))


def test_a_max_length_out_of_the_models_range_fails_setup_naming_the_range(
        encoder_path: str, reranker_path: str) -> None:
    from mtq.backends.hf import CrossEncoder, Embedder

    model = Embedder().set_options(model=encoder_path, max_length=hf_models.POSITIONS + 1)
    with pytest.raises(mtq.ConfigError, match=f"give at most {hf_models.POSITIONS}"):
        model.setup("cpu")
    # [CLS] text [SEP]: 3 at least; [CLS] query [SEP] passage [SEP]: 5
    with pytest.raises(mtq.ConfigError, match="adds 2 special tokens to an input; give at "
                                              "least 3"):
        Embedder().set_options(model=encoder_path, max_length=2).setup("cpu")
    with pytest.raises(mtq.ConfigError, match="give at least 5"):
        CrossEncoder().set_options(model=reranker_path, max_length=4).setup("cpu")


def test_a_tokenizer_without_a_pad_token_pads_with_another_special_token(
        encoder_path: str) -> None:
    from transformers import AutoTokenizer

    from mtq.backends.hf.encoders import prepare_tokenizer

    tok = AutoTokenizer.from_pretrained(encoder_path)
    tok.pad_token = None
    tok.padding_side = "left"
    prepare_tokenizer(tok)
    assert (tok.pad_token, tok.padding_side) == ("[SEP]", "right")
    enc = tok(["paris", "where is the nearest train station"], padding=True)
    assert enc["input_ids"][0][-1] == tok.sep_token_id and enc["attention_mask"][0][-1] == 0


def test_bad_payloads_fail_alone_with_bad_request_while_their_batch_completes(
        qname: str, redis_url: str, encoder_path: str) -> None:
    from mtq.backends.hf import Embedder

    class Counted(Embedder):
        sizes: list[int] = []

        def predict(self, batch: list[Any]) -> list[Any]:
            self.sizes.append(len(batch))
            return super().predict(batch)

    payloads: list[Any] = ["paris", 3, {"text": "redis", "lang": "en"}, {"text": ["a"]},
                           {"text": "hello world"}, {"prompt": "x"}, b"raw bytes"]
    q = mtq.Queue(qname, redis_url, settings=FAST)
    tasks = q.submit_many(payloads)
    model = Counted().set_options(model=encoder_path)
    with serving(make_worker(model, qname, redis_url, max_wait_ms=300)):
        good = [tasks[0].result(timeout=60), tasks[4].result(timeout=60)]
        errors = {}
        for i in (1, 2, 3, 5, 6):
            with pytest.raises(mtq.TaskFailed) as failed:
                tasks[i].result(timeout=60)
            errors[i] = failed.value.error or ""
    assert model.sizes == [len(payloads)], "one batch, not bisected"
    direct = Direct(encoder_path)
    assert close(good[0]["embedding"], direct.mean("paris"))
    assert close(good[1]["embedding"], direct.mean("hello world"))
    assert all(e.startswith("BadRequest: ") for e in errors.values()), errors
    assert "got 3 (int)" in errors[1]
    assert "unknown field 'lang'" in errors[2]
    assert "'text' must be a string" in errors[3]
    assert "unknown field 'prompt'" in errors[5]
    assert "(bytes)" in errors[6]
    for i in errors:
        info = tasks[i].info()
        assert (info.status, info.attempts) == ("failed", 1), info  # no retry
    assert q.stats()["retried"] == 0


def test_cls_pooling_unnormalised_through_mtq_worker_run_with_set(
        qname: str, redis_url: str, subprocess_env: dict[str, str], encoder_path: str,
        tmp_path: Path) -> None:
    q = mtq.Queue(qname, redis_url, settings=FAST)
    tasks = q.submit_many(TEXTS[:3])
    with open(tmp_path / "worker.log", "wb") as log:
        proc = worker_process(["hf:Embedder", "-q", qname, "--set", f"model={encoder_path}",
                               "--set", "pooling=cls", "--set", "normalize=false"],
                              subprocess_env, log)
    try:
        results = [t.result(timeout=90) for t in tasks]
    except BaseException:
        print((tmp_path / "worker.log").read_text(errors="replace")[-3000:])
        raise
    finally:
        kill_process(proc)
    direct = Direct(encoder_path)
    for text, res in zip(TEXTS, results):
        assert close(res["embedding"], direct.hidden(text)[0].tolist()), text
    assert abs(sum(x * x for x in results[0]["embedding"]) - 1) > 1e-3  # not normalised


@pytest.mark.parametrize(("sets", "says", "lists"), [
    (["pooling=cls"], "option 'model' is required", True),
    (["model=M", "poolin=cls"], "has no option 'poolin'", True),
    (["model=M", "pooling=max"], "must be one of mean, cls; got 'max'", False),
    (["model=M", "max_length=0"], "must be >= 1", False),
    (["model=M", "normalize=maybe"], "takes true or false", False),
])
def test_bad_options_exit_2_before_anything_starts(sets: list[str], says: str, lists: bool,
                                                   subprocess_env: dict[str, str]) -> None:
    args = [a for s in sets for a in ("--set", s)]
    out = subprocess.run([PY, "-m", "mtq", "worker", "run", "hf:Embedder", "-q", "x", *args],
                         env=subprocess_env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert says in out.stderr, out.stderr
    if lists:  # an unknown or missing option: the error lists the ones there are
        assert "pooling (mean|cls, default 'mean')" in out.stderr, out.stderr


# -- hf:CrossEncoder ---------------------------------------------------------------------
QUERY = "where is the nearest train station"
PASSAGES = ["paris is the capital of france", "redis keeps its data in memory",
            "a cat sat on the mat", "gpus run matrix multiplications very fast",
            "berlin has many museums and a large park"]


def test_reranking_matches_the_model_called_directly_across_a_batch(
        qname: str, redis_url: str, r: redis.Redis, reranker_path: str) -> None:
    from mtq.backends.hf import CrossEncoder

    class Passes(CrossEncoder):
        passes: list[int] = []

        def _pass(self, queries: list[str], passages: list[str]) -> Any:
            self.passes.append(len(queries))
            return super()._pass(queries, passages)

    requests: list[dict[str, Any]] = [
        {"query": QUERY, "passages": PASSAGES},
        {"query": "how do I reset my password", "passages": [*PASSAGES[:3], LONG], "top_n": 2},
        {"query": "paris", "passages": []},
        {"query": "paris", "passages": ["paris", 7]},
        {"query": "paris", "passages": ["paris"], "k": 3},
        {"query": "embeddings", "passages": [PASSAGES[2]]},
        {"query": "paris", "passages": ["paris"] * 6},
    ]
    q = mtq.Queue(qname, redis_url, settings=FAST)
    # the good ones as tenant A, charged 1000 each until their tokens settle it
    tasks = q.submit_many([mtq.Request(p, tenant="B" if i in (3, 4, 6) else "A", cost=1000)
                           for i, p in enumerate(requests)])
    model = Passes().set_options(model=reranker_path, max_pairs=3, max_passages=5)
    with serving(make_worker(model, qname, redis_url, max_wait_ms=300)):
        a, b, empty, _, _, f, _ = (t.result(timeout=60) if i not in (3, 4, 6) else None
                                   for i, t in enumerate(tasks))
        with pytest.raises(mtq.TaskFailed, match="BadRequest: passage 1 must be a string"):
            tasks[3].result(timeout=60)
        with pytest.raises(mtq.TaskFailed, match="BadRequest: unknown field 'k'"):
            tasks[4].result(timeout=60)
        with pytest.raises(mtq.TaskFailed, match=r"BadRequest: 6 passages .* max_passages"):
            tasks[6].result(timeout=60)
    # the 10 pairs of the batch's good requests, in passes of at most 3
    assert model.passes == [3, 3, 3, 1]
    direct = Direct(reranker_path, head=True)
    for req, res in ((requests[0], a), (requests[1], b), (requests[5], f)):
        want = direct.scores(req["query"], req["passages"])
        assert close(res["scores"], want, 1e-4), (res["scores"], want)
        best_first = sorted(range(len(want)), key=lambda j: -want[j])
        gaps = [want[best_first[k]] - want[best_first[k + 1]] for k in range(len(want) - 1)]
        assert all(g > 1e-3 for g in gaps), f"scores too close to test an order: {want}"
        assert res["ranking"] == best_first[:req.get("top_n", len(want))]
    assert len(b["ranking"]) == 2 and b["truncated"] == [False, False, False, True]
    assert a["truncated"] == [False] * 5
    assert empty == {"scores": [], "ranking": [], "tokens": 0, "truncated": []}
    assert served(r, q)["s:A"] == float(a["tokens"] + b["tokens"] + f["tokens"])


def test_scores_of_a_two_label_model_and_with_a_sigmoid(hf_root: Path) -> None:
    import torch

    from mtq.backends.hf import CrossEncoder

    two = str(hf_models.reranker(hf_root, num_labels=2))
    one = str(hf_models.reranker(hf_root, num_labels=1))
    req = {"query": QUERY, "passages": PASSAGES[:3]}
    m2 = CrossEncoder().set_options(model=two)
    m2.setup("cpu")
    direct = Direct(two, head=True)
    with torch.inference_mode():
        x = direct.tok([QUERY] * 3, PASSAGES[:3], padding=True, return_tensors="pt")
        want = torch.softmax(direct.net(**x).logits, -1)[:, 1].tolist()
    (res,) = m2.predict([req])
    assert close(res.value["scores"], want), (res.value["scores"], want)
    m1 = CrossEncoder().set_options(model=one, activation="sigmoid")
    m1.setup("cpu")
    logits = Direct(one, head=True).scores(QUERY, PASSAGES[:3])
    (res,) = m1.predict([req])
    assert close(res.value["scores"], torch.sigmoid(torch.tensor(logits)).tolist())


# -- on the GPU --------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(DEVICE.startswith("cuda") and devices.cuda_count() == 0,
                    reason="needs a CUDA device")
def test_both_backends_in_bfloat16_on_the_device(qname: str, redis_url: str,
                                                 encoder_path: str,
                                                 reranker_path: str) -> None:
    import torch

    from mtq.backends.hf.loading import torch_dtype

    if DEVICE.startswith("cuda"):  # "auto" is bfloat16 on a GPU that has it
        assert torch_dtype("auto", torch.device(DEVICE)) == torch.bfloat16
    q = mtq.Queue(qname, redis_url, settings=FAST)
    emb = q.submit_many([*TEXTS, LONG])
    we = make_worker("hf:Embedder", qname, redis_url, device=DEVICE,
                     options={"model": encoder_path, "dtype": "bfloat16"})
    with serving(we):
        vectors = [t.result(timeout=90) for t in emb]
    assert we.model.net.dtype == torch.bfloat16  # type: ignore[union-attr]
    assert str(next(we.model.net.parameters()).device).startswith(DEVICE.split(":")[0])  # type: ignore[union-attr]
    direct = Direct(encoder_path)
    for text, res in zip([*TEXTS, LONG], vectors):
        want = direct.mean(text)
        cosine = sum(x * y for x, y in zip(res["embedding"], want))
        assert cosine > 0.99, (text, cosine)  # bfloat16 against float32 on the CPU
    assert vectors[-1]["truncated"] and vectors[-1]["tokens"] == hf_models.POSITIONS

    q2 = mtq.Queue(qname + "-rerank", redis_url, settings=FAST)
    task = q2.submit({"query": QUERY, "passages": PASSAGES})
    wr = make_worker("hf:CrossEncoder", q2.name, redis_url, device=DEVICE,
                     options={"model": reranker_path, "dtype": "bfloat16"})
    with serving(wr):
        res = task.result(timeout=90)
    assert wr.model.net.dtype == torch.bfloat16  # type: ignore[union-attr]
    want = Direct(reranker_path, head=True).scores(QUERY, PASSAGES)
    assert close(res["scores"], want, 0.05 * max(abs(x) for x in want)), (res["scores"], want)
    assert res["ranking"][0] == max(range(len(want)), key=lambda j: want[j])


# -- the example -------------------------------------------------------------------------
# slow (about 10 s here: a Python, a worker process and transformers twice): the default
# suite runs the example end to end in test_docs_run (docs/models.md's
# `python examples/hf_embeddings.py`, its default model), and tests truncation and a bad
# payload failing alone through a worker above
@pytest.mark.slow
def test_the_example_serves_a_local_folder_end_to_end(subprocess_env: dict[str, str],
                                                      encoder_path: str) -> None:
    out = subprocess.run([PY, str(ROOT / "examples" / "hf_embeddings.py"), "--model", encoder_path],
                         env={**subprocess_env, "HF_HUB_OFFLINE": "1"}, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "5 embeddings of 32 floats" in out.stdout, out.stdout
    assert f"{hf_models.POSITIONS} tokens embedded, truncated: True" in out.stdout, out.stdout
    assert "fails alone, at once: BadRequest: 'text' must be a string" in out.stdout, out.stdout
