"""Replies against a real redis-server: one pub/sub subscription per client, the
event stream of a task (live and replayed), token fencing in emit.lua, waiting on
another client's task, callbacks, groups, asyncio, and reconnects (a killed
pub/sub connection, a restarted redis-server).

Workers are played by a :class:`mtq.Consumer` driven from the test, so every
event is produced at a point the test chooses.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

import mtq
from mtq import replies, serialization
from mtq.broker.codes import Code
from mtq.broker.consumer import Chunk
from mtq.client.replies import hub as hub_module
from mtq.settings import QueueSettings
from tests.support.servers import RedisServer
from tests.support.waits import Reader, wait_for

pytestmark = pytest.mark.timeout(60)

FAST = QueueSettings(lease_ms=5000, retry_backoff_ms=0)


# -- helpers -----------------------------------------------------------------------
def until(predicate: Callable[[], Any], timeout: float, message: str,
          state: Callable[[], Any]) -> Any:
    """:func:`wait_for`, with ``state()`` at the time of the failure in its message."""
    try:
        return wait_for(predicate, timeout, message)
    except pytest.fail.Exception:
        pytest.fail(f"timed out after {timeout}s: {message}; now: {state()!r:.1500}")


def name_of(client: redis.Redis) -> str:
    return str(client.connection_pool.connection_kwargs["client_name"])


def pubsub_conns(admin: redis.Redis, name: str) -> list[dict[str, Any]]:
    """The server's pub/sub connections opened by the client called ``name``."""
    return [c for c in admin.client_list(_type="pubsub") if c.get("name") == name]


def close_hub(client: redis.Redis, admin: redis.Redis) -> None:
    """Stop the reply hub of ``client`` (a hub otherwise lives as long as the process):
    a test that made a client of its own stops the hub's threads so they do not outlive it."""
    hub = hub_module._hubs.get(client)
    if hub is not None:
        hub.close_all()
    client.close()


@pytest.fixture
def client(redis_url: str, r: redis.Redis) -> Iterator[redis.Redis]:
    """A Redis client of this test's own, so a reply hub of its own (the process-wide
    client of ``connect(url)`` is shared by every test), named so that its pub/sub
    connection can be picked out of CLIENT LIST."""
    c = redis.Redis.from_url(redis_url, client_name="mtqtest-" + uuid.uuid4().hex[:10])
    yield c
    close_hub(c, r)


@pytest.fixture
def consumer(qname: str, redis_url: str) -> mtq.Consumer:
    return mtq.Consumer(qname, redis_url, settings=FAST)


def attach(hub: replies.Hub, start: Callable[[], Reader], feeds: int = 1) -> Reader:
    """Start a reader and wait until its feed is open on ``hub`` (from then on no event
    can be missed). ``feeds``: how many feeds the hub has once it is."""
    before = hub.watching()
    reader = start()
    wait_for(lambda: hub.watching() >= before + feeds or reader.finished.is_set(), 10,
             "the reader's feed was not opened on the hub")
    return reader


def claim_one(consumer: mtq.Consumer) -> mtq.Claimed:
    got = wait_for(lambda: consumer.claim(1), 5, "nothing to claim")
    assert len(got) == 1
    return got[0]


def snapshot_read(q: mtq.Queue, task_id: str) -> bool:
    """True once a reader on ``q`` has read the task's stored state: watch.lua then added
    the reply channel of ``q``'s client to the task (that client did not submit it)."""
    reply = q.redis.hget(q.broker.keys.task(task_id), "reply") or b""
    return q.reply_channel().encode() in reply.split()


def follow(watcher: mtq.Queue, task: mtq.Task, make: Callable[[mtq.Task], Iterable[Any]]
           ) -> Reader:
    """Read ``make(handle)`` in a thread, ``handle`` being the task seen from the client of
    ``watcher`` (not the one that submitted it); returns once the reader has read the
    stored state, so every event published from then on reaches it live."""
    handle = watcher.task(task.id)
    reader = Reader(lambda: make(handle))
    wait_for(lambda: snapshot_read(watcher, task.id) or reader.finished.is_set(), 10,
             "the reader did not read the task's stored state")
    return reader


def tok(claimed: mtq.Claimed, index: int, value: Any) -> tuple[str, str, int, bytes]:
    """An emit item: (id, lease token, index, encoded value)."""
    return (claimed.id, claimed.token, index, serialization.dumps(value))


def kinds(events: list[mtq.Event]) -> list[str]:
    return [e.kind for e in events]


