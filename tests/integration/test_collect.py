"""Collecting many results: ``Task.result()`` on tasks whose outcomes already reached
the client over its reply channel costs no round trip (mtq.replies.Hub.take), against
a real redis-server and a real ``mtq worker run`` process; what the inbox keeps is
bounded, and a dead letter's outcome is never kept (it can be retried)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

import mtq
from mtq import replies
from tests.support.processes import gated_task, gated_worker
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def worker(qname: str, subprocess_env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    with gated_worker(qname, subprocess_env, "--batch-size", "16") as proc:
        yield proc


def commands(client: redis.Redis) -> int:
    """Every command the server ran so far, but INFO (how we count)."""
    stats = client.info("commandstats")
    return sum(v["calls"] for k, v in stats.items() if k != "cmdstat_info")


def test_results_already_received_cost_no_round_trip(
        qname: str, redis_url: str, client: redis.Redis,
        worker: subprocess.Popen[bytes]) -> None:
    n = 300
    q = mtq.Queue(qname, redis_url, client=client)
    tasks = q.submit_many([{"i": i} for i in range(n)])
    hub = replies.hub_of(client)
    wait_for(lambda: hub.kept() == n, 30, f"the client did not receive {n} outcomes "
             f"(kept {hub.kept()}); is the worker running?")
    # stopped, the worker sends nothing more: every command from here on is ours
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(20) == 0
    before = commands(client)
    got = [t.result(timeout=5) for t in tasks]
    after = commands(client)
    assert [g["i"] for g in got] == list(range(n))
    assert after == before, f"{after - before} commands ran for {n} results already received"
    assert hub.kept() == 0
    # taken once: a second call reads the stored state (and agrees)
    assert tasks[7].result(timeout=5)["i"] == 7


def test_a_result_asked_before_its_outcome_arrives_waits_for_it_as_ever(
        qname: str, redis_url: str, client: redis.Redis, tmp_path: Path,
        worker: subprocess.Popen[bytes]) -> None:
    gate = tmp_path / "gate"
    gate.touch()
    q = mtq.Queue(qname, redis_url, client=client)
    t = q.submit({"i": 1, "gate": str(gate)})
    hub = replies.hub_of(client)
    assert hub.take(qname, t.id) is None
    gate.unlink()
    assert t.result(timeout=30)["i"] == 1
    assert hub.kept() == 0, "the outcome went to the waiting reader, not the inbox"


def test_the_inbox_keeps_the_newest_within_its_bounds_and_the_rest_read_redis(
        qname: str, redis_url: str, client: redis.Redis, monkeypatch: pytest.MonkeyPatch,
        worker: subprocess.Popen[bytes]) -> None:
    monkeypatch.setattr(replies, "INBOX_MAX", 5)
    q = mtq.Queue(qname, redis_url, client=client)
    first = q.submit_many([{"i": i} for i in range(20)])
    wait_for(lambda: q.stats()["succeeded"] == 20, 30, "the worker did not run 20 tasks")
    hub = replies.hub_of(client)
    wait_for(lambda: hub.take(qname, first[-1].id) is not None, 10,
             "the last outcome never reached the inbox")
    assert hub.kept() == 4  # the five newest, less the one taken
    assert all(hub.take(qname, t.id) is None for t in first[:15]), "evicted ones are gone"
    assert [t.result(timeout=5)["i"] for t in first] == list(range(20))

    monkeypatch.setattr(replies, "INBOX_MAX", 1000)
    monkeypatch.setattr(replies, "INBOX_MAX_BYTES", 1)  # every message is over it
    more = q.submit_many([{"i": i} for i in range(3)])
    wait_for(lambda: q.stats()["succeeded"] == 23, 30, "the worker did not run 3 more")
    assert hub.kept() <= 1
    assert [t.result(timeout=5)["i"] for t in more] == list(range(3))


def test_a_dead_letter_is_not_kept_so_a_retried_one_is_waited_for(
        qname: str, redis_url: str, client: redis.Redis, tmp_path: Path,
        worker: subprocess.Popen[bytes]) -> None:
    fail = tmp_path / "fail"
    fail.touch()
    q = mtq.Queue(qname, redis_url, client=client)
    q.configure(max_retries=0)
    t = q.submit({"i": 5, "fail": str(fail)})
    wait_for(lambda: t.status() == "dead", 30, "the task was not dead-lettered")
    ok = q.submit({"i": 6})  # after the dead one on the same channel: its outcome came too
    wait_for(lambda: replies.hub_of(client).kept() == 2, 10, "the outcomes did not come")
    # kept only as "it ended": its reader reads the stored state, never this failure
    assert replies.hub_of(client).take(qname, t.id) == replies.ENDED, "a dead letter was kept"
    fail.unlink()
    assert q.retry_dead([t.id]) == 1
    assert t.result(timeout=30)["i"] == 5  # ran again: not the kept failure
    assert ok.result(timeout=5)["i"] == 6


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The task ids whose stored state Task.result() reads (a watch.lua round trip)."""
    reads: list[str] = []
    snapshot = mtq.Task._snapshot

    def counted(self: mtq.Task, *args: object, **kw: object) -> object:
        reads.append(self.id)
        return snapshot(self, *args, **kw)

    monkeypatch.setattr(mtq.Task, "_snapshot", counted)
    return reads


