"""Every script and every error code, against a real redis-server."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
import redis

import mtq
from mtq.broker import protocol, scripts
from mtq.broker.codes import Code
from mtq.broker.keys import QUEUES
from mtq.broker.protocol import DEAD, FAIL, Broker

pytestmark = pytest.mark.timeout(60)


def make(qname: str, url: str, **settings: Any) -> tuple[mtq.Queue, mtq.Consumer]:
    q = mtq.Queue(qname, url, **settings)
    c = mtq.Consumer(qname, url, settings=q.settings, worker_id="w1")
    return q, c


def expire_leases(r: redis.Redis, q: mtq.Queue, *ids: str) -> None:
    """Move lease deadlines into the past (what time would do, without waiting)."""
    for task_id in ids:
        r.zadd(q.broker.keys.leases, {task_id: 0}, xx=True)


def make_due(r: redis.Redis, q: mtq.Queue, *ids: str) -> None:
    for task_id in ids:
        r.zadd(q.broker.keys.delayed, {task_id: 0}, xx=True)


def ok(tasks: list[mtq.Claimed], value: Any = None) -> list[mtq.Outcome]:
    return [mtq.Outcome(t, ok=True, value=value) for t in tasks]


# -- submit ------------------------------------------------------------------------
def test_submit_stores_task_and_counts(qname: str, redis_url: str, r: redis.Redis) -> None:
    q, _ = make(qname, redis_url)
    t = q.submit({"x": 1}, stream="u1")
    info = t.info()
    assert (info.status, info.stream, info.attempts, info.deliveries) == ("queued", "u1", 0, 0)
    assert info.created and info.started is None
    assert q.stats()["waiting"] == 1 and q.stats()["streams"] == 1
    assert r.sismember(QUEUES, qname)


def test_submit_many_one_round_trip_per_chunk_keeps_order(qname: str, redis_url: str,
                                                          r: redis.Redis) -> None:
    q, c = make(qname, redis_url)
    tasks = q.submit_many([{"i": i} for i in range(2500)], stream="s")
    assert len({t.id for t in tasks}) == 2500
    assert [x.decode() for x in r.lrange(q.broker.keys.stream("s"), 0, -1)] == [t.id for t in tasks]
    assert q.stats()["waiting"] == 2500


def test_submit_many_mixed_requests(qname: str, redis_url: str) -> None:
    q, c = make(qname, redis_url)
    tasks = q.submit_many([{"a": 1}, mtq.Request({"b": 2}, stream="u9", retries=0), {"c": 3}],
                          stream="u1")
    assert [t.info().stream for t in tasks] == ["u1", "u9", "u1"]
    claimed = {t.id: t for t in c.claim(10)}
    assert claimed[tasks[1].id].retries == 0 and claimed[tasks[0].id].retries is None


def test_idempotency_key_returns_existing_task(qname: str, redis_url: str) -> None:
    q, c = make(qname, redis_url)
    a = q.submit({"x": 1}, key="req-1")
    b = q.submit({"x": 2}, key="req-1")
    assert a.id == b.id
    assert q.stats()["waiting"] == 1
    many = q.submit_many([mtq.Request({"x": 3}, key="req-1"), mtq.Request({"x": 4}, key="req-2")])
    assert many[0].id == a.id and many[1].id != a.id
    assert q.stats()["waiting"] == 2


def test_user_given_id_and_duplicate(qname: str, redis_url: str) -> None:
    q, _ = make(qname, redis_url)
    assert q.submit({}, id="my-task-1").id == "my-task-1"
    with pytest.raises(mtq.DuplicateTask):
        q.submit({}, id="my-task-1")
    with pytest.raises(mtq.InvalidName):
        q.submit({}, id="bad id")


def test_queue_full_fails_fast_and_writes_nothing(qname: str, redis_url: str) -> None:
    q, c = make(qname, redis_url, max_length=3)
    q.submit_many([{}, {}])
    with pytest.raises(mtq.QueueFull) as exc:
        q.submit_many([{}, {}])
    assert "max_length is 3" in str(exc.value) and exc.value.waiting == 2
    assert q.stats()["waiting"] == 2
    q.submit({})  # exactly fits
    with pytest.raises(mtq.QueueFull):
        q.submit({})
    c.settle(ok(c.claim(1)))
    q.submit({})  # room again once one is taken


# -- claim: order, one running per stream, stream-less fill ---------------------------
def test_claim_round_robin_one_task_per_stream(qname: str, redis_url: str) -> None:
    q, c = make(qname, redis_url)
    a = q.submit_many([{"s": "a", "i": i} for i in range(3)], stream="a")
    b = q.submit_many([{"s": "b", "i": i} for i in range(3)], stream="b")
    got = c.claim(10)
    assert [t.id for t in got] == [a[0].id, b[0].id]
    assert c.claim(10) == []  # both streams busy: nothing more is claimable
    c.settle(ok(got[:1]))     # finish a's head only
    assert [t.id for t in c.claim(10)] == [a[1].id]


def test_streamless_tasks_fill_the_batch(qname: str, redis_url: str) -> None:
    q, c = make(qname, redis_url)
    free = q.submit_many([{"i": i} for i in range(10)])
    s = q.submit_many([{"i": i} for i in range(5)], stream="s")
    got = c.claim(8)
    ids = [t.id for t in got]
    assert s[0].id in ids and not set(ids) & {t.id for t in s[1:]}
    assert [i for i in ids if i != s[0].id] == [t.id for t in free[:7]]
    rest = c.claim(100)
    assert [t.id for t in rest] == [t.id for t in free[7:]]


def test_streamless_tasks_get_a_fair_share_among_many_streams(qname: str,
                                                              redis_url: str) -> None:
    q, c = make(qname, redis_url)
    free = q.submit_many([{"f": i} for i in range(5)])
    q.submit_many([mtq.Request({}, stream=f"s{i}") for i in range(100)])
    got = c.claim(4)  # the stream-less marker was first in the ring
    assert got[0].id == free[0].id and all(t.stream for t in got[1:])


def test_claim_reports_next_timer(qname: str, redis_url: str) -> None:
    q, c = make(qname, redis_url, lease_ms=5000)
    q.submit({})
    assert c.claim(1) and 4000 < c.next_timer_ms <= 5000
    assert c.claim(1) == [] and c.next_timer_ms > 0


def test_claim_works_its_timer_out_from_the_earliest_lease_and_retry(
        qname: str, redis_url: str, r: redis.Redis) -> None:
    """claim.lua reads the earliest lease and retry once, reaps or promotes only when
    one is due, and reports the soonest of: the earliest lease left, its own new
    leases, the earliest retry (each read again after a reap or a promotion)."""
    q, c = make(qname, redis_url, lease_ms=60_000, retry_backoff_ms=600_000)
    assert c.claim(5) == [] and c.next_timer_ms == -1  # nothing running, nothing delayed
    a, b = q.submit_many([{"i": 0}, {"i": 1}])
    (held,) = c.claim(1)
    r.zadd(q.broker.keys.leases, {held.id: int(r.time()[0]) * 1000 + 20_000}, xx=True)
    (other,) = c.claim(1)  # its own lease ends in 60 s: the older one, in 20 s, is sooner
    assert 15_000 < c.next_timer_ms <= 20_000, c.next_timer_ms
    c.settle([mtq.Outcome(other, ok=False, error="ValueError: later")])
    r.zadd(q.broker.keys.delayed, {other.id: int(r.time()[0]) * 1000 + 600_000}, xx=True)
    assert c.claim(5) == [] and 15_000 < c.next_timer_ms <= 20_000
    expire_leases(r, q, held.id)  # due: reaped, and the timer read again without it
    (again,) = c.claim(5)
    assert again.id == held.id and again.deliveries == 2
    assert 55_000 < c.next_timer_ms <= 60_000, c.next_timer_ms
    make_due(r, q, other.id)  # due: promoted and claimed; no retry is left
    (retried,) = c.claim(5)
    assert retried.id == other.id and retried.attempts == 1
    assert 55_000 < c.next_timer_ms <= 60_000, c.next_timer_ms
    c.settle(ok([again, retried]))
    assert c.claim(5) == [] and c.next_timer_ms == -1
    assert {a.status(), b.status()} == {"succeeded"}


def test_the_latency_list_is_trimmed_in_steps_and_read_to_its_cap(
        qname: str, redis_url: str, r: redis.Redis) -> None:
    q, c = make(qname, redis_url)
    key = q.broker.keys.latency
    r.rpush(key, *([7] * (protocol.LATENCY_KEEP + 150)))  # not trimmed yet: under the slack
    q.submit({})
    c.settle(ok(c.claim(1)))
    assert r.llen(key) == protocol.LATENCY_KEEP + 151  # one command per ack call, no trim
    pipe = r.pipeline(transaction=False)
    q.broker.snapshot_into(pipe)
    assert len(Broker.parse_snapshot(pipe.execute())["latency_ms"]) == protocol.LATENCY_KEEP
    q.submit_many([{}] * 60)
    c.settle(ok(c.claim(60)))  # past the slack: back to the cap, newest first
    assert r.llen(key) == protocol.LATENCY_KEEP
    assert r.lindex(key, -1) == b"7"


# -- ack and fencing ---------------------------------------------------------------
def test_ack_stores_result_with_retention(qname: str, redis_url: str, r: redis.Redis) -> None:
    q, c = make(qname, redis_url, retention_s=100)
    t = q.submit({"x": 2})
    report = c.settle(ok(c.claim(1), {"y": 4}))
    assert report.succeeded == 1 and not report.lost
    assert t.result(timeout=5) == {"y": 4}
    assert 0 < r.ttl(q.broker.keys.task(t.id)) <= 100
    assert q.stats()["succeeded"] == 1 and q.stats()["running"] == 0


def test_ack_with_a_stale_token_is_rejected(qname: str, redis_url: str) -> None:
    q, c = make(qname, redis_url)
    t = q.submit({})
    (task,) = c.claim(1)
    codes = q.broker.ack([(t.id, "999999", b"\xc0")])
    assert codes == [Code.LEASE_LOST]
    assert t.status() == "running"


def test_late_ack_after_lease_expiry_loses_and_new_owner_wins(qname: str, redis_url: str,
                                                              r: redis.Redis) -> None:
    q, a = make(qname, redis_url)
    b = mtq.Consumer(qname, redis_url, worker_id="w2")
    t = q.submit({"n": 1}, stream="u")
    behind = q.submit({"n": 2}, stream="u")
    (held,) = a.claim(1)
    expire_leases(r, q, t.id)
    (again,) = b.claim(5)  # reaps first, then claims: the same task, back at the head
    assert again.id == t.id and again.deliveries == 2 and again.token != held.token
    late = a.settle(ok([held], "from A"))
    assert late.lost == [t.id] and late.succeeded == 0
    assert b.settle(ok([again], "from B")).succeeded == 1
    assert t.result(timeout=5) == "from B"
    assert a.settle(ok([held], "from A again")).lost == [t.id]
    assert t.result(timeout=5) == "from B"
    assert [x.id for x in b.claim(5)] == [behind.id]


# -- nack: retry to the head, fail, dead-letter, release ------------------------------
def test_retry_goes_back_to_the_head_and_blocks_the_stream(qname: str, redis_url: str,
                                                           r: redis.Redis) -> None:
    q, c = make(qname, redis_url, retry_backoff_ms=60_000)
    first, second = q.submit_many([{"i": 0}, {"i": 1}], stream="u")
    (t,) = c.claim(5)
    rep = c.settle([mtq.Outcome(t, ok=False, error="ValueError: boom")])
    assert rep.retried == 1
    info = first.info()
    assert info.status == "delayed" and info.attempts == 1 and info.error == "ValueError: boom"
    assert c.claim(5) == []            # the stream stays blocked while the retry waits
    assert 30_000 <= c.next_timer_ms <= 60_000  # backoff with jitter
    make_due(r, q, first.id)
    (again,) = c.claim(5)
    assert again.id == first.id and again.attempts == 1
    c.settle(ok([again]))
    assert [x.id for x in c.claim(5)] == [second.id]
    assert q.stats()["retried"] == 1


def test_retries_exhausted_dead_letter(qname: str, redis_url: str, r: redis.Redis) -> None:
    q, c = make(qname, redis_url, max_retries=1, retry_backoff_ms=0)
    t = q.submit({}, stream="u")
    nxt = q.submit({}, stream="u")
    c.settle([mtq.Outcome(c.claim(1)[0], ok=False, error="E: 1")])   # retried (attempt 1)
    (again,) = c.claim(1)
    assert again.id == t.id
    rep = c.settle([mtq.Outcome(again, ok=False, error="E: 2")])
    assert rep.dead == 1
    assert t.status() == "dead" and t.info().attempts == 2
    assert r.lrange(q.broker.keys.dead, 0, -1) == [t.id.encode()]
    with pytest.raises(mtq.TaskFailed) as exc:
        t.result(timeout=5)
    assert exc.value.status == "dead" and "E: 2" in str(exc.value)
    assert [x.id for x in c.claim(5)] == [nxt.id]   # the stream moves on


def test_per_task_retries_and_failed_without_dead_letter(qname: str, redis_url: str) -> None:
    q, c = make(qname, redis_url, dead_letter=False)
    t = q.submit({}, retries=0)
    assert c.settle([mtq.Outcome(c.claim(1)[0], ok=False, error="E: x")]).failed == 1
    assert t.status() == "failed" and q.stats()["dead"] == 0


def test_non_retryable_fails_at_once(qname: str, redis_url: str) -> None:
    q, c = make(qname, redis_url)
    t = q.submit({})
    c.settle([mtq.Outcome(c.claim(1)[0], ok=False, error="PayloadError: x", retryable=False)])
    assert t.status() == "failed"


def test_unencodable_result_fails_the_task_not_the_batch(qname: str, redis_url: str) -> None:
    q, c = make(qname, redis_url)
    good, bad = q.submit_many([{}, {}])
    got = {x.id: x for x in c.claim(2)}
    rep = c.settle([mtq.Outcome(got[good.id], ok=True, value=1),
                    mtq.Outcome(got[bad.id], ok=True, value=object())])
    assert rep.succeeded == 1 and rep.failed == 1
    assert good.result(timeout=5) == 1
    assert "EncodeError" in (bad.info().error or "")


def test_dead_letter_list_is_capped(qname: str, redis_url: str, r: redis.Redis) -> None:
    q, c = make(qname, redis_url, max_retries=0, dead_max=2)
    tasks = q.submit_many([{}, {}, {}])
    for _ in range(3):
        c.settle([mtq.Outcome(c.claim(1)[0], ok=False, error="E: x")])
    assert r.llen(q.broker.keys.dead) == 2
    with pytest.raises(mtq.TaskNotFound):
        tasks[0].status()            # the oldest dead task was dropped with its hash
    assert tasks[2].status() == "dead"


def test_release_gives_back_without_counting_a_delivery(qname: str, redis_url: str) -> None:
    q, c = make(qname, redis_url)
    a, b = q.submit_many([{}, {}], stream="u")
    held = c.claim(1)
    assert c.release(held) == 1
    info = a.info()
    assert info.status == "queued" and info.deliveries == 0
    assert [x.id for x in c.claim(1)] == [a.id]


def test_nack_unknown_action_and_stale_token(qname: str, redis_url: str) -> None:
    q, c = make(qname, redis_url)
    t = q.submit({})
    (held,) = c.claim(1)
    assert q.broker.nack([(t.id, held.token, "explode", "")]) == [Code.BAD_ARGUMENT]
    assert q.broker.nack([(t.id, "0", FAIL, "x")]) == [Code.LEASE_LOST]
    assert t.status() == "running"
    assert q.broker.nack([(t.id, held.token, DEAD, "x")]) == [1]
    assert t.status() == "dead"


# -- extend and reap ---------------------------------------------------------------
def test_extend_moves_the_deadline_and_reports_lost(qname: str, redis_url: str,
                                                    r: redis.Redis) -> None:
    q, c = make(qname, redis_url, lease_ms=1000)
    t = q.submit({})
    (held,) = c.claim(1)
    before = r.zscore(q.broker.keys.leases, t.id)
    lost, cancel = c.extend([held], lease_ms=60_000)
    assert (lost, cancel) == ([], [])
    assert r.zscore(q.broker.keys.leases, t.id) > before + 50_000
    expire_leases(r, q, t.id)
    c.reap()
    assert c.extend([held]) == ([t.id], [])


def test_reap_requeues_at_head_then_poison_goes_dead(qname: str, redis_url: str,
                                                     r: redis.Redis) -> None:
    q, c = make(qname, redis_url, max_deliveries=2)
    t, behind = q.submit_many([{}, {}], stream="u")
    for delivery in (1, 2):
        (held,) = c.claim(5)
        assert held.id == t.id and held.deliveries == delivery
        expire_leases(r, q, t.id)
        assert c.reap() == 1
    assert t.status() == "dead"
    assert "PoisonTask" in (t.info().error or "")
    assert r.lrange(q.broker.keys.dead, 0, -1) == [t.id.encode()]
    assert [x.id for x in c.claim(5)] == [behind.id]
    assert q.stats()["redelivered"] == 1


def test_reap_script_returns_counts(qname: str, redis_url: str, r: redis.Redis) -> None:
    q, c = make(qname, redis_url)
    q.submit({})
    (held,) = c.claim(1)
    expire_leases(r, q, held.id)
    reaped, promoted, nxt = q.broker.reap()
    assert (reaped, promoted, nxt) == (1, 0, -1)


# -- deadlines ---------------------------------------------------------------------
def test_expired_task_is_never_run_and_stream_moves_on(qname: str, redis_url: str,
                                                       r: redis.Redis) -> None:
    q, c = make(qname, redis_url)
    old = q.submit({}, stream="u", ttl=60)
    new = q.submit({}, stream="u")
    assert old.info().deadline is not None
    r.hset(q.broker.keys.task(old.id), "deadline", 1)  # as if 60 s had passed
    assert [x.id for x in c.claim(5)] == [new.id]
    assert old.status() == "expired"
    with pytest.raises(mtq.TaskFailed) as exc:
        old.result(timeout=1)
    assert exc.value.status == "expired"
    assert q.stats()["expired"] == 1 and q.stats()["waiting"] == 0


def test_ttl_must_be_positive(qname: str, redis_url: str) -> None:
    q, _ = make(qname, redis_url)
    with pytest.raises(ValueError):
        q.submit({}, ttl=0)


# -- cancel ------------------------------------------------------------------------
def test_cancel_waiting_task_does_not_block_the_stream(qname: str, redis_url: str) -> None:
    q, c = make(qname, redis_url)
    a, b, d = q.submit_many([{}, {}, {}], stream="u")
    assert a.cancel() is True
    assert a.status() == "cancelled" and q.stats()["waiting"] == 2
    with pytest.raises(mtq.TaskCancelled):
        a.result(timeout=1)
    (held,) = c.claim(5)
    assert held.id == b.id
    assert d.cancel() is True
    c.settle(ok([held]))
    assert c.claim(5) == []          # d was cancelled: its tombstone is skipped
    assert q.stats()["cancelled"] == 2 and q.stats()["waiting"] == 0


def test_cancel_running_task_is_flagged_and_worker_learns_it(qname: str, redis_url: str) -> None:
    q, c = make(qname, redis_url)
    t, behind = q.submit_many([{}, {}], stream="u")
    (held,) = c.claim(1)
    assert t.cancel() is False and t.info().cancel_requested
    assert c.extend([held]) == ([], [t.id])
    assert c.settle([mtq.Outcome(held, ok=False, cancelled=True)]).cancelled == 1
    assert t.status() == "cancelled"
    assert [x.id for x in c.claim(1)] == [behind.id]


def test_cancel_running_then_worker_dies(qname: str, redis_url: str, r: redis.Redis) -> None:
    q, c = make(qname, redis_url)
    t = q.submit({})
    c.claim(1)
    t.cancel()
    expire_leases(r, q, t.id)
    c.reap()
    assert t.status() == "cancelled"   # not redelivered: nobody wants it any more


def test_cancel_retry_waiting_task_releases_stream(qname: str, redis_url: str) -> None:
    q, c = make(qname, redis_url, retry_backoff_ms=60_000)
    t, behind = q.submit_many([{}, {}], stream="u")
    c.settle([mtq.Outcome(c.claim(1)[0], ok=False, error="E: x")])
    assert t.status() == "delayed"
    assert t.cancel() is True
    assert [x.id for x in c.claim(1)] == [behind.id]


def test_cancel_finished_and_unknown(qname: str, redis_url: str) -> None:
    q, c = make(qname, redis_url)
    t = q.submit({})
    c.settle(ok(c.claim(1)))
    assert t.cancel() is False and t.status() == "succeeded"
    assert q.broker.cancel(t.id) == (Code.FINISHED, "succeeded")
    with pytest.raises(mtq.TaskNotFound):
        q.task("nope").cancel()


# -- waking without polling ----------------------------------------------------------
def test_blocked_consumer_is_woken_by_submit(qname: str, redis_url: str) -> None:
    q, c = make(qname, redis_url)
    assert c.claim(1) == []
    assert c.wait(timeout=0.05) is False  # nothing to do: times out
    result: dict[str, Any] = {}

    def sleeper() -> None:
        t0 = time.monotonic()
        result["woken"] = c.wait(timeout=8)
        result["after"] = time.monotonic() - t0
        result["claimed"] = c.claim(1)

    th = threading.Thread(target=sleeper)
    th.start()
    # the sleeper is blocked in BLPOP before we submit: wait for Redis to see it
    r = q.redis
    deadline = time.monotonic() + 5
    while int(r.info("clients")["blocked_clients"]) < 1:
        assert time.monotonic() < deadline, "consumer never blocked on the wake list"
        time.sleep(0.005)
    t = q.submit({"wake": 1})
    th.join(10)
    assert not th.is_alive(), "the woken consumer did not finish its claim within 10 s"
    assert result["woken"] is True and result["after"] < 5
    assert [x.id for x in result["claimed"]] == [t.id]


# -- events and stats ----------------------------------------------------------------
def test_lifecycle_events_are_published(qname: str, redis_url: str) -> None:
    q, c = make(qname, redis_url)
    ps = q.redis.pubsub(ignore_subscribe_messages=True)
    ps.subscribe(q.broker.keys.events)
    ps.get_message(timeout=1)
    t = q.submit({})
    c.settle(ok(c.claim(1)))
    events = []
    deadline = time.monotonic() + 5
    while len(events) < 3 and time.monotonic() < deadline:
        m = ps.get_message(timeout=1)
        if m:
            events.append(json.loads(m["data"]))
    ps.close()
    assert [e["event"] for e in events] == ["queued", "started", "succeeded"]
    assert events[1]["ids"] == [t.id] and events[1]["worker"] == "w1"


def test_stats_are_o1_counters(qname: str, redis_url: str) -> None:
    q, c = make(qname, redis_url, max_retries=0)
    q.submit_many([mtq.Request({}, stream=f"s{i % 3}") for i in range(6)] + [{}])
    s = q.stats()
    assert (s["waiting"], s["streams"], s["submitted"]) == (7, 3, 7)
    got = c.claim(2)
    c.settle([mtq.Outcome(got[0], ok=True), mtq.Outcome(got[1], ok=False, error="E: x")])
    s = q.stats()
    assert (s["waiting"], s["succeeded"], s["dead"], s["dead_total"]) == (5, 1, 1, 1)


# -- results -------------------------------------------------------------------------
def test_result_waits_for_completion_from_another_thread(qname: str, redis_url: str) -> None:
    q, c = make(qname, redis_url)
    t = q.submit({"x": 21})
    th = threading.Thread(target=lambda: c.settle(ok(c.claim(1), 42)))
    th.start()
    assert t.result(timeout=10) == 42
    th.join(10)
    assert not th.is_alive(), "the settling thread did not finish within 10 s"


def test_result_timeout_and_not_found(qname: str, redis_url: str) -> None:
    q, _ = make(qname, redis_url)
    t = q.submit({})
    start = time.monotonic()
    with pytest.raises(mtq.ResultTimeout) as exc:
        t.result(timeout=0.3)
    waited = time.monotonic() - start
    assert isinstance(exc.value, TimeoutError) and exc.value.status == "queued"
    # the caller's timeout, once: not what was left of it after the wait on its own task
    assert exc.value.timeout == 0.3 and "within 0.3s" in str(exc.value)
    assert 0.3 <= waited < 2.0, f"result(timeout=0.3) gave up after {waited:.2f} s"
    other = q.submit({})
    start = time.monotonic()
    with pytest.raises(mtq.ResultTimeout):
        other.result(timeout=-1)  # a time already past: no wait at all (not "forever")
    assert time.monotonic() - start < 2.0
    with pytest.raises(mtq.TaskNotFound):
        q.task("missing").result(timeout=1)


# -- bad input harms nothing -----------------------------------------------------------
def test_bad_input_gets_named_errors_and_queue_stays_healthy(qname: str, redis_url: str) -> None:
    q, c = make(qname, redis_url, max_payload_bytes=1000)
    with pytest.raises(mtq.PayloadTooLarge):
        q.submit({"blob": b"x" * 2000})
    with pytest.raises(mtq.EncodeError):
        q.submit({"obj": object()})
    with pytest.raises(mtq.InvalidName):
        q.submit({}, stream="has space")
    with pytest.raises(mtq.InvalidName):
        q.submit({}, stream="")
    with pytest.raises(mtq.InvalidName):
        mtq.Queue("bad{name}", redis_url)
    with pytest.raises(mtq.EncodeError):   # one bad item: nothing of the batch is sent
        q.submit_many([{}, {"o": object()}])
    assert q.stats()["submitted"] == 0
    t = q.submit({"fine": True}, stream="ok")
    c.settle(ok(c.claim(5), "done"))
    assert t.result(timeout=5) == "done"


def test_garbage_payload_fails_only_that_task(qname: str, redis_url: str, r: redis.Redis) -> None:
    from mtq.workers.model import FunctionModel
    from mtq.workers.worker import Worker

    q, c = make(qname, redis_url)
    good = q.submit({"x": 1})
    bad = q.submit({"x": 2})
    r.hset(q.broker.keys.task(bad.id), "payload", b"\xc1\xc1")  # not msgpack
    w = Worker(FunctionModel(lambda p: p["x"]), qname, consumer=c)
    w.command({"cmd": "drain"})
    w.run()
    assert good.result(timeout=5) == 1
    assert bad.status() == "failed" and "PayloadError" in (bad.info().error or "")


def test_unreachable_redis_is_a_broker_error(unreachable_url: str) -> None:
    q = mtq.Queue("x", unreachable_url)
    with pytest.raises(mtq.BrokerError, match="cannot reach Redis"):
        q.submit({})


def test_a_bad_number_of_retries_is_a_named_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from mtq.broker.connection import open_client
    from mtq.settings import RedisSettings

    for bad in ("-1", "many", "1.5"):
        monkeypatch.setenv("MTQ_REDIS_RETRIES", bad)
        with pytest.raises(mtq.ConfigError, match="MTQ_REDIS_RETRIES must be a whole number"):
            open_client("redis://127.0.0.1:1/0", RedisSettings(), None)


# -- regressions found by the stateful test ---------------------------------------------
def test_tombstones_do_not_shrink_a_batch(qname: str, redis_url: str) -> None:
    q, c = make(qname, redis_url, retry_backoff_ms=0, retry_backoff_max_ms=0)
    a, b = q.submit_many([{}, {}])
    d = q.submit({})
    c.settle([mtq.Outcome(c.claim(1)[0], ok=False, error="E: x")])  # a: retry, due now
    assert b.cancel() is True                                        # b: a tombstone
    assert {t.id for t in c.claim(2)} == {a.id, d.id}


def test_cancel_request_wins_over_a_final_failure(qname: str, redis_url: str,
                                                  r: redis.Redis) -> None:
    q, c = make(qname, redis_url, max_retries=0)
    t = q.submit({})
    (held,) = c.claim(1)
    t.cancel()
    c.settle([mtq.Outcome(held, ok=False, error="E: x")])  # would be dead-lettered
    assert t.status() == "cancelled" and r.llen(q.broker.keys.dead) == 0


# -- regressions found in review: reused ids, order of released stream-less tasks ------
def test_dead_letter_trim_never_deletes_a_live_task(qname: str, redis_url: str,
                                                    r: redis.Redis) -> None:
    q, c = make(qname, redis_url, dead_max=1, max_retries=0)
    x = q.submit({}, id="x")
    c.settle([mtq.Outcome(c.claim(1)[0], ok=False, error="E: 1")])
    r.delete(q.broker.keys.task("x"))            # as if its dead retention ran out
    x2 = q.submit({}, id="x")                    # the id is reused by a live task
    y = q.submit({}, id="y")
    held = {t.id: t for t in c.claim(2)}
    c.settle([mtq.Outcome(held["y"], ok=False, error="E: 2")])  # trims the old "x"
    assert x2.status() == "running"
    assert c.settle([mtq.Outcome(held["x"], ok=True, value=1)]).succeeded == 1
    assert x.result(timeout=5) == 1 and y.status() == "dead"


def test_cancelled_tombstone_keeps_its_id_until_claimed(qname: str, redis_url: str,
                                                        r: redis.Redis) -> None:
    q, c = make(qname, redis_url, retention_s=1)
    a = q.submit({}, stream="s")
    q.submit({}, stream="s", id="x")
    (held,) = c.claim(5)
    assert q.task("x").cancel() is True
    assert r.ttl(q.broker.keys.task("x")) == -1    # no expiry while the tombstone exists
    with pytest.raises(mtq.DuplicateTask):
        q.submit({}, stream="s2", id="x")
    y = q.submit({}, stream="s")
    c.settle([mtq.Outcome(held, ok=True)])
    assert [t.id for t in c.claim(5)] == [y.id]    # the tombstone is skipped ...
    assert 0 < r.ttl(q.broker.keys.task("x")) <= 1  # ... and its retention starts
    assert a.status() == "succeeded"


def test_released_streamless_batch_keeps_its_order(qname: str, redis_url: str) -> None:
    q, c = make(qname, redis_url)
    tasks = q.submit_many([{}, {}, {}])
    c.release(c.claim(3))
    assert [t.id for t in c.claim(3)] == [t.id for t in tasks]


def test_ttl_must_be_finite_and_bounded(qname: str, redis_url: str) -> None:
    q, _ = make(qname, redis_url)
    for bad in (float("inf"), float("nan"), 1e15, -1, "10"):
        with pytest.raises(ValueError):
            q.submit({}, ttl=bad)  # type: ignore[arg-type]


def test_duplicate_in_submit_many_reports_what_went_in(qname: str, redis_url: str) -> None:
    q, _ = make(qname, redis_url)
    q.submit({}, id="taken")
    with pytest.raises(mtq.DuplicateTask) as exc:
        q.submit_many([mtq.Request({}, id="new-1"), mtq.Request({}, id="taken"),
                       mtq.Request({}, id="new-2")])
    assert [t.id for t in exc.value.created] == ["new-1", "new-2"]
    assert exc.value.duplicates == ["taken"]
    assert q.stats()["waiting"] == 3


# -- loading --------------------------------------------------------------------------
def test_scripts_compile_in_redis(r):
    # SCRIPT LOAD compiles the Lua: a syntax error in any script (or in the
    # pasted library) fails here, and Redis must agree on the SHA1.
    for name in scripts.NAMES:
        s = scripts.script(name)
        sha = r.script_load(s.source)
        assert (sha.decode() if isinstance(sha, bytes) else sha) == s.sha
