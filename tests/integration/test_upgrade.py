"""A fleet being upgraded: producers and workers of the mtq before scheduling (its
scripts, tests/data/lua-before-scheduling/, run as such a process runs them) beside
current ones on one queue that schedules. What docs/scheduling.md ("Upgrades and
crashes") and docs/operations.md promise: every task runs, once, in its stream's order;
an older worker serves the lane of standard tasks without a tenant and leaves the rest
to current workers; an older producer's tasks are scheduled with the rest."""

from __future__ import annotations

from typing import Any

import msgpack
import redis

import mtq
from mtq import serialization
from mtq.broker.keys import QueueKeys
from tests.support.paths import ROOT

OLD = ROOT / "tests" / "data" / "lua-before-scheduling"


class OldProcess:
    """The scripts of an older mtq, with its twenty KEYS and its arguments."""

    def __init__(self, r: redis.Redis, queue: str) -> None:
        self.r, self.k = r, QueueKeys(queue)
        lib = (OLD / "_lib.lua").read_text()
        self.scripts = {name: r.register_script(
            (OLD / f"{name}.lua").read_text().replace("--@include _lib.lua", lib))
            for name in ("submit", "claim", "ack")}

    def _run(self, name: str, args: list[Any]) -> Any:
        return self.scripts[name](keys=self.k.script_keys[:20],
                                  args=[self.k.events, self.k.control, *args])

    def submit(self, task_id: str, payload: Any, stream: str) -> None:
        self._run("submit", [0, 64, 3600, "", 1, task_id, serialization.dumps(payload),
                             stream, "", 0, "", "", "", 3600, 0, 10_000, 60])

    def claim(self, n: int) -> list[tuple[str, str, str]]:
        """(id, token, stream) of up to n tasks claimed as an older worker claims."""
        raw = self._run("claim", ["old-worker", n, 30_000, 5, 100, 3600, 3600, 100, 0, "0"])
        out = []
        for j in range(3, len(raw), 9):
            out.append((raw[j].decode(), raw[j + 1].decode(), raw[j + 3].decode()))
        return out

    def ack(self, items: list[tuple[str, str, str]]) -> list[int]:
        args: list[Any] = [3600, len(items)]
        for task_id, token, _ in items:
            args += [task_id, token, msgpack.packb("old")]
        return self._run("ack", [*args, 0, ""])


def test_older_and_current_processes_share_a_scheduling_queue(qname: str, redis_url: str,
                                                              r: redis.Redis) -> None:
    q = mtq.Queue(qname, redis_url)
    c = mtq.Consumer(qname, redis_url, settings=q.settings, worker_id="new")
    old = OldProcess(r, qname)
    # a current producer turns scheduling on; an older one goes on submitting
    new_tasks = [q.submit({"n": i}, stream=f"u{i % 3}", tenant="acme", cost=5)
                 for i in range(12)]
    new_tasks += [q.submit({"i": i}, stream="mixed", priority="interactive") for i in range(3)]
    for i in range(6):
        old.submit(f"old{i}", {"old": i}, stream="mixed" if i < 3 else f"o{i}")
    assert r.hget(QueueKeys(qname).stats, "sched") == b"1"

    # the older worker serves only the lane of standard tasks without a tenant
    ran: list[str] = []
    for _ in range(10):
        got = old.claim(4)
        if not got:
            break
        assert all(not r.hget(QueueKeys(qname).task(t), "tenant") and
                   not r.hget(QueueKeys(qname).task(t), "band") for t, _, _ in got), got
        assert old.ack(got) == [1] * len(got)
        ran += [t for t, _, _ in got]
    assert set(ran) == {"old3", "old4", "old5"}, "the stream 'mixed' starts with interactive tasks"

    # current workers run the rest, each task once, the stream 'mixed' in its order
    order: list[str] = []
    for _ in range(50):
        got = c.claim(4)
        if not got:
            break
        order += [t.id for t in got]
        assert c.settle([mtq.Outcome(t, ok=True, value=1) for t in got]).succeeded == len(got)
    assert len(order) == len(set(order)), "nothing ran twice"
    assert set(order) | set(ran) == {t.id for t in new_tasks} | {f"old{i}" for i in range(6)}
    mixed = [t for t in order if t in {x.id for x in new_tasks[12:]} or t in {"old0", "old1", "old2"}]
    assert mixed == [x.id for x in new_tasks[12:]] + ["old0", "old1", "old2"], mixed
    assert q.stats()["waiting"] == 0 and q.stats()["succeeded"] == 21


def test_an_older_worker_releases_a_stream_whose_next_task_has_a_tenant(
        qname: str, redis_url: str, r: redis.Redis) -> None:
    """An older worker's ack puts the stream back in the plain ring: a current worker
    finds it there and moves it to the lane of its head, which runs once."""
    q = mtq.Queue(qname, redis_url)
    c = mtq.Consumer(qname, redis_url, settings=q.settings, worker_id="new")
    old = OldProcess(r, qname)
    q.submit({"warm": 1}, tenant="other", priority="batch")  # scheduling on
    first = q.submit({"i": 0}, stream="s")
    second = q.submit({"i": 1}, stream="s", tenant="acme", priority="interactive")
    (held,) = old.claim(1)
    assert held[0] == first.id
    assert old.ack([held]) == [1]
    assert r.lrange(QueueKeys(qname).ready, 0, -1) == [b"s"], "the older ack's ring"
    got = c.claim(2)
    assert got[0].id == second.id, "moved to the interactive lane, first"
    c.settle([mtq.Outcome(t, ok=True, value=1) for t in got])
    assert second.result(timeout=10) == 1 and first.result(timeout=10) == "old"


def test_a_stream_moved_within_its_band_does_not_stop_the_claim(qname: str, redis_url: str,
                                                                 r: redis.Redis) -> None:
    """A stream an older worker put in the plain ring whose head has a tenant of the same
    band moves to that tenant's lane; the claim goes on and takes it."""
    q = mtq.Queue(qname, redis_url)
    c = mtq.Consumer(qname, redis_url, settings=q.settings, worker_id="new")
    old = OldProcess(r, qname)
    q.submit({"warm": 1}, tenant="other", priority="batch")  # scheduling on
    first = q.submit({"i": 0}, stream="s")
    second = q.submit({"i": 1}, stream="s", tenant="acme")
    (held,) = old.claim(1)
    assert held[0] == first.id and old.ack([held]) == [1]
    got = c.claim(2)
    assert got[0].id == second.id
    c.settle([mtq.Outcome(t, ok=True, value=1) for t in got])
    assert q.stats()["waiting"] == 0 and second.result(timeout=10) == 1