def run_threads(fns: list[Callable[[], None]], timeout: float) -> None:
    errors: list[BaseException] = []

    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        def body() -> None:
            try:
                fn()
            except BaseException as exc:
                errors.append(exc)
        return body

    threads = [threading.Thread(target=wrap(fn), daemon=True) for fn in fns]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), f"threads still running after {timeout}s"
    if errors:
        raise errors[0]


# -- 1. one subscription per client ---------------------------------------------------
def test_one_pubsub_connection_serves_every_waiter_of_a_client(
        qname: str, redis_url: str, r: redis.Redis, client: redis.Redis,
        consumer: mtq.Consumer) -> None:
    q = mtq.Queue(qname, client=client, settings=FAST)
    tasks = q.submit_many([{"i": i} for i in range(500)])
    results: dict[str, Any] = {}

    def waiter(ts: list[mtq.Task]) -> Callable[[], None]:
        def body() -> None:
            for t in ts:
                results[t.id] = t.result(timeout=30)
        return body

    threads = threading.Thread(target=run_threads,
                               args=([waiter(tasks[k::5]) for k in range(5)], 40), daemon=True)
    threads.start()
    done = 0
    deadline = time.monotonic() + 30
    while done < 500:
        assert time.monotonic() < deadline, f"only {done} of 500 tasks were claimed"
        batch = consumer.claim(64)
        report = consumer.settle([mtq.Outcome(t, ok=True, value=serialization.loads(t.payload)["i"] * 2)
                                  for t in batch])
        assert report.succeeded == len(batch)
        done += len(batch)
    threads.join(40)
    assert not threads.is_alive(), "the waiters did not all get their results"
    assert results == {t.id: i * 2 for i, t in enumerate(tasks)}

    conns = pubsub_conns(r, name_of(client))
    assert len(conns) == 1, conns
    assert conns[0]["sub"] == "2", conns  # the hub's own channel + this queue's reply channel
    assert q.hub.watching() == 0

    # a second queue on the same client subscribes on the same connection
    q2 = mtq.Queue(qname + "-b", client=client, settings=FAST)
    t2 = q2.submit("x")
    c2 = mtq.Consumer(qname + "-b", redis_url, settings=FAST)
    c2.settle([mtq.Outcome(claim_one(c2), ok=True, value="y")])
    assert t2.result(timeout=5) == "y"
    conns = pubsub_conns(r, name_of(client))
    assert [c["sub"] for c in conns] == ["3"], conns
    assert q.hub is q2.hub and q.hub.watching() == 0


# -- 2. late subscribers ---------------------------------------------------------------
def test_finished_task_returns_stored_result_and_replays_tokens(
        qname: str, client: redis.Redis, consumer: mtq.Consumer) -> None:
    q = mtq.Queue(qname, client=client, settings=FAST)
    t = q.submit({"p": 1})
    c = claim_one(consumer)
    words = [f"w{i}" for i in range(25)]
    report = consumer.settle([mtq.Outcome(c, ok=True, value={"text": " ".join(words)})],
                             chunks=[Chunk(c, i, w) for i, w in enumerate(words)])
    assert (report.succeeded, report.streamed) == (1, 25)
    assert t.status() == "succeeded"
    assert t.result(timeout=5) == {"text": " ".join(words)}
    assert list(t.tokens(timeout=5)) == words
    evs = list(t.events(timeout=5))
    assert kinds(evs) == ["token"] * 25 + ["succeeded"]
    assert [e.index for e in evs[:-1]] == list(range(25))
    assert all(e.ts == 0.0 for e in evs), "replayed events carry ts 0.0"
    assert evs[-1].data == {"text": " ".join(words)} and evs[-1].delivery == 1
    assert [e.kind for e in t.events(timeout=5, tokens=False)] == ["succeeded"]
    assert q.hub.watching() == 0


# -- 3. live event order -----------------------------------------------------------------
def test_live_subscriber_sees_started_tokens_progress_and_result_in_order(
        qname: str, redis_url: str, client: redis.Redis, consumer: mtq.Consumer) -> None:
    q = mtq.Queue(qname, redis_url, settings=FAST)
    watcher = mtq.Queue(qname, client=client, settings=FAST)
    t = q.submit("go")
    reader = follow(watcher, t, lambda h: h.events(timeout=10))
    c = claim_one(consumer)
    consumer.settle([], chunks=[Chunk(c, 0, "a"), Chunk(c, 1, "b")])
    consumer.settle([], chunks=[Chunk(c, -1, {"pct": 50})])
    consumer.settle([], chunks=[Chunk(c, 2, "c")])
    consumer.settle([mtq.Outcome(c, ok=True, value="abc")], chunks=[Chunk(c, 3, "d")])
    evs = reader.join()
    assert kinds(evs) == ["started", "token", "token", "progress", "token", "token", "succeeded"]
    assert evs[0].delivery == 1 and evs[0].task_id == t.id
    toks = [e for e in evs if e.kind == "token"]
    assert [(e.index, e.data) for e in toks] == [(0, "a"), (1, "b"), (2, "c"), (3, "d")]
    assert evs[3].data == {"pct": 50} and evs[3].index is None
    assert evs[-1].data == "abc" and evs[-1].terminal
    assert all(e.ts > 0 for e in evs), "live events carry the server time"
    assert [e.ts for e in evs] == sorted(e.ts for e in evs)


