"""Running out of memory against a real redis-server, with real workers and the
errors torch really raises: a batch that does not fit is split in the same delivery
(no task charged for it) and the worker lowers its batch size, then raises it again;
a task that does not fit alone ends with DeviceOutOfMemory after its retries; a
process that really runs out of address space; a generator that sheds requests
when a decode step or a prefill runs out of memory."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

import mtq
from mtq.broker.protocol import TERMINAL
from mtq.workers import memory, registry
from mtq.workers.model import Model
from mtq.workers.worker import Worker
from tests.models import Counter
from tests.support.waits import Reader, wait_for
from tests.support.workers import FAST, registered_worker, serving

pytestmark = pytest.mark.timeout(60)


def all_done(tasks: list[mtq.Task]) -> Callable[[], bool]:
    return lambda: all(t.status() in TERMINAL for t in tasks)


def oom(what: str) -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB ({what})")


def assert_charged_once(tasks: list[mtq.Task]) -> None:
    """Every task succeeded on its first delivery, with no failed attempt."""
    infos = [t.info() for t in tasks]
    assert [(i.status, i.attempts, i.deliveries) for i in infos] == \
        [("succeeded", 0, 1)] * len(tasks), [(i.id, i.status, i.attempts, i.deliveries)
                                            for i in infos]


# -- a batch model ------------------------------------------------------------------------
class Bounded(Model):
    """Runs out of memory (torch.OutOfMemoryError, as CUDA raises it) on more than
    ``k`` payloads, or on any batch holding a ``poison`` one; records each call's size."""

    max_batch_size = 32
    max_wait_ms = 0.0

    def __init__(self, k: int = 1000) -> None:
        self.k = k
        self.sizes: list[int] = []
        self.calls: list[list[int]] = []
        self.lock = threading.Lock()

    def predict(self, batch: list[Any]) -> list[Any]:
        with self.lock:
            self.sizes.append(len(batch))
            self.calls.append([p["i"] for p in batch])
        if len(batch) > self.k:
            raise oom(f"a batch of {len(batch)}")
        if any(p.get("poison") for p in batch):
            raise oom("a poison payload")
        return [{"i": p["i"], "n": len(batch)} for p in batch]


def test_a_batch_too_large_is_split_and_the_batch_size_lowered(qname: str,
                                                               redis_url: str) -> None:
    q = mtq.Queue(qname, redis_url, settings=FAST)
    first = q.submit_many([{"i": i} for i in range(24)])
    model = Bounded(k=4)
    w = Worker(model, qname, url=redis_url, settings=FAST)
    with serving(w) as run:
        wait_for(all_done(first), 20, "the first tasks did not settle")
        assert [t.result(timeout=1)["i"] for t in first] == list(range(24))
        assert_charged_once(first)
        assert model.sizes[0] > 4, model.sizes  # they came in one batch, and it failed
        cap = w.batch_cap()
        assert 1 <= cap <= 4, cap
        seen = len(model.sizes)
        second = q.submit_many([{"i": 100 + i} for i in range(24)])
        wait_for(all_done(second), 20, "the second tasks did not settle")
        assert_charged_once(second)
        later = model.sizes[seen:]
        assert later and max(later) <= cap, later  # no batch ran out of memory again
        assert sum(later) == 24
        r = redis.Redis.from_url(redis_url)
        wait_for(lambda: [e for e in registry.list_workers(r, qname)
                          if e.get("batch_cap") == cap], 10,
                 "the registry never showed the lowered batch size")
        run.stop()


def test_the_batch_size_goes_back_up_after_a_run_of_batches_that_fit(
        qname: str, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "RECOVER_BATCHES", 2)
    q = mtq.Queue(qname, redis_url, settings=FAST)
    first = q.submit_many([{"i": i} for i in range(16)])
    model = Bounded(k=4)
    w = Worker(model, qname, url=redis_url, settings=FAST)
    with serving(w) as run:
        wait_for(all_done(first), 20, "the first tasks did not settle")
        lowered = w.batch_cap()
        assert lowered <= 4
        model.k = 1000  # the memory is free again (another process let go of it, say)
        seen = len(model.sizes)
        more = q.submit_many([{"i": i} for i in range(400)])
        wait_for(all_done(more), 30, "the tasks did not settle")
        assert_charged_once(more[:50])
        later = model.sizes[seen:]
        assert max(later) > lowered, later  # bigger batches again, step by step
        assert w.batch_cap() > lowered
        steps = sorted(set(later))
        assert len(steps) >= 3, steps
        run.stop()


