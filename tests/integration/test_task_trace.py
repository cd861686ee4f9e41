"""A task's trace (``Task.trace()``, ``mtq task``, ``mtq trace``) against a real
redis-server: on the happy path it is read from the task's own fields and no trace list
exists; the first step off that path (retry, release, restart after a lost lease,
cancel request, retry from the dead letters) writes the life so far into a list that
holds every later line too, and expires with the task. A task an older mtq made (no
``trace`` field, a full list) reads as its list."""

from __future__ import annotations

from typing import Any

import pytest
import redis

import mtq
from mtq.broker.keys import QueueKeys
from mtq.broker.protocol import read_traces

pytestmark = pytest.mark.timeout(60)


def make(qname: str, url: str, **settings: Any) -> tuple[mtq.Queue, mtq.Consumer]:
    q = mtq.Queue(qname, url, **settings)
    return q, mtq.Consumer(qname, url, settings=q.settings, worker_id="w1")


def steps(t: mtq.Task) -> list[tuple[str, str]]:
    return [(e.kind, e.detail) for e in t.trace()]


def test_the_happy_path_keeps_no_list_and_reads_the_same_lines(
        qname: str, redis_url: str, r: redis.Redis) -> None:
    q, c = make(qname, redis_url)
    t = q.submit({"i": 1}, stream="u")
    k = QueueKeys(qname)
    assert steps(t) == [("queued", "stream u")]
    (held,) = c.claim(1)
    assert steps(t) == [("queued", "stream u"), ("started", "delivery 1 on w1")]
    c.settle([mtq.Outcome(held, ok=True, value=2)])
    assert steps(t) == [("queued", "stream u"), ("started", "delivery 1 on w1"),
                        ("succeeded", "")]
    assert r.exists(k.trace(t.id)) == 0 and r.hget(k.task(t.id), "trace") == b"0"
    ms = [round(e.ts * 1000) for e in t.trace()]
    info = t.info()
    assert ms == [info.created, info.started, info.finished]
    assert 0 < r.ttl(k.task(t.id)) <= q.settings.retention_s
    # mtq trace reads the same lines
    assert [line.split(b"|", 2)[1] for line in read_traces(r, qname, [t.id])[0]] == \
        [b"queued", b"started", b"succeeded"]


def test_a_failure_reads_its_error_from_the_fields(qname: str, redis_url: str) -> None:
    q, c = make(qname, redis_url)
    t = q.submit({})
    (held,) = c.claim(1)
    c.settle([mtq.Outcome(held, ok=False, error="ValueError: no", retryable=False)])
    assert steps(t) == [("queued", ""), ("started", "delivery 1 on w1"),
                        ("failed", "ValueError: no")]


def test_a_retry_writes_the_life_so_far_and_every_later_line(
        qname: str, redis_url: str, r: redis.Redis) -> None:
    q, c = make(qname, redis_url, retry_backoff_ms=60_000)
    t = q.submit({})
    (held,) = c.claim(1)
    c.settle([mtq.Outcome(held, ok=False, error="ValueError: boom")])
    r.zadd(q.broker.keys.delayed, {t.id: 0}, xx=True)  # due now
    (again,) = c.claim(1)
    c.settle([mtq.Outcome(again, ok=True)])
    kinds = [k for k, _ in steps(t)]
    assert kinds == ["queued", "started", "retry", "started", "succeeded"]
    assert steps(t)[1] == ("started", "delivery 1 on w1")
    assert steps(t)[3] == ("started", "delivery 2 on w1")
    k = QueueKeys(qname)
    assert r.hget(k.task(t.id), "trace") == b"1"
    assert r.llen(k.trace(t.id)) == 5
    assert 0 < r.ttl(k.trace(t.id)) <= q.settings.retention_s, "the list expires with it"


def test_a_release_keeps_the_delivery_it_gave_back(qname: str, redis_url: str) -> None:
    q, c = make(qname, redis_url)
    t = q.submit({})
    held = c.claim(1)
    assert c.release(held) == 1
    (again,) = c.claim(1)
    c.settle([mtq.Outcome(again, ok=True)])
    assert steps(t) == [("queued", ""), ("started", "delivery 1 on w1"),
                        ("released", "given back unrun by its worker"),
                        ("started", "delivery 1 on w1"), ("succeeded", "")]


def test_a_lost_lease_and_a_worker_that_takes_over(qname: str, redis_url: str,
                                                   r: redis.Redis) -> None:
    q, c = make(qname, redis_url)
    other = mtq.Consumer(qname, redis_url, settings=q.settings, worker_id="w2")
    t = q.submit({})
    (held,) = c.claim(1)
    r.zadd(q.broker.keys.leases, {t.id: 0}, xx=True)  # its worker froze past the lease
    (again,) = other.claim(1)
    assert again.id == t.id
    assert c.settle([mtq.Outcome(held, ok=True)]).lost == [t.id]  # fenced out
    other.settle([mtq.Outcome(again, ok=True)])
    assert steps(t) == [("queued", ""), ("started", "delivery 1 on w1"),
                        ("restarted", "lease expired"), ("started", "delivery 2 on w2"),
                        ("succeeded", "")]


def test_a_cancel_request_then_the_cancel(qname: str, redis_url: str) -> None:
    q, c = make(qname, redis_url)
    t = q.submit({})
    (held,) = c.claim(1)
    assert t.cancel() is False
    c.settle([mtq.Outcome(held, ok=False, cancelled=True)])
    assert [k for k, _ in steps(t)] == ["queued", "started", "cancel requested", "cancelled"]


def test_a_dead_letter_retried_keeps_its_first_life(qname: str, redis_url: str) -> None:
    q, c = make(qname, redis_url, max_retries=0)
    t = q.submit({})
    (held,) = c.claim(1)
    assert c.settle([mtq.Outcome(held, ok=False, error="ValueError: x")]).dead == 1
    assert q.retry_dead([t.id]) == 1
    (again,) = c.claim(1)
    c.settle([mtq.Outcome(again, ok=True)])
    assert [k for k, _ in steps(t)] == ["queued", "started", "dead", "queued", "started",
                                        "succeeded"]
    assert steps(t)[3] == ("queued", "retried from the dead letters")


def test_a_task_of_an_older_mtq_reads_as_its_list(qname: str, redis_url: str,
                                                  r: redis.Redis) -> None:
    q, c = make(qname, redis_url)
    t = q.submit({})
    k = QueueKeys(qname)
    # as an older producer wrote it: no 'trace' field, its queued line in a list
    created = r.hget(k.task(t.id), "created").decode()
    r.hdel(k.task(t.id), "trace")
    r.rpush(k.trace(t.id), f"{created}|queued|")
    (held,) = c.claim(1)
    c.settle([mtq.Outcome(held, ok=True)])
    assert [k for k, _ in steps(t)] == ["queued", "started", "succeeded"]
    assert r.llen(k.trace(t.id)) == 3, "the new scripts go on writing its list"
    assert 0 < r.ttl(k.trace(t.id)) <= q.settings.retention_s
