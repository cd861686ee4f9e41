"""Scheduling per tenant and band against a real redis-server: the rows
:func:`mtq.admin.tenants` reads (tasks submitted for several tenants and bands, some
claimed by a real :class:`mtq.Consumer`, one settled with its reported cost, one
tenant held back by its rate limit, one refused), ``mtq status --tenants`` (table,
--json, --top and its "other" row), the exporter's ``mtq_tenant_*`` families (its text,
in process and over HTTP from ``mtq metrics serve``), the dashboard's tenants panel,
and what a snapshot of many tenants costs."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

import mtq
from mtq.admin import TenantRow, snapshot, tenants
from mtq.broker.consumer import Consumer, Outcome
from mtq.cli.main import cli
from mtq.dashboard.app import run as dashboard
from mtq.observe.prometheus import MtqCollector
from tests.support.paths import PY
from tests.support.processes import free_port
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MTQ_HOME", str(tmp_path / "mtq-home"))
    monkeypatch.delenv("MTQ_REDIS_URL", raising=False)


def status(url: str, *args: str) -> Any:
    # a wide terminal, so that rich does not fold the tables' cells
    return CliRunner().invoke(cli, ["status", *args, "--redis", url], catch_exceptions=False,
                              env={"COLUMNS": "200"})


def workload(client: redis.Redis, name: str) -> None:
    """acme: 3 interactive tasks of cost 5, two claimed, one of them settled at cost 8;
    beta: 2 batch tasks of cost 2; slow (1 request a minute, held): 3 tasks; and one
    task without a tenant. A second claim takes every task but slow's two held."""
    q = mtq.Queue(name, client=client)
    q.configure(tenant_rpm="slow=1", rate_limit_mode="hold")
    acme = q.submit_many([mtq.Request({"i": i}, tenant="acme", priority="interactive", cost=5)
                          for i in range(3)])
    q.submit_many([mtq.Request({"i": i}, tenant="beta", priority="batch", cost=2)
                   for i in range(2)])
    q.submit_many([mtq.Request({"i": i}, tenant="slow") for i in range(3)])
    q.submit({"plain": True})
    c = Consumer(name, client=client)
    first = c.claim(2)
    assert [t.id for t in first] == [t.id for t in acme[:2]], "interactive first"
    assert c.settle([Outcome(first[0], ok=True, value=1, cost=8.0)]).succeeded == 1
    rest = c.claim(20)
    assert len(rest) == 5, "all but slow's two held tasks"


def test_rows_per_tenant_and_band(client: redis.Redis, qname: str) -> None:
    plain = mtq.Queue(qname + "-plain", client=client)
    plain.submit({"i": 0})
    assert tenants(client, plain.name) == [], "no scheduling: no rows"

    workload(client, qname)
    rows = tenants(mtq.Queue(qname, client=client))
    assert rows == tenants(client, qname)
    by = {(r.tenant, r.band): r for r in rows}
    assert set(by) == {("", "standard"), ("acme", "interactive"), ("beta", "batch"),
                       ("slow", "standard")}
    assert by["acme", "interactive"] == TenantRow(
        "acme", "interactive", waiting=0, waiting_cost=0.0, running=2, served_cost=18.0)
    assert by["beta", "batch"] == TenantRow("beta", "batch", running=2, served_cost=4.0)
    assert by["", "standard"] == TenantRow("", "standard", running=1, served_cost=1.0)
    slow = by["slow", "standard"]
    assert (slow.waiting, slow.waiting_cost, slow.running, slow.served_cost) == (2, 2.0, 1, 1.0)
    assert slow.held >= 1, "the second claim passed slow over for its rate limit"

    refusing = mtq.Queue(qname + "-rl", client=client)
    refusing.configure(tenant_rpm="rl=1", rate_limit_mode="reject")
    refusing.submit({"i": 0}, tenant="rl")
    for i in range(2):
        with pytest.raises(mtq.RateLimited):
            refusing.submit({"i": i + 1}, tenant="rl")
    assert tenants(client, refusing.name) == [
        TenantRow("rl", "standard", waiting=1, waiting_cost=1.0, refused=2)]
    snap = snapshot(client, [qname, plain.name])
    assert snap.queue(qname).tenants == rows  # type: ignore[union-attr]
    assert snap.queue(plain.name).tenants == []  # type: ignore[union-attr]


