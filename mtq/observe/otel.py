"""OpenTelemetry context propagation: a task carries its producer's trace.

Optional: everything here is a no-op when ``opentelemetry-api`` is not installed
(``pip install 'mtq[otel]'``). The import is tried once, on first use; after that
the cost on a path without OpenTelemetry is one check of a cached value.

Span layout (one trace from the web request to the model):

* ``mtq.submit <queue>`` (PRODUCER), made by :meth:`mtq.Queue.submit` /
  ``submit_many`` only when a valid span is current (a request instrumented by
  the web framework's OpenTelemetry instrumentation, or the caller's own span);
  a child of that span. Its W3C ``traceparent`` is stored in each task's hash
  (field ``traceparent``; no span current: no field, no cost).
* ``mtq.queue_wait`` (CONSUMER): from the submit (server clock: the claim's
  time less the task's age) to the claim; a child of ``mtq.submit``.
* ``mtq.run`` (CONSUMER): from the start of the task's batch (a generator: the
  prefill of its admission group) to its outcome; a child of ``mtq.submit``.

Both worker spans carry ``mtq.queue``, ``mtq.task_id``, ``mtq.delivery``,
``mtq.batch_size`` and ``mtq.status`` (the handler's outcome: succeeded, failed,
cancelled). A worker makes them on its heartbeat thread, after the fact, with
explicit start and end times: never on the model thread. The context travels in
W3C Trace Context form whatever propagator the process configured, since the
task's field is a ``traceparent``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

#: the cached import: unset, None (not installed) or the API's pieces
_UNSET: Any = object()
_api: Any = _UNSET

TRACER = "mtq"


def api() -> Any:
    """The OpenTelemetry API (a small namespace) or None when it is not installed.
    Imported once; later calls return the cached value."""
    global _api
    if _api is _UNSET:
        try:
            from opentelemetry import trace
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError:
            _api = None
        else:
            _api = _Api(trace, TraceContextTextMapPropagator())
    return _api


class _Api:
    __slots__ = ("trace", "w3c")

    def __init__(self, trace: Any, w3c: Any) -> None:
        self.trace = trace
        self.w3c = w3c


def traced_submit(queue: str, tasks: list[T], send: Callable[[list[T]], list[Any]]
                  ) -> list[Any]:
    """``send(tasks)`` inside a PRODUCER span ``mtq.submit <queue>`` whose traceparent
    each task carries, if a valid span is current; else ``send(tasks)`` as it is.
    ``tasks`` are :class:`mtq.broker.protocol.NewTask` (frozen: copied with the field)."""
    ot = api()
    if ot is None or not ot.trace.get_current_span().get_span_context().is_valid:
        return send(tasks)
    tracer = ot.trace.get_tracer(TRACER)
    with tracer.start_as_current_span(
            f"mtq.submit {queue}", kind=ot.trace.SpanKind.PRODUCER,
            attributes={"mtq.queue": queue, "mtq.batch_size": len(tasks)}) as span:
        carrier: dict[str, str] = {}
        ot.w3c.inject(carrier)
        parent = carrier.get("traceparent", "")
        if parent:
            tasks = [dataclasses.replace(t, traceparent=parent)  # type: ignore[type-var]
                     for t in tasks]
        out = send(tasks)
        if len(out) == 1:
            span.set_attribute("mtq.task_id", str(getattr(out[0], "id", "")))
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class TaskSpan:
    """What the worker spans of one traced task are made of (times: wall clock, s)."""

    traceparent: str
    queue: str
    task_id: str
    delivery: int
    batch_size: int
    submitted: float
    claimed: float
    started: float
    ended: float
    status: str


def _ns(t: float) -> int:
    return int(t * 1e9)


def emit(spans: Sequence[TaskSpan]) -> None:
    """Record ``mtq.queue_wait`` and ``mtq.run`` of each task under its producer's
    context (see the module docstring). Nothing without the API."""
    ot = api()
    if ot is None or not spans:
        return
    trace = ot.trace
    tracer = trace.get_tracer(TRACER)
    for s in spans:
        ctx = ot.w3c.extract({"traceparent": s.traceparent})
        if not trace.get_current_span(ctx).get_span_context().is_valid:
            continue  # a malformed field: no trace to join
        attrs = {"mtq.queue": s.queue, "mtq.task_id": s.task_id, "mtq.delivery": s.delivery,
                 "mtq.batch_size": s.batch_size, "mtq.status": s.status}
        wait = tracer.start_span("mtq.queue_wait", context=ctx, kind=trace.SpanKind.CONSUMER,
                                 start_time=_ns(min(s.submitted, s.claimed)), attributes=attrs)
        wait.end(end_time=_ns(s.claimed))
        run = tracer.start_span("mtq.run", context=ctx, kind=trace.SpanKind.CONSUMER,
                                start_time=_ns(s.started), attributes=attrs)
        if s.status == "failed":
            run.set_status(trace.Status(trace.StatusCode.ERROR))
        run.end(end_time=_ns(max(s.ended, s.started)))
