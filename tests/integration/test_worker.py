"""The in-process worker engine against a real redis-server: dynamic batching,
bisection, control commands, cancel, the registry, and the consumer calls the
supervisor relies on (requeue, release_leases, claim age)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

import mtq
from mtq.broker.keys import QueueKeys
from mtq.broker.protocol import TERMINAL, NewTask
from mtq.settings import QueueSettings
from mtq.workers import control, registry
from mtq.workers import fetcher as fetcher_module
from mtq.workers.model import FunctionModel, Model
from mtq.workers.worker import Worker
from tests.support.waits import wait_for
from tests.support.workers import FAST, Recorder, Running, make_worker, serving

pytestmark = pytest.mark.timeout(60)


# -- helpers ------------------------------------------------------------------------------
def statuses(tasks: list[mtq.Task]) -> list[str]:
    return [t.status() for t in tasks]


def all_done(tasks: list[mtq.Task]) -> Callable[[], bool]:
    return lambda: all(s in TERMINAL for s in statuses(tasks))


# -- dynamic batching ------------------------------------------------------------------------
@pytest.mark.gpu_smoke
def test_presubmitted_backlog_runs_in_full_batches(qname: str, redis_url: str) -> None:
    q = mtq.Queue(qname, redis_url, settings=FAST)
    tasks = q.submit_many([{"i": i} for i in range(64)])
    model = Recorder(lambda p: p["i"] * 2, max_batch_size=32, max_wait_ms=1000)
    w = make_worker(model, qname, redis_url)
    with serving(w) as run:
        wait_for(lambda: q.stats()["succeeded"] == 64, 10, "64 tasks did not succeed")
        totals = run.stop()
    assert [len(c) for c in model.calls] == [32, 32]
    assert [p["i"] for p in model.seen()] == list(range(64))  # FIFO across batches
    assert [t.result(timeout=1) for t in tasks] == [i * 2 for i in range(64)]
    assert w.hist == {32: 2}
    assert totals["succeeded"] == 64 and totals["batches"] == 2 and totals["tasks"] == 64


class HoldsACall(Model):
    """Batches of 4, run at once, except its ``hold``-th predict call, which waits until
    ``release`` is set."""

    name = "holds-a-call"
    max_batch_size = 4
    max_wait_ms = 0.0

    def __init__(self, hold: int) -> None:
        self.hold = hold
        self.calls: list[list[int]] = []
        self.holding, self.release = threading.Event(), threading.Event()

    def predict(self, batch: list[Any]) -> list[Any]:
        self.calls.append([p["i"] for p in batch])
        if len(self.calls) == self.hold:
            self.holding.set()
            assert self.release.wait(20), "test release never came"
        return [p["i"] for p in batch]


class SlotPeak:
    """Wraps a worker's ``slot.put``: :attr:`most` is the most tasks its slot held
    after a put."""

    def __init__(self, w: Worker) -> None:
        self.most = 0
        put = w.slot.put

        def put_and_count(claimed: Any, claimed_at: float) -> list[mtq.Claimed]:
            refused = put(claimed, claimed_at)
            self.most = max(self.most, len(w.slot))
            return refused

        w.slot.put = put_and_count  # type: ignore[method-assign]


@pytest.mark.parametrize(("fast_batch_s", "ahead"), [(60.0, 2), (0.0, 1)],
                         ids=["fast-model", "slow-model"])
def test_batches_claimed_ahead_two_for_a_fast_model_on_a_deep_queue(
        qname: str, redis_url: str, monkeypatch: pytest.MonkeyPatch,
        fast_batch_s: float, ahead: int) -> None:
    """Fetcher.claim_ahead: while its claims come back full and its batches run in
    under FAST_BATCH_S (set here so that every batch is fast, or none, however slow
    this machine is), the fetcher keeps two batches claimed ahead of the running one,
    never more (when no more fit in AHEAD_WORK_S of its work: none here); one for a
    slow model, and one again once the queue is empty."""
    monkeypatch.setattr(fetcher_module, "FAST_BATCH_S", fast_batch_s)
    monkeypatch.setattr(fetcher_module, "AHEAD_WORK_S", 0.0)  # no more than two (below)
    q = mtq.Queue(qname, redis_url, settings=FAST)
    tasks = q.submit_many([{"i": i} for i in range(40)])
    model = HoldsACall(hold=3)
    w = make_worker(model, qname, redis_url)
    peak = SlotPeak(w)
    with serving(w, model.release) as run:
        wait_for(lambda: model.holding.is_set() and len(w.slot) == 4 * ahead, 10,
                 f"the third batch did not start with {ahead} batch(es) claimed ahead")
        # Redis shows them running (leased): the held batch and those claimed ahead
        assert q.stats()["running"] == 4 + 4 * ahead
        assert w.slot.ahead == ahead
        model.release.set()
        wait_for(all_done(tasks), 10, "the worker did not run every task")
        wait_for(lambda: w.slot.ahead == 1, 5, "an empty queue left two batches ahead")
        run.stop()
    assert peak.most == 4 * ahead  # never more
    assert [t.result(timeout=1) for t in tasks] == list(range(40))
    assert sorted(i for call in model.calls for i in call) == list(range(40))
    assert [t.info().deliveries for t in tasks] == [1] * 40


def test_a_fast_model_with_batches_of_one_claims_many_at_a_time(
        qname: str, redis_url: str, r: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fetcher.claim_ahead: a model given batches of one that runs in microseconds (every
    batch counted fast, and AHEAD_MOST tasks of its work fitting in AHEAD_WORK_S, however
    slow this machine is) keeps up to AHEAD_MOST tasks claimed ahead on a deep queue,
    claiming once half of them are taken: 300 tasks in a few claims instead of 300, each
    run once, in the queue's order. The many-batch claim that found the queue empty
    registered the worker idle with the room of one batch, not the 63 or so it left (a
    submit hands it one task at most, the rest queue for any worker), and a burst
    submitted then runs."""
    monkeypatch.setattr(fetcher_module, "FAST_BATCH_S", 60.0)
    monkeypatch.setattr(fetcher_module, "AHEAD_WORK_S", 60.0)
    q = mtq.Queue(qname, redis_url, settings=FAST)
    tasks = q.submit_many([{"i": i} for i in range(300)])
    ran: list[int] = []

    def handle(p: dict[str, int]) -> int:
        ran.append(p["i"])
        return p["i"]

    w = make_worker(FunctionModel(handle), qname, redis_url, max_batch_size=1)
    claims: list[tuple[int, int]] = []  # (asked for, got)
    claim = w.consumer.claim

    def claim_and_log(batch_size: int, lease_ms: int | None = None,
                      room: int | None = None) -> list[mtq.Claimed]:
        assert room == 1
        got = claim(batch_size, lease_ms, room)
        claims.append((batch_size, len(got)))
        return got

    w.consumer.claim = claim_and_log  # type: ignore[method-assign]
    peak = SlotPeak(w)
    idle = QueueKeys(qname).idle
    with serving(w) as run:
        wait_for(all_done(tasks), 20, "the worker did not run every task")
        wait_for(lambda: r.hget(idle, w.worker_id) is not None, 10,
                 f"the worker did not register idle after the queue emptied: {claims}")
        # a claim that found the queue empty; the first that did asked for many
        short = next(i for i, (asked, got) in enumerate(claims) if got < asked)
        assert claims[short][0] > 1, claims
        room = r.hget(idle, w.worker_id).decode().split("|")[2]
        assert room == "1"
        burst = q.submit_many([{"i": i} for i in range(300, 304)])
        wait_for(all_done(burst), 10, "the burst did not run")
        run.stop()
    assert ran == list(range(304))
    assert [t.info().deliveries for t in tasks] == [1] * 300
    assert peak.most <= fetcher_module.AHEAD_MOST
    deep = [c for c in claims if c[0] > 1]
    assert deep and max(got for _, got in deep) >= fetcher_module.AHEAD_MOST // 2, claims
    assert len(claims) < 40, f"{len(claims)} claims for 300 tasks: {claims}"


