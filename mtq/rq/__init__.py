"""Serving RQ queues with mtq workers: ``mtq rq worker QUEUE...`` (see docs/rq.md).

``mtq.rq.batched`` marks a job function as batched; it needs nothing but the standard
library, so the modules that define jobs import it whether a plain ``rq worker`` or
``mtq rq worker`` runs them. The worker itself (:mod:`mtq.rq.worker`) imports rq.
"""

from __future__ import annotations

from mtq.rq.batched import Batched, batched, batched_spec

__all__ = ["Batched", "batched", "batched_spec"]
