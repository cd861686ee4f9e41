"""Direct delivery (see "Direct delivery" in mtq/broker/lua/_lib.lua): a worker whose
claim took all there was and left it room is registered idle, and a submit hands it the tasks that would be
claimable at once, running under a lease, through its inbox. Against a real
redis-server; the kill test SIGKILLs a real worker process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import redis

import mtq
from mtq.broker import scripts
from mtq.broker.consumer import Consumer, Outcome
from mtq.broker.keys import QueueKeys
from mtq.broker.protocol import Claimed
from mtq.settings import QueueSettings
from mtq.workers.worker import Monitor
from tests.support.processes import kill_process
from tests.support.waits import wait_for
from tests.support.workers import FAST, Recorder, make_worker, serving

pytestmark = pytest.mark.timeout(60)


def consumer(qname: str, client: redis.Redis, **settings: int) -> Consumer:
    c = Consumer(qname, client=client, settings=QueueSettings(**settings) if settings else None)
    c.direct = True
    return c


def evalshas(r: redis.Redis) -> int:
    return int(r.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def test_a_sleeping_worker_is_handed_a_new_task_without_a_claim(r: redis.Redis,
                                                                qname: str) -> None:
    keys = QueueKeys(qname)
    c = consumer(qname, r)
    assert c.claim(8) == []
    assert r.hkeys(keys.idle) == [c.worker_id.encode()], "an empty claim registers its worker"
    q = mtq.Queue(qname, client=r)
    task = q.submit({"x": 1})
    # the submit itself made it the worker's: running under a lease, no wake-up marker
    h = r.hgetall(keys.task(task.id))
    assert (h[b"status"], h[b"worker"], h[b"deliveries"]) == \
        (b"running", c.worker_id.encode(), b"1"), h
    assert r.zscore(keys.leases, task.id) is not None
    assert r.llen(keys.wake) == 0 and r.llen(keys.free) == 0
    assert r.hget(keys.idle, c.worker_id).split(b"|")[2] == b"8", "registered as it was"
    assert q.stats()["waiting"] == 0 and q.stats()["running"] == 1
    before = evalshas(r)
    handed = c.wait(5)
    assert evalshas(r) == before, "the wait returned the task: no claim ran"
    assert isinstance(handed, list) and [t.id for t in handed] == [task.id]
    assert c.registered, "it sleeps again without a claim"
    t = handed[0]
    assert (t.token, t.payload, t.deliveries, t.stream) == \
        (h[b"token"].decode(), h[b"payload"], 1, None)
    assert t.live_until > 0
    report = c.settle([Outcome(t, True, {"y": 2})])
    assert report.succeeded == 1
    assert task.result(timeout=5) == {"y": 2}
    second = q.submit({"x": 2})  # to the same registration: it came back for the first
    handed = c.wait(5)
    assert isinstance(handed, list) and [t.id for t in handed] == [second.id]
    assert evalshas(r) == before + 2, "a submit and an ack: no claim"
    c.settle([Outcome(handed[0], True, None)])
    trace = task.trace()
    assert [e.kind for e in trace] == ["queued", "started", "succeeded"], trace
    assert trace[1].detail == f"delivery 1 on {c.worker_id}"


def test_only_what_would_be_claimable_at_once_is_handed_over(r: redis.Redis, qname: str) -> None:
    """Room 2: of five stream-less tasks the first two are handed over, the rest queue in
    order behind them; of three tasks of one stream only the head is, and the next
    waits for it to end (one running task per stream, order kept)."""
    keys = QueueKeys(qname)
    q = mtq.Queue(qname, client=r)
    c = consumer(qname, r)
    assert c.claim(2) == []
    free = q.submit_many([{"i": i} for i in range(5)])
    handed = c.wait(5)
    assert isinstance(handed, list)
    assert [t.id for t in handed] == [t.id for t in free[:2]]
    assert r.lrange(keys.free, 0, -1) == [t.id.encode() for t in free[2:]]
    assert r.hlen(keys.idle) == 0 and not c.registered, "it was handed its whole room"
    other = Consumer(qname, client=r)
    assert [t.id for t in other.claim(8)] == [t.id for t in free[2:]]

    assert c.claim(8) == []
    s = q.submit_many([{"i": i} for i in range(3)], stream="s")
    assert r.hget(keys.idle, c.worker_id).split(b"|")[2] == b"8"
    handed = c.wait(5)
    assert isinstance(handed, list) and [t.id for t in handed] == [s[0].id]
    assert r.sismember(keys.busy, "s")
    assert other.claim(8) == [], "the stream is busy: its next task waits"
    c.settle([Outcome(handed[0], True, None)])
    assert [t.id for t in other.claim(8)] == [s[1].id]


def test_a_submit_says_how_many_it_handed_over_and_its_client_yields_only_then(
        r: redis.Redis, qname: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The submit's answer counts the tasks that went straight to a sleeping worker. Its
    client then yields its CPU once (a worker that shares it runs the task first,
    docs/architecture.md): after such a submit, and after no other."""
    from mtq.broker import lane

    yields: list[int] = []
    monkeypatch.setattr(lane, "sched_yield", lambda: yields.append(1))
    q = mtq.Queue(qname, client=r)
    c = consumer(qname, r)
    assert c.claim(2) == []
    answer = q.broker.submit(q.prepare([None] * 3))
    assert answer.handed == 2 and len(answer) == 3 and all(isinstance(i, str) for i in answer)
    assert q.broker.submit(q.prepare([None])).handed == 0, "its whole room was handed: queued"
    q.submit(None)
    assert yields == [], "nothing was handed over: no yield"
    assert len(c.wait(5)) == 2  # type: ignore[arg-type]
    assert [t.id for t in c.claim(8)] and c.claim(8) == [] and c.registered
    q.submit(None)
    assert yields == [1], "a task was handed over: one yield"
    q.submit_many([None] * 3)
    assert yields == [1, 1], "one yield a submit, however many it handed over"


