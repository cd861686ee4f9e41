"""benchmarks.scheduling's quick run: against a real redis-server and real ``mtq worker
run`` processes, the scheduled queues share the worker by cost and weight and put the
interactive band first, where round robin does neither. The default run holds those two
steps; the whole quick run (Redis's instructions under callgrind, round trips, the rate
limit and deadlines: about 45 s more) is a slow test (make test-slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.paths import ROOT

pytestmark = pytest.mark.timeout(120)


def quick_run(tmp_path: Path, *args: str) -> tuple[dict[str, Any], str]:
    """The quick run's figures (its --json) and its output."""
    out = tmp_path / "sched.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.scheduling", "--quick", "--no-docs",
                           "--json", str(out), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def check_fair_and_prio(data: dict[str, Any], stdout: str) -> None:
    table = stdout[-4000:]  # the run's table, to read beside a failure
    fair, w31, rr = data["fair"]
    # weights 1:1 and 3:1 against round robin's one task per stream (800:1 by cost)
    assert 0.75 < fair["overall"] < 1.33, (fair, table)
    assert 2.2 < w31["overall"] < 4.0, (w31, table)
    assert rr["overall"] > 50, (rr, table)
    for f in (fair, w31, rr):  # both tenants backlogged to the end
        assert min(f["left"].values()) > 0, (f, table)
    # start-time fair queueing's bound on the lag, which holds at any length of run
    assert fair["lag"] <= 2000 / 1 + 50 / 1 + 1e-6, (fair, table)
    assert w31["lag"] <= 2000 / 3 + 50 / 1 + 1e-6, (w31, table)
    prio = data["prio"]
    waits, rr_waits = sorted(prio["waits"]), sorted(prio["rr_waits"])
    assert len(waits) == len(rr_waits) == prio["interactive"] > 0, table
    # first before the batch backlog, where round robin queues it behind
    assert waits[len(waits) // 2] * 5 < rr_waits[len(rr_waits) // 2], (waits, rr_waits, table)
    assert 0 < prio["mixed"] < prio["alone"], table
    assert "interactive queue wait" in stdout  # the table


def test_the_scheduling_benchmarks_fair_share_and_priority_run_quick(tmp_path: Path) -> None:
    data, stdout = quick_run(tmp_path, "--only", "fair", "--only", "priority")
    check_fair_and_prio(data, stdout)
    assert "redis" not in data and "rate" not in data  # the steps asked for only


@pytest.mark.slow
def test_the_scheduling_benchmark_runs_quick(tmp_path: Path) -> None:
    data, stdout = quick_run(tmp_path)
    check_fair_and_prio(data, stdout)
    assert data["redis"]["rt_plain_ms"] > 0 and data["redis"]["rt_sched_ms"] > 0
    assert data["rate"]["accepted"] > 0 and data["deadlines"]["admitted"] > 0