def test_a_task_that_does_not_fit_alone_ends_with_device_out_of_memory(
        qname: str, redis_url: str) -> None:
    settings = FAST.replace(max_retries=2)
    q = mtq.Queue(qname, redis_url, settings=settings)
    payloads: list[dict[str, Any]] = [{"i": i} for i in range(20)]
    payloads[7]["poison"] = True
    tasks = q.submit_many(payloads)
    model = Bounded()
    w = Worker(model, qname, url=redis_url, settings=settings)
    with serving(w) as run:
        wait_for(all_done(tasks), 20, "the tasks did not settle")
        cap = w.batch_cap()
        run.stop()
    poison = tasks[7].info()
    assert (poison.status, poison.attempts) == ("dead", 3), poison
    assert (poison.error or "").startswith("DeviceOutOfMemory: the task ran out of memory "
                                           "on its own"), poison.error
    assert "OutOfMemoryError: CUDA out of memory" in (poison.error or "")
    assert "OutOfMemoryError" in (poison.traceback or "")
    assert_charged_once(tasks[:7] + tasks[8:])
    assert [t.result(timeout=1)["i"] for t in tasks[:7] + tasks[8:]] == \
        [i for i in range(20) if i != 7]
    # it ran alone from its first delivery's end on, and no batch size was lowered for it
    calls = [c for c in model.calls if 7 in c]
    assert all(c == [7] for c in calls[calls.index([7]):]) and len(calls) > 3, model.calls
    assert cap == 32


def test_a_worker_whose_process_runs_out_of_address_space(
        qname: str, redis_url: str, subprocess_env: dict[str, str], tmp_path: Path) -> None:
    """A real allocation failure (RLIMIT_AS, see tests/oom_models.py) in a
    ``mtq worker run`` process: the batch is split, every task succeeds once."""
    log = tmp_path / "calls.log"
    env = {**subprocess_env, "MALLOC_ARENA_MAX": "2"}  # no address space per thread
    q = mtq.Queue(qname, redis_url, settings=FAST)
    with registered_worker("tests.oom_models:Hungry", qname, env, log):
        tasks = q.submit_many([{"i": i} for i in range(16)])
        wait_for(all_done(tasks), 40, "the tasks did not settle")
    lines = log.read_text().splitlines()
    failed = [ln for ln in lines if ln.startswith("F ")]
    assert failed, lines
    assert all("can't allocate memory" in ln or "MemoryError" in ln for ln in failed), failed
    assert [t.result(timeout=1)["i"] for t in tasks] == list(range(16))
    assert_charged_once(tasks)
    ran = [int(ln.split()[1]) for ln in lines if ln.startswith("B ")]
    assert max(ran) < min(int(ln.split()[1]) for ln in failed), lines


# -- a generator --------------------------------------------------------------------------
class Tight(Counter):
    """A Counter whose decode runs out of memory with more than ``k`` requests running
    (or with a ``huge`` one among them), and whose prefill does past ``prefill_k``
    prompt tokens; records the size of every decode step and prefill."""

    max_running = 8
    k = 1000
    prefill_k = 1000

    def setup(self, device: Any) -> None:
        super().setup(device)
        self.sizes: list[int] = []
        self.prefills: list[int] = []

    def prefill(self, requests: list[mtq.Generation]) -> list[Any]:
        tokens = sum(r.prompt_tokens for r in requests)
        self.prefills.append(tokens)
        if tokens > self.prefill_k:
            raise oom(f"a prefill of {tokens} tokens")
        return super().prefill(requests)

    def decode(self, requests: list[mtq.Generation]) -> list[Any]:
        self.sizes.append(len(requests))
        if len(requests) > self.k or any(r.payload.get("huge") for r in requests):
            raise oom(f"a decode step on {len(requests)} requests")
        return super().decode(requests)


