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
import mtq.workers.ledger
import mtq.workers.worker
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
        # "until_stopped": step on until a member is stopped, then a few more steps, so
        # that a slow machine cannot finish the batch before the cancel arrives.
        until_stopped = any(p.get("until_stopped") for p in batch)
        after = 5
        for _ in range(int(max(p.get("steps", 0) for p in batch))):
            cur.raise_if_cancelled()
            self.skipped |= cur.stopped
            if until_stopped and cur.stopped:
                after -= 1
                if after == 0:
                    break
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


def test_one_cancelled_batch_member_ends_cancelled_the_other_succeeds(
        qname: str, redis_url: str) -> None:
    model = Batch()
    q = mtq.Queue(qname, redis_url)
    with serving(make_worker(model, qname, redis_url)):
        a, b = q.submit_many([{"v": 1, "steps": 4000, "until_stopped": True},
                              {"v": 2, "steps": 4000}])
        assert model.started.wait(10)
        running(a)
        a.cancel()
        assert ended(a, 5).status == "cancelled"
        assert b.result(timeout=10) == 2
    assert model.skipped == {a.id} and model.batches == [2], (model.skipped, model.batches)


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
    assert not report.lost and (report.succeeded, report.cancelled) == (0, 1), report
    info = t.info()
    assert info.status == "cancelled", info
    assert r.hget(QueueKeys(qname).task(t.id), "result") is None
    with pytest.raises(mtq.TaskCancelled):
        t.result(timeout=1)
    # a task a scheduling claim charged leaves its lane's running count as it ends
    u = q.submit({"x": 2}, tenant="acme")
    (claimed,) = c.claim(1)
    assert claimed.id == u.id and u.cancel() is False
    count = f"mtq:{{{qname}}}:sched:count"
    assert int(r.hget(count, "s:acme|r") or 0) == 1
    c.settle([mtq.Outcome(claimed, ok=True, value="late")])
    assert u.status() == "cancelled" and int(r.hget(count, "s:acme|r") or 0) == 0


# -- bad input, the queue's default ----------------------------------------------------------

def test_a_bad_timeout_is_refused_before_anything_is_written(
        qname: str, redis_url: str, r: redis.Redis) -> None:
    from click.testing import CliRunner

    from mtq.cli.main import cli

    q = mtq.Queue(qname, redis_url)
    for bad in (0, -1, float("nan"), float("inf"), True, "1", 1e12):
        with pytest.raises(mtq.ConfigError, match="timeout must be a number of seconds"):
            q.submit({}, timeout=bad)
        with pytest.raises(mtq.ConfigError, match="timeout"):
            q.submit_many([{}, {}], timeout=bad)
        with pytest.raises(mtq.ConfigError, match="timeout"):
            q.submit_many([{}, mtq.Request({}, timeout=bad)])
    assert not r.keys(f"mtq:{{{qname}}}:task:*"), "a refused submit wrote a task"
    for bad in ("0", "-1", "nan", "x"):
        res = CliRunner().invoke(cli, ["submit", qname, "{}", "--run-timeout", bad,
                                       "--redis", redis_url])
        assert res.exit_code == 2 and "Traceback" not in res.output, (bad, res.output)
    for bad in ("-1", "x", "nan", "1e12"):
        res = CliRunner().invoke(cli, ["queue", "config", qname, "task_timeout_s", bad,
                                       "--redis", redis_url])
        assert res.exit_code == 2 and "Traceback" not in res.output, (bad, res.output)
    assert not r.keys(f"mtq:{{{qname}}}:task:*")
    assert not r.hgetall(f"mtq:{{{qname}}}:config"), "a refused setting was stored"
    with pytest.raises(mtq.ConfigError, match="cancel_grace_s"):
        QueueSettings(cancel_grace_s=-1)


def test_a_run_timeout_rides_on_the_task_only_when_given(qname: str, redis_url: str,
                                                         r: redis.Redis) -> None:
    from click.testing import CliRunner

    from mtq.cli.main import cli

    q = mtq.Queue(qname, redis_url)
    plain, timed = q.submit({}), q.submit({}, timeout=1.5)
    many = q.submit_many([{}, mtq.Request({}, timeout=3)], timeout=2)
    res = CliRunner().invoke(cli, ["submit", qname, "{}", "--run-timeout", "4",
                                   "--redis", redis_url])
    assert res.exit_code == 0, res.output
    k = QueueKeys(qname)
    stored = [r.hget(k.task(t), "timeout") for t in
              (plain.id, timed.id, many[0].id, many[1].id, res.output.strip())]
    assert stored == [None, b"1500", b"2000", b"3000", b"4000"]
    c = mtq.Consumer(qname, redis_url, settings=FAST)
    got = {t.id: t.timeout_ms for t in c.claim(10)}
    assert got[plain.id] == 0 and got[timed.id] == 1500 and got[many[1].id] == 3000


