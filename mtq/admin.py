"""What operators read (the queues, one snapshot of everything, a task found by id, scheduling per
tenant and band) and the engine commands (load, unload, reload, reset the engines serving a
queue, waiting for their answers);
they live in :mod:`mtq.client.admin` and :mod:`mtq.client.engines`, and this module
re-exports them under the path the docs name (``mtq.admin.snapshot``, ``mtq.admin.reload``)."""

from mtq.broker.tenants import TenantRow, top_rows, top_tenants
from mtq.client.admin import (
    QueueView,
    Snapshot,
    _pct,
    find_task,
    queue_names,
    snapshot,
    tenants,
)
from mtq.client.engines import engines, load, reload, reset, unload

__all__ = ["QueueView", "Snapshot", "TenantRow", "_pct", "engines", "find_task", "load",
           "queue_names", "reload", "reset", "snapshot", "tenants", "top_rows", "top_tenants",
           "unload"]
