"""Scheduling per tenant and band, without Redis: the rows parsed from the two hashes'
replies (:func:`mtq.broker.tenants.parse_rows`), the top N and "other" of the displays
(:func:`top_rows`) and of the exporter (:func:`top_tenants`, the ``mtq_tenant_*``
families), and the dashboard's panel rendered from a hand-built snapshot."""

from __future__ import annotations

from rich.console import Console

from mtq.admin import QueueView, Snapshot
from mtq.broker.tenants import (
    OTHER,
    TenantRow,
    busiest,
    parse_rows,
    shown_tenant,
    top_rows,
    top_tenants,
)
from mtq.dashboard.tenants import tenant_rows
from mtq.dashboard.view import History, render
from mtq.observe.tenants import tenant_families


def test_parse_rows_reads_every_kind_and_skips_band_totals() -> None:
    count = {b"i:acme|w": b"3", b"i:acme|c": b"15.5", b"i:acme|r": b"2", b"i:acme|h": b"4",
             b"s:|w": b"1", b"s:|c": b"1", b"b:beta|x": b"7", b"i|c": b"15.5", b"s|c": b"1",
             b"i:acme|z": b"9"}  # a kind this version does not know: ignored
    served = {b"i:acme": b"40", b"b:gamma": b"2.5"}
    rows = parse_rows(count, served)
    assert rows == [
        TenantRow("", "standard", waiting=1, waiting_cost=1.0),
        TenantRow("acme", "interactive", waiting=3, waiting_cost=15.5, running=2,
                  served_cost=40.0, held=4),
        TenantRow("beta", "batch", refused=7),
        TenantRow("gamma", "batch", served_cost=2.5),
    ]
    assert all(isinstance(r.waiting, int) and isinstance(r.held, int) for r in rows)


def test_parse_rows_reads_str_replies_and_shows_negative_counts_as_0() -> None:
    rows = parse_rows({"s:acme|w": "-2", "s:acme|r": "-1", "s:acme|c": "-0.5"},
                      {"s:acme": "-3"})
    assert rows == [TenantRow("acme", "standard")]
    assert parse_rows({}, {}) == []


def row(tenant: str, band: str = "standard", **kw: float) -> TenantRow:
    return TenantRow(tenant, band, **kw)  # type: ignore[arg-type]


def test_top_rows_busiest_first_then_one_other_row_summing_the_rest() -> None:
    rows = [row("a", waiting=1), row("b", waiting=5, running=1), row("c", served_cost=9.0),
            row("d", "batch", waiting=1, served_cost=3.0, held=2, refused=1),
            row("e", running=2, waiting_cost=4.0)]
    top = top_rows(rows, 3)
    assert [r.tenant for r in top[:3]] == ["b", "e", "d"]  # 6, 2, then 1 with more served
    other = top[3]
    assert (other.tenant, other.band, other.folded) == (OTHER, "", 2)
    assert (other.waiting, other.served_cost) == (1, 9.0)
    assert top_rows(rows, 5) == sorted(rows, key=busiest)  # nothing left: no other row
    assert top_rows([], 3) == []


def test_top_tenants_keeps_n_tenants_by_served_cost_and_sums_the_rest_per_band() -> None:
    rows = [row("big", "interactive", served_cost=100.0), row("big", "batch", served_cost=1.0),
            row("mid", served_cost=50.0, waiting=9), row("", served_cost=10.0, running=1),
            row("tiny", "batch", served_cost=0.5, held=3, waiting=100),
            row("zero", "batch", refused=2)]
    out = top_tenants(rows, 2)
    kept = [(r.tenant, r.band) for r in out if not r.folded]
    assert kept == [("big", "interactive"), ("big", "batch"), ("mid", "standard")]
    others = {r.band: r for r in out if r.folded}
    assert set(others) == {"standard", "batch"}
    assert (others["standard"].running, others["standard"].served_cost) == (1, 10.0)
    assert (others["batch"].waiting, others["batch"].held, others["batch"].refused,
            others["batch"].folded) == (100, 3, 2, 2)
    # the sum over every series is the queue's total, whatever N
    for n in (0, 1, 2, 10):
        assert sum(r.served_cost for r in top_tenants(rows, n)) == 161.5


def test_the_exporter_labels_no_tenant_none_and_the_rest_other() -> None:
    rows = [row("", served_cost=5.0, waiting=2), row("acme", "interactive", served_cost=9.0),
            row("beta", "batch", waiting=1, refused=4)]
    fams = {name: (kind, labels, samples)
            for name, kind, _doc, labels, samples in tenant_families(
                {"q": top_tenants(rows, 2), "off": []})}
    assert set(fams) == {"mtq_tenant_waiting", "mtq_tenant_waiting_cost", "mtq_tenant_running",
                         "mtq_tenant_served_cost", "mtq_tenant_held", "mtq_tenant_refused"}
    kind, labels, samples = fams["mtq_tenant_waiting"]
    assert kind == "gauge" and labels == ("queue", "tenant", "band")
    assert dict(samples) == {("q", "acme", "interactive"): 0, ("q", "none", "standard"): 2,
                             ("q", "other", "batch"): 1}
    assert fams["mtq_tenant_refused"][0] == "counter"
    assert dict(fams["mtq_tenant_refused"][2])[("q", "other", "batch")] == 4


def test_shown_tenant() -> None:
    assert shown_tenant(row("")) == "(none)"
    assert shown_tenant(row("acme")) == "acme"
    assert shown_tenant(TenantRow(OTHER, "", folded=3)) == "other (3)"


def test_the_dashboard_shows_a_tenants_panel_only_for_queues_with_scheduling() -> None:
    rows = [row(f"t{i:02}", waiting=i) for i in range(15)] + [row("", "batch", running=1)]
    snap = Snapshot(1_700_000_000.0, [QueueView(name="plain", waiting=2),
                                       QueueView(name="llm", waiting=106, tenants=rows)], [])
    assert [q for q, _ in tenant_rows(snap.queues)] == ["llm"] * 11
    console = Console(record=True, width=120, height=60, color_system=None)
    console.print(render(snap, History(), url="redis://x"))
    text = console.export_text()
    assert "tenants (busiest first)" in text
    lines = text.splitlines()
    top = next(x for x in lines if " t14 " in x)
    assert top.split()[:4] == ["llm", "t14", "standard", "14"]
    other = next(x for x in lines if "other (6)" in x)
    assert other.split()[3:6] == ["all", "10", "1"]  # t00..t04 wait 10; (none) runs 1
    plain = Snapshot(1_700_000_000.0, [QueueView(name="plain", waiting=2)], [])
    console = Console(record=True, width=120, height=60, color_system=None)
    console.print(render(plain, History(), url="redis://x"))
    assert "tenants" not in console.export_text()