def test_events_published_before_the_stored_state_is_read_do_not_follow_it(
        qname: str, client: redis.Redis, consumer: mtq.Consumer) -> None:
    """events() opens its feed, then reads the stored state. A task that starts and
    streams in between is in both: the replayed tokens come first, and the live
    started event (older than them) must not be handed on after them as if the task
    had started again. The interleaving is made deterministic by doing the work just
    before the real read (the Redis calls are real)."""
    q = mtq.Queue(qname, client=client, settings=FAST)
    t = q.submit("x")
    real_watch = q.broker.watch
    claimed: list[mtq.Claimed] = []

    def watch_after_work(task_id: str, reply: str, tokens_from: int = -1) -> Any:
        if not claimed:
            claimed.append(claim_one(consumer))
            consumer.settle([], chunks=[Chunk(claimed[0], 0, "a"), Chunk(claimed[0], 1, "b")])
        return real_watch(task_id, reply, tokens_from)

    q.broker.watch = watch_after_work  # type: ignore[method-assign]
    reader = Reader(lambda: t.events(timeout=10))
    until(lambda: len(reader.items) >= 2, 5, "the replayed tokens did not arrive",
          lambda: reader.items)
    consumer.settle([mtq.Outcome(claimed[0], ok=True, value="ab")])
    evs = reader.join()
    got = kinds(evs)
    assert [e.data for e in evs if e.kind == "token"] == ["a", "b"]
    assert got[-1] == "succeeded"
    first_token = got.index("token")
    assert not {"queued", "started"} & set(got[first_token:]), \
        f"events from before the replayed tokens were delivered after them: {got}"


# -- 4. emit: dedupe, gaps, fencing ------------------------------------------------------
def test_emit_skips_repeats_refuses_gaps_and_stale_leases(
        qname: str, redis_url: str, r: redis.Redis, client: redis.Redis,
        consumer: mtq.Consumer) -> None:
    q = mtq.Queue(qname, redis_url, settings=FAST)
    watcher = mtq.Queue(qname, client=client, settings=FAST)
    t = q.submit("x")
    reader = follow(watcher, t, lambda h: h.events(timeout=10))
    first = claim_one(consumer)
    b = consumer.broker
    assert b.emit([tok(first, 0, "t0"), tok(first, 1, "t1")]) == [1, 1]
    assert b.emit([tok(first, 1, "again")]) == [0]  # already streamed: skipped
    assert b.emit([tok(first, 3, "gap")]) == [Code.BAD_ARGUMENT]  # index 2 missing
    assert r.lrange(b.keys.out(t.id), 0, -1) == [serialization.dumps("t0"),
                                                 serialization.dumps("t1")]
    # its worker dies; the task is redelivered under a new lease token
    assert consumer.give_back([(first.id, first.token)], [], "worker died") == [1]
    second = claim_one(consumer)
    assert second.id == t.id and second.token != first.token and second.deliveries == 2
    assert b.emit([tok(first, 2, "stale")]) == [Code.LEASE_LOST]
    report = consumer.settle([], chunks=[Chunk(first, 2, "stale")])
    assert (report.stream_lost, report.streamed) == ([t.id], 0)
    # the new delivery regenerates from 0: the indexes already streamed are skipped
    assert b.emit([tok(second, 0, "t0"), tok(second, 1, "t1"), tok(second, 2, "t2")]) == [0, 0, 1]
    consumer.settle([mtq.Outcome(second, ok=True, value="done")])
    evs = reader.join()
    assert kinds(evs) == ["started", "token", "token", "restarted", "started", "token",
                          "succeeded"]
    assert [e.data for e in evs if e.kind == "token"] == ["t0", "t1", "t2"]
    assert (evs[3].delivery, evs[3].data) == (1, "worker died")
    assert evs[4].delivery == 2
    assert list(t.tokens(timeout=5)) == ["t0", "t1", "t2"]


