"""The warm standby: a set-up process per device that takes a dead worker's place at once.

Probe logs ``S <time> <pid>`` when its setup starts (tests/models.py), so the tests
see which process is the standby before it serves anything: it is set up but not in
the registry (it claims nothing) until the supervisor promotes it.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import redis

import mtq
from mtq.workers import control
from tests.support.supervisors import StartFn, Sup, read_log, wait_workers
from tests.support.waits import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def setups(log: Path) -> list[int]:
    """Pids of the processes whose model setup started, in order."""
    return [c.pid for c in read_log(log) if c.tag == "S"]


def start_with_standby(supervise: StartFn, queue: str, r: redis.Redis, log: Path
                       ) -> tuple[Sup, dict[str, Any], int]:
    """A supervisor of tests.models:Probe with its serving worker and its standby's pid."""
    sup = supervise("tests.models:Probe", queue, env={"MTQ_TEST_LOG": str(log)})
    (serving,) = wait_workers(r, queue, 1, sup)
    wait_for(lambda: len(setups(log)) == 2, 30, f"no standby was set up\n{sup.output()}")
    (standby,) = [pid for pid in setups(log) if pid != serving["pid"]]
    return sup, serving, standby


@pytest.mark.gpu_smoke
def test_a_standby_takes_a_dead_workers_place_at_once(supervise: StartFn, qname: str,
                                                      redis_url: str, r: redis.Redis,
                                                      tmp_path: Path) -> None:
    log = tmp_path / "calls.log"
    sup, serving, standby = start_with_standby(supervise, qname, r, log)
    assert [w["pid"] for w in wait_workers(r, qname, 1, sup)] == [serving["pid"]], \
        "the standby claims nothing and is not in the registry"

    os.kill(serving["pid"], signal.SIGKILL)
    killed = time.monotonic()
    (promoted,) = wait_workers(r, qname, 1, sup, check=lambda w: w["pid"] != serving["pid"])
    took = time.monotonic() - killed
    assert promoted["pid"] == standby, "the standby took over, not a new process"
    assert took < 2.0, f"the standby took {took:.2f} s to serve"
    q = mtq.Queue(qname, redis_url)
    assert q.submit({"s": "a", "i": 1}).result(timeout=10)["pid"] == standby
    wait_for(lambda: len(setups(log)) == 3, 30, f"no new standby followed\n{sup.output()}")
    assert "its standby" in sup.output() and "took over" in sup.output()


def test_a_standby_promoted_while_paused_claims_nothing(supervise: StartFn, qname: str,
                                                        redis_url: str, r: redis.Redis,
                                                        tmp_path: Path) -> None:
    log = tmp_path / "calls.log"
    sup, serving, _standby = start_with_standby(supervise, qname, r, log)
    assert control.send(r, qname, "pause") == 1
    wait_workers(r, qname, 1, sup, check=lambda w: w["state"] == "paused")
    q = mtq.Queue(qname, redis_url)
    tasks = q.submit_many([{"s": "p", "i": i} for i in range(4)])
    os.kill(serving["pid"], signal.SIGKILL)
    (promoted,) = wait_workers(r, qname, 1, sup, check=lambda w: w["pid"] != serving["pid"])
    mark = time.time()
    wait_workers(r, qname, 1, sup, check=lambda w: w["beat"] > mark + 1.0)
    assert promoted["state"] == "paused"
    assert [t.status() for t in tasks] == ["queued"] * 4
    assert control.send(r, qname, "resume") == 1
    assert [t.result(timeout=10)["pid"] for t in tasks] == [promoted["pid"]] * 4


def test_standby_0_starts_none_and_a_reload_refreshes_the_standby(
        supervise: StartFn, qname: str, r: redis.Redis, tmp_path: Path) -> None:
    log = tmp_path / "calls.log"
    none = supervise("tests.models:Probe", qname, "--standby", "0",
                     env={"MTQ_TEST_LOG": str(log)})
    wait_workers(r, qname, 1, none)
    none.kill()
    assert len(setups(log)) == 1, "--standby 0 set a standby up"

    log2 = tmp_path / "calls2.log"
    sup = supervise("tests.models:Probe", qname + "-2", env={"MTQ_TEST_LOG": str(log2)})
    wait_workers(r, qname + "-2", 1, sup)
    wait_for(lambda: len(setups(log2)) == 2, 30, "no standby was set up")
    # which of the two set-ups is the standby's: its own line says (either may be first)
    ready = wait_for(lambda: re.search(r"standby ready on cpu \(pid (\d+)\)", sup.output()),
                     30, f"no standby ready\n{sup.output()}")
    old_standby = int(ready.group(1))
    assert old_standby in setups(log2)
    assert control.send(r, qname + "-2", "reload") == 1
    wait_for(lambda: len(setups(log2)) >= 3 and not Path(f"/proc/{old_standby}").exists(), 30,
             f"the standby was not replaced after a reload\n{sup.output()}")


def test_a_reload_to_broken_code_keeps_the_supervisor_serving(
        supervise: StartFn, qname: str, redis_url: str, r: redis.Redis,
        tmp_path: Path) -> None:
    """After a reload to a module that no longer imports, the serving process keeps the
    old model (as without a standby) and the standby that cannot load it is given up,
    not the supervisor."""
    version = tmp_path / "version"
    version.write_text("1")
    sup = supervise("tests.models:Retimed", qname, env={"MTQ_TEST_VERSION_FILE": str(version)})
    wait_workers(r, qname, 1, sup)
    wait_for(lambda: "standby ready" in sup.output(), 30, f"no standby\n{sup.output()}")
    version.write_text("2 not-a-number")  # tests.models now fails to import
    assert control.send(r, qname, "reload") == 1
    wait_for(lambda: "cannot load the target" in sup.output(), 30,
             f"the standby's failure was not reported\n{sup.output()}")
    assert sup.running(), sup.output()
    q = mtq.Queue(qname, redis_url)
    assert q.submit({"s": "a", "i": 0}).result(timeout=10)["version"] == "1"