def test_status_tenants_table_and_json(client: redis.Redis, redis_url: str,
                                       qname: str) -> None:
    workload(client, qname)
    mtq.Queue(qname + "-plain", client=client).submit({"i": 0})
    res = status(redis_url, "--tenants")
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith(f"{qname}: 4 tenant/band rows"))
    table = [x.split() for x in lines[start + 3:start + 7]]
    # busiest first: waiting + running, then served
    assert table == [["slow", "standard", "2", "2", "1", "1", table[0][6], "0"],
                     ["acme", "interactive", "0", "0", "2", "18", "0", "0"],
                     ["beta", "batch", "0", "0", "2", "4", "0", "0"],
                     ["(none)", "standard", "0", "0", "1", "1", "0", "0"]]
    assert int(table[0][6]) >= 1  # slow's held count
    assert f"{qname}-plain: no scheduling" in res.output

    res = status(redis_url, qname, "--tenants", "--json")
    assert res.exit_code == 0, res.output
    (view,) = json.loads(res.output)["queues"]
    assert (view["queue"], view["scheduling"], view["top"]) == (qname, True, 20)
    assert [(t["tenant"], t["band"], t["running"], t["served_cost"]) for t in view["tenants"]] \
        == [("slow", "standard", 1, 1.0), ("acme", "interactive", 2, 18.0),
            ("beta", "batch", 2, 4.0), ("", "standard", 1, 1.0)]
    assert status(redis_url, qname + "-nope", "--tenants").exit_code == 3
    assert status(redis_url, qname, "--tenants", "--top", "0").exit_code == 2


def many_tenants(client: redis.Redis, name: str, n: int) -> None:
    """Tenant t<i> submits i + 1 tasks of cost 10 (t0 the least busy); a claim takes 3."""
    q = mtq.Queue(name, client=client)
    q.submit_many([mtq.Request({"i": i}, tenant=f"t{i}", cost=10)
                   for i in range(n) for _ in range(i + 1)])
    assert len(Consumer(name, client=client).claim(3)) == 3


def test_more_tenants_than_top_are_summed_in_other(client: redis.Redis, redis_url: str,
                                                   qname: str) -> None:
    many_tenants(client, qname, 6)  # 21 tasks
    res = status(redis_url, qname, "--tenants", "--top", "3", "--json")
    rows = json.loads(res.output)["queues"][0]["tenants"]
    assert [r["tenant"] for r in rows] == ["t5", "t4", "t3", "other"]
    other = rows[3]
    assert (other["band"], other["folded"]) == ("", 3)
    assert sum(r["waiting"] + r["running"] for r in rows) == 21
    assert other["waiting"] + other["running"] == 1 + 2 + 3
    assert sum(r["served_cost"] for r in rows) == 30.0
    res = status(redis_url, qname, "--tenants", "--top", "3")
    assert "other (3)" in res.output and "all" in res.output

    # the exporter, in process: 2 tenants of their own (by cost served), the rest "other"
    text = MtqCollector(client, [qname], workers=None, tenant_top=2).render().decode()
    samples = {(s.name, s.labels["tenant"], s.labels["band"]): s.value
               for f in text_string_to_metric_families(text) if f.name.startswith("mtq_tenant")
               for s in f.samples}
    tenants_seen = {t for _, t, _ in samples}
    assert len(tenants_seen) == 3 and "other" in tenants_seen
    waiting = {t: v for (name, t, _), v in samples.items() if name == "mtq_tenant_waiting"}
    running = {t: v for (name, t, _), v in samples.items() if name == "mtq_tenant_running"}
    assert sum(waiting.values()) + sum(running.values()) == 21
    served = {t: v for (name, t, _), v in samples.items()
              if name == "mtq_tenant_served_cost_total"}
    assert sum(served.values()) == 30.0
    # fair share gave the 3 claims to 3 tenants: two named, the third summed in "other"
    assert sorted(served.values()) == [10.0, 10.0, 10.0]