class SettleLog:
    """Wraps a worker's ``consumer.settle``: records which thread settled which tasks
    (the model thread is the one serving() runs the worker in); ``hold_chunks``: a
    settle that streams chunks waits for ``release``; ``fail_inline``: the model
    thread's first settle raises RedisUnavailable, before ("unsent") or after ("lost
    reply") the real one ran."""

    def __init__(self, w: Worker, hold_chunks: bool = False, fail_inline: str = "") -> None:
        self.real = w.consumer.settle
        self.calls: list[tuple[str, list[str]]] = []
        self.hold_chunks, self.fail_inline = hold_chunks, fail_inline
        self.holding, self.release = threading.Event(), threading.Event()
        w.consumer.settle = self  # type: ignore[method-assign]

    def __call__(self, outcomes: Any, chunks: Any = ()) -> Any:
        name = threading.current_thread().name
        self.calls.append((name, [o.task.id for o in outcomes]))
        if chunks and self.hold_chunks:
            self.holding.set()
            assert self.release.wait(20), "the test never released the chunks"
        if self.fail_inline and name != "mtq-publisher":
            mode, self.fail_inline = self.fail_inline, ""
            if mode == "lost reply":
                self.real(outcomes, chunks)
            raise mtq.RedisUnavailable("connection reset (test)")
        return self.real(outcomes, chunks)

    def threads(self, task_id: str) -> list[str]:
        return [name for name, ids in self.calls if task_id in ids]