def test_a_worker_is_handed_only_what_its_room_holds(r: redis.Redis, qname: str) -> None:
    """Its room (what its claim left: what its slot could take) is the most one submit
    hands it, and a submit that hands it all of it ends its registration: a burst
    spreads over the sleeping workers, and what none has room for queues."""
    keys = QueueKeys(qname)
    q = mtq.Queue(qname, client=r)
    c = consumer(qname, r)
    assert c.claim(8) == []
    first = q.submit(None)  # handed over while it is not waiting: its next claim has it
    got = c.claim(8)
    assert [t.id for t in got] == [first.id]
    assert r.hlen(keys.idle) == 0 and r.llen(keys.worker_inbox(c.worker_id)) == 0
    assert not c.registered
    # a claim that finds an inbox registers nothing: the next submit queues and wakes
    second = q.submit(None)
    assert r.hget(keys.task(second.id), "status") == b"queued"
    assert r.llen(keys.wake) == 1
    assert [t.id for t in c.claim(8)] == [second.id]
    # it took all there was: registered again, with the room left
    assert r.hget(keys.idle, c.worker_id).split(b"|")[2] == b"7" and c.registered
    assert [t.id for t in c.claim(8)] == [] and r.hget(keys.idle, c.worker_id).split(b"|")[2] == b"8"
    other = consumer(qname, r)
    assert other.claim(4) == []
    burst = q.submit_many([None] * 13)  # eight to one, four to the other, one queued
    assert [r.hget(keys.task(t.id), "worker") for t in burst] == \
        [c.worker_id.encode()] * 8 + [other.worker_id.encode()] * 4 + [None]
    assert r.lrange(keys.free, 0, -1) == [burst[-1].id.encode()]
    assert [len(w.wait(5)) for w in (c, other)] == [8, 4]  # type: ignore[arg-type]
    assert r.hlen(keys.idle) == 0 and not (c.registered or other.registered)


def test_a_claim_of_many_small_batches_registers_the_room_of_one(
        r: redis.Redis, qname: str) -> None:
    """A claim's ``room`` (a worker that claims many small batches at once passes its
    batch size) bounds the room it registers with, whatever it left of what it asked
    for; a claim without it (an older worker's: claim.lua's ARGV[13] absent) registers
    what it left, as before; and one with no room to give registers nothing."""
    keys = QueueKeys(qname)
    q = mtq.Queue(qname, client=r)
    c = consumer(qname, r)
    q.submit(None)
    assert len(c.claim(64, room=1)) == 1  # took all there was, 63 left of its 64
    assert r.hget(keys.idle, c.worker_id).split(b"|")[2] == b"1" and c.registered
    burst = q.submit_many([None] * 3)  # one handed over, two queued for anyone
    assert [r.hget(keys.task(t.id), "status") for t in burst] == \
        [b"running", b"queued", b"queued"]
    assert r.hlen(keys.idle) == 0
    assert [t.id for t in c.wait(5)] == [burst[0].id]  # type: ignore[union-attr]
    assert not c.registered
    assert len(c.claim(64, room=0)) == 2  # room for none: not registered
    assert r.hlen(keys.idle) == 0 and not c.registered
    # an older worker's claim: eleven arguments after the channels, no room
    b = c.broker
    call = b.claim_call(c.worker_id, 5, window_ms=5000)
    old = scripts.Call(call.script, call.keys, call.args[:-1], call.parse)
    assert b.run(old)[0].tasks == []
    assert r.hget(keys.idle, c.worker_id).split(b"|")[2] == b"5"


