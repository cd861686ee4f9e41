"""Engines: the bugs a review of issue 44 found (in-process, real redis-server)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import redis

import mtq
from mtq.broker import registry
from mtq.workers.host import Host
from mtq.workers.residency import EngineOp
from mtq.workers.worker import Worker
from tests import engine_models as em
from tests.support.engines import FLOATS, ask, engine, hosting, result
from tests.support.waits import wait_for
from tests.support.workers import FAST, serving

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("engine_counters")]


@pytest.mark.parametrize("declared", [False, True])
def test_host_setup_of_engines_bigger_than_the_budget_does_not_hang(
        declared: bool, qname: str, redis_url: str) -> None:
    """Two engines loaded at start whose real size passes the budget (not known from
    the host file): no engine's model thread runs yet, so none can unload for room;
    setup must not wait for that forever."""
    qa, qb = qname, qname + "-b"
    a = engine(qa, redis_url, "a")
    b = engine(qb, redis_url, "b", memory_bytes=FLOATS * 4 if declared else None)
    host = Host([a, b], memory_budget=int(FLOATS * 4 * 1.5))
    done = threading.Event()
    errors: list[BaseException] = []

    def setup() -> None:
        try:
            host.setup()
        except BaseException as exc:
            errors.append(exc)
        done.set()

    threading.Thread(target=setup, daemon=True).start()
    finished = done.wait(10)
    if not finished:
        host.stop()  # (make_room gives up on a stop)
        done.wait(10)
    assert finished, "Host.setup() hung waiting for an engine to unload for room"
    assert not errors, errors
    assert em.SETUPS == {"a": 1, "b": 1} and a.loaded and b.loaded
    t = threading.Thread(target=host.run, daemon=True)
    t.start()
    try:
        assert result(mtq.Queue(qa, redis_url), 1)["tag"] == "a"
        assert result(mtq.Queue(qb, redis_url), 2)["tag"] == "b"
    finally:
        host.stop()
        t.join(30)


def test_resume_does_not_make_an_unloaded_engine_claim(qname: str, redis_url: str,
                                                        r: redis.Redis) -> None:
    """After an unload command an engine claims nothing until a load: a pause and
    resume (which, in a host, reach every engine of the process) must not undo it."""
    q = mtq.Queue(qname, redis_url)
    w = engine(qname, redis_url, "a")
    with serving(w):
        assert result(q, 1)["x"] == 1
        assert ask(w, "unload")["ok"]
        w.command({"cmd": "pause"})
        w.command({"cmd": "resume"})
        assert w.slot.paused, "resume made the unloaded engine claim again"
        t = q.submit(2)
        # a heartbeat after the submit: the entry is written again
        registry.remove(r, w.worker_id)
        wait_for(lambda: registry.list_workers(r, qname), 10, "the engine did not report")
        assert t.status() == "queued" and em.SETUPS["a"] == 1 and not w.loaded
        assert ask(w, "load")["ok"]
        assert t.result(timeout=10)["x"] == 2


def test_unload_while_a_reload_loads_beside_leaves_the_engine_unloaded(
        qname: str, redis_url: str) -> None:
    """An unload asked while a reload sets its new model up beside the serving one:
    the engine ends unloaded (and claiming nothing), not holding a set-up model that
    the engine and the budget count as unloaded."""
    q = mtq.Queue(qname, redis_url)
    w = engine(qname, redis_url, "old")
    em.GATES["new"] = threading.Event()
    with serving(w):
        assert result(q, 0)["tag"] == "old"
        got: list[dict[str, Any]] = []
        w.request(EngineOp("reload", options={"tag": "new"}, reply=got.append))
        assert em.HELD.setdefault("new", threading.Event()).wait(10), "no beside load"
        unloaded = ask(w, "unload")
        assert unloaded["ok"] and unloaded["state"] == "unloaded"
        em.GATES["new"].set()
        wait_for(lambda: got, 10, "no answer to the reload")
        wait_for(lambda: not w.reloading and not w.ops.pending, 10, "the swap did not end")
        # either the reload lost (the staged model torn down) or the engine is loaded
        # with it and says so; never a set-up model in an engine that says unloaded
        if w.loaded:
            assert w.engine_state == "loaded" and w.options["tag"] == "new"
        else:
            assert not got[0]["ok"], got
            assert em.TEARDOWNS["new"] == 1, "the staged model was never torn down"
            assert w.engine_state == "unloaded" and w.slot.paused


def test_a_reload_asked_while_another_loads_beside_is_the_one_that_serves(
        qname: str, redis_url: str) -> None:
    q = mtq.Queue(qname, redis_url)
    w = engine(qname, redis_url, "old")
    em.GATES["new"] = threading.Event()
    with serving(w):
        assert result(q, 0)["tag"] == "old"
        got: list[dict[str, Any]] = []
        w.request(EngineOp("reload", options={"tag": "new"}, reply=got.append))
        assert em.HELD.setdefault("new", threading.Event()).wait(10), "no beside load"
        later: list[dict[str, Any]] = []  # asked last: it unloads first (no room beside
        # while the other loads), then waits for the load lock the beside load holds
        w.request(EngineOp("reload", options={"tag": "newer"}, reply=later.append))
        wait_for(lambda: w.engine_state == "loading", 10, "the later reload did not start")
        em.GATES["new"].set()
        wait_for(lambda: got and later, 10, "no answer to a reload")
        assert later[0]["ok"], later
        assert result(q, 1)["tag"] == "newer" and w.options["tag"] == "newer"
        assert not got[0]["ok"] and em.TEARDOWNS["new"] == 1, got


def test_unload_of_an_engine_given_a_model_object_answers_and_keeps_serving(
        qname: str, redis_url: str) -> None:
    """An engine made from a model object (not a target name) cannot make a new one
    to unload to: the unload is refused with an answer, the engine serves on."""
    q = mtq.Queue(qname, redis_url)
    w = Worker(em.Sized(), qname, url=redis_url, settings=FAST, options={"tag": "obj"})
    with serving(w) as running:
        assert result(q, 1)["tag"] == "obj"
        got: list[dict[str, Any]] = []
        w.request(EngineOp("unload", reply=got.append))
        wait_for(lambda: got or not running.thread.is_alive(), 10, "no answer to the unload")
        assert running.thread.is_alive(), f"the engine died: {running.error!r}"
        assert not got[0]["ok"] and "model object" in got[0]["error"], got
        assert w.loaded and result(q, 2)["tag"] == "obj"
        assert not w.evictable(), "the budget would ask it to unload, again and again"


def test_a_command_asked_as_the_engine_stops_is_answered(qname: str, redis_url: str) -> None:
    """An engine command still waiting for the batch boundary when the engine stops
    (a process stopped, drained, scaled down) is answered, not left to time out."""
    q = mtq.Queue(qname, redis_url)
    w = engine(qname, redis_url, "a", options={"work_ms": "500"})
    with serving(w):
        t = q.submit(1)
        wait_for(lambda: w.ledger.busy, 10, "the batch did not start")
        got: list[dict[str, Any]] = []
        w.request(EngineOp("unload", reply=got.append))
        w.stop()
        wait_for(lambda: got, 10, "the unload asked as the engine stopped was never answered")
        assert t.result(timeout=10)["x"] == 1
        assert not got[0]["ok"] and "stop" in got[0]["error"], got


def test_no_deadlock_when_the_budgets_victim_has_a_reload_queued_first(
        qname: str, redis_url: str) -> None:
    """An engine loading on demand holds the load lock while it waits for the least
    recently used one to unload; if that one carries out a reload asked just before
    (between the budget's look and its request), the reload's load waits for the lock:
    the loading engine must not wait for that unload forever."""
    qa, qv = qname, qname + "-v"
    a = engine(qa, redis_url, "a", on_demand=True)
    v = engine(qv, redis_url, "v")
    host = Host([a, v], memory_budget=int(FLOATS * 4 * 1.5))  # room for one
    asked: list[str] = []
    forward = v.request

    def request(op: EngineOp) -> None:
        if op.reason == "budget" and not asked:  # the command came in first
            asked.append("reload")
            forward(EngineOp("reload", options={"tag": "v2"}))
        forward(op)

    v.request = request  # type: ignore[method-assign]
    with hosting(host):
        assert result(mtq.Queue(qv, redis_url), 0)["tag"] == "v"
        t = mtq.Queue(qa, redis_url).submit(1)
        try:
            got = t.result(timeout=15)
        except mtq.errors.ResultTimeout:
            pytest.fail("the on-demand load and the victim's reload wait on each other")
        assert got["tag"] == "a" and asked == ["reload"]
        assert result(mtq.Queue(qv, redis_url), 2)["tag"] == "v2"
