"""Cancel and timeouts of running work with real ``mtq worker run`` processes (no
supervisor): a function that never checks runs to its end and its result is dropped
(the task ends cancelled or TaskTimeout, never succeeded); a worker killed while a
cancelled or timed-out task runs loses nothing and runs nothing twice to an end."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import redis

import mtq
from mtq.broker.protocol import TERMINAL
from tests.support.waits import wait_for
from tests.support.workers import registered_worker

pytestmark = pytest.mark.timeout(60)


def lines(log: Path, tag: str) -> list[str]:
    return [ln for ln in (log.read_text().splitlines() if log.exists() else [])
            if ln.startswith(tag + " ")]


def test_a_bare_worker_drops_the_result_of_a_function_that_never_checks(
        qname: str, redis_url: str, subprocess_env: dict[str, str], tmp_path: Path) -> None:
    log = tmp_path / "calls.log"
    gate_c, gate_t = tmp_path / "gate-c", tmp_path / "gate-t"
    gate_c.touch()
    gate_t.touch()
    q = mtq.Queue(qname, redis_url)
    q.configure(max_retries=0, dead_letter=False)
    with registered_worker("tests.handlers:gated", qname, subprocess_env, log):
        c = q.submit({"i": 1, "gate": str(gate_c)})
        t = q.submit({"i": 2, "gate": str(gate_t)}, timeout=0.2)
        wait_for(lambda: c.status() == "running", 10, "the first task never started")
        c.cancel()
        gate_c.unlink()  # it runs to its end...
        wait_for(lambda: c.status() in TERMINAL, 10, "the cancelled task never ended")
        assert c.status() == "cancelled"  # ... and its result is dropped
        wait_for(lambda: len(lines(log, "B")) == 2, 10, "the second task never started")
        time.sleep(0.4)  # past its timeout, the function running on
        gate_t.unlink()
        wait_for(lambda: t.status() in TERMINAL, 10, "the timed-out task never ended")
        info = t.info()
    assert info.status == "failed" and (info.error or "").startswith("TaskTimeout: "), info
    assert len(lines(log, "D")) == 2, "each function ran to its end once"


@pytest.mark.parametrize("how", ["cancel", "timeout"])
def test_a_worker_killed_while_a_stopped_task_runs_loses_nothing_runs_nothing_twice(
        how: str, qname: str, redis_url: str, r: redis.Redis,
        subprocess_env: dict[str, str], tmp_path: Path) -> None:
    log = tmp_path / "calls.log"
    gate = tmp_path / "gate"
    gate.touch()
    q = mtq.Queue(qname, redis_url)
    q.configure(max_retries=0, dead_letter=False, lease_ms=1000)
    t = q.submit({"i": 1, "gate": str(gate)}, timeout=0.2 if how == "timeout" else None)
    with registered_worker("tests.handlers:gated", qname, subprocess_env, log) as proc:
        wait_for(lambda: lines(log, "B"), 10, "the task never started")
        if how == "cancel":
            t.cancel()
        else:
            time.sleep(0.3)  # past its timeout: the worker is stopping it (it never checks)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    # another worker reaps the lapsed lease: a task with a cancel request ends cancelled;
    # one that timed out runs again (the first run's outcome never reached Redis) and,
    # past its timeout again, fails
    with registered_worker("tests.handlers:gated", qname, subprocess_env, log):
        if how == "timeout":
            wait_for(lambda: len(lines(log, "B")) == 2, 10, "it never ran again")
            time.sleep(0.3)
            gate.unlink()
        wait_for(lambda: t.status() in TERMINAL, 10, f"the task never ended ({t.status()})")
        info = t.info()
    stats = {k.decode(): int(v) for k, v in r.hgetall(f"mtq:{{{qname}}}:stats").items()
             if k in (b"succeeded", b"failed", b"cancelled")}
    if how == "cancel":
        assert info.status == "cancelled", info
        assert len(lines(log, "B")) == 1, "a cancelled task ran again"
        assert stats.get("cancelled") == 1 and not stats.get("succeeded"), stats
    else:
        assert info.status == "failed" and (info.error or "").startswith("TaskTimeout: ")
        assert stats.get("failed") == 1 and not stats.get("succeeded"), stats
        assert info.deliveries == 2