# -- 5. results over the inline limit -----------------------------------------------------
def test_result_larger_than_the_inline_limit_is_read_from_the_task(
        qname: str, r: redis.Redis, client: redis.Redis, consumer: mtq.Consumer) -> None:
    q = mtq.Queue(qname, client=client, settings=FAST)
    big = "x" * 100_000 + "end"
    t = q.submit("big")
    waiter = attach(q.hub, lambda: Reader(lambda: [t.result(timeout=10)]))
    raw = r.pubsub()
    raw.subscribe(q.reply_channel())
    try:
        wait_for(lambda: raw.get_message(timeout=0.1), 5, "no subscribe confirmation")
        c = claim_one(consumer)
        consumer.settle([mtq.Outcome(c, ok=True, value=big)])
        assert waiter.join() == [big]

        def done_message() -> Any:
            msg = raw.get_message(timeout=0.1)
            if msg and msg["type"] == "message":
                kind, _, items = replies.decode_message(msg["data"])
                if kind == "done":
                    return items
            return None

        (tid, ev), = wait_for(done_message, 5, "no done message on the reply channel")
        assert tid == t.id and ev.data is replies.FETCH  # too large to ride in the message
    finally:
        raw.close()
    assert t.result(timeout=5) == big  # late, from the stored state


# -- 6. another client's task ---------------------------------------------------------
def test_waiting_on_a_task_submitted_by_another_client_gets_live_tokens(
        qname: str, redis_url: str, r: redis.Redis, client: redis.Redis,
        consumer: mtq.Consumer) -> None:
    other = redis.Redis.from_url(redis_url, client_name="mtqtest-" + uuid.uuid4().hex[:10])
    try:
        mine = mtq.Queue(qname, client=client, settings=FAST)
        theirs = mtq.Queue(qname, client=other, settings=FAST)
        t = theirs.submit("prompt")
        handle = mine.task(t.id)
        reader = attach(mine.hub, lambda: Reader(lambda: handle.events(timeout=10)))
        wait_for(lambda: snapshot_read(mine, t.id), 5,
                 "watch did not add the waiter's reply channel to the task")
        assert snapshot_read(theirs, t.id)  # the submitter's channel is still there
        submitter = attach(theirs.hub, lambda: Reader(lambda: t.tokens(timeout=10)))
        c = claim_one(consumer)
        for i in range(5):
            consumer.settle([], chunks=[Chunk(c, i, i * i)])
        consumer.settle([mtq.Outcome(c, ok=True, value="fin")])
        evs = reader.join()
        assert kinds(evs) == ["started"] + ["token"] * 5 + ["succeeded"]
        assert [e.data for e in evs[1:6]] == [0, 1, 4, 9, 16]
        assert all(e.ts > 0 for e in evs), "the other client's events arrived live"
        assert submitter.join() == [0, 1, 4, 9, 16]
        assert handle.result(timeout=5) == "fin"
    finally:
        close_hub(other, r)


# -- 7. many waiters, callbacks -------------------------------------------------------
def test_1000_tasks_waited_from_8_threads_and_callbacks_fire_exactly_once(
        qname: str, client: redis.Redis, consumer: mtq.Consumer) -> None:
    q = mtq.Queue(qname, client=client, settings=FAST)
    tasks = q.submit_many([{"i": i, "fail": i % 10 == 3} for i in range(1000)])
    lock = threading.Lock()
    calls: collections.Counter[tuple[str, str]] = collections.Counter()
    seen: dict[str, Any] = {}

    def on_ok(task: mtq.Task, result: Any) -> None:
        with lock:
            calls["ok", task.id] += 1
            seen[task.id] = result

    def on_err(task: mtq.Task, exc: mtq.TaskFailed) -> None:
        with lock:
            calls["err", task.id] += 1
            seen[task.id] = (exc.status, exc.error)

    def raises(task: mtq.Task, value: Any) -> None:
        raise RuntimeError("a buggy callback")

    def register(t: mtq.Task) -> None:
        t.on_success(raises).on_error(raises)  # registered first: must not stop the others
        t.on_success(on_ok).on_error(on_err)

    early, late = tasks[:500], tasks[500:]
    for t in early:
        register(t)
    got: dict[str, Any] = {}

    def waiter(ts: list[mtq.Task]) -> Callable[[], None]:
        def body() -> None:
            for t in ts:
                try:
                    got[t.id] = t.result(timeout=30)
                except mtq.TaskFailed as exc:
                    got[t.id] = exc.status
        return body

    waiting = threading.Thread(target=run_threads,
                               args=([waiter(tasks[k::8]) for k in range(8)], 45), daemon=True)
    waiting.start()
    done = 0
    deadline = time.monotonic() + 30
    while done < 1000:
        assert time.monotonic() < deadline, f"only {done} of 1000 tasks were claimed"
        batch = consumer.claim(100)
        outcomes = []
        for c in batch:
            p = serialization.loads(c.payload)
            outcomes.append(mtq.Outcome(c, ok=False, error="ValueError: odd one", retryable=False)
                            if p["fail"] else mtq.Outcome(c, ok=True, value=p["i"]))
        consumer.settle(outcomes)
        done += len(batch)
    waiting.join(45)
    assert not waiting.is_alive(), "the 8 waiting threads did not finish"
    expected = {t.id: ("failed" if i % 10 == 3 else i) for i, t in enumerate(tasks)}
    assert got == expected

    for t in late:  # the tasks have finished: each callback is called at once
        register(t)
    # a barrier: the callback thread handles items in order, so once the callback of a
    # task completed after every registration has run, every earlier one has run too
    barrier = threading.Event()
    sentinel = q.submit("last").on_success(lambda task, value: barrier.set())
    consumer.settle([mtq.Outcome(claim_one(consumer), ok=True, value=1)])
    assert barrier.wait(20), "the sentinel's callback never ran"
    assert sentinel.result(timeout=1) == 1
    until(lambda: sum(calls.values()) >= 1000, 20, "not all 1000 callbacks ran",
          lambda: sum(calls.values()))
    for i, t in enumerate(tasks):
        which = "err" if i % 10 == 3 else "ok"
        assert calls[which, t.id] == 1, (i, dict(calls))
        assert seen[t.id] == (("failed", "ValueError: odd one") if which == "err" else i)
    assert sum(calls.values()) == 1000
    until(lambda: q.hub.watching() == 0, 10, "feeds left open", q.hub.watching)


