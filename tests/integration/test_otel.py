"""OpenTelemetry context propagation: producer span -> task hash -> worker spans."""

from __future__ import annotations

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)

import mtq
from mtq.broker.keys import QueueKeys
from mtq.workers.worker import Worker
from tests.support.waits import wait_for
from tests.support.workers import serving

FAST = mtq.QueueSettings(lease_ms=5000, retry_backoff_ms=0)


@pytest.fixture(scope="module")
def provider() -> TracerProvider:
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):  # set by an earlier module: one per process
        return current
    p = TracerProvider()
    trace.set_tracer_provider(p)
    return p


@pytest.fixture
def exporter(provider: TracerProvider):
    exp = InMemorySpanExporter()
    processor = SimpleSpanProcessor(exp)
    provider.add_span_processor(processor)
    yield exp
    exp.clear()
    exp.shutdown()  # (later spans are dropped by it)


def _by_name(exporter, name):
    return [s for s in exporter.get_finished_spans() if s.name == name]


@pytest.mark.parametrize("target", ["tests.models:Probe", "tests.models:Counter"])
def test_worker_spans_join_the_producer_trace(redis_url, r, qname, exporter, target):
    q = mtq.Queue(qname, redis_url)
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("request") as request:
        t = q.submit({"s": "a", "i": 1, "n": 3}, stream="a")
        many = q.submit_many([{"i": 2, "n": 2}, {"i": 3, "n": 2}])
    stored = r.hget(QueueKeys(qname).task(t.id), "traceparent")
    assert stored is not None and stored.decode().startswith("00-")
    worker = Worker(target, qname, url=redis_url, settings=FAST)
    with serving(worker):
        for task in (t, *many):
            task.result(timeout=20)
        wait_for(lambda: len(_by_name(exporter, "mtq.run")) == 3, 10,
                 "the worker did not record an mtq.run span per task")
    trace_id = request.get_span_context().trace_id
    submits = _by_name(exporter, f"mtq.submit {qname}")
    assert len(submits) == 2
    assert all(s.kind == trace.SpanKind.PRODUCER for s in submits)
    assert all(s.parent is not None and s.parent.span_id == request.get_span_context().span_id
               for s in submits)
    runs = {s.attributes["mtq.task_id"]: s for s in _by_name(exporter, "mtq.run")}
    waits = {s.attributes["mtq.task_id"]: s for s in _by_name(exporter, "mtq.queue_wait")}
    assert set(runs) == set(waits) == {t.id, *(m.id for m in many)}
    single = next(s for s in submits if s.attributes["mtq.batch_size"] == 1)
    assert single.attributes["mtq.task_id"] == t.id
    for task_id, run in runs.items():
        wait = waits[task_id]
        producer = single if task_id == t.id else next(s for s in submits if s is not single)
        for span in (wait, run):
            assert span.context.trace_id == trace_id
            assert span.parent is not None and span.parent.span_id == producer.context.span_id
            assert span.kind == trace.SpanKind.CONSUMER
            assert span.attributes["mtq.queue"] == qname
            assert span.attributes["mtq.delivery"] == 1
            assert span.attributes["mtq.status"] == "succeeded"
            assert span.attributes["mtq.batch_size"] >= 1
        # submit (server clock) <= claim <= batch start <= outcome; clocks of one host
        slack = 50_000_000  # 50 ms: the server's and this process's clocks, rounding
        assert producer.start_time - slack <= wait.start_time <= wait.end_time
        assert wait.end_time <= run.start_time + slack
        assert run.start_time <= run.end_time


def test_no_span_no_traceparent(redis_url, r, qname, exporter):
    q = mtq.Queue(qname, redis_url)
    t = q.submit({"i": 1})
    many = q.submit_many([{"i": 2}])
    for task in (t, *many):
        assert r.hget(QueueKeys(qname).task(task.id), "traceparent") is None
    worker = Worker("tests.models:Probe", qname, url=redis_url, settings=FAST)
    with serving(worker):
        t.result(timeout=20)
        many[0].result(timeout=20)
    worker.batchlog.spans()
    assert not exporter.get_finished_spans()