def test_an_idle_worker_settles_in_the_model_thread_a_busy_one_in_the_publisher(
        qname: str, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Publisher.settle_here: a batch that ends with the next batch claimed ahead is left
    to the publisher, and the model runs on; one that ends with nothing waiting in the
    slot is settled by the model thread itself (no hand-off to the publisher), which
    yields its CPU once as the ack's reply comes in (and the publisher never does)."""
    from mtq.broker import lane

    yields: list[str] = []
    monkeypatch.setattr(lane, "sched_yield",
                        lambda: yields.append(threading.current_thread().name))
    q = mtq.Queue(qname, redis_url, settings=FAST)
    tasks = q.submit_many([{"i": i} for i in range(8)])
    model = HoldsACall(hold=1)
    w = make_worker(model, qname, redis_url)
    log = SettleLog(w)
    with serving(w, model.release) as run:
        # the first batch of 4 is held; the other 4 are claimed into the slot meanwhile
        wait_for(lambda: model.holding.is_set() and len(w.slot) == 4, 10,
                 "the next batch was not claimed while the first ran")
        model.release.set()
        assert [t.result(timeout=10) for t in tasks] == list(range(8))
        # a client has its result as Redis applies the ack, before the publisher's
        # bookkeeping of it is done: the worker is idle once that is done too
        wait_for(lambda: not w.ledger.unsettled, 10, "the publisher kept the batches")
        alone = q.submit({"i": 8})  # to the idle worker
        assert alone.result(timeout=10) == 8
        run.stop()
    assert model.calls == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    assert [log.threads(t.id) for t in tasks[:4]] == [["mtq-publisher"]] * 4
    # the second batch: by either, whether the publisher was still settling the first
    assert all(len(log.threads(t.id)) == 1 for t in tasks[4:])
    assert log.threads(alone.id) == ["test-worker"]
    assert [t.info().deliveries for t in [*tasks, alone]] == [1] * 9
    inline = [name for name, _ in log.calls if name == "test-worker"]
    assert [name for name in yields if name != "MainThread"] == inline, \
        "one yield per settle in the model thread, none in the publisher"
    # (this thread yields after its submit of `alone` if the submit handed it over: the
    # worker may not have registered again yet; see test_direct.py)
    assert yields.count("MainThread") <= 1


class WaitLog:
    """Wraps a worker's ``consumer.wait``: which thread waited, and the ids of the tasks
    each wait was handed."""

    def __init__(self, w: Worker) -> None:
        real = w.consumer.wait
        self.calls: list[tuple[str, list[str]]] = []

        def wait(*args: Any, **kw: Any) -> Any:
            got = real(*args, **kw)
            handed = [t.id for t in got] if isinstance(got, list) else []
            self.calls.append((threading.current_thread().name, handed))
            return got

        w.consumer.wait = wait  # type: ignore[method-assign]

    def waited_for(self, task_id: str) -> list[str]:
        return [name for name, ids in self.calls if task_id in ids]


@pytest.mark.parametrize(("fast_batch_s", "waiter"), [(60.0, "test-worker"),
                                                       (0.0, "mtq-fetcher")],
                         ids=["fast-model", "slow-model"])
def test_an_idle_fast_worker_waits_for_work_in_its_model_thread(
        qname: str, redis_url: str, r: redis.Redis, monkeypatch: pytest.MonkeyPatch,
        fast_batch_s: float, waiter: str) -> None:
    """Fetcher.wait: once its model has shown itself fast (a batch in under
    FAST_BATCH_S, set here so that every batch is fast, or none), an idle worker's
    wait for work (BLPOP) is made by the model thread, which runs what a submit hands
    it with no hand-off from the fetcher; a slow model's fetcher waits itself."""
    monkeypatch.setattr(fetcher_module, "FAST_BATCH_S", fast_batch_s)
    q = mtq.Queue(qname, redis_url, settings=FAST)
    model = Recorder(lambda p: p * 2, max_batch_size=4, max_wait_ms=0)
    w = make_worker(model, qname, redis_url)
    log = WaitLog(w)
    with serving(w) as run:
        wait_for(lambda: r.hlen(QueueKeys(qname).idle) == 1, 10,
                 "the worker did not register idle")
        first = q.submit(0)  # the model has not run a batch yet: the fetcher waits
        assert first.result(timeout=10) == 0
        tasks = []
        for i in range(1, 6):
            if i > 1 and waiter == "test-worker":  # the model thread's batch has ended
                wait_for(lambda: w.slot._waiter == "taken", 10,
                         "the model thread did not take the wait")
            tasks.append(q.submit(i))
            assert tasks[-1].result(timeout=10) == 2 * i
        run.stop()
    # the fetcher's wait for the second was out before the first batch ended
    assert [log.waited_for(t.id) for t in (first, tasks[0])] == [["mtq-fetcher"]] * 2
    assert [log.waited_for(t.id) for t in tasks[1:]] == [[waiter]] * 4
    assert model.seen() == list(range(6))
    assert [t.info().deliveries for t in [first, *tasks]] == [1] * 6


def test_a_pause_takes_the_wait_back_from_the_model_thread(
        qname: str, redis_url: str, r: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """Paused while its model thread waits for work, the worker gives up its direct
    delivery registration (a paused worker is handed nothing): a task submitted then
    stays queued, and runs once it resumes. Stopped while the model thread waits, it
    stops."""
    monkeypatch.setattr(fetcher_module, "FAST_BATCH_S", 60.0)
    keys = QueueKeys(qname)
    q = mtq.Queue(qname, redis_url, settings=FAST)
    model = Recorder(lambda p: p * 2, max_batch_size=4, max_wait_ms=0)
    w = make_worker(model, qname, redis_url)
    log = WaitLog(w)
    with serving(w) as run:
        for i in range(2):
            assert q.submit(i).result(timeout=10) == 2 * i
        wait_for(lambda: w.slot._waiter == "taken", 10, "the model thread did not take the wait")
        w.command({"cmd": "pause"})
        wait_for(lambda: r.hlen(keys.idle) == 0, 10, "a paused worker stayed registered")
        held = q.submit(7)
        assert held.status() == "queued"
        w.command({"cmd": "resume"})
        assert held.result(timeout=10) == 14
        assert q.submit(8).result(timeout=10) == 16
        wait_for(lambda: w.slot._waiter == "taken", 10, "the model thread did not wait again")
        totals = run.stop()  # with the wait in the model thread: bounded by serving()
    assert totals["succeeded"] == 4
    assert r.hlen(keys.idle) == 0, "a stopped worker takes its registration back"
    assert "test-worker" in {name for name, _ in log.calls}


class Streams(Model):
    """Streams two tokens per payload, then returns their join."""

    name = "streams"
    max_batch_size = 4
    max_wait_ms = 0.0

    def predict(self, batch: list[Any]) -> Any:
        for i, p in enumerate(batch):
            yield i, f"{p}-a"
            yield i, f"{p}-b"
        return [f"{p}-a{p}-b" for p in batch]


def test_an_outcome_waits_for_its_chunks_in_the_publishers_hands(qname: str,
                                                                  redis_url: str) -> None:
    """A task's chunks reach Redis before its outcome: while the publisher holds a
    task's chunks, the model thread does not settle the task itself (it would end the
    task, and its lease, before the chunks were written: they would be refused)."""
    q = mtq.Queue(qname, redis_url, settings=FAST)
    w = make_worker(Streams(), qname, redis_url)
    log = SettleLog(w, hold_chunks=True)
    with serving(w, log.release) as run:
        t = q.submit("x")
        assert log.holding.wait(10), "the publisher never sent the chunks"
        wait_for(lambda: w.totals["batches"] == 1 and not w.ledger.busy, 10,
                 "the model did not finish its batch")
        assert t.status() == "running"  # its outcome waits behind its chunks
        log.release.set()
        assert t.result(timeout=10) == "x-ax-b"
        run.stop()
    assert [e.data for e in t.events(timeout=5) if e.kind == "token"] == ["x-a", "x-b"]
    assert set(log.threads(t.id)) == {"mtq-publisher"}


@pytest.mark.parametrize("fault", ["unsent", "lost reply"])
def test_a_settle_that_fails_in_the_model_thread_is_taken_over_by_the_publisher(
        qname: str, redis_url: str, fault: str) -> None:
    """The model thread's settle is tried once: when it fails (the connection reset
    before the ack went out, or after it ran with its reply lost), the publisher
    settles the outcome instead, and the task ends once, with one delivery (an ack
    applied already is refused by its lease token, not applied twice)."""
    q = mtq.Queue(qname, redis_url, settings=FAST)
    model = Recorder(lambda p: p * 2)
    w = make_worker(model, qname, redis_url)
    log = SettleLog(w, fail_inline=fault)
    with serving(w) as run:
        t = q.submit(21)
        assert t.result(timeout=10) == 42
        wait_for(lambda: len(log.threads(t.id)) == 2, 10, "the publisher did not settle it")
        # its settle is done (the log has it from its start): the model thread settles
        # only when the publisher has nothing in hand
        wait_for(lambda: w.ledger.unsettled == 0, 10, "the publisher did not finish settling it")
        later = q.submit(1)
        assert later.result(timeout=10) == 2
        run.stop()
    assert log.threads(t.id) == ["test-worker", "mtq-publisher"]
    assert log.threads(later.id) == ["test-worker"]  # one failure, not a fallback for good
    assert model.seen() == [21, 1]
    assert t.info().deliveries == 1 and t.status() == "succeeded"
    assert q.stats()["succeeded"] == 2


@pytest.mark.gpu_smoke
def test_partial_batch_runs_max_wait_after_submission(qname: str, redis_url: str) -> None:
    q = mtq.Queue(qname, redis_url, settings=FAST)
    model = Recorder(max_batch_size=32)
    w = make_worker(model, qname, redis_url, max_wait_ms=50)
    assert w.policy.max_wait_ms == 50.0
    with serving(w) as run:
        wait_for(lambda: w.state == "idle", 10, "worker did not start")
        t0 = time.monotonic()
        tasks = q.submit_many([{"i": i} for i in range(3)])
        wait_for(model.started.is_set, 5, "the batch of 3 never ran")
        ran_after = model.times[0] - t0
        wait_for(all_done(tasks), 5, "tasks did not finish")
        run.stop()
    assert [len(c) for c in model.calls] == [3]
    assert 0.040 <= ran_after < 1.0, f"batch ran {ran_after * 1000:.1f} ms after submission"


@pytest.mark.gpu_smoke
def test_batch_holds_at_most_one_task_per_stream_in_fifo_order(qname: str,
                                                               redis_url: str) -> None:
    q = mtq.Queue(qname, redis_url, settings=FAST)
    streams = ["a", "b", "c", "d"]
    by_stream = {s: q.submit_many([{"s": s, "i": i} for i in range(10)], stream=s)
                 for s in streams}
    model = Recorder(lambda p: f"{p['s']}{p['i']}", max_batch_size=32)
    w = make_worker(model, qname, redis_url)
    with serving(w) as run:
        wait_for(lambda: q.stats()["succeeded"] == 40, 15, "40 stream tasks did not succeed")
        run.stop()
    for call in model.calls:
        names = [p["s"] for p in call]
        assert len(names) == len(set(names)), f"two tasks of one stream in a batch: {call}"
    seen = model.seen()
    for s in streams:
        assert [p["i"] for p in seen if p["s"] == s] == list(range(10))
        assert [t.result(timeout=1) for t in by_stream[s]] == [f"{s}{i}" for i in range(10)]
        finished = [t.info().finished or 0 for t in by_stream[s]]
        assert finished == sorted(finished), f"stream {s} finished out of order"


# -- failure isolation -----------------------------------------------------------------------
def test_one_bad_payload_is_bisected_out_then_dead_after_retries(qname: str,
                                                                 redis_url: str) -> None:
    settings = FAST.replace(max_retries=1)
    q = mtq.Queue(qname, redis_url, settings=settings)
    bad = 13
    tasks = q.submit_many([{"i": i, "bad": i == bad} for i in range(32)])
    model = Recorder(lambda p: p["i"] + 100, fail_if=lambda p: p["bad"], max_batch_size=32)
    w = make_worker(model, qname, redis_url, settings=settings)
    with serving(w) as run:
        wait_for(all_done(tasks), 10, "the batch did not settle")
        totals = run.stop()
    assert len(model.calls[0]) == 32
    first_batch_calls = len(model.calls) - 1  # the last call is the lone retry
    assert first_batch_calls <= 2 * 5 + 2, [len(c) for c in model.calls]
    assert model.calls[-1] == [{"i": bad, "bad": True}]
    for i, t in enumerate(tasks):
        if i == bad:
            info = t.info()
            assert (info.status, info.attempts) == ("dead", 2)
            assert "ValueError: bad payload in batch" in (info.error or "")
        else:
            assert t.result(timeout=1) == i + 100
    assert (totals["succeeded"], totals["retried"], totals["dead"]) == (31, 1, 1)


def test_undecodable_payload_fails_only_that_task(qname: str, redis_url: str) -> None:
    q = mtq.Queue(qname, redis_url, settings=FAST)  # max_retries 3: not retried anyway
    good = q.submit_many([{"i": i} for i in range(3)])
    q.broker.submit([NewTask(id="garbage-1", payload=b"\xc1")])
    more = q.submit_many([{"i": 3}])
    model = Recorder(lambda p: p["i"], max_batch_size=32)
    w = make_worker(model, qname, redis_url)
    with serving(w) as run:
        garbage = q.task("garbage-1")
        wait_for(all_done([*good, *more, garbage]), 10, "tasks did not settle")
        run.stop()
    info = garbage.info()
    assert (info.status, info.attempts) == ("failed", 1)
    assert (info.error or "").startswith("PayloadError: cannot decode")
    assert [t.result(timeout=1) for t in [*good, *more]] == [0, 1, 2, 3]
    assert len(model.calls) == 1 and len(model.calls[0]) == 4  # one predict, no bisection


def test_unencodable_result_fails_only_that_task(qname: str, redis_url: str) -> None:
    q = mtq.Queue(qname, redis_url, settings=FAST)
    tasks = q.submit_many([{"i": i} for i in range(3)])
    model = Recorder(lambda p: object() if p["i"] == 1 else p["i"], max_batch_size=32)
    w = make_worker(model, qname, redis_url)
    with serving(w) as run:
        wait_for(all_done(tasks), 10, "tasks did not settle")
        run.stop()
    assert statuses(tasks) == ["succeeded", "failed", "succeeded"]
    assert "EncodeError" in (tasks[1].info().error or "")


def test_function_model_runs_per_item_and_publishes_each_outcome(qname: str,
                                                                 redis_url: str) -> None:
    settings = FAST.replace(max_retries=0)
    q = mtq.Queue(qname, redis_url, settings=settings)
    payloads = [{"x": i} for i in range(6)]
    tasks = q.submit_many(payloads)
    calls: list[Any] = []

    def handle(p: dict[str, Any]) -> Any:
        calls.append(p)
        if p["x"] == 2:
            raise RuntimeError("item 2 is broken")
        if p["x"] == 5:  # the first outcome was published before the batch ended
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                if tasks[0].status() == "succeeded":
                    return "saw-first"
                time.sleep(0.01)
            return "first-not-published"
        return p["x"] * 3

    w = make_worker(FunctionModel(handle), qname, redis_url, settings=settings)
    assert w.policy.max_batch_size == 64
    with serving(w) as run:
        wait_for(all_done(tasks), 10, "tasks did not settle")
        totals = run.stop()
    assert calls == payloads  # one call per payload, in order, no bisection retries
    assert [tasks[i].result(timeout=1) for i in (0, 1, 3, 4)] == [0, 3, 9, 12]
    assert tasks[5].result(timeout=1) == "saw-first"
    info = tasks[2].info()
    assert info.status == "dead" and "RuntimeError: item 2 is broken" in (info.error or "")
    assert (totals["succeeded"], totals["dead"]) == (5, 1)


# -- control commands -------------------------------------------------------------------------
def test_pause_gives_back_claimed_ahead_and_resume_runs_them(qname: str,
                                                             redis_url: str) -> None:
    q = mtq.Queue(qname, redis_url, settings=FAST)
    tasks = q.submit_many([{"i": i} for i in range(4)])
    gate = threading.Event()
    model = Recorder(lambda p: p["i"], gate=gate, max_batch_size=2)
    w = make_worker(model, qname, redis_url)
    with serving(w, gate) as run:
        wait_for(lambda: model.started.is_set() and len(w.slot) == 2, 5,
                 "the first batch did not start with the next one claimed ahead")
        assert statuses(tasks) == ["running"] * 4
        w.command({"cmd": "pause"})
        assert w.slot.paused and w.state == "running"  # the batch in progress goes on
        # the claimed-ahead tasks are back in the queue, their delivery not counted
        assert statuses(tasks[2:]) == ["queued", "queued"]
        assert [t.info().deliveries for t in tasks[2:]] == [0, 0]
        assert len(w.slot) == 0
        gate.set()
        wait_for(lambda: statuses(tasks[:2]) == ["succeeded"] * 2, 5,
                 "the running batch did not finish while paused")
        wait_for(lambda: w.state == "paused", 5, "state did not become paused")
        model.started.clear()
        assert not model.started.wait(0.3), "predict ran while paused"
        assert statuses(tasks[2:]) == ["queued", "queued"]
        assert w.report()["held"] == 0
        w.command({"cmd": "resume"})
        wait_for(all_done(tasks), 5, "resumed worker did not run the rest")
        run.stop()
    assert [t.result(timeout=1) for t in tasks] == [0, 1, 2, 3]
    assert [[p["i"] for p in c] for c in model.calls] == [[0, 1], [2, 3]]


def test_drain_returns_once_the_queue_is_empty(qname: str, redis_url: str) -> None:
    q = mtq.Queue(qname, redis_url, settings=FAST)
    tasks = q.submit_many([{"i": i} for i in range(20)])
    model = Recorder(lambda p: p["i"], max_batch_size=4)
    w = make_worker(model, qname, redis_url)
    run = Running(w)
    w.command({"cmd": "drain"})
    totals = run.join(15)  # returns by itself: nobody calls stop()
    assert statuses(tasks) == ["succeeded"] * 20
    assert totals["succeeded"] == 20
    assert registry.list_workers(w.consumer.redis, qname) == []


def test_drain_runs_every_task_of_a_stream(qname: str, redis_url: str) -> None:
    """A stream's next task is claimable only once the previous one is acked, which
    the publisher does after the model thread moves on. To make the interleaving
    deterministic (not a race the fetcher usually wins), each settle waits until
    the fetcher has made one claim after the batch ran; the Redis calls are real."""
    q = mtq.Queue(qname, redis_url, settings=FAST)
    tasks = q.submit_many([{"i": i} for i in range(4)], stream="s")
    ran, claimed_after = threading.Event(), threading.Event()

    def fn(p: dict[str, Any]) -> int:
        claimed_after.clear()
        ran.set()
        return int(p["i"])

    model = Recorder(fn, max_batch_size=4)
    w = make_worker(model, qname, redis_url)
    claim, settle = w.consumer.claim, w.consumer.settle

    def claim_then_mark(batch_size: int, lease_ms: int | None = None,
                        room: int | None = None) -> list[mtq.Claimed]:
        got = claim(batch_size, lease_ms, room)
        if not got and ran.is_set():
            claimed_after.set()
        return got

    def settle_after_a_claim(outcomes: Any, chunks: Any = ()) -> Any:
        claimed_after.wait(2)
        ran.clear()
        return settle(outcomes, chunks)

    w.consumer.claim = claim_then_mark  # type: ignore[method-assign]
    w.consumer.settle = settle_after_a_claim  # type: ignore[method-assign]
    run = Running(w)
    w.command({"cmd": "drain"})
    run.join(20)
    assert statuses(tasks) == ["succeeded"] * 4


RELOADABLE = '''
import mtq

VERSION = {version!r}


class Versioned(mtq.Model):
    max_batch_size = 4
    max_wait_ms = 0
    name = "versioned"
    version = VERSION

    def predict(self, batch):
        hook = globals().get("HOOK")
        if hook is not None:
            hook(batch)
        return [{{"v": VERSION, "i": p["i"]}} for p in batch]
'''


@pytest.fixture
def reloadable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path]]:
    """A module on sys.path the test rewrites; no bytecode cache, so a rewrite within
    the same second is still seen by importlib.reload."""
    name = "mtq_reload_" + uuid.uuid4().hex[:10]
    path = tmp_path / f"{name}.py"
    path.write_text(RELOADABLE.format(version="1"))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name, path
    sys.modules.pop(name, None)