def test_callback_registered_on_a_finished_task_fires_once(
        qname: str, client: redis.Redis, consumer: mtq.Consumer) -> None:
    q = mtq.Queue(qname, client=client, settings=FAST)
    ok, bad, gone = q.submit_many(["a", "b", "c"])
    claimed = {c.id: c for c in consumer.claim(3)}
    consumer.settle([mtq.Outcome(claimed[ok.id], ok=True, value="A"),
                     mtq.Outcome(claimed[bad.id], ok=False, error="E: no", retryable=False)])
    consumer.release([claimed[gone.id]])
    assert gone.cancel() is True
    out: list[tuple[str, str, Any]] = []
    fired = threading.Semaphore(0)

    def note(kind: str) -> Callable[[mtq.Task, Any], None]:
        def fn(task: mtq.Task, value: Any) -> None:
            out.append((kind, task.id, value if kind == "ok" else type(value).__name__))
            fired.release()
        return fn

    for t in (ok, bad, gone):
        t.on_success(note("ok")).on_error(note("err"))
    for _ in range(3):
        assert fired.acquire(timeout=10), f"callbacks missing: {out}"
    assert sorted(out) == sorted([("ok", ok.id, "A"), ("err", bad.id, "TaskFailed"),
                                  ("err", gone.id, "TaskCancelled")])


# -- 8. groups ----------------------------------------------------------------------
def test_group_callbacks_counts_results_and_on_done_once(
        qname: str, redis_url: str, client: redis.Redis, consumer: mtq.Consumer) -> None:
    q = mtq.Queue(qname, client=client, settings=FAST)
    other_q = mtq.Queue(qname + "-o", client=client, settings=FAST)
    other_c = mtq.Consumer(qname + "-o", redis_url, settings=FAST)
    lock = threading.Lock()
    oks: list[tuple[str, Any]] = []
    errs: list[tuple[str, str]] = []
    dones: list[mtq.Group] = []
    g = q.group()
    g.on_success(lambda t, v: oks.append((t.id, v)))
    g.on_error(lambda t, e: errs.append((t.id, e.status)))
    g.on_done(dones.append)
    tasks = g.submit_many([{"i": i} for i in range(10)])
    foreign = other_q.submit({"i": 10})
    g.add(foreign)
    assert len(g) == 11 and g.tasks == [*tasks, foreign]
    assert g.counts() == {"succeeded": 0, "failed": 0, "pending": 11}

    outcomes = []
    for c in consumer.claim(10):
        i = serialization.loads(c.payload)["i"]
        outcomes.append(mtq.Outcome(c, ok=i % 4 != 1, value=i * 10, error="E: bad",
                                    retryable=False))
    consumer.settle(outcomes)
    other_c.settle([mtq.Outcome(claim_one(other_c), ok=True, value=100)])
    until(lambda: g.counts()["pending"] == 0, 10, "group still pending", g.counts)
    with lock:
        assert dones == [], "on_done fired before the group was closed"
    assert g.counts() == {"succeeded": 8, "failed": 3, "pending": 0}
    g.close()
    assert dones == [g]
    assert g.wait(5) is True
    g.close()
    assert dones == [g], "on_done fired twice"
    results = g.results(timeout=5)
    for i, value in enumerate(results):
        if i % 4 == 1 and i < 10:
            assert isinstance(value, mtq.TaskFailed) and value.status == "failed"
        else:
            assert value == i * 10
    ids = {t.id: i for i, t in enumerate(g.tasks)}
    assert sorted(ids[tid] for tid, _ in oks) == [i for i in range(11) if i % 4 != 1 or i == 10]
    assert sorted(ids[tid] for tid, _ in errs) == [1, 5, 9]
    # callbacks registered now are called at once for the outcomes so far
    late: list[str] = []
    g.on_error(lambda t, e: late.append(t.id))
    assert sorted(late) == sorted(t.id for t in (tasks[1], tasks[5], tasks[9]))
    g.on_done(lambda grp: late.append("done"))
    assert late[-1] == "done"
    with pytest.raises(RuntimeError):
        g.add(other_q.submit({"i": 11}))


