"""How ``mtq rq worker``'s jobs end where RQ's retry, webhook and cancel bookkeeping
meet its batched, fenced commit (mtq/rq/finishing.py): retries with an interval,
webhooks on retried attempts, a job cancelled while it runs. Each was found running
RQ's own test suite under BatchWorker (scripts/rq-conformance); these tests hold the
same behaviour with the real rq package, real workers and real HTTP webhooks."""

from __future__ import annotations

import http.server
import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone

import pytest
import redis

pytest.importorskip("rq")

from rq import Queue, Retry
from rq.job import Job, JobStatus
from rq.registry import CanceledJobRegistry, FailedJobRegistry, ScheduledJobRegistry
from rq.results import Result
from rq.serializers import JSONSerializer
from rq.suspension import resume, suspend
from rq.webhook import Webhook

from mtq.rq import leases
from mtq.rq.worker import BatchWorker
from tests import rq_jobs as J
from tests.support.waits import wait_for


@pytest.fixture
def q(client: redis.Redis, qname: str, redis_url: str,
      monkeypatch: pytest.MonkeyPatch) -> Queue:
    monkeypatch.setenv("MTQ_TEST_REDIS_URL", redis_url)  # for the jobs run in this process
    return Queue(qname, connection=client, serializer=JSONSerializer)


def run_burst(q: Queue) -> BatchWorker:
    w = BatchWorker([q], connection=q.connection, name="w-" + uuid.uuid4().hex[:8])
    w.work(burst=True)
    return w


def fetch(q: Queue, job: Job) -> Job:
    return Job.fetch(job.id, connection=q.connection, serializer=JSONSerializer)


class Hooks(http.server.ThreadingHTTPServer):
    """A real HTTP server on a free loopback port that records each webhook it gets."""

    def __init__(self) -> None:
        self.got: list[tuple[str, dict]] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.got.append((self.path, json.loads(body)))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}{path}"

    def paths(self) -> list[str]:
        return [p for p, _ in self.got]


@pytest.fixture
def hooks() -> Iterator[Hooks]:
    server = Hooks()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def both(hooks: Hooks) -> list[Webhook]:
    return [Webhook(hooks.url("/finished"), "finished", method="POST"),
            Webhook(hooks.url("/failed"), "failed", method="POST")]


# -- retries with an interval ----------------------------------------------------------
def test_a_failed_job_with_a_retry_interval_is_scheduled_with_its_retry_counted(
        q: Queue, client: redis.Redis) -> None:
    job = q.enqueue(J.boom, "x", retry=Retry(max=2, interval=30))
    t0 = datetime.now(timezone.utc)
    run_burst(q)
    j = fetch(q, job)
    assert j.get_status() == JobStatus.SCHEDULED and j.retries_left == 1
    registry = ScheduledJobRegistry(queue=q)
    assert registry.get_job_ids() == [job.id]
    due = registry.get_scheduled_time(job)
    assert 25 <= (due - t0).total_seconds() <= 35, due
    assert q.count == 0 and no_lease(client, q)
    assert j.latest_result() is None  # as under rq worker: a retried attempt stores none


def test_a_returned_retry_with_an_interval_is_scheduled_and_counted(
        q: Queue, client: redis.Redis) -> None:
    key = "retry-later-" + uuid.uuid4().hex
    job = q.enqueue(J.retry_later, key, 30)
    run_burst(q)
    j = fetch(q, job)
    assert j.get_status() == JobStatus.SCHEDULED and j.number_of_retries == 1
    assert ScheduledJobRegistry(queue=q).get_job_ids() == [job.id]
    assert j.latest_result().type == Result.Type.RETRIED
    assert client.get(key) == b"1"