def rewrite(path: Path, text: str) -> None:
    path.write_text(text)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))


def test_reload_swaps_the_model_without_losing_tasks(qname: str, redis_url: str,
                                                     reloadable: tuple[str, Path]) -> None:
    name, path = reloadable
    q = mtq.Queue(qname, redis_url, settings=FAST)
    w = make_worker(f"{name}:Versioned", qname, redis_url)
    module = sys.modules[name]
    gate, started = threading.Event(), threading.Event()

    def hook(batch: list[Any]) -> None:  # holds the first batch so others wait in the slot
        started.set()
        assert gate.wait(20)

    vars(module)["HOOK"] = hook  # survives importlib.reload: the new source does not define it
    first = q.submit_many([{"i": i} for i in range(12)])
    with serving(w, gate) as run:
        wait_for(lambda: started.is_set() and len(w.slot) == 4, 5,
                 "the first batch did not start with the next one claimed ahead")
        rewrite(path, RELOADABLE.format(version="22"))
        w.command({"cmd": "reload"})
        assert len(w.slot) == 0  # claimed-ahead tasks went back for the new model
        gate.set()
        wait_for(lambda: w.model.describe() == ("versioned", "22"), 5, "the model was not reloaded")
        wait_for(all_done(first), 10, "tasks submitted before the reload did not finish")
        later = q.submit_many([{"i": i} for i in range(12, 15)])
        wait_for(all_done(later), 5, "tasks submitted after the reload did not finish")
        assert w.last_error == ""
        run.stop()
    results = [t.result(timeout=1) for t in [*first, *later]]
    assert [r["i"] for r in results] == list(range(15))
    assert [r["v"] for r in results[:4]] == ["1"] * 4  # the batch running at reload time
    assert [r["v"] for r in results[4:]] == ["22"] * 11
    assert w.policy.max_batch_size == 4 and w.slot.max_batch_size == 4


