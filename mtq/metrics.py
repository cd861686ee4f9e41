"""The Prometheus exporter; it lives in :mod:`mtq.observe.prometheus`.

This path is kept for code that imports it. Its :class:`MtqCollector` reads the
worker registry (:func:`mtq.broker.registry.list_workers`) unless given another
reader (the one in :mod:`mtq.observe.prometheus` reads none by default).
"""

from __future__ import annotations

from collections.abc import Sequence

import redis

from mtq.broker.registry import list_workers
from mtq.observe import prometheus as _prometheus
from mtq.observe.prometheus import (
    BATCH_BOUNDS,
    CONTENT_TYPE,
    COUNTERS,
    DEFAULT_PORT,
    GAUGES,
    HISTOGRAMS,
    WORKER_LABELS,
    Reading,
    WorkerReader,
    exporter_client,
    known_queues,
    make_exporter,
    registry_of,
)


class MtqCollector(_prometheus.MtqCollector):
    """:class:`mtq.observe.prometheus.MtqCollector`, reading the worker registry
    by default."""

    def __init__(self, client: redis.Redis, queues: Sequence[str] | None = None,
                 workers: WorkerReader | None = list_workers) -> None:
        super().__init__(client, queues, workers)


__all__ = ["BATCH_BOUNDS", "CONTENT_TYPE", "COUNTERS", "DEFAULT_PORT", "GAUGES", "HISTOGRAMS",
           "WORKER_LABELS", "MtqCollector", "Reading", "WorkerReader", "exporter_client",
           "known_queues", "make_exporter", "registry_of"]