def test_waiting_on_an_own_task_reads_nothing_but_another_handle_reads_once(
        qname: str, redis_url: str, client: redis.Redis, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, worker: subprocess.Popen[bytes]) -> None:
    reads = _count_reads(monkeypatch)
    q = mtq.Queue(qname, redis_url, client=client)
    gate, t = gated_task(q, tmp_path, 1)
    other = mtq.Queue(qname, redis_url).task(t.id)  # a handle that did not submit it
    subprocess.Popen(["sh", "-c", f"sleep 0.3; rm -f {gate}"])  # opens while both wait
    assert t.result(timeout=30)["i"] == 1
    assert reads == [], "the submitter's own reply subscription was enough"
    assert other.result(timeout=30)["i"] == 1
    assert reads == [t.id], "a handle from an id reads the stored state once"


def test_aresult_on_an_own_task_reads_nothing_and_times_out_with_the_callers_timeout(
        qname: str, redis_url: str, client: redis.Redis, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, worker: subprocess.Popen[bytes]) -> None:
    reads = _count_reads(monkeypatch)
    q = mtq.Queue(qname, redis_url, client=client)
    gate, t = gated_task(q, tmp_path, 7)

    async def go() -> None:
        with pytest.raises(mtq.ResultTimeout) as exc:
            await t.aresult(timeout=0.3)  # its handler waits for the gate
        assert exc.value.timeout == 0.3, "the timeout reported is not the caller's"
        assert reads == [t.id], "the short way gave up without one read of the stored state"
        gate.unlink()
        u = q.submit({"i": 8})
        assert (await u.aresult(timeout=30))["i"] == 8
        assert reads == [t.id], "waiting on an own task read its stored state"
        # its outcome came while nobody waited on it: the inbox holds it
        assert (await t.aresult(timeout=30))["i"] == 7

    asyncio.run(go())
    assert reads == [t.id]


def test_an_own_task_is_read_after_its_reply_connection_was_lost(
        qname: str, redis_url: str, client: redis.Redis, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, worker: subprocess.Popen[bytes]) -> None:
    reads = _count_reads(monkeypatch)
    q = mtq.Queue(qname, redis_url, client=client)
    hub = replies.hub_of(client)
    gate, t = gated_task(q, tmp_path, 2)
    before = hub.resyncs
    # the reply connection drops while the task runs; its outcome may come while it is away
    client.client_kill_filter(_type="pubsub")
    gate.unlink()
    wait_for(lambda: hub.resyncs > before, 10, "the hub did not subscribe again")
    # at once (not after the 10 s safety-net read): an event lost with the connection
    # is read from the stored state
    assert t.result(timeout=5)["i"] == 2
    assert reads == [t.id]


def test_a_task_whose_outcome_a_reader_took_is_read_by_the_next(
        qname: str, redis_url: str, client: redis.Redis, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, worker: subprocess.Popen[bytes]) -> None:
    """The outcome reached a reader (result(), events(), a callback, a group): a later
    result() on the same handle reads the stored state at once, never waits for an
    event that came and went (the 10 s safety-net read would exceed the timeouts)."""
    reads = _count_reads(monkeypatch)
    q = mtq.Queue(qname, redis_url, client=client)
    t = q.submit({"i": 1})
    assert t.result(timeout=30)["i"] == 1
    assert t.result(timeout=5)["i"] == 1
    e = q.submit({"i": 2})
    assert [ev.kind for ev in e.events(timeout=30)][-1] == "succeeded"
    assert e.result(timeout=5)["i"] == 2
    g = q.group()
    tasks = g.submit_many([{"i": i} for i in range(3, 6)])
    assert [r["i"] for r in g.results(timeout=30)] == [3, 4, 5]
    assert [x.result(timeout=5)["i"] for x in tasks] == [3, 4, 5]
    # the stored outcome read at most once per later result() (events() may read it too);
    # a group's member needs none when its outcome event came after the group's own
    # read (timing): at most one each
    assert reads.count(t.id) == 1 and 1 <= reads.count(e.id) <= 2, reads
    assert all(reads.count(x.id) <= 1 for x in tasks), reads
    assert set(reads) <= {t.id, e.id, *(x.id for x in tasks)}, reads
