"""A thread waiting for its own result reads the reply connection itself
(``mtq.replies.Hub.read_own``) while the reply listener parks: what the listener must
still do (serve other feeds, fill the inbox, make a lost connection anew) it still
does. Against a real redis-server and a real ``mtq worker run`` process."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

import mtq
from mtq import replies
from mtq.broker.keys import QueueKeys
from mtq.client import waiting
from tests.support.processes import gated_task, gated_worker
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def worker(qname: str, subprocess_env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    with gated_worker(qname, subprocess_env) as proc:
        yield proc


def _lead(q: mtq.Queue, hub: replies.Hub) -> None:
    """Round trips until this thread reads its result itself (the listener parked)."""
    before = hub.read_by_callers
    for i in range(200):
        assert q.submit({"i": i}).result(timeout=30)["i"] == i
        if hub.read_by_callers > before:
            return
    pytest.fail("200 round trips in a row, and the listener never left a result to its "
                "waiter")


def _parked(q: mtq.Queue, hub: replies.Hub, monkeypatch: pytest.MonkeyPatch) -> None:
    """:func:`_lead`, with the listener then parked for as long as the test runs (only
    the wake-ups under test bring it back)."""
    monkeypatch.setattr(replies, "PARK_S", 600.0)
    _lead(q, hub)


def _waiting(t: mtq.Task, hub: replies.Hub) -> tuple[threading.Thread, list[Any]]:
    """A thread waiting for ``t``'s result, once it reads the reply connection itself:
    the thread, and the list its result goes to."""
    answer: list[Any] = []
    waiter = threading.Thread(target=lambda: answer.append(t.result(timeout=30)))
    waiter.start()
    wait_for(lambda: hub.reader == "waiter", 10, "the waiter did not read for itself")
    return waiter, answer


def test_a_waiter_reads_its_own_result_and_the_listener_reads_again_when_none_does(
        qname: str, redis_url: str, client: redis.Redis,
        worker: subprocess.Popen[bytes]) -> None:
    q = mtq.Queue(qname, redis_url, client=client)
    hub = replies.hub_of(client)
    _lead(q, hub)
    before = hub.read_by_callers
    for i in range(50):
        assert q.submit({"i": i}).result(timeout=30)["i"] == i
    after = hub.read_by_callers  # (a waiter may read twice for one result under load)
    assert after >= before + 50, "a waiter in a loop did not read its own"
    # nobody waits now: the listener reads again within PARK_S, and an outcome that comes
    # meanwhile reaches the inbox (no round trip for the result() that comes later)
    t = q.submit({"i": 7})
    wait_for(lambda: hub.kept() == 1, 10, "the outcome nobody waited for was not read")
    assert hub.read_by_callers == after  # the listener read it, no caller
    assert t.result(timeout=5)["i"] == 7


def test_many_threads_waiting_for_their_own_results_each_get_theirs(
        qname: str, redis_url: str, client: redis.Redis,
        worker: subprocess.Popen[bytes]) -> None:
    q = mtq.Queue(qname, redis_url, client=client)
    hub = replies.hub_of(client)
    _lead(q, hub)
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def loop(k: int) -> None:
        try:
            got[k] = [q.submit({"i": k * 1000 + i}).result(timeout=30)["i"]
                      for i in range(40)]
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert got == {k: [k * 1000 + i for i in range(40)] for k in range(8)}


def test_a_waiter_left_waiting_when_the_reading_one_is_done_is_served_at_once(
        qname: str, redis_url: str, client: redis.Redis, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, worker: subprocess.Popen[bytes],
        subprocess_env: dict[str, str]) -> None:
    """A reads for itself, B waits for A to read; A's result comes first: the listener
    reads on for B (it is parked for as long as the test runs otherwise)."""
    with gated_worker(qname, subprocess_env):
        q = mtq.Queue(qname, redis_url, client=client)
        hub = replies.hub_of(client)
        _parked(q, hub, monkeypatch)
        # both workers up and asleep, so that the two tasks run at once
        wait_for(lambda: client.hlen(QueueKeys(qname).idle) == 2, 20,
                 "the second worker did not start")
        gate_a, a = gated_task(q, tmp_path, 1, "a")
        gate_b, b = gated_task(q, tmp_path, 2, "b")  # on the other worker
        ta, got_a = _waiting(a, hub)
        got_b: list[Any] = []
        tb = threading.Thread(target=lambda: got_b.append(b.result(timeout=30)))
        tb.start()
        wait_for(lambda: hub.watching() == 2, 10, "B is not waiting")
        gate_a.unlink()
        ta.join(10)
        assert got_a and got_a[0]["i"] == 1
        gate_b.unlink()
        tb.join(5)  # well within RESYNC_S (10 s), after which B would read Redis itself
        assert got_b and got_b[0]["i"] == 2, "B was left waiting with nobody reading"


@pytest.mark.parametrize("reader", ["events", "callback", "aresult"])
def test_a_reader_opened_while_the_listener_parks_is_served_at_once(
        qname: str, redis_url: str, client: redis.Redis, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, worker: subprocess.Popen[bytes],
        reader: str) -> None:
    """With the listener parked for as long as the test runs, a reader that is not a
    waiter for its own result (which would read for itself) wakes it."""
    import asyncio

    q = mtq.Queue(qname, redis_url, client=client)
    hub = replies.hub_of(client)
    _parked(q, hub, monkeypatch)
    gate, t = gated_task(q, tmp_path, 1)
    seen: list[Any] = []
    done = threading.Event()
    if reader == "events":
        def read() -> None:
            seen.extend(ev.kind for ev in t.events(timeout=30))
            done.set()
        threading.Thread(target=read, daemon=True).start()
    elif reader == "callback":
        t.add_done_callback(lambda task, ev: (seen.append(ev.kind), done.set()))
    else:
        def read_async() -> None:
            seen.append(asyncio.run(t.aresult(timeout=30))["i"])
            done.set()
        threading.Thread(target=read_async, daemon=True).start()
    wait_for(lambda: hub.watching() >= 1, 10, "the reader opened no feed")
    gate.unlink()
    # well within RESYNC_S (10 s), after which each of them would read the stored state
    assert done.wait(5), f"the {reader} reader was not served while the listener parked"
    assert seen[-1] in ("succeeded", 1), seen


def test_a_reply_connection_lost_under_a_reading_waiter_is_made_anew(
        qname: str, redis_url: str, client: redis.Redis, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, worker: subprocess.Popen[bytes]) -> None:
    """The waiter reading for itself finds the connection gone: the listener makes it
    anew and the waiter gets its result (from the stored state if its event was lost)."""
    q = mtq.Queue(qname, redis_url, client=client)
    hub = replies.hub_of(client)
    _parked(q, hub, monkeypatch)
    gate, t = gated_task(q, tmp_path, 3)
    before, read = hub.resyncs, hub.read_by_callers
    waiter, answer = _waiting(t, hub)
    client.client_kill_filter(_type="pubsub")
    # at once, not after RESYNC_S (10 s) of the waiter's silence
    wait_for(lambda: hub.resyncs > before, 5, "the hub did not subscribe again")
    gate.unlink()
    waiter.join(5)
    assert answer and answer[0]["i"] == 3
    assert hub.read_by_callers >= read
    # and the next round trips go on as before (a waiter reads for itself again)
    _lead(q, hub)


def test_closing_the_hub_under_a_reading_waiter_ends_its_wait(
        qname: str, redis_url: str, client: redis.Redis, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, worker: subprocess.Popen[bytes]) -> None:
    q = mtq.Queue(qname, redis_url, client=client)
    hub = replies.hub_of(client)
    _parked(q, hub, monkeypatch)
    gate, t = gated_task(q, tmp_path, 4)
    waiter, answer = _waiting(t, hub)
    # the outcome of a task submitted through the closed hub goes to its channel: the
    # waiter learns it from the stored state, re-read after RESYNC_S without an event
    monkeypatch.setattr(waiting, "RESYNC_S", 1.0)  # (10 s)
    hub.close_all()
    gate.unlink()  # its result now comes from the stored state, through a new hub
    waiter.join(5)  # the closed hub's read ends at once: no wait on a feed nobody feeds
    assert not waiter.is_alive(), "the waiter hung on a closed hub"
    assert answer and answer[0]["i"] == 4


def test_a_queue_whose_hub_was_closed_is_served_at_once_through_a_new_one(
        qname: str, redis_url: str, client: redis.Redis,
        worker: subprocess.Popen[bytes]) -> None:
    """The queue's tasks name the new hub's reply channel, which it subscribes: their
    outcomes come as events, not only after RESYNC_S (10 s) of silence."""
    q = mtq.Queue(qname, redis_url, client=client)
    assert q.submit({"i": 1}).result(timeout=30)["i"] == 1
    replies.hub_of(client).close_all()
    start = time.monotonic()
    for i in range(3):
        assert q.submit({"i": i}).result(timeout=30)["i"] == i
    assert time.monotonic() - start < 5, "the outcomes came only from re-reads"


def test_a_forked_child_never_reads_its_parents_reply_connection(
        qname: str, redis_url: str, client: redis.Redis,
        monkeypatch: pytest.MonkeyPatch, worker: subprocess.Popen[bytes]) -> None:
    """The listener parked at the fork: the child's waiter must not read (nor steal a
    message of) the socket it shares with its parent, whose round trips go on."""
    import os

    q = mtq.Queue(qname, redis_url, client=client)
    hub = replies.hub_of(client)
    _parked(q, hub, monkeypatch)
    pid = os.fork()
    if pid == 0:  # the child: wait a while on a feed, as result() would
        code = 2
        try:
            before = hub.read_by_callers
            got = hub.read_own(replies.OneShot((qname, "nothing")), 0.5)
            code = 0 if got is None and hub.read_by_callers == before else 1
        finally:
            os._exit(code)
    for i in range(30):
        assert q.submit({"i": i}).result(timeout=10)["i"] == i
    ended: list[int] = []

    def child_ended() -> bool:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got:
            ended.append(status)
        return bool(got)

    try:
        wait_for(child_ended, 10, "the forked child did not end")
    finally:
        if not ended:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(ended[0]) == 0, "the child read its parent's connection"
