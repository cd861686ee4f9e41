"""The exporter's families per queue, tenant and band (``mtq_tenant_*``), from the
scheduling hashes :class:`mtq.observe.prometheus.MtqCollector` reads in its one round
trip (:mod:`mtq.broker.scrape`).

Cardinality is bounded: per queue, the :data:`~mtq.broker.tenants.DEFAULT_TOP` (20)
tenants served the most cost get their own ``tenant`` label value (each with up to
three bands); every other tenant is summed per band under ``tenant="other"``
(:func:`mtq.broker.tenants.top_tenants`). So a queue exports at most (N + 1) x 3 series
per family, whatever its number of tenants. Tasks without a tenant are
``tenant="none"``. The top N is chosen by cost served, a total that only grows, so the
set changes only when one tenant's total overtakes another's; at such a change the
counters of "other" step down once (Prometheus' rate() reads a decrease as a reset).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from mtq.broker.tenants import OTHER, TenantRow

#: family name -> (TenantRow attribute, kind, help)
TENANT_FAMILIES = {
    "mtq_tenant_waiting": ("waiting", "gauge",
                           "Tasks of the tenant waiting in the band (scheduling on)."),
    "mtq_tenant_waiting_cost": ("waiting_cost", "gauge",
                                "Estimated cost of the tenant's tasks waiting in the band."),
    "mtq_tenant_running": ("running", "gauge", "Tasks of the tenant running in the band."),
    "mtq_tenant_served_cost": ("served_cost", "counter",
                               "Cost served to the tenant in the band (charged at claim, "
                               "settled with the reported cost)."),
    "mtq_tenant_held": ("held", "counter", "Times a claim passed the tenant over for its "
                                           "rate limit (rate_limit_mode hold)."),
    "mtq_tenant_refused": ("refused", "counter", "Tasks of the tenant refused at submit "
                                                 "(rate limit, or a deadline it would miss)."),
}
LABELS = ("queue", "tenant", "band")


def label(row: TenantRow) -> str:
    """The ``tenant`` label value of a row: 'none' for tasks without a tenant."""
    if row.folded:
        return OTHER
    return row.tenant or "none"


def tenant_families(shown: Mapping[str, Sequence[TenantRow]]
                    ) -> Iterator[tuple[str, str, str, tuple[str, ...], list[Any]]]:
    """The families (:data:`mtq.observe.prometheus.Family`) of queue -> the rows it
    exports (:func:`~mtq.broker.tenants.top_tenants` of its rows)."""
    labelled = [((q, label(r), r.band), r) for q, rows in shown.items() for r in rows]
    for name, (attr, kind, doc) in TENANT_FAMILIES.items():
        yield name, kind, doc, LABELS, [(labels, getattr(r, attr)) for labels, r in labelled]