def test_group_wait_times_out_while_a_task_never_finishes(
        qname: str, client: redis.Redis, consumer: mtq.Consumer) -> None:
    q = mtq.Queue(qname, client=client, settings=FAST)
    dones: list[mtq.Group] = []
    with q.group() as g:
        g.on_done(dones.append)
        a, _b = g.submit_many(["a", "b"])
    c = claim_one(consumer)
    assert c.id == a.id
    consumer.settle([mtq.Outcome(c, ok=True, value=1)])
    wait_for(lambda: g.counts()["succeeded"] == 1, 5, "the first task's outcome did not arrive")
    assert g.wait(0.3) is False
    with pytest.raises(mtq.ResultTimeout):
        g.results(timeout=0.2)
    assert dones == [] and g.counts() == {"succeeded": 1, "failed": 0, "pending": 1}


def test_a_group_callback_that_raises_does_not_stop_the_others_or_on_done(
        qname: str, client: redis.Redis, consumer: mtq.Consumer) -> None:
    q = mtq.Queue(qname, client=client, settings=FAST)
    seen: list[Any] = []
    dones: list[mtq.Group] = []
    g = q.group()

    def buggy(task: mtq.Task, value: Any) -> None:
        raise RuntimeError("a buggy group callback")

    g.on_success(buggy)
    g.on_success(lambda t, v: seen.append(v))
    g.on_done(dones.append)
    g.submit_many([1, 2, 3])
    g.close()  # no more tasks: on_done is due when the last one ends
    consumer.settle([mtq.Outcome(c, ok=True, value=serialization.loads(c.payload))
                     for c in consumer.claim(3)])
    until(lambda: g.counts()["pending"] == 0, 10, "the outcomes did not arrive", g.counts)
    assert sorted(seen) == [1, 2, 3], "a raising group callback kept the next one from running"
    # not g.wait(): it closes the group again, which would fire on_done by itself
    until(lambda: dones == [g], 2, "on_done never fired after the last task ended",
          lambda: (dones, g.counts()))


class ClosingFeed(replies.Feed):
    """A feed whose reader ends on the task's terminal event and closes its feed at once,
    before the hub's dispatch has moved on to the next feed of the task. A real reader
    (a result() waiting in another thread, an asyncio reader) does this whenever it
    wins the race for the GIL; here it happens every time."""

    __slots__ = ("got", "hub")

    def __init__(self, key: tuple[str, str], hub: replies.Hub) -> None:
        super().__init__(key)
        self.hub = hub
        self.got: list[Any] = []

    def push(self, item: mtq.Event | str) -> None:
        self.got.append(item)
        if isinstance(item, mtq.Event) and item.terminal:
            self.hub.close(self)


def test_a_reader_closing_its_feed_during_a_dispatch_does_not_hide_the_event_from_others(
        qname: str, redis_url: str, client: redis.Redis, consumer: mtq.Consumer) -> None:
    """Several readers of one task: the one that ends first must not make the hub skip
    the next one. A done callback is the victim here: it has no periodic re-read, so a
    skipped completion means it never fires."""
    submitter = mtq.Queue(qname, redis_url, settings=FAST)
    q = mtq.Queue(qname, client=client, settings=FAST)
    t = q.task(submitter.submit("x").id)
    first = ClosingFeed((qname, t.id), q.hub)
    q.hub.open(first)
    fired: list[Any] = []
    t.on_success(lambda task, v: fired.append(v))  # its feed opens second
    # its first read of the stored state is done (the task is still queued): from now
    # on only the live completion can fire it
    wait_for(lambda: snapshot_read(q, t.id), 5, "the callback's read did not happen")
    consumer.settle([mtq.Outcome(claim_one(consumer), ok=True, value="done")])
    until(lambda: any(isinstance(e, mtq.Event) and e.terminal for e in first.got), 5,
          "the first feed did not get the completion", lambda: first.got)
    until(lambda: fired == ["done"], 3, "the done callback never fired",
          lambda: (fired, q.hub.watching()))


