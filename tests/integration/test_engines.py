"""Engines: several models in one process, each in a thread of its own, loaded,
unloaded, reloaded and reset on command, loaded on demand and unloaded when idle
within a per-process budget. In-process against a real redis-server (the host file,
supervised host processes and the commands' CLI have tests of their own)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import redis

import mtq
from mtq.broker import registry
from mtq.broker.keys import QueueKeys
from mtq.trace import parse_record
from mtq.workers import host as host_module
from mtq.workers import residency
from mtq.workers.host import Host
from mtq.workers.residency import EngineOp
from mtq.workers.worker import Worker
from tests import engine_models as em
from tests.support.engines import FLOATS, SIZED, ask, engine, hosting, result
from tests.support.waits import wait_for
from tests.support.workers import FAST, serving

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("engine_counters")]


def test_two_engines_in_one_process_serve_their_queues_from_threads_of_their_own(
        qname: str, redis_url: str, r: redis.Redis) -> None:
    qa, qb = qname, qname + "-b"
    a, b = engine(qa, redis_url, "a"), engine(qb, redis_url, "b")
    with hosting(Host([a, b])):
        assert result(mtq.Queue(qa, redis_url), 1)["tag"] == "a"
        assert result(mtq.Queue(qb, redis_url), 2)["tag"] == "b"
        names = {t.name for t in threading.enumerate()}
        assert {f"mtq-engine-{qa}", f"mtq-engine-{qb}"} <= names
        wait_for(lambda: {w["queue"] for w in registry.list_workers(r)} >= {qa, qb}, 10,
                 "both engines did not report")
        rows = {w["queue"]: w for w in registry.list_workers(r) if w["queue"] in (qa, qb)}
        assert rows[qa]["process"] == rows[qb]["process"]
        assert rows[qa]["id"] != rows[qb]["id"]
        assert rows[qa]["engine"] == rows[qb]["engine"] == "loaded"
        assert rows[qa]["memory_bytes"] == FLOATS * 4
    assert em.SETUPS == {"a": 1, "b": 1}


def test_unloaded_engine_claims_nothing_until_loaded(qname: str, redis_url: str,
                                                     r: redis.Redis) -> None:
    q = mtq.Queue(qname, redis_url)
    w = engine(qname, redis_url, "a")
    with serving(w):
        assert result(q, 1)["x"] == 1
        answer = ask(w, "unload")
        assert answer["ok"] and answer["state"] == "unloaded" and "freed" in answer["detail"]
        assert em.TEARDOWNS["a"] == 1 and not w.loaded and w.state == "unloaded"
        t = q.submit(2)
        wait_for(lambda: (registry.list_workers(r, qname) or [{}])[0].get("engine")
                 == "unloaded", 10, "the registry did not show the engine unloaded")
        assert t.status() == "queued"  # a beat later, still waiting in its stream
        answer = ask(w, "load")
        assert answer["ok"] and answer["state"] == "loaded"
        assert t.result(timeout=10)["x"] == 2
    assert em.SETUPS["a"] == 2


def test_on_demand_engine_loads_for_its_first_task(qname: str, redis_url: str,
                                                   r: redis.Redis) -> None:
    q = mtq.Queue(qname, redis_url)
    w = engine(qname, redis_url, "a", on_demand=True)
    with serving(w):
        wait_for(lambda: registry.list_workers(r, qname), 10, "the engine did not report")
        assert em.SETUPS["a"] == 0 and w.state == "unloaded"
        t = q.submit(7)
        assert t.result(timeout=10)["x"] == 7
        assert em.SETUPS["a"] == 1 and w.loaded and w.load_s > 0
    # the task's wait for the load is in the batch records (what `mtq trace` reads)
    records = [parse_record(x) for x in r.lrange(QueueKeys(qname).batches, 0, -1)]
    loads = [rec for rec in records if rec["k"] == "load"]
    assert len(loads) == 1 and loads[0]["ids"] == [t.id]


def test_idle_engine_unloads_and_loads_again_for_the_next_task(qname: str,
                                                               redis_url: str) -> None:
    q = mtq.Queue(qname, redis_url)
    w = engine(qname, redis_url, "a", on_demand=True, idle_unload_s=0.5)
    with serving(w):
        assert result(q, 1)["x"] == 1
        # (loaded goes false inside the unload; the state, once the command is done)
        wait_for(lambda: w.state == "unloaded", 10, "the idle engine was not unloaded")
        assert em.TEARDOWNS["a"] == 1 and not w.loaded
        assert result(q, 2)["x"] == 2
    assert em.SETUPS["a"] == 2


@pytest.mark.parametrize("budget", ["count", "bytes"])
def test_a_budget_unloads_the_least_recently_used_idle_engine(
        budget: str, qname: str, redis_url: str) -> None:
    queues = [qname, qname + "-b", qname + "-c"]
    tags = ["a", "b", "c"]
    engines = [engine(qn, redis_url, tag, on_demand=True) for qn, tag in zip(queues, tags)]
    limits = {"max_loaded": 2} if budget == "count" else {"memory_budget": FLOATS * 4 * 2}
    host = Host(engines, **limits)
    clients = [mtq.Queue(qn, redis_url) for qn in queues]
    with hosting(host):
        for rnd in range(3):  # a workload that cycles the three models
            for i, (q, tag) in enumerate(zip(clients, tags)):
                assert result(q, rnd)["tag"] == tag
                assert sum(e.loaded for e in engines) <= 2
                if rnd or i == 2:  # from the third model on, each load evicts the LRU one
                    lru = tags[(i + 1) % 3]
                    assert not engines[(i + 1) % 3].loaded, f"{lru} should have been unloaded"
    assert em.SETUPS == {"a": 3, "b": 3, "c": 3}
    assert em.TEARDOWNS == {"a": 3, "b": 2, "c": 2}


def test_reload_with_new_options_loads_beside_the_serving_model(qname: str,
                                                                 redis_url: str) -> None:
    q = mtq.Queue(qname, redis_url)
    w = engine(qname, redis_url, "old")
    em.GATES["new"] = threading.Event()
    with serving(w):
        assert result(q, 0)["tag"] == "old"
        got: list[dict[str, Any]] = []
        w.request(EngineOp("reload", options={"tag": "new", "floats": str(FLOATS)},
                           reply=got.append))
        assert em.HELD.setdefault("new", threading.Event()).wait(10), "the new one never loaded"
        # the old model goes on serving while the new one is set up
        assert [result(q, i)["tag"] for i in range(3)] == ["old"] * 3
        em.GATES["new"].set()
        wait_for(lambda: got, 10, "no answer to the reload")
        assert got[0]["ok"] and "beside" in got[0]["detail"], got
        assert result(q, 9)["tag"] == "new"
        assert w.options["tag"] == "new"
    assert em.TEARDOWNS["old"] == 1


def test_reload_to_options_that_fail_keeps_the_old_model_serving(qname: str,
                                                                 redis_url: str) -> None:
    q = mtq.Queue(qname, redis_url)
    w = engine(qname, redis_url, "old")
    with serving(w):
        assert result(q, 0)["tag"] == "old"
        answer = ask(w, "reload", options={"tag": "bad", "fail": "true"})
        assert not answer["ok"] and "no weights" in answer["error"]
        assert "old model goes on serving" in answer["error"]
        assert result(q, 1)["tag"] == "old" and w.options["tag"] == "old"
        assert w.engine_state == "loaded" and not w.last_error.startswith("load")
        answer = ask(w, "reload", options={"tag": "x", "nope": "1"})  # not an option
        assert not answer["ok"] and "nope" in answer["error"]
        assert result(q, 2)["tag"] == "old"


def test_reload_without_room_unloads_first_and_loads_the_old_model_again_on_failure(
        qname: str, redis_url: str) -> None:
    q = mtq.Queue(qname, redis_url)
    w = engine(qname, redis_url, "old")
    host = Host([w], memory_budget=int(FLOATS * 4 * 1.5))  # no room for two
    with hosting(host):
        assert result(q, 0)["tag"] == "old"
        answer = ask(w, "reload", options={"tag": "bad", "fail": "true"})
        assert not answer["ok"] and "old model was loaded again" in answer["error"]
        assert em.TEARDOWNS["old"] == 1 and em.SETUPS["old"] == 2
        assert result(q, 1)["tag"] == "old"
        answer = ask(w, "reload", options={"tag": "new", "floats": str(FLOATS)})
        assert answer["ok"] and "unloaded first" in answer["detail"], answer
        assert result(q, 2)["tag"] == "new"


def test_reset_drops_state_and_keeps_the_weights(qname: str, redis_url: str) -> None:
    q = mtq.Queue(qname, redis_url)
    w = engine(qname, redis_url, "a")
    with serving(w):
        assert result(q, 1)["x"] == 1
        w.slot.set_batch_size(1)  # as after running out of memory
        answer = ask(w, "reset")
        assert answer["ok"] and "reset() ran" in answer["detail"]
        assert em.RESETS["a"] == 1 and em.SETUPS["a"] == 1
        assert w.slot.max_batch_size == w.policy.max_batch_size == 8
        assert result(q, 2)["x"] == 2


def test_unload_now_gives_a_generators_running_requests_back_uncounted(
        qname: str, redis_url: str) -> None:
    q = mtq.Queue(qname, redis_url)
    w = Worker("tests.engine_models:Steps", qname, url=redis_url, settings=FAST)
    with serving(w):
        t = q.submit({"n": 200, "step_ms": 20})
        wait_for(lambda: t.status() == "running", 10, "the generation did not start")
        answer = ask(w, "unload", now=True)
        assert answer["ok"] and answer["state"] == "unloaded"
        wait_for(lambda: t.status() == "queued", 10, "the request did not go back")
        assert t.info().deliveries == 0  # given back, not counted
        assert ask(w, "load")["ok"]
        assert t.result(timeout=30) == list(range(200))


def test_an_engine_that_fails_stops_alone(qname: str, redis_url: str) -> None:
    qa, qb = qname, qname + "-b"
    a, b = engine(qa, redis_url, "a"), engine(qb, redis_url, "b")
    host = Host([a, b])
    with hosting(host):
        t = mtq.Queue(qa, redis_url).submit("crash")
        wait_for(lambda: qa in host.failed, 10, "the engine's failure was not caught")
        assert "the engine's loop broke" in a.last_error
        assert result(mtq.Queue(qb, redis_url), 3)["tag"] == "b"  # the other serves on
        # what it ran goes back to its stream, the delivery counted (as for a crash)
        wait_for(lambda: t.status() == "queued", 10, "the failed engine's task did not go back")
        assert t.info().deliveries == 1


def test_an_engine_waiting_for_room_behind_busy_ones_takes_a_turn(
        qname: str, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every loaded engine has a backlog (none ever idle): the one waiting to load
    unloads the least recently used busy one after BUSY_UNLOAD_S, not never."""
    monkeypatch.setattr(residency, "BUSY_UNLOAD_S", 1.0)
    queues = [qname, qname + "-b", qname + "-c"]
    engines = [engine(queues[0], redis_url, "a", options={"work_ms": "50"}),
               engine(queues[1], redis_url, "b", options={"work_ms": "50"}),
               engine(queues[2], redis_url, "c", on_demand=True)]
    clients = [mtq.Queue(qn, redis_url) for qn in queues]
    with hosting(Host(engines, max_loaded=2)):
        backlog = [t for q in clients[:2] for t in q.submit_many(list(range(400)))]
        wait_for(lambda: all(e.ledger.busy for e in engines[:2]), 10,
                 "the two loaded engines did not get busy")
        assert result(clients[2], "c")["tag"] == "c"
        left = [t for t in backlog if t.status() != "succeeded"]
        assert left, "the backlog ended first: nothing showed the turn was taken"
        wait_for(lambda: all(t.status() == "succeeded" for t in backlog), 60,
                 "the busy engines' tasks did not all finish")
    assert em.SETUPS["c"] == 1 and sum(em.TEARDOWNS.values()) >= 1