def test_a_worker_that_comes_back_for_each_hand_off_is_handed_any_number(
        r: redis.Redis, qname: str) -> None:
    """The room bounds one submit, not a registration: a worker that popped every reply
    before the next submit keeps being handed tasks without a claim, until its window
    ends; one that did not ends its registration with the next hand-off. (Its worker
    takes the registration back itself when its slot is full: see the next test.)"""
    keys = QueueKeys(qname)
    q = mtq.Queue(qname, client=r)
    c = consumer(qname, r)
    assert c.claim(2) == []
    before = evalshas(r)
    for i in range(7):  # more than three times its room
        task = q.submit({"i": i})
        handed = c.wait(5)
        assert isinstance(handed, list) and [t.id for t in handed] == [task.id], i
        assert c.settle([Outcome(handed[0], True, i)]).succeeded == 1
        assert task.result(timeout=5) == i
    assert evalshas(r) == before + 14, "a submit and an ack each: no claim"
    assert r.hget(keys.idle, c.worker_id).split(b"|")[2] == b"2" and c.registered
    # it does not come back: the second hand-off finds the first unread and ends it
    unread = [q.submit(None), q.submit(None)]
    assert [r.hget(keys.task(t.id), "worker") for t in unread] == [c.worker_id.encode()] * 2
    assert r.hlen(keys.idle) == 0
    late = q.submit(None)
    assert r.hget(keys.task(late.id), "status") == b"queued" and r.llen(keys.wake) == 1
    # it thinks itself registered still: it pops what it was handed, then the marker
    assert [t.id for w in (c.wait(5), c.wait(5)) for t in w] == [t.id for t in unread]  # type: ignore[union-attr]
    assert c.wait(5) is True
    assert [t.id for t in c.claim(8)] == [late.id]


def test_a_registration_lapses_after_its_window(r: redis.Redis, qname: str) -> None:
    """A worker that did not come back (stopped, or died) within its window is handed
    nothing; the next submit drops its stale registration and queues."""
    keys = QueueKeys(qname)
    c = consumer(qname, r, lease_ms=400)  # window: half a lease, 200 ms
    assert c.claim(8) == []
    expiry = int(r.hget(keys.idle, c.worker_id).split(b"|")[0])

    def server_ms() -> int:
        sec, usec = r.time()
        return sec * 1000 + usec // 1000

    wait_for(lambda: server_ms() > expiry, 5, "the registration did not lapse")
    task = mtq.Queue(qname, client=r).submit(None)
    assert r.hget(keys.task(task.id), "status") == b"queued"
    assert r.hlen(keys.idle) == 0, "the stale registration was dropped"


def test_a_retired_worker_gives_back_what_it_was_handed(r: redis.Redis, qname: str) -> None:
    keys = QueueKeys(qname)
    q = mtq.Queue(qname, client=r)
    c = consumer(qname, r)
    assert c.claim(8) == []
    task = q.submit({"x": 1}, stream="s")
    handed = c.retire()
    assert [t.id for t in handed] == [task.id]
    assert r.hlen(keys.idle) == 0 and r.exists(keys.worker_inbox(c.worker_id)) == 0
    assert c.release(handed) == 1
    after = q.submit({"x": 2})  # no registration left: queued
    assert r.hget(keys.task(after.id), "status") == b"queued"
    other = Consumer(qname, client=r)
    got = other.claim(8)
    assert [t.id for t in got] == [task.id, after.id]
    assert got[0].deliveries == 1, "given back uncounted"


