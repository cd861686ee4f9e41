"""The "observability" profile of docker-compose.yml and deploy/ (Prometheus, Grafana
and mtq's dashboard), checked without Docker: the files parse, point at each other,
and every metric the dashboard queries is one the exporter (mtq.observe.prometheus) exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")

from tests.support.cli_parse import parse_mtq  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PROFILE = "observability"
OBSERVABILITY = ("exporter", "prometheus", "grafana")
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "mtq.json"


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """container path -> host path of the service's bind mounts from this repository."""
    out = {}
    for v in service.get("volumes") or []:
        host, container = str(v).split(":")[:2]
        if host.startswith("./"):
            out[container] = host
    return out


def test_the_profile_is_optional(services: dict[str, dict[str, Any]]) -> None:
    for name in OBSERVABILITY:
        assert name in services, f"docker-compose.yml: add the {name} service"
        assert services[name].get("profiles") == [PROFILE], (
            f"{name}: only under the optional profile (profiles: [{PROFILE}]), so a plain "
            "'docker compose up' starts Redis and the workers alone")
    for name, service in services.items():
        if name not in OBSERVABILITY:
            assert not service.get("profiles"), f"{name} must start without a profile"


def test_every_mounted_file_is_in_the_repository(services: dict[str, dict[str, Any]]) -> None:
    for name in ("prometheus", "grafana"):
        mounts = _mounts(services[name])
        assert mounts, f"{name}: mount its configuration from deploy/"
        for host in mounts.values():
            assert (ROOT / host).exists(), f"{name} mounts {host}, which does not exist"


def test_prometheus_scrapes_the_exporter(services: dict[str, dict[str, Any]]) -> None:
    cmd = parse_mtq(services["exporter"]["command"], "exporter")
    assert cmd.path == ("mtq", "metrics", "serve")
    assert cmd.params["host"] == "0.0.0.0", (
        "exporter: listen on every interface of its container (--host 0.0.0.0), or "
        "Prometheus cannot reach it")
    config_path = ROOT / _mounts(services["prometheus"])["/etc/prometheus/prometheus.yml"]
    config = yaml.safe_load(config_path.read_text())
    targets = [t for job in config["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]]
    assert targets == [f"exporter:{cmd.params['port']}"], targets


def test_grafana_provisions_the_data_source_and_the_dashboard(
        services: dict[str, dict[str, Any]], dashboard: dict[str, Any]) -> None:
    mounts = _mounts(services["grafana"])
    provisioning = ROOT / mounts["/etc/grafana/provisioning"]
    source = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    uids = {d["uid"]: d for d in source["datasources"]}
    providers = yaml.safe_load((provisioning / "dashboards" / "mtq.yml").read_text())["providers"]
    folder = providers[0]["options"]["path"]
    assert (ROOT / mounts[folder] / DASHBOARD.name).is_file(), (
        "the dashboard provider's folder must be where deploy/grafana/dashboards is mounted")
    used = {p["datasource"]["uid"] for p in dashboard["panels"] if "datasource" in p}
    assert used and used <= set(uids), f"panels use data sources {used}, provisioned {set(uids)}"
    prometheus = next(iter(uids.values()))
    assert prometheus["url"] == "http://prometheus:9090"


def _exported() -> set[str]:
    """Metric family names mtq.observe.prometheus declares (string literals starting with mtq_)."""
    source = (ROOT / "mtq" / "observe" / "prometheus.py").read_text()
    return {_family(n) for n in re.findall(r"""["'](mtq_[a-z0-9_]+)["']""", source)}


def _family(name: str) -> str:
    return re.sub(r"_(bucket|sum|count|total)$", "", name)


def test_dashboard_queries_only_metrics_the_exporter_exports(dashboard: dict[str, Any]) -> None:
    exported = _exported()
    assert "mtq_queue_waiting_tasks" in exported  # the reader itself works
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 15
    for expr in exprs:
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
        for name in re.findall(r"\b(mtq_[a-z0-9_]+)", expr):
            assert _family(name) in exported, f"the dashboard queries {name}, not exported"


def test_dashboard_covers_what_operators_watch(dashboard: dict[str, Any]) -> None:
    text = json.dumps(dashboard)
    for family in ("mtq_task_latency_seconds_bucket", "mtq_queue_wait_seconds_bucket",
                   "mtq_generation_ttft_seconds_bucket", "mtq_worker_busy_seconds_total",
                   "mtq_worker_batch_size", "mtq_cache_hits_total", "mtq_up"):
        assert family in text, f"the dashboard has no panel on {family}"
    assert dashboard["templating"]["list"][0]["name"] == "queue"
