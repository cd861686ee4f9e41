"""Scheduling seen per tenant and band: the rows that ``mtq status --tenants``, the
dashboard's tenants panel and the exporter's ``mtq_tenant_*`` families show.

A queue with scheduling on keeps, per lane (band, tenant), counts in the hash
``sched:count`` ('<b>:<t>|w' waiting tasks, '|c' their cost, '|r' running, '|h' times
a claim passed the tenant over for its rate limit, '|x' tasks refused at submit) and
the cost served in ``sched:served`` ('<b>:<t>'): see _lib.lua, "Scheduling". Reading
them is two HGETALLs a queue (:func:`read_into`), whose size grows with the number of
lanes that ever had work, not with the number of tasks. Everything else here is pure:
:func:`parse_rows` turns the two replies into :class:`TenantRow`, :func:`top_rows`
and :func:`top_tenants` bound what a display or the exporter shows (the busiest N and
what is left summed into "other" rows).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mtq.broker.keys import QueueKeys
from mtq.validation import BAND_NAMES

#: how many tenants (exporter) or rows (status, dashboard) get their own entry by default
DEFAULT_TOP = 20
#: the tenant of a row that sums the rows left out
OTHER = "other"
#: bands, most urgent first (the order rows of one tenant are listed in)
BAND_ORDER = {name: i for i, name in enumerate(BAND_NAMES.values())}


@dataclass(frozen=True)
class TenantRow:
    """One lane of a queue: a tenant ('' = the tasks that name none) in one band
    (interactive, standard, batch), or, with ``folded`` > 0, the sum of that many
    rows left out of a top N (tenant :data:`OTHER`; band '' when it sums every band).
    Counts below 0 (possible while older workers run beside newer ones) read 0."""

    tenant: str
    band: str
    waiting: int = 0
    waiting_cost: float = 0.0
    running: int = 0
    #: cost served to the lane: charged at claim, settled with the reported cost
    served_cost: float = 0.0
    #: times a claim passed the tenant over for its rate limit (rate_limit_mode hold)
    held: int = 0
    #: tasks refused at submit (rate limit in reject mode, or a deadline it would miss)
    refused: int = 0
    #: 0: a lane; else the number of lanes this "other" row sums
    folded: int = 0

    @property
    def active(self) -> int:
        """Tasks waiting or running."""
        return self.waiting + self.running


#: the kinds of the count hash, by their position in a lane's list of figures
_SLOTS = {"w": 0, "c": 1, "r": 2, "h": 3, "x": 4}


def _lane(key: Any) -> str | None:
    """'<b>:<t>' (bytes or str) as str when b is a band letter; None for anything else."""
    lane = key.decode() if isinstance(key, bytes) else str(key)
    return lane if len(lane) > 1 and lane[1] == ":" and lane[0] in BAND_NAMES else None


def parse_rows(count: Mapping[Any, Any], served: Mapping[Any, Any]) -> list[TenantRow]:
    """The rows of a queue from its ``sched:count`` and ``sched:served`` hashes (bytes
    or str), sorted by tenant, then band (most urgent first). No lane: []. Fields of
    other shapes (the band totals '<b>|c', kinds this version does not know) are
    skipped."""
    lanes: defaultdict[str, list[float]] = defaultdict(lambda: [0.0] * 6)
    for key, value in count.items():
        lane_field, sep, kind = (key.decode() if isinstance(key, bytes) else str(key)
                                 ).rpartition("|")
        slot = _SLOTS.get(kind) if sep else None
        lane = _lane(lane_field) if slot is not None else None
        if slot is not None and lane is not None:
            lanes[lane][slot] = float(value)
    for key, value in served.items():
        lane = _lane(key)
        if lane is not None:
            lanes[lane][5] = float(value)
    rows = [TenantRow(lane[2:], BAND_NAMES[lane[0]], int(max(0.0, w)), max(0.0, c),
                      int(max(0.0, r)), max(0.0, s), int(max(0.0, h)), int(max(0.0, x)))
            for lane, (w, c, r, h, x, s) in lanes.items()]
    rows.sort(key=lambda row: (row.tenant, BAND_ORDER[row.band]))
    return rows


def read_into(pipe: Any, keys: QueueKeys) -> int:
    """Queue the two reads :func:`parse_rows` takes on ``pipe``; returns their number."""
    pipe.hgetall(keys.sched_count)
    pipe.hgetall(keys.sched_served)
    return 2


def busiest(row: TenantRow) -> tuple[Any, ...]:
    """Sort key, busiest first: tasks waiting and running, then cost served, then
    tenant and band (so that equal rows keep a stable order)."""
    return (-row.active, -row.served_cost, row.tenant, BAND_ORDER.get(row.band, 9))


def fold(rows: Iterable[TenantRow], band: str = "") -> TenantRow | None:
    """One :data:`OTHER` row summing ``rows`` (None when there are none)."""
    rows = list(rows)
    if not rows:
        return None
    return TenantRow(
        tenant=OTHER, band=band, folded=sum(r.folded or 1 for r in rows),
        waiting=sum(r.waiting for r in rows), running=sum(r.running for r in rows),
        waiting_cost=sum(r.waiting_cost for r in rows),
        served_cost=sum(r.served_cost for r in rows),
        held=sum(r.held for r in rows), refused=sum(r.refused for r in rows))


def top_rows(rows: Sequence[TenantRow], n: int = DEFAULT_TOP) -> list[TenantRow]:
    """The ``n`` busiest rows (:func:`busiest`), then, if any are left, one
    :data:`OTHER` row (band '') summing them: what ``mtq status --tenants`` and the
    dashboard show."""
    ordered = sorted(rows, key=busiest)
    n = max(0, n)
    rest = fold(ordered[n:])
    return ordered[:n] + ([rest] if rest is not None else [])


def top_tenants(rows: Sequence[TenantRow], n: int = DEFAULT_TOP) -> list[TenantRow]:
    """The rows of the ``n`` tenants served the most cost (all bands; ties by name),
    then the other tenants' rows summed per band into :data:`OTHER` rows: what the
    exporter exports. Ranking by cost served, a total that only grows, keeps the set
    stable from scrape to scrape: it changes only when a tenant's total overtakes
    another's (then the counters of "other" may step down once)."""
    served: dict[str, float] = {}
    for r in rows:
        served[r.tenant] = served.get(r.tenant, 0.0) + r.served_cost
    kept = set(sorted(served, key=lambda t: (-served[t], t))[:max(0, n)])
    out = [r for r in rows if r.tenant in kept]
    for band in BAND_ORDER:
        other = fold((r for r in rows if r.tenant not in kept and r.band == band), band)
        if other is not None:
            out.append(other)
    return out


def shown_tenant(row: TenantRow) -> str:
    """A row's tenant as displays show it: '(none)' for tasks without a tenant,
    'other (N)' for a row summing N lanes."""
    if row.folded:
        return f"{OTHER} ({row.folded})"
    return row.tenant or "(none)"


__all__ = ["DEFAULT_TOP", "OTHER", "TenantRow", "busiest", "fold", "parse_rows", "read_into",
           "shown_tenant", "top_rows", "top_tenants"]
