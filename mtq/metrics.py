"""The Prometheus exporter; it lives in :mod:`mtq.observe.prometheus`."""

from __future__ import annotations

from mtq.observe.prometheus import (
    BATCH_BOUNDS,
    CONTENT_TYPE,
    COUNTERS,
    DEFAULT_PORT,
    GAUGES,
    HISTOGRAMS,
    WORKER_LABELS,
    MtqCollector,
    Reading,
    WorkerReader,
    exporter_client,
    known_queues,
    make_exporter,
    registry_of,
)

__all__ = ["BATCH_BOUNDS", "CONTENT_TYPE", "COUNTERS", "DEFAULT_PORT", "GAUGES", "HISTOGRAMS",
           "WORKER_LABELS", "MtqCollector", "Reading", "WorkerReader", "exporter_client",
           "known_queues", "make_exporter", "registry_of"]