def test_failed_reload_keeps_the_old_model(qname: str, redis_url: str,
                                           reloadable: tuple[str, Path]) -> None:
    name, path = reloadable
    q = mtq.Queue(qname, redis_url, settings=FAST)
    w = make_worker(f"{name}:Versioned", qname, redis_url)
    with serving(w) as run:
        t = q.submit({"i": 0})
        assert t.result(timeout=5) == {"v": "1", "i": 0}
        rewrite(path, "raise RuntimeError('broken at import')\n")
        w.command({"cmd": "reload"})
        wait_for(lambda: "reload failed" in w.last_error, 5, "reload failure not reported")
        assert "broken at import" in w.last_error and "TargetError" in w.last_error
        assert w.model.describe() == ("versioned", "1")
        wait_for(lambda: w.state == "idle", 5, "worker did not go back to idle")
        t2 = q.submit({"i": 1})
        assert t2.result(timeout=5) == {"v": "1", "i": 1}
        assert w.report()["last_error"] == w.last_error
        run.stop()


def test_reload_of_a_model_object_reports_an_error(qname: str, redis_url: str) -> None:
    q = mtq.Queue(qname, redis_url, settings=FAST)
    model = Recorder(lambda p: p)
    w = make_worker(model, qname, redis_url)
    with serving(w) as run:
        w.command({"cmd": "reload"})
        wait_for(lambda: "cannot re-import" in w.last_error, 5, "no error for a model object")
        assert q.submit(5).result(timeout=5) == 5
        assert w.model is model
        run.stop()


