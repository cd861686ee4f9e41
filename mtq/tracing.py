"""OpenTelemetry context propagation; it lives in :mod:`mtq.observe.otel`.

This path is kept for code that imports it (``from mtq import tracing``).
"""

from mtq.observe.otel import TRACER, TaskSpan, api, emit, traced_submit

__all__ = ["TRACER", "TaskSpan", "api", "emit", "traced_submit"]
