"""The dashboard's tenants panel: for each queue with scheduling on, its busiest
tenant/band rows (tasks waiting and running, then cost served) and one "other" row
summing the rest. Read from the snapshot (:attr:`mtq.admin.QueueView.tenants`): no
Redis command of its own."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from mtq.admin import QueueView
from mtq.broker.tenants import TenantRow, shown_tenant, top_rows
from mtq.dashboard.cells import Column, _cell

#: rows a queue shows in the panel before the rest is summed into "other"
PANEL_TOP = 10


def _num(n: float) -> str:
    n = round(n)
    return f"{n:,}" if n < 100_000 else f"{n / 1e6:.1f}M" if n < 1e8 else f"{n:.2g}"


def tenant_rows(queues: Iterable[QueueView], top: int = PANEL_TOP
                ) -> list[tuple[str, TenantRow]]:
    """(queue, row) for the panel: each queue's :func:`top_rows`, queues in order."""
    return [(q.name, r) for q in queues if q.tenants for r in top_rows(q.tenants, top)]


def tenant_columns() -> list[Column]:
    """The panel's columns."""
    def num(attr: str, style: str = "") -> Any:
        return lambda item: _cell(_num(getattr(item[1], attr)),
                                  style if getattr(item[1], attr) else "dim")

    return [
        Column("queue", lambda item: _cell(item[0]), 2, "left", squeeze=True),
        Column("tenant", lambda item: _cell(shown_tenant(item[1]),
                                            "dim" if item[1].folded else "bold"),
               0, "left", squeeze=True),
        Column("band", lambda item: _cell(item[1].band or "all"), 0, "left"),
        Column("waiting", num("waiting", "bold"), 0),
        Column("running", num("running"), 1),
        Column("served", num("served_cost", "green"), 3),
        Column("w.cost", num("waiting_cost"), 4),
        Column("held", num("held", "yellow"), 5),
        Column("refused", num("refused", "red"), 6),
    ]
