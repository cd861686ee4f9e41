"""Timeouts and cancel of running work (docs/workers.md, "Timeouts and cancel"), against
a real redis-server with in-process workers: a plain generator function, an
mtq.Generator request, a cooperative function and a cooperative batch member are
stopped; a timeout inside a batch fails that member alone; a success that comes back
after a cancel or a timeout never ends succeeded."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import redis

import mtq
from mtq.broker.keys import QueueKeys
from mtq.broker.protocol import TERMINAL
from mtq.settings import QueueSettings
from mtq.workers.model import FunctionModel
from tests.models import Counter
from tests.support.waits import wait_for
from tests.support.workers import FAST, make_worker, serving

pytestmark = pytest.mark.timeout(60)

NO_RETRY = QueueSettings(lease_ms=1500, retry_backoff_ms=0, max_retries=0, dead_letter=False)


def ended(t: mtq.Task, timeout: float = 10.0) -> mtq.TaskInfo:
    wait_for(lambda: t.status() in TERMINAL, timeout, f"task {t.id} never ended ({t.status()})")
    return t.info()


def running(t: mtq.Task) -> None:
    wait_for(lambda: t.status() == "running", 10, f"task {t.id} never started")


# -- a plain generator function ------------------------------------------------------------

def test_cancel_stops_a_running_plain_generator_between_two_steps(
        qname: str, redis_url: str) -> None:
    steps: list[int] = []
    closed = threading.Event()

    def tokens(p: dict[str, Any]) -> Any:
        try:
            for i in range(10_000):
                steps.append(i)
                time.sleep(0.005)
                yield i
        finally:
            closed.set()

    q = mtq.Queue(qname, redis_url)
    with serving(make_worker(FunctionModel(tokens), qname, redis_url)):
        t = q.submit({})
        wait_for(lambda: len(steps) > 5, 10, "the generator never stepped")
        assert t.cancel() is False  # running: its worker is told
        info = ended(t, 5)
        assert info.status == "cancelled", info
        assert closed.wait(5), "the generator was not closed"
        n = len(steps)
        assert n < 10_000
        time.sleep(0.1)
        assert len(steps) == n, "the generator stepped on after it was stopped"


def test_a_plain_generator_past_its_timeout_fails_with_task_timeout(
        qname: str, redis_url: str) -> None:
    def tokens(p: dict[str, Any]) -> Any:
        for i in range(100_000):
            time.sleep(0.005)
            yield i

    q = mtq.Queue(qname, redis_url)
    with serving(make_worker(FunctionModel(tokens), qname, redis_url, settings=NO_RETRY)):
        t0 = time.monotonic()
        t = q.submit({}, timeout=0.3)
        info = ended(t, 5)
        took = time.monotonic() - t0
    assert info.status == "failed", info
    assert info.error and info.error.startswith("TaskTimeout: "), info.error
    assert took < 2.0, f"stopped {took:.2f}s after submit, for a timeout of 0.3 s"


# -- an mtq.Generator -------------------------------------------------------------------------

def test_cancel_and_timeout_stop_running_generator_requests_alone(
        qname: str, redis_url: str) -> None:
    model = Counter()
    q = mtq.Queue(qname, redis_url)
    with serving(make_worker(model, qname, redis_url, settings=NO_RETRY)):
        slow = {"n": 100_000, "step_ms": 5}
        cancelled = q.submit(slow)
        timed = q.submit(slow, timeout=0.4)
        short = q.submit({"n": 50, "step_ms": 5})
        running(cancelled)
        wait_for(lambda: len(model.steps) > 3, 10, "no decode step ran")
        cancelled.cancel()
        assert ended(cancelled, 5).status == "cancelled"
        info = ended(timed, 5)
        assert info.status == "failed" and (info.error or "").startswith("TaskTimeout: "), info
        assert short.result(timeout=10)["tokens"] == list(range(50))
    assert cancelled.id in model.released and timed.id in model.released


# -- cooperative functions and models ---------------------------------------------------------

def test_a_cooperative_function_stops_on_cancel(qname: str, redis_url: str) -> None:
    seen: list[Any] = []

    def work(p: dict[str, Any]) -> str:
        cur = mtq.current_task()
        seen.append(cur.id)
        for _ in range(2000):
            cur.raise_if_cancelled()
            time.sleep(0.005)
        return "finished"

    q = mtq.Queue(qname, redis_url)
    with serving(make_worker(FunctionModel(work), qname, redis_url)):
        t = q.submit({})
        running(t)
        wait_for(lambda: seen, 5, "the function never ran")
        t0 = time.monotonic()
        t.cancel()
        info = ended(t, 5)
        took = time.monotonic() - t0
    assert info.status == "cancelled", info
    assert seen == [t.id]
    assert took < 1.0, f"{took:.2f}s from cancel to cancelled"


def test_a_cooperative_function_times_out_then_is_retried_then_fails(
        qname: str, redis_url: str) -> None:
    calls: list[float] = []

    def work(p: dict[str, Any]) -> str:
        calls.append(time.monotonic())
        while True:
            mtq.current_task().raise_if_cancelled()
            time.sleep(0.002)

    q = mtq.Queue(qname, redis_url)
    settings = QueueSettings(lease_ms=1500, retry_backoff_ms=0, max_retries=2, dead_letter=False)
    with serving(make_worker(FunctionModel(work), qname, redis_url, settings=settings)):
        t = q.submit({}, timeout=0.2)
        info = ended(t, 10)
    assert info.status == "failed", info
    assert (info.error or "").startswith("TaskTimeout: "), info.error
    assert len(calls) == 3, f"ran {len(calls)} times: one run and two retries expected"
    assert info.attempts == 3


class Batch(mtq.Model):
    """A batch model that works in steps and skips the tasks that were stopped."""

    max_batch_size = 8
    max_wait_ms = 200.0

    def __init__(self) -> None:
        self.skipped: set[str] = set()
        self.started = threading.Event()
        self.batches: list[int] = []

    def predict(self, batch: list[Any]) -> list[Any]:
        self.batches.append(len(batch))
        self.started.set()
        cur = mtq.current_task()
        for _ in range(int(max(p.get("steps", 0) for p in batch))):
            cur.raise_if_cancelled()
            self.skipped |= cur.stopped
            time.sleep(0.005)
        return [p.get("v") for p in batch]


def test_a_timeout_inside_a_batch_fails_that_member_alone(qname: str, redis_url: str) -> None:
    model = Batch()
    q = mtq.Queue(qname, redis_url)
    with serving(make_worker(model, qname, redis_url, settings=NO_RETRY)):
        tasks = q.submit_many([mtq.Request({"v": 1, "steps": 80}, timeout=0.1),
                               {"v": 2, "steps": 80}, {"v": 3, "steps": 80}])
        infos = [ended(t) for t in tasks]
    assert model.batches[0] == 3, model.batches
    assert infos[0].status == "failed" and (infos[0].error or "").startswith("TaskTimeout: ")
    assert [tasks[1].result(timeout=1), tasks[2].result(timeout=1)] == [2, 3]
    assert model.skipped == {tasks[0].id}


def test_a_cancelled_batch_member_ends_cancelled_and_the_whole_batch_stops(
        qname: str, redis_url: str) -> None:
    model = Batch()
    q = mtq.Queue(qname, redis_url)
    with serving(make_worker(model, qname, redis_url)):
        a, b = q.submit_many([{"v": 1, "steps": 2000}, {"v": 2, "steps": 2000}])
        assert model.started.wait(10)
        running(a)
        a.cancel()
        wait_for(lambda: a.id in model.skipped, 5, "the batch never saw its member stopped")
        assert b.status() == "running"
        b.cancel()
        assert (ended(a, 5).status, ended(b, 5).status) == ("cancelled", "cancelled")
    assert len(model.batches) == 1, "the batch ran again after it was stopped"


# -- a success after the stop -----------------------------------------------------------------

def test_a_function_that_never_checks_ends_cancelled_not_succeeded(
        qname: str, redis_url: str) -> None:
    gate = threading.Event()

    def deaf(p: dict[str, Any]) -> str:
        assert gate.wait(20)
        return "done"

    q = mtq.Queue(qname, redis_url)
    with serving(make_worker(FunctionModel(deaf), qname, redis_url, settings=NO_RETRY), gate):
        c = q.submit({})
        running(c)
        c.cancel()
        gate.set()
        assert ended(c).status == "cancelled"
        gate.clear()
        t = q.submit({}, timeout=0.2)
        running(t)
        time.sleep(0.4)  # past its timeout, while it runs on
        gate.set()
        info = ended(t)
    assert info.status == "failed" and (info.error or "").startswith("TaskTimeout: "), info


def test_ack_of_a_task_with_a_cancel_request_ends_it_cancelled(qname: str, r: redis.Redis,
                                                               redis_url: str) -> None:
    """The race: a cancel reaches Redis after the worker's last lease extend and before
    its ack; ack.lua ends it cancelled, the result dropped."""
    q = mtq.Queue(qname, redis_url)
    t = q.submit({"x": 1})
    c = mtq.Consumer(qname, redis_url, settings=FAST)
    (claimed,) = c.claim(1)
    assert t.cancel() is False  # running: requested
    report = c.settle([mtq.Outcome(claimed, ok=True, value="late")])
    assert not report.lost
    info = t.info()
    assert info.status == "cancelled", info
    assert r.hget(QueueKeys(qname).task(t.id), "result") is None
    with pytest.raises(mtq.TaskCancelled):
        t.result(timeout=1)