def test_reload_arriving_right_after_take_does_not_drop_the_batch(
        qname: str, redis_url: str, reloadable: tuple[str, Path]) -> None:
    name, _path = reloadable
    q = mtq.Queue(qname, redis_url, settings=FAST)
    w = make_worker(f"{name}:Versioned", qname, redis_url)
    take = w.slot.take
    fired = threading.Event()

    def take_then_reload() -> Any:
        # the interleaving of a control command landing between take() and the
        # model loop's check of the reload flag, made deterministic
        batch = take()
        if batch and not fired.is_set():
            fired.set()
            w.command({"cmd": "reload"})
        return batch

    w.slot.take = take_then_reload  # type: ignore[method-assign]
    with serving(w) as run:
        tasks = q.submit_many([{"i": i} for i in range(3)])
        wait_for(fired.is_set, 5, "no batch was taken")
        try:
            wait_for(all_done(tasks), 1.5, f"tasks stuck: {statuses(tasks)}")
        finally:
            run.stop()
    assert statuses(tasks) == ["succeeded"] * 3


def test_cancel_of_a_task_waiting_in_the_slot(qname: str, redis_url: str) -> None:
    q = mtq.Queue(qname, redis_url, settings=FAST)
    a, b = q.submit_many([{"i": 0}, {"i": 1}])
    gate = threading.Event()
    model = Recorder(lambda p: p["i"], gate=gate, max_batch_size=1)
    w = make_worker(model, qname, redis_url)
    with serving(w, gate) as run:
        wait_for(lambda: model.started.is_set() and [t.id for t in w.slot.ids()] == [b.id], 5,
                 "b was not claimed ahead while a runs")
        assert b.cancel() is False  # it is leased: its worker is asked to stop it
        wait_for(lambda: b.status() == "cancelled", 5, "b was not cancelled from the slot")
        assert len(w.slot) == 0
        gate.set()
        assert a.result(timeout=5) == 0
        totals = run.stop()
    assert model.seen() == [{"i": 0}]  # b never ran
    with pytest.raises(mtq.TaskCancelled):
        b.result(timeout=1)
    assert (totals["succeeded"], totals["cancelled"]) == (1, 1)


# -- registry and control channel ---------------------------------------------------------
def test_running_worker_is_in_the_registry_until_stopped(qname: str, redis_url: str,
                                                         r: redis.Redis) -> None:
    q = mtq.Queue(qname, redis_url, settings=FAST)
    model = Recorder(lambda p: p, max_batch_size=8)
    w = make_worker(model, qname, redis_url, worker_id=f"test-{qname}")
    with serving(w) as run:
        tasks = q.submit_many([1, 2, 3])
        wait_for(all_done(tasks), 5, "tasks did not finish")

        def entry() -> dict[str, Any] | None:
            rows = [e for e in registry.list_workers(r, qname) if e["id"] == w.worker_id]
            return rows[0] if rows and rows[0].get("succeeded") == 3 else None

        e = wait_for(entry, 5, "worker not in the registry with its 3 successes")
        assert e["queue"] == qname and e["device"] == "cpu"
        assert e["model"] == "recorder" and str(e["version"]) == "7"
        assert e["state"] in ("idle", "running")
        assert e["histogram"] == {"3": 1} and e["typical_batch"] == 3
        assert e["max_batch_size"] == 8 and e["tasks"] == 3 and e["pid"] == os.getpid()
        assert e["last_error"] == "" and e["heartbeat_age_s"] < 5
        assert registry.list_workers(r, "other-" + qname) == []
        run.stop()
    assert [e for e in registry.list_workers(r) if e["id"] == w.worker_id] == []
    assert r.exists(f"mtq:worker:{w.worker_id}") == 0


def test_listener_delivers_commands_and_send_counts_subscribers(qname: str,
                                                                r: redis.Redis) -> None:
    got: list[dict[str, Any]] = []
    arrived = threading.Event()

    def callback(msg: dict[str, Any]) -> None:
        got.append(msg)
        arrived.set()

    assert control.send(r, qname, "pause") == 0  # nobody listens yet
    listener = control.Listener(r, qname, callback)
    listener.start()
    try:
        assert listener.subscribed.is_set()
        channel = f"mtq:{{{qname}}}:control"
        r.publish(channel, "not json")
        r.publish(channel, json.dumps([1, 2]))
        assert control.send(r, qname, "reload", worker="w-1") == 1
        assert arrived.wait(5), "the command never reached the callback"
        assert got == [{"cmd": "reload", "worker": "w-1"}]  # malformed ones ignored
    finally:
        listener.close()
    assert not listener._thread.is_alive()