def test_a_worker_run_takes_hand_offs_and_retires_when_it_stops(
        r: redis.Redis, qname: str, redis_url: str) -> None:
    keys = QueueKeys(qname)
    gate = threading.Event()
    model = Recorder(lambda p: p["i"] * 2, gate=gate, max_batch_size=4)
    w = make_worker(model, qname, redis_url)
    q = mtq.Queue(qname, redis_url)
    with serving(w, gate) as running:
        wait_for(lambda: r.hlen(keys.idle) == 1, 10, "the worker did not register idle")
        first = q.submit({"i": 1})
        assert r.hget(keys.task(first.id), "worker") == w.worker_id.encode()
        assert model.started.wait(10), "the handed task did not run"
        # held in predict: it is registered still, as it was
        assert r.hget(keys.idle, w.worker_id).split(b"|")[2] == b"4"
        second = q.submit({"i": 2})
        assert r.hget(keys.task(second.id), "worker") == w.worker_id.encode()
        gate.set()
        assert (first.result(timeout=10), second.result(timeout=10)) == (2, 4)
        wait_for(lambda: r.hlen(keys.idle) == 1, 10, "the worker did not register again")
        totals = running.stop()
    assert totals["succeeded"] == 2
    assert r.hlen(keys.idle) == 0, "a stopped worker takes its registration back"
    late = q.submit({"i": 3})
    assert r.hget(keys.task(late.id), "status") == b"queued"


def test_a_worker_whose_slot_is_full_takes_its_registration_back(
        r: redis.Redis, qname: str, redis_url: str) -> None:
    """A model that lets batches fill (max_wait_ms above 0) leaves the wait to the
    fetcher, which pops hand-offs while its slot has room and holds what it popped at
    once (the heartbeat keeps the leases, here for longer than one). Once the
    hand-offs fill its slot it takes its registration back: later tasks queue for
    any worker instead of waiting, shown running, behind its batch. Each runs once."""
    keys = QueueKeys(qname)
    gate = threading.Event()
    model = Recorder(lambda p: p["i"], gate=gate, max_batch_size=2, max_wait_ms=20)
    w = make_worker(model, qname, redis_url)  # lease 1.5 s
    q = mtq.Queue(qname, redis_url, settings=FAST)
    inbox = keys.worker_inbox(w.worker_id)

    def server_ms() -> int:
        sec, usec = r.time()
        return sec * 1000 + usec // 1000

    with serving(w, gate) as running:
        wait_for(lambda: r.hlen(keys.idle) == 1, 10, "the worker did not register idle")
        tasks = [q.submit({"i": 0})]
        assert model.started.wait(10), "the first task did not run"
        for i in (1, 2):  # each one comes when the slot has room for it: popped
            wait_for(lambda: r.hlen(keys.idle) == 1, 10, "the worker is not registered")
            tasks.append(q.submit({"i": i}))
            wait_for(lambda: r.llen(inbox) == 0, 10, f"hand-off {i} was not popped")
        assert [r.hget(keys.task(t.id), "worker") for t in tasks] == [w.worker_id.encode()] * 3
        wait_for(lambda: r.hlen(keys.idle) == 0 and not w.consumer.registered, 10,
                 "the worker with a full slot did not take its registration back")
        assert len(w.slot) == 2
        tasks += [q.submit({"i": 3}), q.submit({"i": 4})]
        assert [r.hget(keys.task(t.id), "status") for t in tasks[3:]] == [b"queued"] * 2
        # held past the lease they were handed under: their leases were kept
        until = max(float(r.zscore(keys.leases, t.id) or 0) for t in tasks[:3])
        wait_for(lambda: server_ms() > until + 200, 10, "the first leases did not run out")
        assert [r.hget(keys.task(t.id), "status") for t in tasks[:3]] == [b"running"] * 3
        assert all(float(r.zscore(keys.leases, t.id) or 0) > until for t in tasks[:3])
        gate.set()
        assert [t.result(timeout=10) for t in tasks] == list(range(5))
        running.stop()
    assert sorted(p["i"] for p in model.seen()) == list(range(5)), "each ran once"
    assert [r.hget(keys.task(t.id), "deliveries") for t in tasks] == [b"1"] * 5


def _worker_process(qname: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "mtq", "worker", "run", "tests.handlers:double",
             "--queue", qname], env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)