# -- webhooks ----------------------------------------------------------------------------
def test_the_failed_webhook_fires_once_when_the_retries_run_out(
        q: Queue, client: redis.Redis, hooks: Hooks) -> None:
    key = "attempts-" + uuid.uuid4().hex
    job = q.enqueue(J.fail_counting, key, retry=Retry(max=1), webhooks=both(hooks))
    run_burst(q)
    assert client.get(key) == b"2" and fetch(q, job).get_status() == JobStatus.FAILED
    assert hooks.paths() == ["/failed"]
    assert hooks.got[0][1]["status"] == "failed" and "attempt 2 fails" in \
        hooks.got[0][1]["exc_info"]


def test_a_job_that_succeeds_on_its_retry_fires_only_finished(
        q: Queue, client: redis.Redis, hooks: Hooks) -> None:
    key = "flaky-" + uuid.uuid4().hex
    job = q.enqueue(J.flaky, key, retry=Retry(max=1), webhooks=both(hooks))
    run_burst(q)
    assert fetch(q, job).get_status() == JobStatus.FINISHED
    assert hooks.paths() == ["/finished"]


def test_a_returned_retry_fires_failed_once_when_it_runs_out(
        q: Queue, hooks: Hooks) -> None:
    job = q.enqueue(J.always_retry, webhooks=both(hooks))
    run_burst(q)
    assert fetch(q, job).get_status() == JobStatus.FAILED
    assert hooks.paths() == ["/failed"]


