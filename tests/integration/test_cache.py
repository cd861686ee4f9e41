"""The result cache (submit.lua, ack.lua), end to end through real worker processes."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import redis

import mtq
from mtq.broker import catalogue
from mtq.broker.consumer import Consumer
from mtq.broker.keys import QueueKeys
from mtq.workers import control
from tests.support.waits import wait_for
from tests.support.workers import registered_worker


def runs(log: Path) -> list[str]:
    """The B (call started) lines of the handler log."""
    if not log.exists():
        return []
    return [line for line in log.read_text().splitlines() if line.startswith("B ")]


@pytest.fixture
def log(tmp_path: Path) -> Path:
    return tmp_path / "calls.log"


def cached_queue(qname: str, redis_url: str, client: redis.Redis, **kw: Any) -> mtq.Queue:
    q = mtq.Queue(qname, redis_url, client=client)
    q.configure(cache_ttl_s=kw.pop("cache_ttl_s", 300), **kw)
    return q


def test_hit_miss_and_bypass(qname: str, redis_url: str, client: redis.Redis,
                             subprocess_env: dict[str, str], log: Path) -> None:
    q = cached_queue(qname, redis_url, client)
    with registered_worker("tests.handlers:gated", qname, subprocess_env, log):
        first = q.submit({"i": 1})
        assert not first.cached
        assert first.result(timeout=20)["i"] == 1
        second = q.submit({"i": 1})
        assert second.cached and second.id != first.id
        assert second.result(timeout=1) == first.result(timeout=1)
        assert second.status() == "succeeded"
        assert [e.kind for e in second.trace()] == ["cached", "succeeded"]
        k = QueueKeys(qname)
        # as finish() leaves a task: its result and time, its retention, its reply channel
        fields = client.hgetall(k.task(second.id))
        assert fields[b"finished"] == fields[b"created"] and b"token" not in fields
        assert fields[b"reply"] == q.reply_channel().encode()
        retention = q.settings.retention_s
        assert 0 < client.ttl(k.task(second.id)) <= retention
        assert client.exists(k.trace(second.id)) == 0  # read from its fields
        assert len(runs(log)) == 1, "a cache hit ran the handler"
        other = q.submit({"i": 2})  # a different payload: a miss
        assert not other.cached and other.result(timeout=20)["i"] == 2
        bypass = q.submit({"i": 1}, cache=False)
        assert not bypass.cached and bypass.result(timeout=20)["i"] == 1
        many = q.submit_many([{"i": 1}, mtq.Request({"i": 1}, cache=False)])
        assert [t.cached for t in many] == [True, False]
        many[1].result(timeout=20)
        assert len(runs(log)) == 4
        s = q.stats()
        assert (s["cache_hits"], s["cache_misses"], s["cache_entries"]) == (2, 2, 2)
        assert s["submitted"] == 6 and s["succeeded"] == 6


def test_cache_off_sends_no_digest_and_caches_nothing(qname: str, redis_url: str,
                                                      client: redis.Redis,
                                                      subprocess_env: dict[str, str],
                                                      log: Path) -> None:
    q = mtq.Queue(qname, redis_url, client=client)
    assert q.prepare([{"i": 1}])[0].digest == ""
    with registered_worker("tests.handlers:gated", qname, subprocess_env, log):
        assert [q.submit({"i": 1}).result(timeout=20)["i"] for _ in range(2)] == [1, 1]
    assert len(runs(log)) == 2
    assert q.stats()["cache_entries"] == 0


def test_single_flight_runs_once_for_concurrent_identical_submits(
        qname: str, redis_url: str, client: redis.Redis, subprocess_env: dict[str, str],
        log: Path, tmp_path: Path) -> None:
    q = cached_queue(qname, redis_url, client)
    gate = tmp_path / "gate"
    gate.touch()
    payload = {"i": 7, "gate": str(gate)}
    with registered_worker("tests.handlers:gated", qname, subprocess_env, log,
                           "--batch-size", "8"):
        first = q.submit(payload)
        wait_for(lambda: runs(log), 20, "the first task never started")
        tasks: list[mtq.Task] = []
        threads = [threading.Thread(target=lambda: tasks.append(q.submit(payload)))
                   for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert {t.id for t in tasks} == {first.id}
        gate.unlink()
        results = [t.result(timeout=20) for t in [first, *tasks]]
        assert all(r == results[0] for r in results)
    assert len(runs(log)) == 1
    assert q.stats()["cache_joined"] == 8


def test_a_failed_task_frees_the_single_flight_record(
        qname: str, redis_url: str, client: redis.Redis, subprocess_env: dict[str, str],
        log: Path, tmp_path: Path) -> None:
    q = cached_queue(qname, redis_url, client)
    flag = tmp_path / "fail"
    flag.touch()
    payload = {"i": 3, "fail": str(flag)}
    with registered_worker("tests.handlers:gated", qname, subprocess_env, log):
        failed = q.submit(payload, retries=0)
        with pytest.raises(mtq.TaskFailed):
            failed.result(timeout=20)
        flag.unlink()
        again = q.submit(payload)
        assert again.id != failed.id and not again.cached
        assert again.result(timeout=20)["i"] == 3
    assert len(runs(log)) == 2


def _server_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def test_ttl_expiry(qname: str, redis_url: str, client: redis.Redis,
                    subprocess_env: dict[str, str], log: Path) -> None:
    q = cached_queue(qname, redis_url, client, cache_ttl_s=1)
    with registered_worker("tests.handlers:gated", qname, subprocess_env, log):
        first = q.submit({"i": 1})
        first.result(timeout=20)
        assert q.submit({"i": 1}).cached
        finished = int(client.hget(QueueKeys(qname).task(first.id), "finished") or 0)
        wait_for(lambda: _server_ms(client) > finished + 1000, 5,
                 "Redis's clock did not pass the result's cache_ttl_s")
        later = q.submit({"i": 1})
        assert not later.cached and later.result(timeout=20)["i"] == 1
        assert q.submit({"i": 1}).cached  # the new run's result answers now
        assert q.stats()["cache_entries"] == 1  # the same request: one entry
    assert len(runs(log)) == 2


def test_corrupt_entry_is_a_miss(qname: str, redis_url: str, client: redis.Redis,
                                 subprocess_env: dict[str, str], log: Path) -> None:
    q = cached_queue(qname, redis_url, client)
    k = QueueKeys(qname)
    with registered_worker("tests.handlers:gated", qname, subprocess_env, log):
        q.submit({"i": 1}).result(timeout=20)
        other = q.submit({"i": 2})
        other.result(timeout=20)
        (entry,) = [e for e in client.keys(k.cache_prefix + "*")
                    if client.get(e) != other.id.encode()]
        client.set(entry, b"garbage", keepttl=True)  # names no task
        t = q.submit({"i": 1})
        assert not t.cached and t.result(timeout=20)["i"] == 1
        client.set(entry, other.id, keepttl=True)  # names a task of another request
        t = q.submit({"i": 1})
        assert not t.cached and t.result(timeout=20)["i"] == 1, "served another's result"
        assert q.submit({"i": 1}).cached  # the last run took the entry over
    assert len(runs(log)) == 4


def test_size_cap_evicts_the_oldest(
        qname: str, redis_url: str, client: redis.Redis, subprocess_env: dict[str, str],
        log: Path) -> None:
    q = cached_queue(qname, redis_url, client, cache_max_entries=3)
    k = QueueKeys(qname)
    with registered_worker("tests.handlers:gated", qname, subprocess_env, log):
        for i in range(6):
            q.submit({"i": i}).result(timeout=20)
        members = client.zrange(k.cache_index, 0, -1)
        assert q.stats()["cache_entries"] == 3 == len(members)
        entries = client.keys(k.cache_prefix + "*")
        assert sorted(entries) == sorted(k.cache_prefix.encode() + m for m in members)
        assert q.submit({"i": 5}).cached and not q.submit({"i": 0}).cached


def test_generator_caches_seeded_requests_only(qname: str, redis_url: str,
                                               client: redis.Redis,
                                               subprocess_env: dict[str, str],
                                               log: Path) -> None:
    q = cached_queue(qname, redis_url, client)
    with registered_worker("tests.models:Counter", qname, subprocess_env, log):
        assert q.submit({"n": 3, "start": 1}).result(timeout=20)["tokens"] == [1, 2, 3]
        assert not q.submit({"n": 3, "start": 1}).cached
        seeded = q.submit({"n": 3, "start": 1, "seed": 5}).result(timeout=20)
        hit = q.submit({"n": 3, "start": 1, "seed": 5})
        assert hit.cached and hit.result() == seeded


def test_reload_with_a_new_version_invalidates(qname: str, redis_url: str,
                                               client: redis.Redis,
                                               subprocess_env: dict[str, str],
                                               log: Path, tmp_path: Path) -> None:
    q = cached_queue(qname, redis_url, client)
    version = tmp_path / "version"
    version.write_text("v1")
    env = {**subprocess_env, "MTQ_TEST_VERSION_FILE": str(version)}
    k = QueueKeys(qname)
    with registered_worker("tests.models:Versioned", qname, env, log):
        assert q.submit({"i": 1}).result(timeout=20)["version"] == "v1"
        assert q.submit({"i": 1}).cached
        version.write_text("v2")
        assert control.send(client, qname, "reload") >= 1
        wait_for(lambda: client.hget(k.model, "version") == b"v2", 20,
                 "the reload did not record version v2")
        fresh = q.submit({"i": 1})
        assert not fresh.cached and fresh.result(timeout=20)["version"] == "v2"
        assert q.submit({"i": 1}).result(timeout=5)["version"] == "v2"


def test_worker_killed_mid_run_of_a_single_flight_task(
        qname: str, redis_url: str, client: redis.Redis, subprocess_env: dict[str, str],
        log: Path, tmp_path: Path) -> None:
    q = cached_queue(qname, redis_url, client, lease_ms=1500)
    gate = tmp_path / "gate"
    gate.touch()
    payload = {"i": 9, "gate": str(gate)}
    with registered_worker("tests.handlers:gated", qname, subprocess_env, log) as first_worker:
        tasks = [q.submit(payload)]
        wait_for(lambda: runs(log), 20, "the task never started")
        tasks += [q.submit(payload) for _ in range(4)]
        first_worker.kill()
        first_worker.wait(10)
    gate.unlink()
    events: list[list[Any]] = [[] for _ in tasks]

    def collect(i: int) -> None:
        events[i] = [e for e in tasks[i].events(timeout=30, tokens=False) if e.terminal]

    readers = [threading.Thread(target=collect, args=(i,)) for i in range(len(tasks))]
    for t in readers:
        t.start()
    with registered_worker("tests.handlers:gated", qname, subprocess_env, log):
        for t in readers:
            t.join(40)
    assert all(len(e) == 1 and e[0].kind == "succeeded" for e in events), events
    assert len({e[0].data["pid"] for e in events}) == 1
    assert len(runs(log)) == 2  # the killed delivery and the redelivery


def test_an_ack_that_may_not_answer_frees_its_entry_and_one_that_may_keeps_it(
        qname: str, redis_url: str, client: redis.Redis) -> None:
    """ack.lua, claimed and acked by a consumer in this process, per task of one batch:
    a worker on another version than the entry's, and a result too big to answer
    inline, delete the entry (an identical submit runs again); a result of the entry's
    own version keeps it (the next identical submit is answered by that task)."""
    q = cached_queue(qname, redis_url, client)
    catalogue.record(client, qname, {"event": "loaded"},
                     {"target": "t:m", "version": "v1", "kind": "function",
                      "deterministic": 0, "cacheable": 1})
    k = QueueKeys(qname)
    tasks = q.submit_many([{"i": i} for i in range(3)])
    entries = sorted(client.keys(k.base + "cache:*"))
    assert len(entries) == 3 and all(e.startswith((k.base + "cache:v1:").encode())
                                     for e in entries)
    c = Consumer(qname, client=client)
    c.broker.model_version = "v1"
    claimed = {t.id: t for t in c.claim(3)}
    big = "x" * (65536 + 1)  # over REPLY_INLINE (_lib.lua): a hit must answer inline
    report = c.settle([mtq.Outcome(claimed[tasks[0].id], ok=True, value="kept"),
                       mtq.Outcome(claimed[tasks[1].id], ok=True, value=big)])
    assert report.succeeded == 2
    c.broker.model_version = "v0"  # a worker not yet reloaded acks the third
    assert c.settle([mtq.Outcome(claimed[tasks[2].id], ok=True, value="old")]).succeeded == 1
    left = {client.get(e).decode() for e in client.keys(k.base + "cache:*")}
    assert left == {tasks[0].id}, "only the entry whose result may answer is left"
    hit = q.submit({"i": 0})
    assert hit.cached and hit.result(timeout=5) == "kept"
    for i in (1, 2):
        again = q.submit({"i": i})
        assert not again.cached and again.id != tasks[i].id
