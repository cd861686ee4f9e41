"""Engines on a GPU: each engine of a process runs on a CUDA stream of its own (checked
from inside the models), its outputs match a separate process bit for bit in float32,
its device memory goes back to its level before load after an unload, a model's
setup is finished before another stream uses its weights, and the throughput of two
models in one process against the two run one after the other (a figure, recorded as
properties of the test suite in the JUnit XML that ``scripts/gpu-check`` keeps).

Marked ``cuda`` and skipped without a CUDA device; ``scripts/gpu-check --dry-run``
runs them on the CPU (``MTQ_TEST_CUDA_DEVICE=cpu``), where streams and device memory
are not there to read: the same engines run, and the tests check what the CPU has
(the threads, the tensors freed, the outputs).
"""

from __future__ import annotations

import gc
import os
import subprocess
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

import mtq
from mtq.workers import devices
from mtq.workers.host import Host
from mtq.workers.residency import EngineOp
from mtq.workers.worker import Worker
from tests.support.processes import kill_process, worker_process
from tests.support.workers import FAST

DEVICE = os.environ.get("MTQ_TEST_CUDA_DEVICE", "cuda:0")
ON_GPU = DEVICE.startswith("cuda")

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.timeout(120),
    pytest.mark.skipif(ON_GPU and devices.cuda_count() == 0, reason="needs a CUDA device"),
]
MiB = 2**20
GPT = "tests.engine_cuda_models:StreamGPT"
SLOW = "benchmarks.children.engines:Slow"
WEIGHTS = "benchmarks.children.engines:Weights"
LATE = "tests.engine_cuda_models:LateWeights"
#: the slow model's size: a GPU's products take a few ms, the CPU's (dry run) less
SLOW_SET = {"size": "2048", "matmuls": "8"} if ON_GPU else {"size": "128", "matmuls": "4"}


@pytest.fixture
def weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The fast model's random weights, made once for this process and its children."""
    from benchmarks.children.gen import BENCH
    from mtq.reference.gpt import make_weights

    path = make_weights(tmp_path / "tinygpt.pt", BENCH)
    monkeypatch.setenv("MTQ_REFERENCE_WEIGHTS", str(path))
    return path


def engine(target: str, queue: str, url: str, **kw: Any) -> Worker:
    return Worker(target, queue, url=url, settings=FAST, device=DEVICE, **kw)


@contextmanager
def hosting(host: Host) -> Iterator[Host]:
    host.setup()
    t = threading.Thread(target=host.run, daemon=True)
    t.start()
    try:
        yield host
    finally:
        host.stop()
        t.join(60)
        assert not t.is_alive(), "the host did not stop"
    assert not host.failed, host.failed


@contextmanager
def own_process(target: str, queue: str, env: dict[str, str], tmp_path: Path,
                *args: str) -> Iterator[subprocess.Popen[bytes]]:
    """``mtq worker run TARGET`` on DEVICE: the model in a process of its own."""
    log_path = tmp_path / f"worker-{queue}.log"
    with open(log_path, "wb") as log:
        proc = worker_process([target, "-q", queue, "--device", DEVICE, *args], env, log)
    try:
        yield proc
    except BaseException:
        print(log_path.read_text(errors="replace")[-4000:])
        raise
    finally:
        kill_process(proc)


def ask(w: Worker, kind: str, **kw: Any) -> dict[str, Any]:
    got: list[dict[str, Any]] = []
    done = threading.Event()
    w.request(EngineOp(kind, reply=lambda a: (got.append(a), done.set()), **kw))
    assert done.wait(60), f"no answer to {kind}"
    return got[0]


def gpt_payload(k: int) -> dict[str, Any]:
    return {"prompt": f"request {k}: " + "abc " * k, "max_tokens": 24, "temperature": 0,
            "stop_at_eos": False, "seed": k}


def one_at_a_time(q: mtq.Queue, payloads: list[Any]) -> list[Any]:
    """Each payload's result, submitted one after another: every batch of one."""
    return [q.submit(p).result(timeout=90) for p in payloads]