def test_listener_drives_a_worker(qname: str, redis_url: str, r: redis.Redis) -> None:
    q = mtq.Queue(qname, redis_url, settings=FAST)
    model = Recorder(lambda p: p)
    w = make_worker(model, qname, redis_url)
    listener = control.Listener(r, qname, w.command)
    with serving(w) as run:
        listener.start()
        try:
            assert control.send(r, qname, "pause") == 1
            wait_for(lambda: w.state == "paused", 5, "pause did not reach the worker")
            t = q.submit(1)
            assert control.send(r, qname, "resume") == 1
            assert t.result(timeout=5) == 1
        finally:
            listener.close()
        run.stop()
    assert not listener._thread.is_alive()


def test_registry_keeps_string_fields_as_strings(r: redis.Redis) -> None:
    worker_id = "test-" + uuid.uuid4().hex[:8]
    registry.beat(r, worker_id, {"queue": "q", "version": "1.10", "model": "null",
                                 "batch": 3, "histogram": {"3": 1}}, ttl_s=5)
    try:
        (e,) = [e for e in registry.list_workers(r) if e["id"] == worker_id]
        assert e["batch"] == 3 and e["histogram"] == {"3": 1}
        assert (e["version"], e["model"]) == ("1.10", "null")
    finally:
        registry.remove(r, worker_id)


# -- consumer calls the supervisor uses -------------------------------------------------------
def test_give_back_puts_task_back_at_stream_head_counting_the_delivery(qname: str,
                                                                     redis_url: str) -> None:
    settings = QueueSettings(max_deliveries=2)
    q = mtq.Queue(qname, redis_url, settings=settings)
    c = mtq.Consumer(qname, redis_url, settings=settings, worker_id="w1")
    a, b = q.submit_many([{"i": 0}, {"i": 1}], stream="s")
    (t,) = c.claim(10)
    assert t.id == a.id and t.deliveries == 1 and not t.suspect
    assert c.give_back([(t.id, "wrong-token")], [], "worker killed") == [mtq.broker.codes.Code.LEASE_LOST]
    assert c.give_back([(t.id, t.token)], [], "worker killed") == [1]
    info = a.info()
    assert (info.status, info.deliveries, info.attempts) == ("queued", 1, 0)
    assert q.stats()["redelivered"] == 1 and q.stats()["running"] == 0
    (t2,) = c.claim(10)  # back at the head: before b
    assert t2.id == a.id and t2.deliveries == 2 and t2.suspect
    assert c.give_back([(t2.id, t2.token)], [], "worker killed") == [1]
    info = a.info()
    assert info.status == "dead"
    assert info.error == "PoisonTask: worker killed on each of 2 deliveries"
    assert q.stats()["dead"] == 1
    (t3,) = c.claim(10)  # the stream was released
    assert t3.id == b.id
    assert c.give_back([], [], "x") == []


def test_give_back_keeps_order_of_several_tasks(qname: str, redis_url: str) -> None:
    q = mtq.Queue(qname, redis_url)
    c = mtq.Consumer(qname, redis_url, worker_id="w1")
    tasks = q.submit_many([{"i": i} for i in range(5)])
    got = c.claim(3)
    assert c.give_back([(t.id, t.token) for t in got], [], "supervisor saw it die") == [1, 1, 1]
    again = c.claim(10)
    assert [t.id for t in again] == [t.id for t in tasks]
    assert [t.deliveries for t in again] == [2, 2, 2, 1, 1]


def test_give_back_puts_the_running_batch_before_the_claimed_ahead_tasks(
        qname: str, redis_url: str) -> None:
    """A dead worker's running items were claimed before its claimed-ahead ones, so
    they go back in front of them: counted, and the others uncounted."""
    q = mtq.Queue(qname, redis_url)
    c = mtq.Consumer(qname, redis_url, worker_id="w1")
    tasks = q.submit_many([{"i": i} for i in range(6)])
    running, ahead = c.claim(2), c.claim(2)
    codes = c.give_back([(t.id, t.token) for t in running], [(t.id, t.token) for t in ahead],
                        "worker process died")
    assert codes == [1, 1, 1, 1]
    again = c.claim(10)
    assert [t.id for t in again] == [t.id for t in tasks]
    assert [t.deliveries for t in again] == [2, 2, 1, 1, 1, 1]


def test_release_leases_does_not_count_the_delivery(qname: str, redis_url: str) -> None:
    q = mtq.Queue(qname, redis_url)
    c = mtq.Consumer(qname, redis_url, worker_id="w1")
    tasks = q.submit_many([{"i": i} for i in range(3)], stream="s") + q.submit_many([{"j": 0}])
    got = c.claim(10)
    assert [t.id for t in got] == [tasks[0].id, tasks[3].id]
    assert c.release_leases([(t.id, t.token) for t in got]) == 2
    assert [t.info().deliveries for t in (tasks[0], tasks[3])] == [0, 0]
    assert [t.status() for t in (tasks[0], tasks[3])] == ["queued", "queued"]
    assert q.stats()["redelivered"] == 0
    assert c.release_leases([(got[0].id, got[0].token)]) == 0  # not running any more
    assert c.release_leases([]) == 0
    again = c.claim(10)
    assert [t.id for t in again] == [tasks[0].id, tasks[3].id]
    assert [t.deliveries for t in again] == [1, 1] and not any(t.suspect for t in again)


def test_claim_reports_age_since_submission(qname: str, redis_url: str) -> None:
    q = mtq.Queue(qname, redis_url)
    c = mtq.Consumer(qname, redis_url, worker_id="w1")
    start = time.monotonic()
    q.submit({"x": 1})
    assert not threading.Event().wait(0.15)  # let the task age
    (t,) = c.claim(1)
    elapsed_ms = (time.monotonic() - start) * 1000
    assert 140 <= t.age_ms <= elapsed_ms + 5, (t.age_ms, elapsed_ms)
    q.submit({"x": 2})
    (fresh,) = c.claim(1)
    assert 0 <= fresh.age_ms < 100


