"""A resumed zombie: a worker frozen (SIGSTOP) past its leases, then resumed (SIGCONT).

While it is frozen, a second worker reaps its expired leases and works its streams.
When it resumes, it must not call its handler (a function, a batched model, a
bisection sub-call, a generator's prefill) on any task whose lease it lost: it
re-validates with Redis first and drops them unrun. The model's call log (see
tests/models.py) shows who started what, when: no task it lost is started by it
after the resume, no two calls of one stream overlap, and each stream starts its
tasks in order. The one call that was already running when the process froze
runs on to its end when resumed (nothing can stop a plain function mid-way; its
result is fenced off): it is the only overlap allowed, and the test says so. A
supervised worker is frozen whole, supervisor included (a host frozen: the limit
docs/guarantees.md states); a child frozen alone is killed by its supervisor before
its leases run out (tests/integration/test_fencing.py).
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import redis

import mtq
from mtq.broker.consumer import Consumer
from mtq.broker.keys import QueueKeys
from mtq.broker.protocol import LOST
from mtq.settings import QueueSettings
from mtq.workers.model import FunctionModel
from mtq.workers.registry import list_workers
from mtq.workers.worker import Worker
from tests.support.supervisors import Call, read_log
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(120)

PY = sys.executable
LEASE_MS = 1000
STREAMS, PER_STREAM = 20, 6


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen([PY, "-m", "mtq", *args], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


def _intervals(calls: list[Call]) -> list[tuple[str, int, float, float, int]]:
    """(stream, index, start, end, pid) per task a call worked on: a call runs from its
    B line to the next line of the same process (its D line, or the next call's B line
    when it raised)."""
    by_pid: dict[int, list[Call]] = defaultdict(list)
    for c in calls:
        if c.tag in "BD":
            by_pid[c.pid].append(c)
    out = []
    for pid, cs in by_pid.items():
        for k, c in enumerate(cs):
            if c.tag != "B":
                continue
            end = cs[k + 1].t if k + 1 < len(cs) else float("inf")
            for key in c.keys:
                s, i = key.split(":")
                out.append((s, int(i), c.t, end, pid))
    return out


def analyse(calls: list[Call], zombie: int, stopped: float, resumed: float
            ) -> dict[str, Any]:
    spans = _intervals(calls)
    others = {(s, i) for s, i, _, _, pid in spans if pid != zombie}
    lost_starts = sorted({(s, i) for s, i, t0, _, pid in spans
                          if pid == zombie and t0 > resumed and (s, i) in others})
    # the call the zombie was in when it froze runs on to its end: the one allowed overlap
    frozen = [x for x in spans if x[4] == zombie and x[2] < stopped < x[3]]
    checked = [x for x in spans if x not in frozen]
    overlaps = []
    by_stream: dict[str, list[tuple[str, int, float, float, int]]] = defaultdict(list)
    for x in checked:
        by_stream[x[0]].append(x)
    order_violations = []
    for xs in by_stream.values():
        xs.sort(key=lambda x: x[2])
        for a, b in itertools.pairwise(xs):
            if b[2] < a[3]:
                overlaps.append((a, b))
        top = -1
        for x in xs:
            if x[1] < top:
                order_violations.append(x)
            top = max(top, x[1])
    return {"lost_starts": lost_starts, "overlaps": overlaps,
            "order_violations": order_violations, "frozen": frozen}


KINDS = {
    # kind: (target, supervised?, payload fields)
    "function": ("tests.handlers:logged", False, {"sleep": 0.03}),
    "batched": ("tests.models:Batch8", True, {}),
    "bisection": ("tests.models:Bisecting", False, {}),
    "generator": ("tests.models:LoggedCounter", True, {"n": 6, "step_ms": 10}),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_resumed_zombie_runs_nothing_it_lost(kind: str, qname: str, redis_url: str,
                                               r: redis.Redis, subprocess_env: dict[str, str],
                                               tmp_path: Path) -> None:
    target, supervised, fields = KINDS[kind]
    calls_log = tmp_path / "calls.log"
    env = {**subprocess_env, "MTQ_TEST_LOG": str(calls_log)}
    common = ["--queue", qname, "--redis", redis_url, "--lease-ms", str(LEASE_MS)]
    a_cmd = ["workers", "start", target, *common] if supervised else \
        ["worker", "run", target, *common]
    a = _spawn(a_cmd, env, tmp_path / "a.log")
    procs = [a]
    try:
        ws = wait_for(lambda: list_workers(r, qname), 30,
                      f"worker A never registered:\n{(tmp_path / 'a.log').read_text()}")
        zombie = ws[0]["pid"]
        q = mtq.Queue(qname, redis_url, lease_ms=LEASE_MS)
        reqs = [mtq.Request({"s": f"s{s}", "i": i, **fields}, stream=f"s{s}")
                for i in range(PER_STREAM) for s in range(STREAMS)]
        tasks = q.submit_many(reqs)
        wait_for(lambda: sum(1 for c in read_log(calls_log) if c.tag == "B") >= 3, 20,
                 "worker A did not start working")
        # supervised: the whole host freezes, supervisor included (a child frozen
        # alone is fenced off by its supervisor instead: tests/integration/test_fencing.py)
        freeze = (lambda sig: os.killpg(a.pid, sig)) if supervised else \
            (lambda sig: os.kill(zombie, sig))
        freeze(signal.SIGSTOP)
        stopped = time.time()
        b = _spawn(["worker", "run", target, *common], env, tmp_path / "b.log")
        procs.append(b)

        def b_working_three_leases_on() -> bool:
            started_by_b = any(c.pid not in (zombie,) and c.tag == "B"
                               for c in read_log(calls_log) if c.t > stopped)
            return started_by_b and time.time() > stopped + 3 * LEASE_MS / 1000

        wait_for(b_working_three_leases_on, 30, "worker B did not take the frozen streams over")
        freeze(signal.SIGCONT)
        resumed = time.time()
        wait_for(lambda: q.stats()["succeeded"] >= len(tasks), 60,
                 f"not every task succeeded: {q.stats()}")
        b.send_signal(signal.SIGTERM)
        assert b.wait(20) == 0, (tmp_path / "b.log").read_text()

        # the resumed worker serves new work normally
        fresh = q.submit_many([mtq.Request({"s": f"n{s}", "i": 0, **fields}, stream=f"n{s}")
                               for s in range(4)])
        for t in fresh:
            res = t.result(timeout=20)
            assert res["s"].startswith("n"), res
        assert {c.pid for c in read_log(calls_log) if c.keys and c.keys[0].startswith("n")} \
            == {zombie}, "the new tasks were not run by the resumed worker"

        stats = q.stats()
        assert stats["succeeded"] == len(tasks) + len(fresh), stats
        assert stats["redelivered"] >= 1, f"the zombie held nothing that was reaped: {stats}"
        for s in range(STREAMS):
            got = [t.result(timeout=5) for t in tasks[s::STREAMS]]
            assert [g["i"] for g in got] == list(range(PER_STREAM)), got
        found = analyse(read_log(calls_log), zombie, stopped, resumed)
        assert found["lost_starts"] == [], \
            f"the resumed worker started tasks it had lost: {found['lost_starts']}"
        assert found["overlaps"] == [], f"calls of one stream overlapped: {found['overlaps']}"
        assert found["order_violations"] == [], \
            f"tasks of a stream started out of order: {found['order_violations']}"
    finally:
        for p in procs:
            _kill_group(p)


def test_doubtful_leases_are_checked_with_redis_and_lost_ones_dropped(
        qname: str, redis_url: str, r: redis.Redis) -> None:
    """What a worker does with the tasks it holds after its clock jumped (a freeze):
    the task Redis gave to another worker is dropped unrun; the one whose lease ran out
    in Redis but was not reaped yet is still this worker's (its lease is extended again
    and it runs), as is the one whose lease never ran out."""
    settings = QueueSettings(lease_ms=1000)
    q = mtq.Queue(qname, redis_url, settings=settings)
    q.submit_many([mtq.Request({"i": i}, stream=f"s{i}") for i in range(3)])
    w = Worker(FunctionModel(lambda p: p), qname, url=redis_url, settings=settings)
    held = w.consumer.claim(3)  # as the fetcher claims, and records what it holds
    assert len(held) == 3
    w.ledger.held.update((t.id, t) for t in held)
    assert w.leases.live(held) == held, "fresh leases are kept without asking Redis"
    assert w.totals["revoked"] == 0

    leases = QueueKeys(qname).leases
    r.zadd(leases, {held[0].id: 0})             # its lease ran out in Redis ...
    other = Consumer(qname, redis_url, settings=settings)
    (taken,) = other.claim(1)                   # ... and another worker reaped and took it
    assert taken.id == held[0].id
    r.zadd(leases, {held[1].id: 0})             # ran out too, but nobody reaped it yet
    for t in held:  # what the local clock reads after a freeze of a few leases
        t.live_until = time.monotonic() - 3.0

    kept = w.leases.live(held)
    assert [t.id for t in kept] == [held[1].id, held[2].id]
    now_ms = time.time() * 1000
    assert r.zscore(leases, held[1].id) > now_ms + 500, "the unreaped lease was not extended"
    assert min(t.live_until for t in kept) > time.monotonic() + 0.5
    assert held[0].live_until == LOST
    assert w.totals["revoked"] == 1
    assert w.leases.live(held) == kept, "a lost task is known lost: not asked about again"
    assert w.totals["revoked"] == 1
    # the new owner's result stands; this worker's ack of the old lease would be refused
    assert other.settle([mtq.Outcome(taken, ok=True, value="b")]).succeeded == 1
    assert w.consumer.settle([mtq.Outcome(held[0], ok=True, value="a")]).lost == [held[0].id]
    assert q.task(held[0].id).result(timeout=5) == "b"


def test_a_retry_claimed_again_before_its_first_delivery_is_forgotten_stays_held(
        qname: str, redis_url: str) -> None:
    """The publisher settles a retryable failure; the task is back in its stream at once
    (no backoff) and the fetcher claims it again before the publisher forgets the first
    delivery. Forgetting the first must leave the second held: its lease is extended,
    its figures kept (the race behind a latency histogram short of dead letters)."""
    settings = QueueSettings(max_retries=1, retry_backoff_ms=0)
    q = mtq.Queue(qname, redis_url, settings=settings)
    task = q.submit({"i": 1})
    w = Worker(FunctionModel(lambda p: p), qname, url=redis_url, settings=settings)
    (first,) = w.consumer.claim(1)
    w.ledger.held[first.id] = first
    w.ledger.submitted[first.id] = time.monotonic()
    report = w.consumer.settle([mtq.Outcome(first, ok=False, error="boom", retryable=True)])
    assert report.retried == 1, report
    (again,) = w.consumer.claim(1)  # the fetcher, between the settle and the forget
    assert again.id == first.id and again.token != first.token
    w.ledger.held[again.id] = again
    w.ledger.submitted[again.id] = time.monotonic()
    w.ledger.forget([(first.id, first.token)])
    assert w.ledger.held.get(task.id) is again, "the new delivery was forgotten with the old"
    assert task.id in w.ledger.submitted
    w.ledger.forget([(again.id, again.token)])
    assert task.id not in w.ledger.held and task.id not in w.ledger.submitted