def test_a_finished_group_leaves_no_feed_open(
        qname: str, client: redis.Redis, consumer: mtq.Consumer) -> None:
    q = mtq.Queue(qname, client=client, settings=FAST)
    with q.group() as g:
        g.on_success(lambda t, v: None)
        g.submit_many(range(5))
    consumer.settle([mtq.Outcome(c, ok=True, value=1) for c in consumer.claim(5)])
    assert g.wait(5), g.counts()
    until(lambda: q.hub.watching() == 0, 3, "the group's tasks still have feeds open",
          q.hub.watching)


# -- 9. asyncio -------------------------------------------------------------------------
def test_asyncio_aevents_atokens_aresult(qname: str, redis_url: str, client: redis.Redis,
                                         consumer: mtq.Consumer) -> None:
    q = mtq.Queue(qname, client=client, settings=FAST)
    submitter = mtq.Queue(qname, redis_url, settings=FAST)

    async def collect(it: Any) -> list[Any]:
        return [x async for x in it]

    async def live(reading: Callable[[mtq.Task], Any]) -> tuple[mtq.Task, asyncio.Task[Any]]:
        """Submit a task (from another client: see follow()), start ``reading`` it, wait
        until the reader has read the stored state, then run it: 4 tokens, result R.
        One reader per task (see the test of a feed that closes during a dispatch)."""
        t = q.task(submitter.submit("a").id)
        reader = asyncio.create_task(reading(t))
        await asyncio.to_thread(wait_for, lambda: snapshot_read(q, t.id), 10,
                                "the async reader did not read the stored state")
        c = await asyncio.to_thread(claim_one, consumer)
        for i in range(4):
            await asyncio.to_thread(consumer.settle, [], [Chunk(c, i, f"t{i}")])
        await asyncio.to_thread(consumer.settle, [mtq.Outcome(c, ok=True, value="R")])
        return t, reader

    async def main() -> None:
        t, reader = await live(lambda t: collect(t.aevents(timeout=10)))
        evs = await asyncio.wait_for(reader, 10)
        assert kinds(evs) == ["started"] + ["token"] * 4 + ["succeeded"]
        assert all(e.ts > 0 for e in evs), "the async reader got live events"
        _, tokens = await live(lambda t: collect(t.atokens(timeout=10)))
        assert await asyncio.wait_for(tokens, 10) == ["t0", "t1", "t2", "t3"]
        _, result = await live(lambda t: t.aresult(timeout=10))
        assert await asyncio.wait_for(result, 10) == "R"
        # late: replayed from the stored state
        assert await t.aresult(timeout=5) == "R"
        assert await collect(t.atokens(timeout=5)) == ["t0", "t1", "t2", "t3"]
        # failures and timeouts
        f = q.submit("f")
        c = await asyncio.to_thread(claim_one, consumer)
        await asyncio.to_thread(consumer.settle, [mtq.Outcome(c, ok=False, error="E: x",
                                                              retryable=False)], [Chunk(c, 0, 1)])
        got: list[Any] = []
        with pytest.raises(mtq.TaskFailed):
            async for x in f.atokens(timeout=5):
                got.append(x)
        assert got == [1]
        idle = q.submit("nobody runs me")
        with pytest.raises(mtq.ResultTimeout):
            await idle.aresult(timeout=0.2)

    asyncio.run(main())
    assert q.hub.watching() == 0


