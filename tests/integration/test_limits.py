"""Rate limits, deadlines and the scheduling state across a Redis restart, against a real
redis-server (docs/scheduling.md): a tenant over its limit is refused (reject) or held
(hold) until a claim may take it, which a sleeping worker's timer says; a deadline ends a
task wherever it waits and refuses, at submit, one the work ahead would make it miss;
within a band the earlier deadline goes first where the fair share allows."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import redis

import mtq
from tests.support.servers import RedisServer
from tests.support.waits import wait_for
from tests.support.workers import FAST, make_worker, serving

pytestmark = pytest.mark.timeout(60)


def make(qname: str, url: str, **settings: Any) -> tuple[mtq.Queue, mtq.Consumer]:
    q = mtq.Queue(qname, url, **settings)
    return q, mtq.Consumer(qname, url, settings=q.settings, worker_id="w1")


def count(r: redis.Redis, q: mtq.Queue, field: str) -> float:
    return float(r.hget(q.broker.keys.sched + "count", field) or 0)


def test_reject_mode_refuses_a_tenant_over_its_limit_whole_and_says_when(
        qname: str, redis_url: str, r: redis.Redis) -> None:
    q, _ = make(qname, redis_url, tenant_rpm="acme=60,*=120")
    q.submit(1, tenant="acme")  # a limit of 60 a minute: a burst of one
    with pytest.raises(mtq.RateLimited) as refused:
        q.submit(2, tenant="acme")
    assert refused.value.tenant == "acme" and 0 < refused.value.retry_after <= 1.0
    before = q.stats()["submitted"]
    with pytest.raises(mtq.RateLimited):  # whole: the other tenant's task does not go in
        q.submit_many([mtq.Request(3, tenant="beta"), mtq.Request(4, tenant="acme")])
    assert q.stats()["submitted"] == before
    assert (count(r, q, "s:acme|x"), count(r, q, "s:beta|x")) == (2, 1), \
        "the refused tasks are counted, each in its lane"
    q.submit_many([mtq.Request(i, tenant="beta") for i in range(2)])  # '*': 120, burst 2
    with pytest.raises(mtq.RateLimited):
        q.submit(5, tenant="beta")
    q.submit_many([None] * 50)  # no tenant, no limit
    time.sleep(refused.value.retry_after)  # the time it said to wait: then it goes in
    q.submit(6, tenant="acme")


def test_a_cost_limit_counts_the_cost_of_what_is_submitted(qname: str, redis_url: str) -> None:
    q, _ = make(qname, redis_url, tenant_tpm="acme=6000")  # 100 a second, one second ahead
    q.submit(1, tenant="acme", cost=80)
    q.submit(2, tenant="acme", cost=80)  # a second of budget ahead at most: allowed once
    with pytest.raises(mtq.RateLimited) as refused:
        q.submit(3, tenant="acme", cost=1)
    assert 0.5 < refused.value.retry_after <= 1.6


def test_hold_mode_queues_the_tasks_and_a_claim_takes_them_as_the_limit_allows(
        qname: str, redis_url: str, r: redis.Redis) -> None:
    q, c = make(qname, redis_url, tenant_rpm="slow=120", rate_limit_mode="hold")
    slow = [q.submit(i, tenant="slow", stream=f"s{i}") for i in range(4)]
    fast = [q.submit(i, tenant="fast") for i in range(3)]
    got = c.claim(10)
    ids = {t.id for t in got}
    assert {t.id for t in fast} <= ids and len(ids & {t.id for t in slow}) == 2, \
        "the limit's burst (2 of 120 a minute), then the tenant is passed over"
    assert 0 < c.next_timer_ms <= 500, "the claim says when the held tenant may go on"
    assert count(r, q, "s:slow|h") >= 1
    c.settle([mtq.Outcome(t, ok=True, value=0) for t in got])
    time.sleep(c.next_timer_ms / 1000)  # what the timer said: one more may start then
    again = c.claim(10)
    assert len(again) == 1 and again[0].id in {t.id for t in slow}


def test_a_held_tenant_s_tasks_run_on_a_sleeping_worker_s_timer(
        qname: str, redis_url: str) -> None:
    """No polling: the worker sleeps until the limit allows the next task, and runs all."""
    q = mtq.Queue(qname, redis_url, tenant_rpm="slow=600", rate_limit_mode="hold")
    tasks = [q.submit({"x": i}, tenant="slow") for i in range(14)]  # burst 10, then 10/s
    w = make_worker("tests.handlers:double", qname, redis_url,
                    settings=FAST.replace(tenant_rpm="slow=600", rate_limit_mode="hold"))
    with serving(w):
        started = time.monotonic()
        assert [t.result(timeout=20) for t in tasks] == [2 * i for i in range(14)]
        took = time.monotonic() - started
    assert 0.25 < took < 5, f"{took:.2f} s: four held tasks at 10 a second"


def test_a_deadline_ends_a_task_wherever_it_waits(qname: str, redis_url: str,
                                                  r: redis.Redis) -> None:
    q, c = make(qname, redis_url)
    head = q.submit("head", stream="s")
    behind = q.submit("behind", stream="s", ttl=0.05)
    after = q.submit("after", stream="s")
    (held,) = c.claim(1)
    assert held.id == head.id
    wait_for(lambda: (c.claim(0), behind.status())[1] == "expired", 5,
             "the task behind the running one did not expire where it waits")
    assert q.stats()["waiting"] == 1 and q.stats()["expired"] == 1
    c.settle([mtq.Outcome(held, ok=True, value=1)])
    (nxt,) = c.claim(5)
    assert nxt.id == after.id, "the tombstone is skipped, the order kept"
    with pytest.raises(mtq.TaskFailed):
        behind.result(timeout=1)


def test_a_claim_s_timer_wakes_for_the_next_deadline(qname: str, redis_url: str) -> None:
    q, c = make(qname, redis_url)
    q.submit("head", stream="s")
    q.submit("behind", stream="s", ttl=0.4)
    c.claim(1)
    assert 0 < c.next_timer_ms <= 400


def test_a_deadline_the_work_ahead_would_miss_is_refused_at_once(
        qname: str, redis_url: str, r: redis.Redis) -> None:
    q, c = make(qname, redis_url)
    q.submit(None, tenant="a", cost=10, deadline=5)  # admitted: no rate measured yet
    k = q.broker.keys.sched
    r.hset(k + "vt", "~rate", 100)  # the workers serve 100 cost a second
    q.submit_many([mtq.Request(None, tenant="a", cost=10, stream=f"s{i}") for i in range(30)])
    with pytest.raises(mtq.WouldMissDeadline) as late:  # 310 cost ahead: 3.1 s (+10 %)
        q.submit(None, tenant="a", cost=10, deadline=2.0)
    assert 1.0 < late.value.retry_after < 2.0
    assert count(r, q, "s:a|x") == 1
    q.submit(None, tenant="a", cost=10, deadline=4.0)  # in time
    # another tenant's share: its own work alone ahead, and a's as the fair share serves it
    q.submit(None, tenant="b", cost=10, deadline=0.5)
    q.submit(None, tenant="b", cost=10, priority="interactive", deadline=0.2)
    with pytest.raises(mtq.InvalidArgument):
        q.submit(None, deadline=-1)
    with pytest.raises(mtq.InvalidArgument):
        q.submit(None, deadline=1, ttl=1)


def test_within_a_band_the_earlier_deadline_goes_first_where_the_share_allows(
        qname: str, redis_url: str) -> None:
    q, c = make(qname, redis_url)
    [q.submit(f"a{i}", tenant="A", stream=f"a{i}", cost=10, ttl=100) for i in range(3)]
    [q.submit(f"b{i}", tenant="B", stream=f"b{i}", cost=10, ttl=5) for i in range(3)]
    order = []
    for _ in range(6):
        (t,) = c.claim(1)
        order.append(mtq.serialization.loads(t.payload))
        c.settle([mtq.Outcome(t, ok=True, value=0)])
    assert order[0] == "b0", "B's deadline is earlier, A's time no less"
    assert sorted(order) == ["a0", "a1", "a2", "b0", "b1", "b2"]
    assert abs(order.index("a2") - order.index("b2")) <= 2, "and the shares stay even"


def test_the_scheduling_state_survives_a_redis_restart(tmp_path: Path) -> None:
    server = RedisServer(tmp_path, appendonly=True)
    server.start()
    try:
        first = redis.Redis.from_url(server.url)
        q = mtq.Queue("restart", client=first, tenant_weights="A=3")
        c = mtq.Consumer("restart", client=first, settings=q.settings, worker_id="w1")
        for i in range(8):
            q.submit(i, tenant="A", stream=f"a{i}", cost=10)
            q.submit(i, tenant="B", stream=f"b{i}", cost=10)
        taken = c.claim(4)
        c.settle([mtq.Outcome(t, ok=True, value=0) for t in taken])
        client = redis.Redis.from_url(server.url)
        before = {k: client.hgetall(q.broker.keys.sched + k) for k in ("vt", "served", "count")}
        client.close()
        first.close()
        server.stop()
        server.start()
        client = redis.Redis.from_url(server.url)
        after = {k: client.hgetall(q.broker.keys.sched + k) for k in ("vt", "served", "count")}
        assert after == before and before["served"]
        # (clients of their own: the first ones' connections died with the server)
        q2 = mtq.Queue("restart", client=client, tenant_weights="A=3")
        c2 = mtq.Consumer("restart", client=client, settings=q2.settings, worker_id="w2")
        left = []
        while got := c2.claim(4):
            left += got
            c2.settle([mtq.Outcome(t, ok=True, value=0) for t in got])
        assert len(left) == 12 and q2.stats()["succeeded"] == 16
        served = {k.decode(): float(v)
                  for k, v in client.hgetall(q.broker.keys.sched + "served").items()}
        assert served == {"s:A": 80.0, "s:B": 80.0}
        client.close()
    finally:
        server.stop()


# -- what a review found (each failed before its fix) ---------------------------------------
def test_a_claim_with_a_held_tenant_and_many_in_another_band_ends(qname: str,
                                                                   redis_url: str) -> None:
    """A held tenant counted against a band it is not in, with more tenants there than a
    claim reads at once, made the claim read the band again and again, forever."""
    q, c = make(qname, redis_url, tenant_rpm="H=60", rate_limit_mode="hold")
    q.submit(0, tenant="H", priority="interactive")
    q.submit(1, tenant="H", priority="interactive", stream="h")  # over its burst: held
    q.submit_many([mtq.Request(i, tenant=f"T{i % 20:02d}", stream=f"s{i}")
                   for i in range(400)])
    got = c.claim(64)
    assert len(got) == 64


def test_a_stream_moved_to_the_plain_lane_in_a_claim_is_claimed(qname: str,
                                                                 redis_url: str) -> None:
    q, c = make(qname, redis_url)
    head = q.submit("A", stream="u", priority="interactive")
    nxt = q.submit("B", stream="u")  # standard, no tenant: the lane of K_READY
    head.cancel()
    got = c.claim(4)
    assert [t.id for t in got] == [nxt.id]


def test_the_lane_counts_start_right_when_scheduling_turns_on(qname: str, redis_url: str,
                                                              r: redis.Redis) -> None:
    q, c = make(qname, redis_url)
    q.submit_many([{"prompt": "x" * 10, "max_tokens": 490} for _ in range(10)])
    running = c.claim(2)  # claimed before: charged nothing
    q.submit(None, tenant="acme")  # turns it on
    while got := c.claim(64):
        c.settle([mtq.Outcome(t, ok=True, value=0) for t in got])
    c.settle([mtq.Outcome(t, ok=True, value=0) for t in running])
    counts = {k.decode(): float(v) for k, v in
              r.hgetall(q.broker.keys.sched + "count").items()}
    assert all(v == 0 for v in counts.values()), counts


def test_a_call_of_more_than_the_burst_goes_in_whole_and_delays_the_next(
        qname: str, redis_url: str) -> None:
    q, _ = make(qname, redis_url, tenant_rpm="acme=600")  # burst 10
    assert len(q.submit_many([mtq.Request(i, tenant="acme") for i in range(30)])) == 30
    with pytest.raises(mtq.RateLimited) as refused:
        q.submit(0, tenant="acme")
    assert 1.5 < refused.value.retry_after < 2.5  # 20 more than the burst, at 10 a second


def test_a_deadline_of_a_cancelled_task_does_not_expire_its_id_used_again(
        qname: str, redis_url: str, r: redis.Redis) -> None:
    q, c = make(qname, redis_url)
    t = q.submit("old", id="same-id", ttl=0.05)
    t.cancel()
    assert c.claim(1) == []  # its tombstone popped
    r.delete(q.broker.keys.task("same-id"))  # as its retention would end
    again = q.submit("new", id="same-id")
    time.sleep(0.1)  # past the old deadline
    (got,) = c.claim(1)
    assert got.id == again.id and again.status() == "running"
