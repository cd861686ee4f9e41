"""RQ's own test suite with mtq's BatchWorker in place of RQ's workers
(scripts/rq-conformance): every failure must be on
scripts/rq_conformance/expected-failures.txt, each a dependency on an internal of RQ's
forking Worker with its reason (docs/rq.md, "Held to RQ's own tests"). The default run
leaves RQ's own slow tests out; ``make test-slow`` runs the whole suite."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.paths import ROOT

pytest.importorskip("rq")


def port_taken(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def run_conformance(tmp_path: Path, *args: str) -> dict[str, Any]:
    if port_taken(6379):
        pytest.skip("127.0.0.1:6379 is taken, and RQ's tests connect there: free it to run "
                    "scripts/rq-conformance")
    report = tmp_path / "rq.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "rq-conformance"), "--json",
                           str(report), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=840)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    data: dict[str, Any] = json.loads(report.read_text())
    assert data["unexpected_failures"] == [] and data["expected_failures_marked_bug"] == 0
    return data


@pytest.mark.slow  # ~80 s: the default suite holds mtq rq worker to RQ's semantics itself
@pytest.mark.timeout(900)
def test_rqs_own_suite_less_its_slow_tests_fails_only_the_listed_tests(tmp_path: Path) -> None:
    """As RQ's own default run: its 14 @slow tests (shutdowns, the work horse's death,
    heartbeats: about 30 s of sleeps and signals) skipped, with the SSL one; the slow
    test below (make test-slow) runs them too."""
    data = run_conformance(tmp_path, "--without-slow")
    assert data["tests"] >= 460 and 15 <= data["skipped"] <= 17, data
    assert data["passed"] >= data["tests"] - data["skipped"] - 20, data


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rqs_own_suite_fails_only_the_listed_tests(tmp_path: Path) -> None:
    data = run_conformance(tmp_path)
    assert data["tests"] >= 460 and data["passed"] >= data["tests"] - 20, data
