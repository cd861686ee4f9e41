"""The deployment files, checked by the tools that read them: ``promtool`` (Debian's
``prometheus`` package) on deploy/prometheus/ (``check config``, ``check rules``, the
alerts' unit tests with ``test rules``) and on the exporter's live output (``check
metrics``), and Compose (``docker compose config``, or Debian's ``docker-compose`` 1.29)
on docker-compose.yml. scripts/install-system-deps installs both when missing; a test
skips, saying so, only where neither is installed."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest
import yaml

import mtq
from tests.support.paths import ROOT
from tests.support.processes import free_port
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(90)

PROMETHEUS = ROOT / "deploy" / "prometheus"
INSTALL = "scripts/install-system-deps installs it"


def promtool() -> str:
    found = shutil.which("promtool")
    if not found:
        pytest.skip(f"promtool not found (Debian's prometheus package; {INSTALL})")
    return found


def compose() -> list[str]:
    """``docker compose`` (v2) where the plugin answers, else ``docker-compose`` (v1)."""
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True,
                                 timeout=30).returncode == 0:
        return [docker, "compose"]
    v1 = shutil.which("docker-compose")
    if not v1:
        pytest.skip(f"neither 'docker compose' nor docker-compose is installed "
                    f"(Debian's docker-compose package; {INSTALL})")
    return [v1]


def run(argv: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, **kw)  # type: ignore[call-overload]


def test_promtool_checks_the_config_and_the_rules_it_loads() -> None:
    out = run([promtool(), "check", "config", str(PROMETHEUS / "prometheus.yml")])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 rule files found" in out.stdout, "prometheus.yml loads rules.yml"
    rules = run([promtool(), "check", "rules", str(PROMETHEUS / "rules.yml")])
    assert rules.returncode == 0, rules.stdout + rules.stderr
    assert "5 rules found" in rules.stdout, rules.stdout


def test_the_alerts_fire_as_their_unit_tests_say() -> None:
    out = run([promtool(), "test", "rules", str(PROMETHEUS / "rules.test.yml")])
    assert out.returncode == 0, out.stdout + out.stderr
    tested = {t["alertname"] for case in yaml.safe_load(
        (PROMETHEUS / "rules.test.yml").read_text())["tests"] for t in case["alert_rule_test"]}
    alerts = {r["alert"] for g in yaml.safe_load((PROMETHEUS / "rules.yml").read_text())[
        "groups"] for r in g["rules"]}
    assert alerts - tested <= {"MtqQueueWaitHigh"}, f"alerts without a test: {alerts - tested}"


def test_a_broken_rule_is_caught() -> None:
    """The check can fail: a rule with a bad expression is refused."""
    bad = run([promtool(), "check", "rules", "/dev/stdin"],
              input="groups:\n  - name: x\n    rules:\n      - alert: X\n"
                    "        expr: sum by (queue) (\n")
    assert bad.returncode != 0 and "parse error" in (bad.stdout + bad.stderr)


def test_promtool_accepts_the_exporters_live_output(redis_url: str, qname: str,
                                                     subprocess_env: dict[str, str]) -> None:
    """A real workload (two worker processes of mtq.local on the test's Redis, a task
    that fails, live workers), scraped from ``mtq metrics serve`` and linted."""
    port = free_port()
    exporter = subprocess.Popen([sys.executable, "-m", "mtq", "metrics", "serve",
                                 "--port", str(port)], env=subprocess_env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with mtq.local("tests.handlers:chunks", 2, url=redis_url, queue=qname) as q:
            tasks = q.submit_many([{"chunks": [1, 2]} for _ in range(10)] + [{"fail": "no"}])
            for t in tasks[:-1]:
                assert t.result(timeout=30) == 2
            with pytest.raises(mtq.TaskFailed):
                tasks[-1].result(timeout=30)

            def scraped() -> str | None:
                try:
                    res = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
                except httpx.TransportError:
                    return None
                text = res.text
                # the workers' histograms reach Redis with their next beat
                return text if f'mtq_task_run_seconds_count{{queue="{qname}"}}' in text \
                    and f'mtq_workers{{queue="{qname}"' in text else None

            text = wait_for(scraped, 20, "the exporter to show the queue's workers and runs")
    finally:
        exporter.send_signal(signal.SIGTERM)
        exporter.wait(10)
    out = run([promtool(), "check", "metrics"], input=text)
    assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), \
        out.stdout + out.stderr
    for family in ("counter", "gauge", "histogram"):
        assert f" {family}\n" in text, f"no {family} in the output checked"


@pytest.mark.parametrize("profile", [[], ["--profile", "observability"]],
                         ids=["default", "observability"])
def test_compose_reads_the_compose_file(profile: list[str]) -> None:
    tool = compose()
    started = time.monotonic()
    out = run([*tool, *profile, "config"], cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    services = yaml.safe_load(out.stdout)["services"]
    # (Compose v1 lists the services of every profile; v2 those of the active ones)
    assert {"redis", "gpu-worker", "cpu-worker", "dashboard"} <= set(services)
    if profile:
        assert {"exporter", "prometheus", "grafana"} <= set(services)
        mounts = {(v.get("source") if isinstance(v, dict) else str(v).split(":")[0])
                  for v in services["prometheus"]["volumes"]}
        assert str(PROMETHEUS / "rules.yml") in mounts, mounts
    assert time.monotonic() - started < 30