# -- 10. connection drops ---------------------------------------------------------------
def test_killed_pubsub_connection_resyncs_and_loses_no_token(
        qname: str, r: redis.Redis, client: redis.Redis, consumer: mtq.Consumer) -> None:
    q = mtq.Queue(qname, client=client, settings=FAST)
    t = q.submit("long")
    reader = attach(q.hub, lambda: Reader(lambda: t.tokens(timeout=20)))
    c = claim_one(consumer)
    consumer.settle([], chunks=[Chunk(c, i, i) for i in range(5)])
    until(lambda: len(reader.items) == 5, 5, "the first 5 tokens did not arrive",
          lambda: reader.items)
    resyncs = q.hub.resyncs
    (conn,) = pubsub_conns(r, name_of(client))
    channel = q.reply_channel()
    # kill the hub's connection and stream 5 tokens in one transaction: they are
    # published while nobody is subscribed, whatever the hub does to reconnect
    emit = consumer.broker.emit_call([tok(c, i, i) for i in range(5, 10)])
    pipe = r.pipeline(transaction=True)
    pipe.client_kill_filter(_id=conn["id"])
    pipe.evalsha(emit.script.sha, len(emit.keys), *emit.keys, *emit.args)
    pipe.pubsub_numsub(channel)
    killed, codes, numsub = pipe.execute()
    assert (killed, codes, numsub) == (1, [1] * 5, [(channel.encode(), 0)])
    wait_for(lambda: q.hub.resyncs > resyncs, 10, "the hub did not subscribe again")
    consumer.settle([], chunks=[Chunk(c, i, i) for i in range(10, 15)])
    consumer.settle([mtq.Outcome(c, ok=True, value="ok")], chunks=[Chunk(c, 15, 15)])
    assert reader.join(20) == list(range(16))
    assert len(pubsub_conns(r, name_of(client))) == 1


def test_redis_restart_mid_stream_the_reader_still_completes(
        qname: str, tmp_path: Path) -> None:
    server = RedisServer(tmp_path, appendonly=True)
    server.start()
    own = redis.Redis.from_url(server.url, client_name="mtqtest-" + uuid.uuid4().hex[:10])
    admin = redis.Redis.from_url(server.url)
    try:
        q = mtq.Queue(qname, client=own, settings=FAST)
        consumer = mtq.Consumer(qname, client=redis.Redis.from_url(server.url), settings=FAST)
        t = q.submit("long")
        reader = attach(q.hub, lambda: Reader(lambda: t.tokens(timeout=40)))
        c = claim_one(consumer)
        consumer.settle([], chunks=[Chunk(c, i, f"t{i}") for i in range(5)])
        until(lambda: len(reader.items) == 5, 5, "the first tokens did not arrive",
              lambda: reader.items)
        resyncs = q.hub.resyncs

        server.stop()
        server.start()  # same port and directory: the AOF brings the task back

        def emit(chunks: list[Chunk]) -> bool:  # emit is idempotent by index: safe to repeat
            try:
                consumer.settle([], chunks=chunks)
                return True
            except mtq.BrokerError:
                return False

        wait_for(lambda: emit([Chunk(c, i, f"t{i}") for i in range(5, 10)]), 20,
                 "could not stream after the restart")
        wait_for(lambda: q.hub.resyncs > resyncs, 20, "the hub did not subscribe again")
        consumer.settle([mtq.Outcome(c, ok=True, value="done")],
                        chunks=[Chunk(c, i, f"t{i}") for i in range(10, 12)])
        assert reader.join(30) == [f"t{i}" for i in range(12)]
        assert t.result(timeout=5) == "done"
    finally:
        close_hub(own, admin)
        admin.close()
        server.stop()


# -- 11. errors ---------------------------------------------------------------------------
def test_timeouts_unknown_ids_failures_and_cancels(
        qname: str, client: redis.Redis, consumer: mtq.Consumer) -> None:
    q = mtq.Queue(qname, client=client, settings=FAST)
    idle = q.submit("nobody runs me")
    t0 = time.monotonic()
    with pytest.raises(mtq.ResultTimeout) as timeout:
        idle.result(timeout=0.2)
    assert 0.2 <= time.monotonic() - t0 < 3
    assert (timeout.value.task_id, timeout.value.status) == (idle.id, "queued")
    assert isinstance(timeout.value, TimeoutError)
    with pytest.raises(mtq.TaskNotFound):
        q.task("no-such-task-id").result(timeout=1)
    with pytest.raises(mtq.TaskNotFound):
        list(q.task("no-such-task-id").tokens(timeout=1))

    consumer.settle([], chunks=[])  # nothing: no round trip, no error
    c = claim_one(consumer)
    assert c.id == idle.id
    consumer.settle([mtq.Outcome(c, ok=False, error="ValueError: broke", retryable=False)],
                    chunks=[Chunk(c, 0, "x"), Chunk(c, 1, "y")])
    got: list[Any] = []
    with pytest.raises(mtq.TaskFailed) as failed:
        for x in idle.tokens(timeout=5):
            got.append(x)
    assert got == ["x", "y"]
    assert not isinstance(failed.value, mtq.TaskCancelled)
    assert (failed.value.status, failed.value.error) == ("failed", "ValueError: broke")

    gone = q.submit("cancel me")
    assert gone.cancel() is True
    with pytest.raises(mtq.TaskCancelled):
        list(gone.tokens(timeout=5))
    with pytest.raises(mtq.TaskCancelled):
        gone.result(timeout=5)
    assert q.hub.watching() == 0
