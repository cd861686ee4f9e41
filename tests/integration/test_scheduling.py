"""Scheduling (priority bands, tenants, cost-weighted fair share; see "Scheduling" in
mtq/broker/lua/_lib.lua) against a real redis-server. Claims are driven one at a time
through a Consumer, so every order is deterministic; the kill test SIGKILLs a real
consumer process between its claim and its settlement."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from collections import Counter as Tally
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner

import mtq
from mtq.broker.consumer import Consumer, Outcome
from mtq.broker.protocol import read_traces
from mtq.cli.main import cli
from mtq.errors import ConfigError, InvalidArgument, InvalidName
from tests.models import Counter
from tests.support.processes import kill_process, worker_process
from tests.support.waits import wait_for
from tests.support.workers import FAST, Recorder, make_worker, serving

pytestmark = pytest.mark.timeout(60)


def make(qname: str, url: str, **settings: Any) -> tuple[mtq.Queue, mtq.Consumer]:
    q = mtq.Queue(qname, url, **settings)
    c = mtq.Consumer(qname, url, settings=q.settings, worker_id="w1")
    return q, c


def served(r: redis.Redis, q: mtq.Queue) -> dict[str, float]:
    """The served cost per lane ('<band>:<tenant>'), as Redis holds it."""
    return {k.decode(): float(v) for k, v in r.hgetall(q.broker.keys.sched + "served").items()}


def vt(r: redis.Redis, q: mtq.Queue, tenant: str) -> float:
    return float(r.hget(q.broker.keys.sched + "vt", tenant) or 0)


def field(r: redis.Redis, q: mtq.Queue, task_id: str, name: str) -> str | None:
    v = r.hget(q.broker.keys.task(task_id), name)
    return v.decode() if v is not None else None


def claim_one(q: mtq.Queue, c: mtq.Consumer, r: redis.Redis, cost: float | None = None
              ) -> tuple[mtq.Claimed, str, str]:
    """Claim one task, settle it (with the reported ``cost``), return it with its band
    letter and tenant."""
    got = c.claim(1)
    assert len(got) == 1, f"nothing claimed: {q.stats()}"
    t = got[0]
    band, tenant = field(r, q, t.id, "band") or "s", field(r, q, t.id, "tenant") or ""
    assert c.settle([Outcome(t, ok=True, cost=cost)]).succeeded == 1
    return t, band, tenant


def queue_keys(r: redis.Redis, qname: str) -> set[bytes]:
    return set(r.scan_iter(match=f"mtq:{{{qname}}}:*", count=1000))


# -- priorities ------------------------------------------------------------------------
def test_a_claim_serves_interactive_then_standard_then_batch(qname: str, redis_url: str,
                                                            r: redis.Redis) -> None:
    q, c = make(qname, redis_url)
    q.submit_many([{"i": i} for i in range(3)], priority="batch")
    q.submit_many([{"i": i} for i in range(3)])
    q.submit_many([{"i": i} for i in range(3)], priority="interactive")
    order = "".join(claim_one(q, c, r)[1] for _ in range(9))
    assert order == "iiisssbbb"
    assert c.claim(5) == []
    assert served(r, q) == {"i:": 3.0, "s:": 3.0, "b:": 3.0}


def test_one_claim_of_many_takes_the_bands_in_order(qname: str, redis_url: str,
                                                   r: redis.Redis) -> None:
    q, c = make(qname, redis_url, band_min_share=0)
    b = q.submit({"x": 0}, priority="batch")
    s = q.submit({"x": 1})
    i = q.submit({"x": 2}, priority="interactive")
    assert [t.id for t in c.claim(3)] == [i.id, s.id, b.id]


def test_a_stream_keeps_fifo_and_competes_in_the_band_of_its_head(
        qname: str, redis_url: str, r: redis.Redis) -> None:
    q, c = make(qname, redis_url, band_min_share=0)
    head = q.submit({"x": "head"}, stream="x", priority="batch")
    second = q.submit({"x": "second"}, stream="x", priority="interactive")
    plain = q.submit({"x": "plain"})  # standard: above the stream's head (batch)
    assert [t.id for t in c.claim(1)] == [plain.id], "the stream competes as batch"
    got = c.claim(5)
    assert [t.id for t in got] == [head.id], "its interactive second waits for its head"
    later = q.submit({"x": "later"})
    c.settle([Outcome(got[0], ok=True)])
    # the head finished: the stream moved to the band of its new head, interactive
    assert [t.id for t in c.claim(1)] == [second.id]
    assert [t.id for t in c.claim(1)] == [later.id]


@pytest.mark.parametrize("share", [5, 20, 50])
def test_band_min_share_bounds_the_starvation_of_batch(qname: str, redis_url: str,
                                                       r: redis.Redis, share: int) -> None:
    """Interactive always backlogged: batch still gets about its share of the claimed
    cost (20 and 50 used to starve it: a credit that reached exactly 0 was taken for a
    band that just started waiting)."""
    q, c = make(qname, redis_url, band_min_share=share)
    q.submit_many([{"i": i} for i in range(120)], priority="interactive")
    q.submit_many([{"i": i} for i in range(120)], priority="batch")
    bands = Tally(claim_one(q, c, r)[1] for _ in range(100))
    assert share - 2 <= bands["b"] <= share + 1, (share, bands)
    assert served(r, q)["b:"] == bands["b"]


def test_with_interactive_backlogged_standard_and_batch_each_get_their_share(
        qname: str, redis_url: str, r: redis.Redis) -> None:
    q, c = make(qname, redis_url, band_min_share=10)
    for band in ("interactive", "standard", "batch"):
        q.submit_many([{"i": i} for i in range(120)], priority=band)
    bands = Tally(claim_one(q, c, r)[1] for _ in range(100))
    assert 7 <= bands["s"] <= 11 and 7 <= bands["b"] <= 11, bands


def test_band_min_share_0_is_strict_priority(qname: str, redis_url: str,
                                             r: redis.Redis) -> None:
    q, c = make(qname, redis_url, band_min_share=0)
    q.submit_many([{"i": i} for i in range(60)], priority="interactive")
    q.submit_many([{"i": i} for i in range(5)], priority="batch")
    q.submit_many([{"i": i} for i in range(5)])
    order = "".join(claim_one(q, c, r)[1] for _ in range(70))
    assert order == "i" * 60 + "s" * 5 + "b" * 5


# -- tenants -----------------------------------------------------------------------------
def test_equal_weights_keep_the_served_cost_of_two_tenants_near_equal(
        qname: str, redis_url: str, r: redis.Redis) -> None:
    """A: cost 2000 over 10 streams; B: cost 50 over 2 streams. A takes one claim, then B
    as many as make up the same cost (40), and so on: the served costs never differ by
    more than the largest single cost."""
    q, c = make(qname, redis_url)
    q.submit_many([mtq.Request({"a": i}, stream=f"a{i % 10}", tenant="A", cost=2000)
                   for i in range(30)])
    q.submit_many([mtq.Request({"b": i}, stream=f"b{i % 2}", tenant="B", cost=50)
                   for i in range(120)])
    order = []
    for _ in range(83):
        order.append(claim_one(q, c, r)[2])
        s = served(r, q)
        assert abs(s.get("s:A", 0) - s.get("s:B", 0)) <= 2000, (len(order), s)
    assert order[:42] == ["A"] + ["B"] * 40 + ["A"], order
    assert order.count("A") == 3 and order.count("B") == 80
    assert served(r, q) == {"s:A": 6000.0, "s:B": 4000.0}
    assert vt(r, q, "A") == 6000.0 and vt(r, q, "B") == 4000.0


def test_weights_3_to_1_and_an_unknown_tenant_weighs_1(qname: str, redis_url: str,
                                                       r: redis.Redis) -> None:
    q, c = make(qname, redis_url, tenant_weights={"A": 3, "B": 1})
    q.submit_many([{"i": i} for i in range(60)], tenant="A", cost=10)
    q.submit_many([{"i": i} for i in range(60)], tenant="B", cost=10)
    q.submit_many([{"i": i} for i in range(60)], tenant="C", cost=10)  # not named: 1
    tenants = []
    for _ in range(50):
        t, _, tenant = claim_one(q, c, r)
        tenants.append(tenant)
        # the charge the claim stored: "weight|band|tenant"
        assert field(r, q, t.id, "weight") == {"A": "3", "B": "1", "C": "1"}[tenant] \
            + "|s|" + tenant
    got = Tally(tenants)
    assert (got["A"], got["B"], got["C"]) == (30, 10, 10), got
    assert served(r, q) == {"s:A": 300.0, "s:B": 100.0, "s:C": 100.0}
    assert [vt(r, q, t) for t in "ABC"] == pytest.approx([100.0] * 3)


def test_a_tenant_back_from_idle_starts_at_the_clock_with_no_banked_credit(
        qname: str, redis_url: str, r: redis.Redis) -> None:
    q, c = make(qname, redis_url)
    q.submit_many([{"i": i} for i in range(80)], tenant="A")
    q.submit_many([{"i": i} for i in range(10)], tenant="B")
    first = [claim_one(q, c, r)[2] for _ in range(40)]
    assert first.count("B") == 10 and first[-20:] == ["A"] * 20, first
    q.submit_many([{"i": i} for i in range(20)], tenant="B")  # back after 20 of A's claims
    assert vt(r, q, "B") >= vt(r, q, "A") - 1, "it came back behind the clock"
    after = "".join(claim_one(q, c, r)[2] for _ in range(10))
    assert after.count("B") in (5, 6) and "BBB" not in after, after


def test_one_claim_shares_among_more_tenants_than_it_reads_at_once(
        qname: str, redis_url: str, r: redis.Redis) -> None:
    """A claim reads a band's 16 least served tenants at a time: with 33, a claim of 66
    still gives each exactly 2."""
    q, c = make(qname, redis_url)
    for i in range(33):
        q.submit_many([{"i": j} for j in range(4)], tenant=f"t{i:02d}")
    got = c.claim(66)
    tally = Tally(field(r, q, t.id, "tenant") for t in got)
    assert len(got) == 66 and set(tally.values()) == {2} and len(tally) == 33, tally
    assert set(served(r, q).values()) == {2.0}


def test_a_tenant_s_streams_take_turns(qname: str, redis_url: str, r: redis.Redis) -> None:
    q, c = make(qname, redis_url)
    tasks = {s: q.submit_many([{"s": s, "i": i} for i in range(3)], stream=s, tenant="A")
             for s in "xyz"}
    order = [claim_one(q, c, r)[0] for _ in range(9)]
    assert [t.stream for t in order] == list("xyz" * 3)
    for s in "xyz":
        assert [t.id for t in order if t.stream == s] == [t.id for t in tasks[s]]


# -- cost ------------------------------------------------------------------------------------
def test_the_default_cost_comes_from_max_tokens_and_the_prompt_else_the_queue(
        qname: str, redis_url: str, r: redis.Redis) -> None:
    q, c = make(qname, redis_url)
    text = q.submit({"prompt": "héllo", "max_tokens": 10}, tenant="A")  # 6 bytes + 10
    chat = q.submit({"messages": [{"role": "user", "content": "abc"},
                                  {"role": "user", "content": "de"}], "max_tokens": 5},
                    tenant="A")
    ids = q.submit({"prompt": [1, 2, 3, 4], "max_tokens": 1}, tenant="A")
    given = q.submit({"prompt": "x", "max_tokens": 10}, tenant="A", cost=3)
    plain = q.submit({"x": 1}, tenant="A")
    assert [field(r, q, t.id, "cost") for t in (text, chat, ids, given, plain)] == \
        ["16.0", "10.0", "5.0", "3.0", None]
    q.configure(default_cost=7)
    assert field(r, q, q.submit({"x": 2}, tenant="A").id, "cost") == "7.0"
    got = c.claim(10)
    assert len(got) == 6
    assert served(r, q) == {"s:A": 16 + 10 + 5 + 3 + 1 + 7}


def test_a_reported_cost_settles_the_difference_and_a_release_refunds(
        qname: str, redis_url: str, r: redis.Redis) -> None:
    q, c = make(qname, redis_url, tenant_weights="A=2", max_retries=0)
    a, b, d, e = q.submit_many([{"i": i} for i in range(4)], tenant="A", cost=100,
                               priority="batch")
    got = {t.id: t for t in c.claim(4)}
    assert served(r, q) == {"b:A": 400.0} and vt(r, q, "A") == 200.0
    c.settle([Outcome(got[a.id], ok=True, cost=30)])  # 70 less
    assert served(r, q) == {"b:A": 330.0} and vt(r, q, "A") == 165.0
    c.settle([Outcome(got[b.id], ok=False, error="E: x", cost=250)])  # a failure: 150 more
    assert served(r, q) == {"b:A": 480.0} and vt(r, q, "A") == 240.0
    assert q.task(b.id).status() in ("failed", "dead")
    c.settle([Outcome(got[d.id], ok=True)])  # none reported: the estimate stands
    assert served(r, q) == {"b:A": 480.0}
    assert c.release([got[e.id]]) == 1  # given back unrun: refunded
    assert served(r, q) == {"b:A": 380.0} and vt(r, q, "A") == 190.0
    (again,) = c.claim(1)
    assert again.id == e.id and served(r, q) == {"b:A": 480.0}, "charged again"
    stale = got[a.id]
    assert c.settle([Outcome(stale, ok=True, cost=1)]).lost == [a.id]
    assert served(r, q) == {"b:A": 480.0}, "a lost ack settles nothing"


@pytest.mark.parametrize("bad", [math.nan, math.inf, -5.0, 1e300, "7"])
def test_a_bad_reported_cost_raises_and_settles_nothing(qname: str, redis_url: str,
                                                       r: redis.Redis, bad: Any) -> None:
    """Used to fail the script half way (nan, inf: the task succeeded, its client never
    told, the error raised to the worker) or to be taken (a negative cost, 1e300)."""
    q, c = make(qname, redis_url)
    t = q.submit({"x": 1}, tenant="A", cost=10)
    (got,) = c.claim(1)
    before = q.stats()
    with pytest.raises(InvalidArgument):
        c.settle([Outcome(got, ok=True, cost=bad)])
    with pytest.raises(InvalidArgument):
        c.settle([Outcome(got, ok=False, error="E: x", cost=bad)])
    with pytest.raises(InvalidArgument):
        c.broker.ack([(got.id, got.token, b"")], costs={got.id: bad})
    assert t.status() == "running" and q.stats() == before
    assert served(r, q) == {"s:A": 10.0}
    c.settle([Outcome(got, ok=True, cost=4)])
    assert t.result(timeout=5) is None and served(r, q) == {"s:A": 4.0}


def test_a_batch_model_reports_costs_with_costed(qname: str, redis_url: str,
                                                r: redis.Redis) -> None:
    q = mtq.Queue(qname, redis_url, settings=FAST)
    tasks = q.submit_many([mtq.Request({"i": i, "c": 3 * i}, tenant="A", cost=100)
                           for i in range(4)])
    model = Recorder(lambda p: mtq.Costed(p["i"], cost=p["c"]))
    with serving(make_worker(model, qname, redis_url)):
        assert [t.result(timeout=15) for t in tasks] == [0, 1, 2, 3]
    assert served(r, q) == {"s:A": 0.0 + 3 + 6 + 9}


def test_a_generator_reports_its_prompt_and_generated_tokens(qname: str, redis_url: str,
                                                             r: redis.Redis) -> None:
    q = mtq.Queue(qname, redis_url, settings=FAST)
    a = q.submit({"n": 4, "prompt": 3}, tenant="A", cost=500)
    b = q.submit({"n": 2, "prompt": 10}, tenant="B", priority="interactive")
    with serving(make_worker(Counter(), qname, redis_url)):
        ra, rb = a.result(timeout=15), b.result(timeout=15)
    assert served(r, q) == {"s:A": 3.0 + len(ra["tokens"]), "i:B": 10.0 + len(rb["tokens"])}
    assert len(ra["tokens"]) == 4 and len(rb["tokens"]) == 2


# -- a worker killed between its claim and its settlement ---------------------------------
HOLDER = r"""
import sys, mtq
url, queue = sys.argv[1], sys.argv[2]
c = mtq.Consumer(queue, url)  # the queue's stored settings: its lease and weights
tasks = c.claim(10)
print(",".join(t.id for t in tasks), flush=True)
sys.stdin.read()   # hold the batch until killed
"""


def test_a_worker_killed_before_settling_leaves_the_counters_consistent(
        qname: str, redis_url: str, r: redis.Redis, subprocess_env: dict[str, str]) -> None:
    """Each delivery is charged its estimate once; the killed one is never settled; each
    task runs again after its lease and succeeds once; nothing is lost."""
    lease_ms = 600
    q = mtq.Queue(qname, redis_url)
    q.configure(lease_ms=lease_ms, tenant_weights="B=2")
    tasks = q.submit_many([mtq.Request({"i": i}, stream=f"s{i % 3}", tenant="AB"[i % 2],
                                       cost=100 + i) for i in range(6)])
    cost = {t.id: 100 + i for i, t in enumerate(tasks)}
    tenant = {t.id: "AB"[i % 2] for i, t in enumerate(tasks)}
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, redis_url, qname],
                            env=subprocess_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        held = set(proc.stdout.readline().strip().split(","))
        assert held == {t.id for t in tasks[:3]}, "the heads of the three streams"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    charged: dict[str, float] = {"s:A": 0.0, "s:B": 0.0}
    for i in held:
        charged["s:" + tenant[i]] += cost[i]
    assert served(r, q) == charged, "the killed claim's charges stand, once"
    c = Consumer(qname, redis_url, settings=q.settings, worker_id="w-live")
    runs: list[mtq.Claimed] = []
    t0 = time.monotonic()
    while q.stats()["succeeded"] < 6:  # the held ones come back once their leases end
        assert time.monotonic() - t0 < 2 * lease_ms / 1000 + 10, \
            f"the tasks did not all complete: {q.stats()}"
        _run_some(c, runs, cost, charged)
    assert sorted(t.id for t in runs) == sorted(cost), "each task ran once after the kill"
    assert all(t.deliveries == 2 for t in runs if t.id in held)
    assert all(t.deliveries == 1 for t in runs if t.id not in held)
    assert served(r, q) == pytest.approx(charged)
    # virtual time: at least the charges over the weights (B weighs 2; a tenant whose
    # lane emptied comes back at the clock)
    assert vt(r, q, "A") >= charged["s:A"] - 1e-6
    assert vt(r, q, "B") >= charged["s:B"] / 2 - 1e-6
    stats = q.stats()
    assert (stats["succeeded"], stats["waiting"], stats["running"], stats["dead"]) == \
        (6, 0, 0, 0), stats
    traces = read_traces(r, qname, [t.id for t in tasks])
    assert [sum(1 for step in tr if b"|succeeded|" in step) for tr in traces] == [1] * 6


def _run_some(c: Consumer, runs: list[mtq.Claimed], cost: dict[str, int],
              charged: dict[str, float]) -> int:
    """Claim and settle what there is, each reporting half its estimate; book the
    charges and settlements in ``charged``."""
    got = c.claim(6)
    if not got:
        c.wait(timeout=0.2)
        return 0
    for t in got:
        lane = "s:" + (c.redis.hget(c.broker.keys.task(t.id), "tenant") or b"").decode()
        charged[lane] += cost[t.id] - cost[t.id] / 2  # charged, then settled at half
    c.settle([Outcome(t, ok=True, cost=cost[t.id] / 2) for t in got])
    runs.extend(got)
    return len(got)


def test_a_real_worker_killed_mid_task_keeps_its_charge_and_the_rerun_settles(
        qname: str, redis_url: str, r: redis.Redis, subprocess_env: dict[str, str],
        tmp_path: Path) -> None:
    """``mtq worker run`` SIGKILLed while its handler runs a task (claimed, charged, not
    settled): the charge stands; after the lease the task runs again on another worker,
    which charges it again and settles its reported cost; it succeeds once."""
    q = mtq.Queue(qname, redis_url)
    q.configure(lease_ms=800)
    gate = tmp_path / "gate"
    gate.touch()
    quick = q.submit({"i": 0, "cost": 5}, tenant="B", cost=10)
    with (tmp_path / "worker.log").open("wb") as log:
        proc = worker_process(["tests.handlers:gated_costed", "-q", qname], subprocess_env, log)
        try:
            assert quick.result(timeout=20)["i"] == 0
            held = q.submit({"i": 1, "cost": 30, "gate": str(gate)}, tenant="A", cost=100)
            wait_for(lambda: held.status() == "running", 20, "the gated task never started")
            assert served(r, q) == {"s:B": 5.0, "s:A": 100.0}
        finally:
            kill_process(proc)
    assert held.status() == "running" and served(r, q)["s:A"] == 100.0
    gate.unlink()
    with serving(make_worker("tests.handlers:gated_costed", qname, redis_url)):
        assert held.result(timeout=20)["i"] == 1
    assert held.info().deliveries == 2
    assert served(r, q) == {"s:B": 5.0, "s:A": 100.0 + 100.0 + (30.0 - 100.0)}
    (trace,) = read_traces(r, qname, [held.id])
    assert sum(1 for step in trace if b"|succeeded|" in step) == 1
    assert q.stats()["succeeded"] == 2 and q.stats()["running"] == 0


def test_a_dead_worker_given_back_by_its_supervisor_keeps_its_charge(
        qname: str, redis_url: str, r: redis.Redis) -> None:
    """The supervisor's give-back: the task that ran keeps its charge (it is charged again
    at its next claim); one claimed but never started is refunded."""
    q = mtq.Queue(qname, redis_url)
    ran, unstarted = q.submit_many([{"i": i} for i in range(2)], tenant="A", cost=40)
    dead = Consumer(qname, redis_url, worker_id="host:1:dead")
    held = {t.id: t for t in dead.claim(2)}
    assert served(r, q) == {"s:A": 80.0}
    sup = Consumer(qname, redis_url)
    codes = sup.give_back([(ran.id, held[ran.id].token)],
                          [(unstarted.id, held[unstarted.id].token)], "it died")
    assert codes == [1, 1]
    assert served(r, q) == {"s:A": 40.0}
    assert {t.id for t in sup.claim(2)} == {ran.id, unstarted.id}
    assert served(r, q) == {"s:A": 120.0}


# -- interplay with the rest of the queue ------------------------------------------------
def test_tenant_less_tasks_run_with_scheduling_on(qname: str, redis_url: str,
                                                  r: redis.Redis) -> None:
    q, c = make(qname, redis_url)
    old = q.submit_many([{"old": i} for i in range(3)])  # before scheduling was on
    q.submit({"x": 0}, tenant="A")
    assert r.hget(q.broker.keys.stats, "sched") == b"1"
    new = q.submit_many([{"new": i} for i in range(2)] + [mtq.Request({"s": 1}, stream="s")])
    got = [claim_one(q, c, r)[0].id for _ in range(7)]
    assert set(got) >= {t.id for t in old + new}
    assert c.claim(5) == [] and q.stats()["waiting"] == 0
    assert served(r, q) == {"s:": 6.0, "s:A": 1.0}


def test_a_tenant_stream_pushed_to_the_plain_ring_is_claimed_and_moved_to_its_lane(
        qname: str, redis_url: str, r: redis.Redis) -> None:
    """An older worker's ack pushes a released stream into ``ready`` whatever its head:
    the next claim takes it (it used to return nothing: the tenant it moved to was not
    among the candidates that claim had read)."""
    q, c = make(qname, redis_url)
    k = q.broker.keys
    first, second = q.submit_many([{"i": 0}, {"i": 1}], stream="x", tenant="A", cost=5)
    (got,) = c.claim(1)
    assert got.id == first.id
    assert c.claim(1) == []  # A's lane is empty now: A leaves the band's candidates
    # the older worker acks `first` its way: status, lease, busy, and the plain ring
    r.hset(k.task(first.id), "status", "succeeded")
    r.zrem(k.leases, first.id)
    r.srem(k.busy, "x")
    r.rpush(k.ready, "x")
    assert [t.id for t in c.claim(1)] == [second.id]
    assert r.llen(k.ready) == 0 and r.llen(k.sched + "ready:s:A") == 0
    assert served(r, q) == {"s:A": 10.0}


def test_a_stream_whose_cancelled_head_hid_another_tenant_s_task_is_claimed(
        qname: str, redis_url: str, r: redis.Redis) -> None:
    """The claim that finds the tombstone moves the stream to the lane of its new head
    and takes it (it used to take nothing, as above; found by the state machine)."""
    q, c = make(qname, redis_url)
    head, nxt = q.submit_many([mtq.Request({"i": 0}, stream="a"),
                               mtq.Request({"i": 1}, stream="a", tenant="A", cost=2)])
    assert head.cancel()
    assert [t.id for t in c.claim(1)] == [nxt.id]
    assert served(r, q) == {"s:A": 2.0}


def test_purge_empties_every_lane(qname: str, redis_url: str, r: redis.Redis) -> None:
    q, c = make(qname, redis_url)
    q.submit_many([{"i": i} for i in range(3)], tenant="A", priority="batch")
    q.submit_many([{"i": i} for i in range(3)], tenant="B", stream="b", priority="interactive")
    q.submit_many([{"i": i} for i in range(2)])
    q.submit_many([{"i": i} for i in range(2)], tenant="A", stream="a")
    running = c.claim(1)[0]  # the head of B's stream: the rest of it waits behind it
    assert q.purge() == 9
    k = q.broker.keys
    for lane in ("b:A", "i:B", "s:A"):
        assert r.llen(k.sched + "free:" + lane) == 0 and r.llen(k.sched + "ready:" + lane) == 0
    assert r.llen(k.free) == 0 and r.llen(k.ready) == 0
    assert q.stats()["waiting"] == 0
    c.settle([Outcome(running, ok=True)])
    assert c.claim(10) == []


def test_deleting_the_queue_deletes_its_scheduling_keys(qname: str, redis_url: str,
                                                       r: redis.Redis) -> None:
    q, c = make(qname, redis_url)
    q.submit_many([{"i": i} for i in range(3)], tenant="A", priority="batch", stream="x")
    q.submit_many([{"i": i} for i in range(3)], tenant="B")
    c.settle([Outcome(t, ok=True, cost=2) for t in c.claim(2)])
    assert any(k.startswith(q.broker.keys.sched.encode()) for k in queue_keys(r, qname))
    q.delete(force=True)
    assert queue_keys(r, qname) == set()


def test_a_cancelled_lane_task_is_a_tombstone_that_claim_skips(qname: str, redis_url: str,
                                                              r: redis.Redis) -> None:
    q, c = make(qname, redis_url)
    a1, a2 = q.submit_many([{"i": i} for i in range(2)], tenant="A", cost=7)
    h1, h2 = q.submit_many([{"i": i} for i in range(2)], tenant="A", stream="x", cost=9,
                           priority="batch")
    assert a1.cancel() and h1.cancel()
    assert q.stats()["waiting"] == 2
    assert [t.id for t in c.claim(5)] == [a2.id, h2.id]
    assert a1.status() == "cancelled" == h1.status()
    assert served(r, q) == {"s:A": 7.0, "b:A": 9.0}, "a tombstone is not charged"
    assert q.stats()["waiting"] == 0


def test_a_dead_letter_of_a_tenant_retried_goes_back_to_its_lane(
        qname: str, redis_url: str, r: redis.Redis) -> None:
    q, c = make(qname, redis_url, max_retries=0)
    t = q.submit({"x": 1}, tenant="A", stream="x", priority="batch", cost=4)
    (got,) = c.claim(1)
    c.settle([Outcome(got, ok=False, error="E: x")])
    assert t.status() == "dead"
    assert q.retry_dead() == 1
    k = q.broker.keys
    assert r.lrange(k.sched + "ready:b:A", 0, -1) == [b"x"] and r.llen(k.ready) == 0
    assert r.zscore(k.sched + "band:b", "A") is not None
    (again,) = c.claim(1)
    assert again.id == t.id and again.deliveries == 1
    assert served(r, q) == {"b:A": 8.0}


def test_an_expired_tenant_task_is_expired_not_run(qname: str, redis_url: str,
                                                   r: redis.Redis) -> None:
    q, c = make(qname, redis_url)
    late = q.submit({"x": 1}, tenant="A", ttl=60, cost=5)
    ok = q.submit({"x": 2}, tenant="A", cost=3)
    r.hset(q.broker.keys.task(late.id), "deadline", 1)  # what time would do
    assert [t.id for t in c.claim(5)] == [ok.id]
    assert late.status() == "expired"
    assert served(r, q) == {"s:A": 3.0}
    assert q.stats()["waiting"] == 0


def test_direct_delivery_to_a_sleeping_worker_charges_its_tenant(
        qname: str, redis_url: str, r: redis.Redis) -> None:
    c = Consumer(qname, redis_url, worker_id="sleeper")
    c.direct = True
    assert c.claim(8) == [] and r.hexists(c.broker.keys.idle, "sleeper")
    q = mtq.Queue(qname, redis_url, tenant_weights="A=4")
    t = q.submit({"x": 1}, tenant="A", cost=50, priority="interactive")
    assert t.status() == "running", "handed to the sleeper"
    assert served(r, q) == {"i:A": 50.0} and vt(r, q, "A") == 12.5
    assert field(r, q, t.id, "weight") == "4|i|A"
    handed = c.wait(5)
    assert isinstance(handed, list) and [x.id for x in handed] == [t.id]
    c.settle([Outcome(handed[0], ok=True, cost=20)])
    assert served(r, q) == {"i:A": 20.0} and vt(r, q, "A") == 5.0


# -- bad input ------------------------------------------------------------------------------
BAD_SUBMITS: list[tuple[dict[str, Any], type[Exception]]] = [
    ({"priority": "urgent"}, InvalidArgument),
    ({"priority": "BATCH"}, InvalidArgument),
    ({"priority": 1}, InvalidArgument),
    ({"cost": -1}, InvalidArgument),
    ({"cost": math.nan}, InvalidArgument),
    ({"cost": math.inf}, InvalidArgument),
    ({"cost": 1e13}, InvalidArgument),
    ({"cost": True}, InvalidArgument),
    ({"tenant": "a b"}, InvalidName),
    ({"tenant": ""}, InvalidName),
    ({"tenant": "-x"}, InvalidName),
    ({"tenant": "a:b"}, InvalidName),
    ({"tenant": "x" * 65}, InvalidName),
]


@pytest.mark.parametrize("bad,error", BAD_SUBMITS, ids=[repr(b) for b, _ in BAD_SUBMITS])
def test_a_bad_scheduling_argument_raises_and_writes_nothing(
        qname: str, redis_url: str, r: redis.Redis, bad: dict[str, Any],
        error: type[Exception]) -> None:
    q = mtq.Queue(qname, redis_url)
    q.submit({"x": 0})  # the queue exists, scheduling off
    before, stats = queue_keys(r, qname), q.stats()
    with pytest.raises(error):
        q.submit({"x": 1}, **bad)
    with pytest.raises(error):
        q.submit_many([{"ok": 1}, mtq.Request({"x": 1}, **bad)])
    with pytest.raises(error):
        q.submit_many([{"ok": 1}, {"x": 1}], **bad)
    assert queue_keys(r, qname) == before and q.stats() == stats
    assert r.hget(q.broker.keys.stats, "sched") is None


def test_a_refused_submit_does_not_turn_scheduling_on(qname: str, redis_url: str,
                                                      r: redis.Redis) -> None:
    """QueueFull writes nothing (it used to turn scheduling on first)."""
    q = mtq.Queue(qname, redis_url, max_length=1)
    q.submit({"x": 0})
    before, stats = queue_keys(r, qname), q.stats()
    with pytest.raises(mtq.QueueFull):
        q.submit({"x": 1}, tenant="A", priority="batch", cost=3)
    assert queue_keys(r, qname) == before and q.stats() == stats
    assert r.hget(q.broker.keys.stats, "sched") is None


BAD_SETTINGS: list[dict[str, Any]] = [
    {"tenant_weights": {"a": 0}}, {"tenant_weights": {"a": -1}},
    {"tenant_weights": {"a": math.nan}}, {"tenant_weights": {"a": math.inf}},
    {"tenant_weights": "a=0"}, {"tenant_weights": "a=-2"}, {"tenant_weights": "a=nan"},
    {"tenant_weights": "a b=1"}, {"tenant_weights": "a"}, {"tenant_weights": "a=x"},
    {"tenant_weights": 3}, {"band_min_share": 100}, {"band_min_share": -1},
    {"band_min_share": 5.5}, {"default_cost": math.nan}, {"default_cost": -1},
    {"default_cost": "x"},
]


@pytest.mark.parametrize("bad", BAD_SETTINGS, ids=[repr(b) for b in BAD_SETTINGS])
def test_a_bad_scheduling_setting_raises_config_error_and_stores_nothing(
        qname: str, redis_url: str, r: redis.Redis, bad: dict[str, Any]) -> None:
    q = mtq.Queue(qname, redis_url)
    q.configure(tenant_weights="good=2")
    before = queue_keys(r, qname)
    config = r.hgetall(q.broker.keys.config)
    with pytest.raises(ConfigError):
        q.configure(**bad)
    with pytest.raises(ConfigError):
        mtq.Queue(qname, redis_url, **bad)
    assert queue_keys(r, qname) == before
    assert r.hgetall(q.broker.keys.config) == config
    assert q.settings.weights == {"good": 2.0}


@pytest.mark.parametrize("args", [
    ["--cost", "nan"], ["--cost", "-1"], ["--cost", "inf"], ["--tenant", "a b"],
    ["--tenant", "x" * 65], ["--priority", "urgent"], ["-p", "Interactive"],
])
def test_the_cli_refuses_bad_scheduling_options_with_exit_2(
        qname: str, redis_url: str, r: redis.Redis, args: list[str]) -> None:
    result = CliRunner().invoke(cli, ["submit", qname, '{"x": 1}', *args, "--redis", redis_url])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert queue_keys(r, qname) <= {f"mtq:{{{qname}}}:config".encode()}, queue_keys(r, qname)


@pytest.mark.parametrize("key,value", [
    ("tenant_weights", "a=0"), ("tenant_weights", "a=-1"), ("tenant_weights", "a=nan"),
    ("tenant_weights", "a b=1"), ("tenant_weights", "a=inf"), ("band_min_share", "100"),
    ("band_min_share", "-1"), ("default_cost", "nan"), ("default_cost", "-3"),
])
def test_the_cli_refuses_bad_scheduling_settings_with_exit_2(qname: str, redis_url: str,
                                                             r: redis.Redis, key: str,
                                                             value: str) -> None:
    runner = CliRunner()
    ok = runner.invoke(cli, ["queue", "config", qname, "tenant_weights", "a=2",
                             "--redis", redis_url])
    assert ok.exit_code == 0, ok.output
    config = r.hgetall(mtq.Queue(qname, redis_url).broker.keys.config)
    result = runner.invoke(cli, ["queue", "config", qname, key, value, "--redis", redis_url])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert r.hgetall(mtq.Queue(qname, redis_url).broker.keys.config) == config
    assert mtq.Queue(qname, redis_url).settings.weights == {"a": 2.0}


def test_the_cli_submits_with_priority_tenant_and_cost(qname: str, redis_url: str,
                                                       r: redis.Redis) -> None:
    result = CliRunner().invoke(cli, ["submit", qname, '{"x": 1}', "-p", "batch", "--tenant",
                                      "acme", "--cost", "12.5", "--redis", redis_url])
    assert result.exit_code == 0, result.output
    h = r.hgetall(mtq.Queue(qname, redis_url).broker.keys.task(result.output.strip()))
    assert (h[b"band"], h[b"tenant"], h[b"cost"]) == (b"b", b"acme", b"12.5")
