"""Dropped connections: every client connection is killed (``CLIENT KILL TYPE normal``
and ``TYPE pubsub``) again and again while producers submit, workers serve and
readers follow tokens and wait on results. Nothing may stall for long, no reader
may die, no submit may fail or be duplicated, and nothing may come back only
through lease expiry."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import redis

import mtq
from mtq.broker.protocol import read_traces
from mtq.workers.registry import list_workers
from tests.support.waits import Reader, wait_for

PY = sys.executable


class Killer:
    """Kills every normal and pub/sub client connection every ``every_s`` seconds, from
    a connection of its own (CLIENT KILL skips the caller's)."""

    def __init__(self, url: str, every_s: float) -> None:
        self.client = redis.Redis.from_url(url)
        self.every_s = every_s
        self.stop = threading.Event()
        self.rounds = 0
        self.killed = 0
        self.thread = threading.Thread(target=self._run, name="test-killer", daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(self.every_s):  # the fault's period, not a wait for work
            for kind in ("normal", "pubsub"):
                self.killed += int(self.client.execute_command("CLIENT", "KILL", "TYPE", kind))
            self.rounds += 1

    def __enter__(self) -> Killer:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join(5)
        self.client.close()


def _starts(r: redis.Redis, queue: str, ids: list[str]) -> list[tuple[float, str]]:
    """(time s, detail) of every 'started' and 'restarted' step of these tasks."""
    out = []
    for k in range(0, len(ids), 500):
        for steps in read_traces(r, queue, ids[k:k + 500]):
            for step in steps:
                ms, kind, detail = step.decode().split("|", 2)
                if kind in ("started", "restarted"):
                    out.append((int(ms) / 1000, f"{kind} {detail}"))
    return sorted(out)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_workers_producers_and_readers_ride_through_client_kills(
        qname: str, redis_url: str, r: redis.Redis, subprocess_env: dict[str, str],
        tmp_path: Path) -> None:
    procs = []
    for n in range(2):
        log = open(tmp_path / f"worker-{n}.log", "wb")  # closed in the finally below
        procs.append((subprocess.Popen(
            [PY, "-m", "mtq", "worker", "run", "tests.models:Counter", "--queue", qname,
             "--redis", redis_url], env=subprocess_env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True), log))
    try:
        wait_for(lambda: len(list_workers(r, qname)) == 2, 30, "two workers did not start")
        q = mtq.Queue(qname, redis_url)
        per_producer, producers = 1000, 3
        submitted: list[list[mtq.Task]] = [[] for _ in range(producers)]
        errors: list[BaseException] = []

        def produce(k: int) -> None:
            try:
                for i in range(per_producer):
                    start = (k * per_producer + i) * 10
                    submitted[k].append(q.submit({"n": 5, "start": start, "step_ms": 2},
                                                 stream=f"p{k}-{i % 20}"))
            except BaseException as exc:
                errors.append(exc)

        # every 0.15 s: this workload takes 2-3 s here, and the test wants 8 rounds at least
        with Killer(redis_url, 0.15) as killer:
            threads = [threading.Thread(target=produce, args=(k,)) for k in range(producers)]
            for t in threads:
                t.start()
            # followers read tokens and waiters results while the kills go on
            wait_for(lambda: all(len(s) >= 100 for s in submitted), 60,
                     f"producers stalled: {[len(s) for s in submitted]} {errors}")
            followed = [s[j] for s in submitted for j in range(0, 100, 10)]
            readers = [Reader(lambda t=t: t.tokens(timeout=60)) for t in followed]
            for t in threads:
                t.join(120)
            assert not errors, f"a submit failed: {errors[0]!r}"
            tasks = [t for s in submitted for t in s]
            results = [t.result(timeout=60) for t in tasks]
            got = [rd.join(60) for rd in readers]
            rounds = killer.rounds
        assert rounds >= 8, f"only {rounds} rounds of kills happened"
        n = producers * per_producer
        assert len({t.id for t in tasks}) == n
        stats = q.stats()
        assert stats["submitted"] == n, f"a retried submit duplicated tasks: {stats}"
        assert (stats["succeeded"], stats["waiting"], stats["running"]) == (n, 0, 0), stats
        for res in results:
            assert res["tokens"] == list(range(res["tokens"][0], res["tokens"][0] + 5)), res
        for t, tokens in zip(followed, got):
            first = tokens[0]
            assert tokens == list(range(first, first + 5)), (t, tokens)
        steps = _starts(r, qname, [t.id for t in tasks])
        expired = [s for s in steps if "lease expired" in s[1]]
        assert not expired, f"tasks came back only through lease expiry: {expired[:5]}"
        gaps = [b[0] - a[0] for a, b in itertools.pairwise(steps)]
        print(f"figures: {rounds} kill rounds, {killer.killed} connections killed, "
              f"{n} submits, longest gap between task starts {max(gaps):.3f} s")
        assert max(gaps) <= 2.0, f"workers stalled {max(gaps):.2f} s after a connection kill"
    finally:
        for p, log in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(10)
            log.close()


# -- the pieces, one by one -------------------------------------------------------------------
def test_a_retried_submit_recognises_what_its_lost_try_wrote(qname: str,
                                                             redis_url: str) -> None:
    """The first try of a submit ran but its reply was lost; the retry finds the tasks
    already there. Those this client wrote count as submitted (ids it generated, or
    given ids whose stored reply channel is its own); a task another client wrote
    under a given id stays a duplicate."""
    from mtq.client.submit import written

    q = mtq.Queue(qname, redis_url)
    reply = q.reply_channel()
    other = mtq.Queue(qname, redis_url, client=redis.Redis.from_url(redis_url))
    other.submit({"x": 0}, id="taken-by-other")
    chunk = q.prepare([{"x": 1}, mtq.Request({"x": 2}, id="given-1"),
                       mtq.Request({"x": 3}, key="idem-1"),
                       mtq.Request({"x": 4}, id="taken-by-other")])
    first = q.broker.submit(chunk, reply)          # the try whose reply was lost
    assert first[3] == mtq.broker.protocol.Code.DUPLICATE_ID
    retry = q.broker.submit(chunk, reply)          # the retry sees duplicates
    assert retry[:2] == [mtq.broker.protocol.Code.DUPLICATE_ID] * 2
    assert written(q, chunk, retry, reply) == [chunk[0].id, "given-1", chunk[2].id,
                                               mtq.broker.protocol.Code.DUPLICATE_ID]
    assert q.stats()["submitted"] == 4  # three of this client's, one of the other's
    # the same given id again, from this client, with another payload: a real duplicate
    again = q.prepare([mtq.Request({"x": 99}, id="given-1")])
    answer = q.broker.submit(again, reply)
    assert written(q, again, answer, reply) == [mtq.broker.protocol.Code.DUPLICATE_ID]


def test_a_retried_submit_that_finds_the_queue_full_of_itself_succeeds(
        qname: str, redis_url: str) -> None:
    from mtq.client.submit import written

    q = mtq.Queue(qname, redis_url, max_length=2)
    reply = q.reply_channel()
    chunk = q.prepare([{"x": 1}, {"x": 2}])
    assert q.broker.submit(chunk, reply) == [chunk[0].id, chunk[1].id]  # the lost try
    retry = q.broker.submit(chunk, reply)
    assert retry[0] == mtq.broker.protocol.Code.QUEUE_FULL
    assert written(q, chunk, retry, reply) == [chunk[0].id, chunk[1].id]
    fresh = q.prepare([{"x": 3}])
    really_full = q.broker.submit(fresh, reply)
    assert written(q, fresh, really_full, reply) == really_full, "really full stays full"


def test_a_worker_gives_back_a_claim_whose_reply_it_lost(qname: str, redis_url: str) -> None:
    from mtq.workers.model import FunctionModel
    from mtq.workers.worker import Worker

    q = mtq.Queue(qname, redis_url)
    q.submit_many([mtq.Request({"i": i}, stream=f"s{i}") for i in range(3)])
    w = Worker(FunctionModel(lambda p: p), qname, url=redis_url)
    (kept,) = w.consumer.claim(1)      # held: the fetcher recorded it
    w.ledger.held[kept.id] = kept
    lost = w.consumer.claim(2)         # ran in Redis, but the reply never arrived
    w.fetcher.release_unknown()
    assert q.task(kept.id).status() == "running"
    assert [q.task(t.id).info().status for t in lost] == ["queued", "queued"]
    assert [q.task(t.id).info().deliveries for t in lost] == [0, 0], "given back uncounted"


def test_calls_sent_once_are_not_repeated_by_the_connection(redis_url: str) -> None:
    """Inside single_attempt a killed connection raises at once; outside, redis-py
    reconnects and sends the command again."""
    from mtq.broker.connection import connect, single_attempt

    client = connect(redis_url, name="mtq-test-once")
    killer = redis.Redis.from_url(redis_url)
    try:
        assert client.ping()
        killer.execute_command("CLIENT", "KILL", "SKIPME", "yes", "TYPE", "normal")
        assert client.ping(), "a dropped connection is re-opened and the command re-sent"
        blocked = threading.Thread(target=lambda: killer.execute_command(
            "CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes") if wait_for(
            lambda: int(killer.info("clients")["blocked_clients"]) >= 1, 10,
            "the BLPOP did not block") else None)
        blocked.start()
        with pytest.raises(redis.exceptions.ConnectionError), single_attempt():
            client.blpop(["mtq-test-once-list"], timeout=10)
        blocked.join(10)
    finally:
        killer.close()


def test_a_failed_claims_sweep_leaves_the_suspects_handed_to_quarantine(
        qname: str, redis_url: str) -> None:
    """A suspect this worker claimed and handed to its supervisor still runs under its id
    in Redis (in the quarantine process): the sweep after a lost claim reply must not give
    it back, or it would run twice at once."""
    from mtq.broker.consumer import Consumer
    from mtq.workers.model import FunctionModel
    from mtq.workers.worker import Monitor, Worker

    class Handing(Monitor):
        def __init__(self) -> None:
            self.handed: list[str] = []

        def quarantine(self, task: mtq.Claimed) -> bool:
            self.handed.append(task.id)
            return True

    q = mtq.Queue(qname, redis_url)
    (suspect,) = q.submit_many([mtq.Request({"i": 0}, stream="s")])
    died = Consumer(qname, redis_url)
    (first,) = died.claim(1)
    died.give_back([(first.id, first.token)], [], "its process died")  # delivery counted
    monitor = Handing()
    w = Worker(FunctionModel(lambda p: p), qname, url=redis_url, monitor=monitor)
    (again,) = w.consumer.claim(1)
    assert again.suspect
    # what the fetcher does with a claimed suspect under a supervisor
    monitor.quarantine(again)
    w.ledger.handed.add((again.id, again.token))
    w.fetcher.release_unknown()
    assert q.task(suspect.id).status() == "running", "the handed-off suspect was given back"
    assert monitor.handed == [suspect.id]