def test_each_engine_runs_on_a_stream_of_its_own_and_matches_its_own_process_bit_for_bit(
        qname: str, redis_url: str, subprocess_env: dict[str, str], weights: Path,
        tmp_path: Path) -> None:
    env = {**subprocess_env, "MTQ_REFERENCE_WEIGHTS": str(weights)}
    qa, qb = qname + "-gpt", qname + "-slow"
    gpts = [gpt_payload(k) for k in range(6)]
    slows = [{"i": f"s{k}", "k": k} for k in range(12)]
    sets = [x for k, v in SLOW_SET.items() for x in ("--set", f"{k}={v}")]
    with ExitStack() as stack:  # the separate processes start while the host serves
        stack.enter_context(own_process(GPT, qa + "-own", env, tmp_path))
        stack.enter_context(own_process(SLOW, qb + "-own", env, tmp_path, *sets))
        a, b = engine(GPT, qa, redis_url), engine(SLOW, qb, redis_url, options=SLOW_SET)
        with hosting(Host([a, b])):
            busy = mtq.Queue(qb, redis_url).submit_many(slows)  # the slow engine runs ...
            in_host = one_at_a_time(mtq.Queue(qa, redis_url), gpts)  # ... beside the fast one
            slow_host = [t.result(timeout=90) for t in busy]
        own = [mtq.Queue(q + "-own", redis_url) for q in (qa, qb)]
        slow_own_tasks = own[1].submit_many(slows)
        in_own = one_at_a_time(own[0], gpts)
        slow_own = [t.result(timeout=90) for t in slow_own_tasks]
    fast_streams = {s for x in in_host for s in x["streams"]}
    slow_streams = {x["stream"] for x in slow_host}
    assert {t for x in in_host for t in x["threads"]} == {f"mtq-engine-{qa}"}, in_host[-1]
    assert {x["thread"] for x in slow_host} == {f"mtq-engine-{qb}"}
    if ON_GPU:  # one stream per engine, neither the default one; a process of its own: default
        assert len(fast_streams) == len(slow_streams) == 1, (fast_streams, slow_streams)
        assert fast_streams.isdisjoint(slow_streams), (fast_streams, slow_streams)
        assert "default" not in fast_streams | slow_streams
        assert {s for x in in_own for s in x["streams"]} == {"default"}
    else:
        assert fast_streams == slow_streams == {"cpu"}
    # bit for bit: the same tokens, logits and sums as the model in its own process
    for mine, theirs in zip(in_host, in_own):
        assert mine["tokens"] == theirs["tokens"] and len(mine["tokens"]) == 24
        assert mine["logits"] == theirs["logits"]
    assert [x["sum"] for x in slow_host] == [x["sum"] for x in slow_own]


def test_unload_gives_the_device_memory_back_and_load_brings_the_same_weights(
        qname: str, redis_url: str) -> None:
    torch = pytest.importorskip("torch")
    mb = 256 if ON_GPU else 8
    dev = torch.device(DEVICE)

    def reading() -> tuple[int, int]:
        if not ON_GPU:
            return 0, 0
        torch.cuda.synchronize(dev)
        return torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)

    if ON_GPU:
        gc.collect()
        torch.cuda.empty_cache()  # what other tests of this process left cached
    alloc0, reserved0 = reading()
    w = engine(WEIGHTS, qname, redis_url, options={"mb": str(mb), "work_ms": "0"},
               on_demand=True)
    q = mtq.Queue(qname, redis_url)
    with hosting(Host([w])):
        first = q.submit({"i": 1}).result(timeout=60)  # loads it
        alloc1, _ = reading()
        held = weakref.ref(w.model.weights)
        answer = ask(w, "unload")
        assert answer["ok"] and answer["state"] == "unloaded", answer
        alloc2, reserved2 = reading()
        assert held() is None, "the unloaded model's weights are still referenced"
        assert ask(w, "load")["ok"]
        again = q.submit({"i": 2}).result(timeout=60)
        alloc3, _ = reading()
    assert first["w"] == again["w"]  # the same seeded weights, loaded again
    assert w.memory_bytes == mb * MiB
    if ON_GPU:
        assert mb * MiB <= alloc1 - alloc0 < (mb + 4) * MiB, (alloc0, alloc1)
        assert alloc2 <= alloc0 + MiB, (alloc0, alloc2)
        # the caching allocator's reserve is emptied by the unload: back to its level
        assert reserved2 <= reserved0 + 2 * MiB, (reserved0, reserved2)
        assert mb * MiB <= alloc3 - alloc0 < (mb + 4) * MiB, (alloc0, alloc3)


