"""What operators read (the queues, one snapshot of everything, a task found by id, scheduling per
tenant and band);
it lives in :mod:`mtq.client.admin`, and this module re-exports it under the path the
docs name (``mtq.admin.snapshot``)."""

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

__all__ = ["QueueView", "Snapshot", "TenantRow", "_pct", "find_task", "queue_names", "snapshot",
           "tenants", "top_rows", "top_tenants"]
