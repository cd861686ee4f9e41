"""RQ's own test suite with mtq's BatchWorker in place of RQ's workers
(scripts/rq-conformance): every failure must be on
scripts/rq_conformance/expected-failures.txt, each a dependency on an internal of RQ's
forking Worker with its reason (docs/rq.md, "Held to RQ's own tests")."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import ROOT

pytest.importorskip("rq")


def port_taken(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.timeout(900)
def test_rqs_own_suite_fails_only_the_listed_tests(tmp_path: Path) -> None:
    if port_taken(6379):
        pytest.skip("127.0.0.1:6379 is taken, and RQ's tests connect there: free it to run "
                    "scripts/rq-conformance")
    report = tmp_path / "rq.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "rq-conformance"), "--json",
                           str(report)], cwd=ROOT, capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["unexpected_failures"] == [] and data["expected_failures_marked_bug"] == 0
    assert data["tests"] >= 460 and data["passed"] >= data["tests"] - 20, data
