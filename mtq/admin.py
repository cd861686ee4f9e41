"""What operators read (the queues, one snapshot of everything, a task found by id);
it lives in :mod:`mtq.client.admin`, and this module re-exports it under the path the
docs name (``mtq.admin.snapshot``)."""

from mtq.client.admin import (
    QueueView,
    Snapshot,
    _pct,
    find_task,
    queue_names,
    snapshot,
)

__all__ = ["QueueView", "Snapshot", "_pct", "find_task", "queue_names", "snapshot"]