@pytest.mark.parametrize("path", ["start", "reload beside"])
def test_a_models_setup_has_finished_before_its_engine_uses_the_weights(
        path: str, qname: str, redis_url: str) -> None:
    """On a GPU an engine runs on its own stream, which does not wait for the kernels
    a setup queued on another (the main thread's at start, a loader's for a reload
    beside the serving model): the engine must wait for setup's work before it hands
    the model over, or its first batches read weights not yet written."""
    busy = {"side": "4096", "busy": "40"} if ON_GPU else {"side": "64", "busy": "4"}
    q = mtq.Queue(qname, redis_url)
    if path == "start":
        w = engine(LATE, qname, redis_url, options=busy)
        tasks = q.submit_many([{"i": k} for k in range(4)])  # waiting when it starts
        with hosting(Host([w])):
            results = [t.result(timeout=60) for t in tasks]
    else:
        w = engine(LATE, qname, redis_url)
        with hosting(Host([w])):
            assert q.submit({"i": 0}).result(timeout=60)["mean"] == 1.0
            stop = threading.Event()
            submitted: list[mtq.Task] = []

            def feed() -> None:  # tasks keep coming: one runs right after the swap
                while not stop.is_set():
                    submitted.append(q.submit({"i": len(submitted)}))
                    stop.wait(0.002)

            feeder = threading.Thread(target=feed, daemon=True)
            feeder.start()
            try:
                answer = ask(w, "reload", options=busy)
            finally:
                stop.set()
                feeder.join(10)
            assert answer["ok"] and "beside" in answer["detail"], answer
            results = [t.result(timeout=60) for t in submitted]
    assert {x["mean"] for x in results} == {1.0}, [x["mean"] for x in results]


def test_two_models_in_one_process_against_one_after_the_other(
        qname: str, redis_url: str, weights: Path,
        record_testsuite_property: Callable[[str, object], None]) -> None:
    """Throughput of a generator and a batch model served together by one process,
    against the same work run one model after the other: a figure, not a judged one
    (recorded as properties of the test suite: ``scripts/gpu-check``'s pytest.xml)."""
    requests, tokens, slow_n = (16, 128, 60) if ON_GPU else (4, 24, 12)
    qa, qb = qname + "-gpt", qname + "-slow"
    gpt_q, slow_q = mtq.Queue(qa, redis_url), mtq.Queue(qb, redis_url)
    gpts = [{**gpt_payload(k), "max_tokens": tokens} for k in range(requests)]
    slows = [{"i": f"s{k}", "k": k} for k in range(slow_n)]

    def work(gpt: bool, slow: bool) -> float:
        t0 = time.perf_counter()
        tasks = (gpt_q.submit_many(gpts) if gpt else []) + \
            (slow_q.submit_many(slows) if slow else [])
        for t in tasks:
            t.result(timeout=90)
        return time.perf_counter() - t0

    a, b = engine(GPT, qa, redis_url), engine(SLOW, qb, redis_url, options=SLOW_SET)
    with hosting(Host([a, b])):
        work(True, True)  # warm-up: caches, kernels
        t_gpt, t_slow, t_both = work(True, False), work(False, True), work(True, True)
    ratio = (t_gpt + t_slow) / t_both
    figures = {"engines_gpt_alone_s": round(t_gpt, 3), "engines_slow_alone_s": round(t_slow, 3),
               "engines_together_s": round(t_both, 3),
               "engines_one_after_the_other_over_together": round(ratio, 3),
               "engines_bound": round((t_gpt + t_slow) / max(t_gpt, t_slow), 3)}
    for k, v in figures.items():
        record_testsuite_property(k, v)
    print(f"two engines on {DEVICE}: {figures}")
    assert t_both > 0 and ratio > 0