def test_a_snapshot_of_many_tenants_costs_the_same_commands(client: redis.Redis,
                                                            qname: str) -> None:
    many_tenants(client, qname, 2)
    many_tenants(client, qname + "-big", 60)
    for name in (qname, qname + "-big"):
        snapshot(client, [name])  # scripts loaded, connections opened

    def commands(name: str) -> int:
        before = {k: v["calls"] for k, v in client.info("commandstats").items()}
        snap = snapshot(client, [name])
        after = {k: v["calls"] for k, v in client.info("commandstats").items()}
        assert snap.queues[0].tenants
        return sum(v - before.get(k, 0) for k, v in after.items()
                   if k not in ("cmdstat_info",))

    assert commands(qname) == commands(qname + "-big")


def test_the_exporter_over_http(client: redis.Redis, qname: str,
                                subprocess_env: dict[str, str]) -> None:
    workload(client, qname)
    port = free_port()
    proc = subprocess.Popen([PY, "-m", "mtq", "metrics", "serve", "--port", str(port), "-q",
                             qname, "--tenant-top", "2"], env=subprocess_env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def scrape() -> str | None:
            try:
                res = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
            except httpx.TransportError:
                return None
            return res.text

        text = wait_for(scrape, 15, f"the exporter never answered on port {port}")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    got = {(s.name, s.labels.get("tenant"), s.labels.get("band")): s.value
           for f in text_string_to_metric_families(text) for s in f.samples
           if s.labels.get("queue") == qname and s.name.startswith("mtq_tenant")}
    # top 2 by cost served: acme (18), beta (4); slow (1) and no tenant (1): "other"
    assert got[("mtq_tenant_served_cost_total", "acme", "interactive")] == 18.0
    assert got[("mtq_tenant_running", "beta", "batch")] == 2
    assert got[("mtq_tenant_waiting", "other", "standard")] == 2
    assert got[("mtq_tenant_waiting_cost", "other", "standard")] == 2.0
    assert got[("mtq_tenant_running", "other", "standard")] == 2
    assert got[("mtq_tenant_served_cost_total", "other", "standard")] == 2.0
    assert got[("mtq_tenant_held_total", "other", "standard")] >= 1
    assert got[("mtq_tenant_refused_total", "acme", "interactive")] == 0
    assert {t for _, t, _ in got} == {"acme", "beta", "other"}
    assert "# TYPE mtq_tenant_served_cost_total counter" in text


def test_the_exporter_names_no_tenant_none(client: redis.Redis, qname: str) -> None:
    workload(client, qname)
    collector = MtqCollector(client, [qname], workers=None)
    text = collector.render().decode()
    assert f'mtq_tenant_running{{queue="{qname}",tenant="none",band="standard"}} 1' in text
    assert 'tenant="other"' not in text  # 4 tenants, under the 20 of the default
    kept = collector.read().tenants[qname]
    assert collector.read().tenants[qname] is kept  # unchanged: the rows are reused
    mtq.Queue(qname, client=client).submit({"i": 0}, tenant="acme", priority="batch", cost=7)
    text = collector.render().decode()  # changed: read anew
    assert f'mtq_tenant_waiting_cost{{queue="{qname}",tenant="acme",band="batch"}} 7.0' in text


def test_the_dashboard_shows_the_tenants_panel(client: redis.Redis, redis_url: str,
                                               qname: str) -> None:
    workload(client, qname)
    console = Console(record=True, width=120, height=50, color_system=None)
    assert dashboard(redis_url, [qname], once=True, console=console) == 0
    lines = console.export_text().splitlines()
    start = lines.index("tenants (busiest first)")
    panel = [x.split() for x in lines[start + 3:start + 7]]
    assert [r[:3] for r in panel] == [[qname, "slow", "standard"], [qname, "acme", "interactive"],
                                      [qname, "beta", "batch"], [qname, "(none)", "standard"]]
    assert panel[1][3:6] == ["0", "2", "18"]  # waiting, running, served