def test_the_queues_task_timeout_applies_to_tasks_without_their_own(
        qname: str, redis_url: str) -> None:
    from click.testing import CliRunner

    from mtq.cli.main import cli

    res = CliRunner().invoke(cli, ["queue", "config", qname, "task_timeout_s", "0.2",
                                   "max_retries", "0", "dead_letter", "false",
                                   "--redis", redis_url])
    assert res.exit_code == 0, res.output

    def work(p: dict[str, Any]) -> str:
        for _ in range(int(p["steps"])):
            mtq.current_task().raise_if_cancelled()
            time.sleep(0.005)
        return "ok"

    q = mtq.Queue(qname, redis_url)
    w = mtq.workers.worker.Worker(FunctionModel(work), qname, url=redis_url,  # stored settings
                                  settings={"lease_ms": 1500})
    with serving(w):
        long, own, short = q.submit({"steps": 2000}), q.submit({"steps": 100}, timeout=5), \
            q.submit({"steps": 1})
        assert ended(long).error.startswith("TaskTimeout: ")  # type: ignore[union-attr]
        assert own.result(timeout=10) == "ok" and short.result(timeout=10) == "ok"


# -- the supervisor's hook ----------------------------------------------------------------------

class Told(mtq.workers.ledger.Monitor):
    def __init__(self) -> None:
        self.aborted_calls: list[tuple[dict[str, str], float]] = []
        self.cleared = 0

    def aborted(self, reasons: Any, grace_s: float) -> None:
        self.aborted_calls.append((dict(reasons), grace_s))

    def idle(self) -> None:
        self.cleared += 1


def test_a_call_that_does_not_stop_is_reported_to_the_monitor_once(
        qname: str, redis_url: str) -> None:
    gate = threading.Event()

    def deaf(p: dict[str, Any]) -> str:
        assert gate.wait(20)
        return "done"

    told = Told()
    settings = QueueSettings(lease_ms=1500, retry_backoff_ms=0, max_retries=0,
                             dead_letter=False, cancel_grace_s=0.5)
    q = mtq.Queue(qname, redis_url)
    with serving(make_worker(FunctionModel(deaf), qname, redis_url, settings=settings,
                             monitor=told), gate):
        a = q.submit({}, timeout=0.2)
        running(a)
        wait_for(lambda: told.aborted_calls, 5, "the monitor was never told")
        assert told.aborted_calls == [({a.id: "timeout"}, 0.5)]
        gate.set()
        assert ended(a).status == "failed"
        gate.clear()
        b = q.submit({})
        running(b)
        b.cancel()
        wait_for(lambda: len(told.aborted_calls) == 2, 5, "the cancel was never reported")
        assert told.aborted_calls[1] == ({b.id: "cancel"}, 0.5)
        gate.set()
        assert ended(b).status == "cancelled"
    assert len(told.aborted_calls) == 2, told.aborted_calls


def test_a_task_cancelled_before_its_call_began_is_not_run(qname: str, redis_url: str) -> None:
    # a per-item batch of two: the second, cancelled while the first runs, is held by
    # the model thread (not in the slot): its function is never called
    gate = threading.Event()
    calls: list[int] = []

    def deaf(p: dict[str, Any]) -> int:
        calls.append(p["i"])
        if p["i"] == 1:
            assert gate.wait(20)
        return p["i"]

    q = mtq.Queue(qname, redis_url)
    w = make_worker(FunctionModel(deaf), qname, redis_url, settings=NO_RETRY)
    with serving(w, gate):
        for t in q.submit_many([{"i": 0}] * 4):  # fast: the worker claims more than one
            t.result(timeout=10)
        del calls[:]
        a, b = q.submit_many([{"i": 1}, {"i": 2}])
        running(a)
        wait_for(lambda: b.status() == "running", 10, "the second was not claimed with it")
        b.cancel()
        wait_for(lambda: b.id in w.ledger.cancel, 5, "the worker never heard of the cancel")
        gate.set()
        assert ended(b).status == "cancelled"
        assert ended(a).status == "succeeded"
    assert calls == [1], calls