def test_a_failed_engine_is_made_again_with_the_options_it_served(
        qname: str, redis_url: str, r: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_module, "RESTART_BASE_S", 0.1)
    qa, qb = qname, qname + "-b"
    made: list[Worker] = []

    def rebuild(i: int, options: dict[str, str]) -> Worker:
        w = Worker(SIZED, [qa, qb][i], url=redis_url, settings=FAST, options=options)
        made.append(w)
        return w

    a, b = engine(qa, redis_url, "a"), engine(qb, redis_url, "b")
    host = Host([a, b], rebuild=rebuild)
    with hosting(host):
        assert ask(a, "reload", options={"tag": "a2"})["ok"]  # the options it serves now
        t = mtq.Queue(qa, redis_url).submit("crash-once")
        wait_for(lambda: made, 10, "the failed engine was not made again")
        # what it ran went back (counted) and runs on the new engine, with its options
        assert t.result(timeout=20) == {"tag": "a2", "x": "crash-once", "w": 1.0}
        assert t.info().deliveries == 2
        assert host.workers[0] is made[0] and made[0].restarts == 1
        assert "loop broke once" in made[0].last_error
        wait_for(lambda: any(w["id"] == made[0].worker_id and w["restarts"] == 1
                             for w in registry.list_workers(r, qa)), 10,
                 "the new engine's entry does not count the restart")
        assert result(mtq.Queue(qb, redis_url), 1)["tag"] == "b"
