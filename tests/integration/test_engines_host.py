"""Engines in a real host process (benchmarks.children.host: a Host of Workers in a
process of its own) against the same model in a process of its own (``mtq worker
run``): the fast model's greedy tokens are the same while a slow engine of the host
is busy; commands sent on the control channel are answered while tasks stream in.
Not timed (benchmarks/engines.py measures)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis

import mtq
from benchmarks.children.engines import RUNLOG
from benchmarks.engine_parts import (
    FAST,
    PROMPTS,
    SLOW,
    THREADS,
    WEIGHTS,
    command,
    fast_payload,
    run_counts,
    start_host,
    start_worker,
)
from benchmarks.harness.procs import Proc
from mtq.broker.keys import QueueKeys
from mtq.workers.registry import list_workers
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def env(subprocess_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    from benchmarks.children.gen import BENCH
    from mtq.reference.gpt import make_weights

    weights = make_weights(tmp_path / "tinygpt.pt", BENCH)  # once, before the processes
    return {**subprocess_env, **THREADS, "MTQ_REFERENCE_WEIGHTS": str(weights),
            RUNLOG: str(tmp_path / "runlog.txt")}


@contextmanager
def running(proc: Proc, r: redis.Redis, *queues: str, killed: bool = False) -> Iterator[Proc]:
    """``proc`` until it has registered an engine on each of ``queues``; stopped (and
    its exit code checked) on the way out, its log shown if the test failed; ``killed``:
    the test kills it (SIGKILL) meanwhile."""
    try:
        for q in queues:
            wait_for(lambda q=q: any(w["pid"] == proc.proc.pid  # type: ignore[misc]
                                     for w in list_workers(r, q)), 60,
                     f"no engine of the process on {q}: {proc.output()[-2000:]}")
        yield proc
        if killed:
            assert proc.proc.wait(10) == -9, proc.output()[-3000:]
        else:
            proc.stop()
            assert proc.proc.returncode == 0, proc.output()[-3000:]
    except BaseException:
        print(proc.output()[-4000:])
        raise
    finally:
        proc.close()


def greedy(q: mtq.Queue, n: int) -> list[Any]:
    tasks = q.submit_many([fast_payload(k, 1000 + k) for k in range(n)])
    return [t.result(timeout=120)["tokens"] for t in tasks]


def test_a_host_process_gives_the_fast_models_tokens_of_its_own_process_beside_a_busy_engine(
        qname: str, redis_url: str, r: redis.Redis, env: dict[str, str]) -> None:
    alone, fast, slow = qname + "-alone", qname + "-fast", qname + "-slow"
    with ExitStack() as stack:
        stack.enter_context(running(start_worker(redis_url, env, FAST, alone), r, alone))
        host = stack.enter_context(running(start_host(redis_url, env, [
            {"queue": fast, "target": FAST},
            {"queue": slow, "target": SLOW, "options": {"size": 512, "matmuls": 8}}]),
            r, fast, slow))
        rows = {w["queue"]: w for w in list_workers(r) if w["pid"] == host.proc.pid}
        assert rows[fast]["process"] == rows[slow]["process"]  # one process, two engines
        sq = mtq.Queue(slow, redis_url)
        busy = sq.submit_many([{"i": f"s{k}"} for k in range(12)])
        wait_for(lambda: busy[0].status() in ("running", "succeeded"), 30,
                 "the slow engine did not start")
        fq = mtq.Queue(fast, redis_url)
        in_host = fq.submit_many([fast_payload(k, 1000 + k) for k in range(len(PROMPTS))])
        tokens_host = [t.result(timeout=120)["tokens"] for t in in_host]
        tokens_alone = greedy(mtq.Queue(alone, redis_url), len(PROMPTS))
        slow_done = [t.result(timeout=120) for t in busy]
        # the slow engine ran while the fast one did: their runs overlap in time
        fast_runs = [(i.started, i.finished) for i in (t.info() for t in in_host)]
        slow_runs = [(i.started, i.finished) for i in (t.info() for t in busy)]
        assert any(a < d and c < b for a, b in fast_runs for c, d in slow_runs), \
            (fast_runs, slow_runs)
    assert all(len(t) == 32 for t in tokens_host), tokens_host
    assert tokens_host == tokens_alone
    assert len({x["sum"] for x in slow_done}) == 1  # the same product every time


def test_commands_to_a_host_process_are_answered_while_tasks_stream_in(
        qname: str, redis_url: str, r: redis.Redis, env: dict[str, str],
        tmp_path: Path) -> None:
    qa, qb = qname + "-a", qname + "-b"
    q = mtq.Queue(qa, redis_url)
    with running(start_host(redis_url, env, [
            {"queue": qa, "target": WEIGHTS, "options": {"tag": "old", "mb": 4}},
            {"queue": qb, "target": WEIGHTS, "options": {"tag": "other", "mb": 4}}]),
            r, qa, qb):
        tasks = q.submit_many([{"i": f"t{k}"} for k in range(20)])
        answer, _ = command(r, qa, "unload", timeout_s=30)
        assert answer["ok"] and answer["state"] == "unloaded", answer
        late = q.submit_many([{"i": f"t{k}"} for k in range(20, 40)])
        wait_for(lambda: list_workers(r, qa)[0]["engine"] == "unloaded", 10,
                 "the registry does not show the engine unloaded")
        assert late[-1].status() == "queued"  # waits while unloaded
        other = mtq.Queue(qb, redis_url).submit({"i": "x"}).result(timeout=30)
        assert other["tag"] == "other"  # the other engine serves on
        answer, _ = command(r, qa, "reload", timeout_s=30, options={"tag": "new", "mb": 4})
        assert answer["ok"], answer
        answer, _ = command(r, qa, "reset", timeout_s=30)
        assert answer["ok"] and "reset() ran" in answer["detail"], answer
        results = [t.result(timeout=60) for t in tasks + late]
        assert q.submit({"i": "t40"}).result(timeout=30)["tag"] == "new"
    assert [x["i"] for x in results] == [f"t{k}" for k in range(40)]
    counts = run_counts(tmp_path / "runlog.txt")
    assert {i: counts[i] for i in counts if i.startswith("t")} == \
        {f"t{k}": 1 for k in range(41)}, counts


def test_a_host_process_killed_mid_load_and_mid_unload_loses_nothing_and_runs_nothing_twice(
        qname: str, redis_url: str, r: redis.Redis, env: dict[str, str],
        tmp_path: Path) -> None:
    """SIGKILL while a reload loads its new model (the old one unloaded first: no room
    beside it), then while an unload tears the model down: the tasks streaming in meanwhile
    are served by the next process, each exactly once (the engine held none while it
    loaded or unloaded: it gave back what it had claimed ahead when the command came)."""
    import threading

    q = mtq.Queue(qname, redis_url)
    q.configure(lease_ms=1500)
    runlog = tmp_path / "runlog.txt"
    plain = {"tag": "a", "mb": 4}
    budget = {"memory_budget": 6 * 2**20}  # one model of 4 MiB, not two
    stop = threading.Event()
    tasks: list[mtq.Task] = []

    def stream() -> None:
        while not stop.is_set():
            tasks.append(q.submit({"i": f"t{len(tasks)}"}))
            stop.wait(0.02)

    def begun(what: str, n: int) -> bool:
        return run_counts(runlog, events=True)[what] >= n

    def command_then_kill(proc: Proc, msg: dict[str, Any], what: str) -> None:
        """Send ``msg``; SIGKILL ``proc`` once it has begun one more ``what``."""
        n = run_counts(runlog, events=True)[what] + 1
        r.publish(QueueKeys(qname).control, json.dumps(msg))
        wait_for(lambda: begun(what, n), 30, f"no {what} began: {proc.output()[-2000:]}")
        proc.kill()

    feeder = threading.Thread(target=stream, daemon=True)
    try:
        # 1. mid-load: a reload with options unloads the old model, then loads for 60 s
        first = start_host(redis_url, env, [{"queue": qname, "target": WEIGHTS,
                                             "options": plain}], **budget)
        with running(first, r, qname, killed=True):
            feeder.start()
            wait_for(lambda: len(tasks) > 10 and tasks[5].status() == "succeeded", 30,
                     "the first host served nothing")
            command_then_kill(first, {"cmd": "reload", "options": {**plain, "load_s": 60}},
                              "@setup")
        # 2. mid-unload: the next process serves what the first held, then its model's
        # teardown takes 60 s when it is unloaded
        second = start_host(redis_url, env, [{"queue": qname, "target": WEIGHTS,
                                              "options": {**plain, "unload_s": 60}}], **budget)
        with running(second, r, qname, killed=True):
            held = len(tasks)
            wait_for(lambda: tasks[held - 1].status() == "succeeded", 30,
                     "the second host did not take over")
            command_then_kill(second, {"cmd": "unload"}, "@teardown")
        third = start_host(redis_url, env, [{"queue": qname, "target": WEIGHTS,
                                             "options": plain}])
        with running(third, r, qname):
            stop.set()
            feeder.join(10)
            results = [t.result(timeout=60) for t in tasks]
    finally:
        stop.set()
    assert [x["i"] for x in results] == [f"t{k}" for k in range(len(tasks))]
    counts = run_counts(runlog)
    assert counts == {f"t{k}": 1 for k in range(len(tasks))}, \
        {i: n for i, n in counts.items() if n != 1}
    # each process served some: the next one took over what waited on the killed one
    assert len({t.info().worker for t in tasks}) == 3