def test_a_generator_that_runs_out_of_memory_in_decode_sheds_requests(
        qname: str, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "RECOVER_STEPS", 3)
    q = mtq.Queue(qname, redis_url, settings=FAST)
    tasks = q.submit_many([{"n": 10, "start": 100 * i} for i in range(8)])
    readers = [Reader(lambda t=t: t.tokens(timeout=30)) for t in tasks]  # type: ignore[misc]
    model = Tight()
    model.k = 3
    w = Worker(model, qname, url=redis_url, settings=FAST)
    with serving(w) as run:
        wait_for(all_done(tasks), 30, "the generations did not settle")
        run.stop()
    for i, (t, reader) in enumerate(zip(tasks, readers)):
        want = [100 * i + k for k in range(10)]
        assert t.result(timeout=1)["tokens"] == want
        assert reader.join(10) == want  # each stream went on where it was, no repeat
    assert_charged_once(tasks)  # those given back were not charged a delivery
    sizes = model.sizes
    assert sizes[0] == 8, sizes  # all eight ran out of memory together ...
    assert sizes[1:3] == [4, 2], sizes  # ... then half of them, then half again
    # after a few steps that fitted, more again (and not so many more that it fails
    # every other step)
    assert 3 in sizes[3:], sizes
    assert len([s for s in sizes if s > 3]) <= 6, sizes


def test_a_generation_that_does_not_fit_alone_ends_with_device_out_of_memory(
        qname: str, redis_url: str) -> None:
    settings = FAST.replace(max_retries=1)
    q = mtq.Queue(qname, redis_url, settings=settings)
    payloads: list[dict[str, Any]] = [{"n": 4, "start": 10 * i} for i in range(5)]
    payloads[0]["huge"] = True  # the first admitted: the last one given back
    tasks = q.submit_many(payloads)
    model = Tight()
    w = Worker(model, qname, url=redis_url, settings=settings)
    with serving(w) as run:
        wait_for(all_done(tasks), 30, "the generations did not settle")
        run.stop()
    huge = tasks[0].info()
    assert (huge.status, huge.attempts) == ("dead", 2), huge
    assert (huge.error or "").startswith("DeviceOutOfMemory"), huge.error
    for i, t in enumerate(tasks[1:], 1):
        assert t.result(timeout=1)["tokens"] == [10 * i + k for k in range(4)]
    assert_charged_once(tasks[1:])
    # 5 ran out of memory, then 2, then the huge one alone: its doing, not the load's,
    # so the others ran together again at once
    sizes = model.sizes
    assert sizes[:3] == [5, 2, 1], sizes
    assert 4 in sizes[3:], sizes


def test_a_prefill_that_runs_out_of_memory_is_split_and_its_budget_lowered(
        qname: str, redis_url: str) -> None:
    q = mtq.Queue(qname, redis_url, settings=FAST)
    first = q.submit_many([{"n": 3, "start": 10 * i, "prompt": 2} for i in range(8)])
    model = Tight()
    model.prefill_k = 6
    w = Worker(model, qname, url=redis_url, settings=FAST)
    with serving(w) as run:
        wait_for(all_done(first), 30, "the generations did not settle")
        assert model.prefills[0] == 16, model.prefills  # all eight prefilled together
        seen = len(model.prefills)
        second = q.submit_many([{"n": 3, "start": 10 * i, "prompt": 2} for i in range(8)])
        wait_for(all_done(second), 30, "the second generations did not settle")
        run.stop()
    for i, t in enumerate(first + second):
        assert t.result(timeout=1)["tokens"] == [10 * (i % 8) + k for k in range(3)]
    assert_charged_once(first + second)
    assert max(model.prefills[seen:]) <= 6, model.prefills  # the budget was lowered