# -- a worker that stops heartbeating ----------------------------------------------------------
@pytest.mark.slow
def test_a_frozen_worker_leaves_the_registry_and_its_tasks_are_reclaimed(
        qname: str, redis_url: str, r: redis.Redis, subprocess_env: dict[str, str],
        tmp_path: Path) -> None:
    """SIGSTOP a worker process holding tasks: its registry entry expires, and a live
    worker's reaper takes its tasks back after the lease and runs them."""
    import signal
    import subprocess

    lease_ms = 1500
    q = mtq.Queue(qname, redis_url, lease_ms=lease_ms)
    log = (tmp_path / "frozen.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mtq", "worker", "run", "tests.models:Probe", "--queue", qname,
         "--redis", redis_url, "--lease-ms", str(lease_ms)],
        env=subprocess_env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: [w for w in registry.list_workers(r, qname) if w["pid"] == proc.pid],
                 20, "the worker process never appeared in the registry")
        tasks = q.submit_many([mtq.Request({"sleep": 30, "s": s, "i": 0}, stream=s)
                               for s in ("a", "b")])
        wait_for(lambda: statuses(tasks) == ["running", "running"], 10,
                 "the worker did not start both tasks")
        proc.send_signal(signal.SIGSTOP)
        wait_for(lambda: not [w for w in registry.list_workers(r, qname)
                              if w["pid"] == proc.pid], 15,
                 "a worker that stopped heartbeating stayed in the registry")
        live = make_worker(FunctionModel(lambda p: p["s"]), qname, redis_url,
                           settings=QueueSettings(lease_ms=lease_ms))
        with serving(live):
            assert [t.result(timeout=20) for t in tasks] == ["a", "b"]
        assert [t.info().deliveries for t in tasks] == [2, 2]
    finally:
        proc.kill()
        proc.wait(timeout=10)
        log.close()


def test_a_permanent_error_fails_the_item_at_once_without_retries(qname: str,
                                                                  redis_url: str) -> None:
    class Picky(Model):
        max_batch_size = 8
        max_wait_ms = 0

        def predict(self, batch: list[Any]) -> list[Any]:
            return [mtq.PermanentError("malformed request") if p.get("bad") else p["x"]
                    for p in batch]

    q = mtq.Queue(qname, redis_url, settings=FAST)
    good, bad = q.submit_many([{"x": 1}, {"bad": True}])
    with serving(make_worker(Picky(), qname, redis_url)):
        assert good.result(timeout=10) == 1
        with pytest.raises(mtq.TaskFailed, match="PermanentError: malformed request"):
            bad.result(timeout=10)
    info = bad.info()
    assert (info.status, info.attempts) == ("failed", 1), "no retry, no dead-letter"
    assert q.stats()["retried"] == 0


# -- regressions from the review ---------------------------------------------------------------
def test_a_result_whose_encoding_raises_fails_that_task_and_the_worker_goes_on(
        qname: str, redis_url: str) -> None:
    """A meta tensor's .cpu() raises NotImplementedError (not a PayloadError) inside the
    publisher: that task fails, and the publisher lives to settle everything after it."""
    torch = pytest.importorskip("torch")

    class Meta(Model):
        max_batch_size = 4
        max_wait_ms = 0

        def predict(self, batch: list[Any]) -> list[Any]:
            return [torch.empty(2, device="meta") if p.get("meta") else p["x"] for p in batch]

    q = mtq.Queue(qname, redis_url, settings=FAST)
    bad, good = q.submit_many([{"meta": True}, {"x": 1}])
    with serving(make_worker(Meta(), qname, redis_url)):
        assert good.result(timeout=10) == 1
        with pytest.raises(mtq.TaskFailed):
            bad.result(timeout=10)
        later = q.submit({"x": 2})
        assert later.result(timeout=10) == 2, "the worker stopped settling"
    assert bad.info().attempts == 1, "an unencodable result is not retried"


def test_leases_are_extended_until_a_stopping_worker_settles(qname: str,
                                                             redis_url: str) -> None:
    """stop() during a predict longer than the lease: the heartbeat keeps the lease,
    so the result is recorded, not discarded as lost."""
    started = threading.Event()

    class Long(Model):
        max_batch_size = 1
        max_wait_ms = 0

        def predict(self, batch: list[Any]) -> list[Any]:
            started.set()
            assert stopping.wait(10)
            time.sleep(1.2)  # the work itself: 2 x the 600 ms lease, after stop()
            # another worker's reaper runs now: it takes the task if its lease lapsed
            reaped.append(mtq.Consumer(qname, redis_url, settings=settings).reap())
            return ["done"]

    stopping = threading.Event()
    reaped: list[int] = []
    settings = QueueSettings(lease_ms=600)
    q = mtq.Queue(qname, redis_url, settings=settings)
    t = q.submit({})
    running = Running(make_worker(Long(), qname, redis_url, settings=settings))
    assert started.wait(10), "predict did not start"
    running.worker.stop()
    stopping.set()
    totals = running.join(20)
    assert reaped == [0], "the lease lapsed while the batch ran"
    assert totals["succeeded"] == 1 and totals["lost"] == 0, totals
    assert (t.status(), t.info().deliveries) == ("succeeded", 1)


def test_a_command_addressed_to_another_worker_is_ignored(qname: str, redis_url: str) -> None:
    w = make_worker(FunctionModel(lambda p: p), qname, redis_url)
    w.setup()
    w.command({"cmd": "pause", "worker": "someone-else"})
    w.command({"cmd": "pause", "supervisor": "another-supervisor"})
    w.command({"cmd": "scale", "replicas": 3})  # a supervisor's command: nothing to do here
    assert w.state == "idle"
    w.command({"cmd": "pause", "worker": w.worker_id})
    assert w.state == "paused"


def test_a_poison_task_given_back_at_the_limit_wakes_a_sleeper(qname: str, redis_url: str,
                                                               r: redis.Redis) -> None:
    """The next task of its stream becomes claimable: a sleeping worker must hear of it."""
    settings = QueueSettings(max_deliveries=1)
    q = mtq.Queue(qname, redis_url, settings=settings)
    c = mtq.Consumer(qname, redis_url, settings=settings, worker_id="w1")
    first, second = q.submit_many([{"i": 0}, {"i": 1}], stream="s")
    (t,) = c.claim(10)
    r.delete(q.broker.keys.wake)
    assert c.give_back([(t.id, t.token)], [], "worker process died") == [1]
    assert first.status() == "dead"
    assert r.llen(q.broker.keys.wake) > 0, "no wake marker for the stream's next task"
    assert [x.id for x in c.claim(10)] == [second.id]


def test_a_bad_device_name_is_a_config_error(qname: str, redis_url: str) -> None:
    with pytest.raises(mtq.ConfigError, match="bad device 'gpu'"):
        make_worker(FunctionModel(lambda p: p), qname, redis_url, device="gpu")
