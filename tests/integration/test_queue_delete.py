"""``mtq queue delete``: a queue made by a typo goes away (``purge`` leaves it in
``mtq status``); a queue that live workers serve is refused unless forced; nothing
of another queue is touched."""

from __future__ import annotations

import threading

import redis
from click.testing import CliRunner

import mtq
from mtq.cli.main import cli
from mtq.workers.model import FunctionModel
from mtq.workers.worker import Worker
from tests.support.waits import wait_for
from tests.support.workers import serving


def run(*args: str, input: str | None = None) -> tuple[int, str]:
    res = CliRunner().invoke(cli, list(args), input=input)
    return res.exit_code, res.output


def keys_of(r: redis.Redis, queue: str) -> list[bytes]:
    return list(r.scan_iter(match=f"mtq:{{{queue}}}:*", count=1000))


def test_a_typo_queue_is_deleted_and_others_are_not_touched(
        r: redis.Redis, redis_url: str, qname: str) -> None:
    typo, other = qname + "-typo", qname + "-other"
    code, _ = run("submit", typo, '{"x": 1}', "--stream", "s", "--redis", redis_url)
    assert code == 0
    kept = mtq.Queue(other, redis_url)
    waiting = kept.submit_many([{"x": i} for i in range(5)], stream="u")
    assert run("purge", typo, "--yes", "--redis", redis_url)[0] == 0
    code, out = run("status", "--json", "--redis", redis_url)
    assert typo in out, "purge leaves the queue listed (why delete exists)"
    before = sorted(keys_of(r, other))

    code, out = run("queue", "delete", typo, "--yes", "--redis", redis_url)
    assert code == 0 and f"queue {typo!r} deleted" in out, out
    assert keys_of(r, typo) == []
    code, out = run("status", "--json", "--redis", redis_url)
    assert code == 0 and typo not in out and other in out, out
    assert sorted(keys_of(r, other)) == before, "another queue's keys changed"
    with serving(Worker(FunctionModel(lambda p: p["x"]), other, url=redis_url)):
        assert [t.result(timeout=20) for t in waiting] == [0, 1, 2, 3, 4]
    # deleting again: there is nothing to delete
    code, out = run("queue", "delete", typo, "--yes", "--redis", redis_url)
    assert code == 3 and "unknown queue" in out, out


def test_a_served_queue_is_refused_unless_forced(r: redis.Redis, redis_url: str,
                                                 qname: str) -> None:
    q = mtq.Queue(qname, redis_url)
    gate = threading.Event()
    w = Worker(FunctionModel(lambda p: gate.wait(20) and p["x"]), qname, url=redis_url)
    with serving(w, gate):
        t = q.submit({"x": 1})
        wait_for(lambda: t.status() == "running", 20, "the task did not start")
        wait_for(lambda: mtq.Queue(qname, redis_url).stats()["running"] == 1, 5, "stats")
        from mtq.workers.registry import list_workers
        wait_for(lambda: list_workers(r, qname), 10, "the worker did not register")

        code, out = run("queue", "delete", qname, "--yes", "--redis", redis_url)
        assert code == 1 and "1 worker(s) serve it" in out and "--force" in out, out
        assert t.status() == "running", "a refused delete deleted something"
        code, out = run("queue", "delete", qname, "--redis", redis_url, input="n\n")
        assert code == 1 and t.status() == "running", out  # answered no

        code, out = run("queue", "delete", qname, "--yes", "--force", "--redis", redis_url)
        assert code == 0, out
        gate.set()
        # the worker's late ack finds no task: fenced off, nothing comes back
        wait_for(lambda: w.totals.get("lost", 0) >= 1, 20, "the late ack was not fenced")
    # a worker still serving it may write its wake key and its last batch records back
    assert [k for k in keys_of(r, qname) if b":wake" not in k and not k.endswith(b":batches")
            ] == [], keys_of(r, qname)
    assert mtq.Queue(qname, redis_url).stats()["succeeded"] == 0