# -- cancelled while it runs -------------------------------------------------------------
def test_a_job_cancelled_while_it_runs_keeps_its_result_and_its_dependents_wait(
        q: Queue, client: redis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    flag = "flag-" + uuid.uuid4().hex
    parent = q.enqueue(J.until_flag, flag)
    child = q.enqueue(J.add, 1, 2, depends_on=parent)

    def cancel_once_started() -> None:
        wait_for(lambda: parent.get_status(refresh=True) == JobStatus.STARTED, 10,
                 "the parent job never started")
        parent.cancel()
        client.set(flag, 1)

    thread = threading.Thread(target=cancel_once_started)
    thread.start()
    with caplog.at_level(logging.INFO, logger="rq.worker"):
        run_burst(q)
    thread.join(15)
    j = fetch(q, parent)
    assert j.get_status() == JobStatus.CANCELED
    assert j.latest_result().return_value == "done"
    assert parent.id in CanceledJobRegistry(queue=q).get_job_ids()
    assert fetch(q, child).get_status() == JobStatus.DEFERRED and q.count == 0
    assert "stall past its lease" not in caplog.text
    assert "cancelled while it ran" in caplog.text
    assert no_lease(client, q)


def no_lease(client: redis.Redis, q: Queue) -> bool:
    """The worker holds no lease on the queue any more (every job ended)."""
    return not client.hlen(leases.owner_key(q.name)) and not client.zcard(
        leases.leases_key(q.name))


# -- the default exception handler -------------------------------------------------------
@pytest.mark.parametrize("disabled", [False, True])
def test_disable_default_exception_handler_keeps_a_failed_job_out_of_the_registry(
        q: Queue, disabled: bool) -> None:
    job = q.enqueue(J.boom, "kaput")
    w = BatchWorker([q], connection=q.connection, name="w-" + uuid.uuid4().hex[:8],
                    disable_default_exception_handler=disabled)
    w.work(burst=True)
    j = fetch(q, job)
    assert j.get_status() == JobStatus.FAILED  # as under rq worker, whichever
    assert (job.id in FailedJobRegistry(queue=q).get_job_ids()) is not disabled
    assert (j.latest_result() is None) is disabled


# -- rq suspend --------------------------------------------------------------------------
def test_a_burst_under_rq_suspend_runs_nothing_and_returns_then_runs_after_resume(
        q: Queue, client: redis.Redis) -> None:
    job = q.enqueue(J.add, 2, 3)
    w = BatchWorker([q], connection=client, name="w-" + uuid.uuid4().hex[:8])
    suspend(client)
    try:
        assert w.work(burst=True) is False
        assert q.count == 1 and fetch(q, job).get_status() == JobStatus.QUEUED
    finally:
        resume(client)
    assert w.work(burst=True) is True  # the same worker, again, as RQ's tests do
    assert q.count == 0 and fetch(q, job).return_value() == 5


# -- RQ's work() arguments and worker bookkeeping -------------------------------------------
def worker(q: Queue, *queues: Queue) -> BatchWorker:
    return BatchWorker([q, *queues], connection=q.connection, name="w-" + uuid.uuid4().hex[:8])


def test_max_jobs_is_exact_even_once_the_worker_claims_in_batches(
        q: Queue, client: redis.Redis) -> None:
    key = "ran-" + uuid.uuid4().hex
    for i in range(10):
        q.enqueue(J.record, key, f"j{i}")
    w = worker(q)
    assert w.work(burst=True, max_jobs=1) is True and client.llen(key) == 1
    # timed now: fast jobs, so it would claim many at once; max_jobs caps the claim
    assert w.work(burst=True, max_jobs=3) is True
    assert client.llen(key) == 4 and q.count == 6 and no_lease(client, q)
    assert max(w.batch_sizes) <= 3, w.batch_sizes


def test_max_idle_time_returns_once_idle_that_long(q: Queue, client: redis.Redis) -> None:
    key = "ran-" + uuid.uuid4().hex
    q.enqueue(J.record, key, "a")
    w = worker(q)
    t0 = time.monotonic()
    assert w.work(max_idle_time=1) is True  # runs the job, then idles 1 s and returns
    assert 1 <= time.monotonic() - t0 < 8 and client.llen(key) == 1
    t0 = time.monotonic()
    assert w.work(max_idle_time=1) is False
    assert 1 <= time.monotonic() - t0 < 8


def test_dequeue_strategies_take_the_queues_in_rqs_orders(
        q: Queue, client: redis.Redis, qname: str) -> None:
    other = Queue(qname + "-b", connection=client, serializer=JSONSerializer)
    for strategy, want in (("default", ["a", "a", "a", "b", "b", "b"]),
                           ("round_robin", ["a", "b", "a", "b", "a", "b"])):
        key = f"order-{strategy}-" + uuid.uuid4().hex
        for _ in range(3):
            q.enqueue(J.record, key, "a")
            other.enqueue(J.record, key, "b")
        worker(q, other).work(burst=True, dequeue_strategy=strategy)  # type: ignore[arg-type]
        got = [x.decode().split(":")[0] for x in client.lrange(key, 0, -1)]
        assert got == want, (strategy, got)
    key = "order-random-" + uuid.uuid4().hex
    for _ in range(3):
        q.enqueue(J.record, key, "a")
        other.enqueue(J.record, key, "b")
    worker(q, other).work(burst=True, dequeue_strategy="random")  # type: ignore[arg-type]
    assert client.llen(key) == 6
    with pytest.raises(ValueError, match="round_robin"):
        worker(q).work(burst=True, dequeue_strategy="fifo")  # type: ignore[arg-type]


def test_rqs_class_methods_rebuild_a_batch_worker_by_its_key(
        q: Queue, client: redis.Redis) -> None:
    w = worker(q)
    w.register_birth()
    try:
        found = BatchWorker.find_by_key(w.key, connection=client)
        assert found is not None and found.name == w.name
        assert w.name in {x.name for x in BatchWorker.all(connection=client)}
    finally:
        w.register_death()


def test_a_warm_stop_asked_while_busy_is_recorded_in_the_worker_hash(
        q: Queue, client: redis.Redis) -> None:
    import signal

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    q.enqueue(J.term_self)
    late = q.enqueue(J.add, 1, 1)
    w = worker(q)
    try:
        assert w.work() is True  # not burst: it returns because of the stop
    finally:
        signal.signal(signal.SIGTERM, before[0])
        signal.signal(signal.SIGINT, before[1])
    assert client.hget(w.key, "shutdown_requested_date") is not None
    assert fetch(q, late).get_status() == JobStatus.QUEUED  # given back, not run