def _killed_asleep(r: redis.Redis, qname: str, env: dict[str, str], log: Path,
                   warm: int = 0) -> str:
    """Start a worker process, wait until it sleeps registered, SIGKILL it; its id.
    ``warm``: it first runs that many tasks, one at a time (a handler as quick as
    tests.handlers:double: from the second, its model thread makes the wait, see
    Fetcher.wait)."""
    proc = _worker_process(qname, env, log)
    try:
        wait_for(lambda: r.hlen(QueueKeys(qname).idle) == 1, 30,
                 f"the worker did not register idle: {log.read_text()}")
        q = mtq.Queue(qname, client=r)
        for i in range(warm):
            assert q.submit({"x": i}).result(timeout=30) == 2 * i
        wait_for(lambda: r.hlen(QueueKeys(qname).idle) == 1, 30,
                 f"the worker did not register idle again: {log.read_text()}")
        return str(r.hkeys(QueueKeys(qname).idle)[0].decode())
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@pytest.mark.parametrize("warm", [0, 3], ids=["fetcher-waits", "model-thread-waits"])
def test_a_task_handed_to_a_killed_worker_runs_once_elsewhere(
        r: redis.Redis, qname: str, redis_url: str, subprocess_env: dict[str, str],
        tmp_path: Path, warm: int) -> None:
    """SIGKILL a worker process asleep and registered (waiting in its fetcher, or,
    warm with a quick handler, in its model thread), then submit three tasks one by
    one. Warm, it registered the room of a full claim: the first two are handed to the
    dead worker (the second finds the first still in its inbox, and ends its
    registration), the third is queued. Fresh, it registered the room of one task (a
    function not measured yet claims one at a time: mtq.workers.claims): the first is
    handed over, which ends its registration, and the others are queued. None is lost:
    the leases expire and a live worker runs all three, each once, to completion."""
    keys = QueueKeys(qname)
    q = mtq.Queue(qname, redis_url)
    q.configure(lease_ms=1000)
    dead_id = _killed_asleep(r, qname, subprocess_env, tmp_path / "dead.log", warm)
    tasks = [q.submit({"x": i}) for i in range(3)]
    handed = 2 if warm else 1
    assert [r.hget(keys.task(t.id), "worker") for t in tasks] == \
        [dead_id.encode()] * handed + [None] * (3 - handed)
    assert not r.hexists(keys.idle, dead_id), "an unread hand-off ends the registration"
    assert r.llen(keys.worker_inbox(dead_id)) == handed
    live = _worker_process(qname, subprocess_env, tmp_path / "live.log")
    try:
        assert [t.result(timeout=30) for t in tasks] == [0, 2, 4]
        rows = [r.hgetall(keys.task(t.id)) for t in tasks]
        assert [h[b"deliveries"] for h in rows] == \
            [b"2"] * handed + [b"1"] * (3 - handed), rows
        assert all(h[b"worker"] != dead_id.encode() for h in rows)
        assert q.stats()["succeeded"] == 3 + warm
    finally:
        kill_process(live)


def test_a_supervisor_gives_back_at_once_what_a_dead_worker_was_handed(
        r: redis.Redis, qname: str, redis_url: str, subprocess_env: dict[str, str],
        tmp_path: Path) -> None:
    """What a supervisor does when its worker process dies (give_back_all): the dead
    worker's registration and inbox are dropped first, and the task it was handed goes
    back uncounted, claimable at once (no lease to wait out)."""
    keys = QueueKeys(qname)
    q = mtq.Queue(qname, redis_url)
    dead_id = _killed_asleep(r, qname, subprocess_env, tmp_path / "w.log")
    task = q.submit({"x": 1}, stream="s")
    assert r.hget(keys.task(task.id), "worker") == dead_id.encode()
    sup = Consumer(qname, client=r)
    codes = sup.give_back_all(dead_id, [], [], "killed")
    assert codes == [1]
    assert r.hlen(keys.idle) == 0 and r.exists(keys.worker_inbox(dead_id)) == 0
    got = Consumer(qname, client=r).claim(8)
    assert [t.id for t in got] == [task.id] and got[0].deliveries == 1


class Quarantining(Monitor):
    """A supervisor's side that takes every suspect (and runs none: a test stand-in)."""

    def __init__(self) -> None:
        self.taken: list[str] = []

    def quarantine(self, task: Claimed) -> bool:
        self.taken.append(task.id)
        return True


def test_a_suspect_handed_to_the_supervisor_is_handed_once(
        r: redis.Redis, qname: str, redis_url: str) -> None:
    """A worker's fetcher hands a suspect (its process died running it) to its supervisor
    and goes on claiming: it must not take it for a task handed to it by a submit (a
    mix-up of the two hand-offs once looped on the suspect, sending it to the supervisor
    without end and claiming nothing more)."""
    q = mtq.Queue(qname, redis_url)
    suspect = q.submit({"i": 1})
    c = Consumer(qname, client=r)
    held = c.claim(1)
    assert c.give_back([(held[0].id, held[0].token)], [], "died") == [1]  # counted
    monitor = Quarantining()
    w = make_worker(Recorder(lambda p: p["i"]), qname, redis_url, monitor=monitor)
    with serving(w) as running:
        wait_for(lambda: monitor.taken, 10, "the suspect was not handed to the supervisor")
        after = q.submit({"i": 2})
        assert after.result(timeout=10) == 2, "the worker went on claiming and running"
        running.stop()
    assert monitor.taken == [suspect.id]
