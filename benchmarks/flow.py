#!/usr/bin/env python
"""Time and flow: one section per measured figure.

    python -m benchmarks.flow                  # every section, writes the flow block
    python -m benchmarks.flow --only delay     # how late a delayed task starts
    python -m benchmarks.flow --only schedule  # schedule occurrences: on time, once
    python -m benchmarks.flow --only chain     # the hand-off time between chain steps
    python -m benchmarks.flow --quick          # smaller sizes, prints only

Each section is a function ``measure_<name>(quick) -> dict`` that returns its rows
(``rows``: (measurement, figure, unit, note)) and targets (``targets``: (what, met,
detail, comparable)); :func:`main` runs the sections asked for and writes their rows
into the ``bench:flow`` block of docs/benchmarks.md.

delay: how late a task submitted with ``delay=`` starts after its due time. One bare
``mtq worker run benchmarks.children.nap:nap`` (a plain function, one task at a time);
N tasks (``{"s": 0}``, a no-op) submitted at once with delays spread evenly over
0.1-2 s, each task's lateness its ``started`` minus (``created`` + its delay), both
Redis server time, so no clock of a client enters it. Idle: the worker has nothing
else to do, and sleeps in its claim wait (BLPOP) until the first task is due (the
submit woke it to read the new timer). Busy: the worker runs a backlog of 20 ms tasks
on one stream throughout; a due task is queued at the tail of the stream-less list and
starts at the worker's next claim, after the running task. Idle again with the server at
``hz 100``: a blocked client's timeout is checked at each of Redis's timer ticks
(``hz``, 10 by default: every 100 ms), which bounds the idle worker's lateness.

schedule: two ``mtq schedule run --lease-ms 1000`` processes and a per-second schedule
(``* * * * * *``, catch-up ``all``) on an idle queue (no worker: each occurrence's task
stays queued, so its ``created`` is the submit's server time). Each occurrence's
lateness is its task's ``created`` minus the occurrence time. Halfway, the leader (the
process whose token holds the lease) is SIGKILLed; the other takes the lease when it
lapses (at most 1 s) and catches up. Exactly once: the occurrences from the first to
the last each have one task (ids are per occurrence, so a second submit is refused;
the schedulers' logs are searched for none lost).

autoscale: ``mtq workers start benchmarks.children.nap:nap --autoscale 0:4,drain=1,
cooldown=2`` (docs/autoscaling.md). The first task's wait from zero processes: a no-op
submitted to the supervisor at zero, its submit to its start (its ``created`` and
``started``, Redis server time), and the supervisor's own figure (``cold_start_ms``: its wake to the first claim), over a few
rounds, each after it went back to zero. Then the time to add capacity under a step
of load: 400 tasks of 20 ms submitted at once at zero, the time until 1, 2 and 4
processes are serving (registered), and how many scale changes the run logged.

chain: three bare ``mtq worker run benchmarks.children.nap:nap`` processes, one per
queue, and N three-step chains of no-op tasks (``{"s": 0}``, each step's payload that
dict with the previous result under ``i``), one chain at a time (each waited for
through ``Chain.result``). A hand-off's time is the next step's ``started`` minus the
previous step's ``finished`` (its ack), both Redis server time (ms): the worker's read
of the chain spec, its submit of the next step to the next queue (where a worker sleeps
registered for direct delivery, or is woken), the record's removal, and the next
worker's start. Split into ack to the next step's ``created`` (the hand-off's submit)
and ``created`` to ``started`` (the next queue). The baseline, measured in the same run
on the same workers: a plain ``submit`` of one no-op to its ``started``, one at a time.
Then what a stream's order across queues costs: N two-step chains on one stream,
submitted at once, each one's function start minus the end of the one before it on the
first queue (the stream is held until the hand-off went in), against N plain tasks on
one stream (released at the ack).

A run of only some sections prints its figures and writes the block only with
``--docs`` (the block holds every section).
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import redis

import mtq
from benchmarks.harness.procs import Proc, wait_for, worker_env
from benchmarks.harness.sections import run_sections
from benchmarks.harness.server import Server, uniq
from mtq.broker.keys import QueueKeys
from mtq.workers.registry import list_workers

NAP = "benchmarks.children.nap:nap"
#: the delays measured, seconds: spread evenly over this range
DELAY_RANGE = (0.1, 2.0)
#: lateness a delayed task may have on an idle worker (target): Redis's timer
#: resolution (hz 10: a blocked client's timeout is checked every 100 ms) and a claim
LATE_P99_MS = 150.0


def _pct(xs: Sequence[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


def _running(q: mtq.Queue) -> bool:
    return q.stats()["running"] > 0


def _lateness(q: mtq.Queue, n: int) -> list[float]:
    """Submit n no-op tasks with delays spread over DELAY_RANGE; wait for them; their
    lateness in ms (server time)."""
    lo, hi = DELAY_RANGE
    delays = [lo + (hi - lo) * i / max(1, n - 1) for i in range(n)]
    tasks = q.submit_many([mtq.Request({"s": 0}, delay=d) for d in delays])
    out = []
    for t, d in zip(tasks, delays):
        t.result(timeout=hi + 60)
        info = t.info()
        assert info.created is not None and info.started is not None
        out.append(info.started - (info.created + d * 1000))
    return out


def measure_delay(quick: bool = False) -> dict[str, Any]:
    n = 20 if quick else 100
    rows: list[tuple[str, float | None, str, str]] = []
    targets: list[tuple[str, bool | None, str, bool]] = []
    figures: dict[str, list[float]] = {}
    for mode in ("idle", "busy", "idle, hz 100"):
        server = Server(args=("--hz", "100") if "hz" in mode else ())
        server.start()
        r = redis.Redis.from_url(server.url)
        try:
            name = uniq("delay")
            p = Proc(["worker", "run", NAP, "--queue", name, "--redis", server.url],
                     worker_env(server.url))
            try:
                wait_for(f"a worker of {NAP}", partial(list_workers, r, name), 120, [p])
                q = mtq.Queue(name, client=r)
                q.submit({"s": 0}).result(timeout=30)  # warm: imported, claiming
                backlog: list[mtq.Task] = []
                if mode == "busy":  # 20 ms tasks on one stream, outlasting the delays
                    count = int((DELAY_RANGE[1] + 2) / 0.02)
                    backlog = q.submit_many([{"s": 0.02}] * count, stream="bg")
                    wait_for("the backlog running", partial(_running, q), 30, [p])
                late = _lateness(q, n)
                if backlog and backlog[-1].status() not in ("queued", "running"):
                    raise SystemExit("the backlog ran out before the delayed tasks: "
                                     "lengthen it")
            finally:
                p.stop()
                p.close()
            figures[mode] = late
            what = {"idle": "idle worker (asleep in its claim wait)",
                    "busy": "busy worker (a backlog of 20 ms tasks on another stream)",
                    "idle, hz 100": "idle worker, redis-server --hz 100"}[mode]
            note = (f"p99 {_pct(late, 99):.0f} ms, max {max(late):.0f} ms, min "
                    f"{min(late):.0f} ms; {n} tasks, delays {DELAY_RANGE[0]}-"
                    f"{DELAY_RANGE[1]} s")
            rows.append((f"delayed task's start past its due time, {what}: p50",
                         statistics.median(late), "ms", note))
            rows.append((f"delayed task's start past its due time, {what}: p99",
                         _pct(late, 99), "ms", ""))
            if mode == "idle":
                targets.append((f"p99 lateness on an idle worker under {LATE_P99_MS:.0f} ms",
                                _pct(late, 99) < LATE_P99_MS,
                                f"p99 {_pct(late, 99):.0f} ms", not quick))
            if min(late) < 0:
                targets.append(("no delayed task starts before its due time", False,
                                f"one started {-min(late):.0f} ms early", True))
        finally:
            mtq.replies.hub_of(r).close_all()
            r.close()
            server.stop()
    return {"rows": rows, "targets": targets, "figures": figures}


def _occurrences(r: redis.Redis, queue: str) -> dict[int, float]:
    """occurrence second -> its task's created (server ms)."""
    from mtq.broker.keys import QueueKeys

    prefix = QueueKeys(queue).task_prefix
    out = {}
    for k in r.scan_iter(prefix + "s-beat-*", count=1000):
        created = r.hget(k, "created")
        out[int(str(k, "utf-8").rsplit("-", 1)[1])] = float(created or 0)
    return out


def _lease(r: redis.Redis) -> str:
    """The token holding the schedulers' lease ('' when none)."""
    from mtq.client import schedules as sch

    raw: Any = r.get(sch.LEASE)
    return raw.decode() if isinstance(raw, bytes) else (raw or "")


def measure_schedule(quick: bool = False) -> dict[str, Any]:
    from mtq.client import schedules as sch

    span = 8 if quick else 30
    server = Server()
    server.start()
    r = redis.Redis.from_url(server.url)
    procs: list[Proc] = []
    try:
        name = uniq("sched")
        sch.add(r, "beat", name, "* * * * * *", {"s": 0}, catch_up="all")
        procs = [Proc(["schedule", "run", "--lease-ms", "1000", "--redis", server.url],
                      worker_env(server.url)) for _ in range(2)]
        wait_for("a scheduler submitting", lambda: len(_occurrences(r, name)) >= 2, 60,
                 procs)
        time.sleep(span / 2)  # the run's first half: a wall-clock span is what is measured
        time.sleep(1.9 - time.time() % 1)  # kill 0.1 s before an occurrence: the worst case
        token = _lease(r)
        leader = next(p for p in procs if token and token in p.output())
        leader.kill()
        killed = time.time()
        wait_for("the takeover", lambda: _lease(r) not in
                 ("", token), 30, [p for p in procs if p is not leader])
        took = time.time() - killed
        time.sleep(span / 2)
        for p in procs:
            if p is not leader:
                p.stop()
        got = _occurrences(r, name)
    finally:
        for p in procs:
            p.kill()
            p.close()
        mtq.replies.hub_of(r).close_all()
        r.close()
        server.stop()
    secs = sorted(got)
    expected = list(range(secs[0], secs[-1] + 1))
    missing = sorted(set(expected) - set(got))
    late = [got[t] - t * 1000 for t in secs]
    steady = [got[t] - t * 1000 for t in secs if not killed - 1 <= t <= killed + 2.5]
    takeover = [got[t] - t * 1000 for t in secs if killed - 1 <= t <= killed + 2.5]
    first = min(t for t in secs if t > killed)
    rows: list[tuple[str, float | None, str, str]] = [
        ("occurrence to its submit, steady leader: p50", statistics.median(steady), "ms",
         f"p99 {_pct(steady, 99):.0f} ms, max {max(steady):.0f} ms; {len(steady)} "
         "occurrences"),
        ("occurrence to its submit, steady leader: p99", _pct(steady, 99), "ms", ""),
        ("occurrence to its submit, the first after the leader's SIGKILL",
         got[first] - first * 1000, "ms",
         f"killed 0.1 s before it; the lease (1000 ms) taken over {took * 1000:.0f} ms "
         f"after the kill; max {max(takeover):.0f} ms over the {len(takeover)} "
         "occurrences from 1 s before the kill to 2.5 s after"),
        ("occurrences, first to last", len(expected), "",
         f"submitted {len(got)}, lost {len(missing)}, doubled 0 (one task id each)"),
    ]
    targets = [("every occurrence submitted exactly once across a leader kill",
                not missing and len(got) == len(expected),
                f"{len(got)} of {len(expected)}; lost {missing[:5]}", True)]
    return {"rows": rows, "targets": targets, "figures": {"late": late}}
def _serving(r: redis.Redis, name: str) -> int:
    return sum(w.get("role", "serving") == "serving" for w in list_workers(r, name))


def measure_autoscale(quick: bool = False) -> dict[str, Any]:
    rounds = 1 if quick else 3
    rows: list[tuple[str, float | None, str, str]] = []
    server = Server()
    server.start()
    r = redis.Redis.from_url(server.url)
    try:
        name = uniq("autoscale")
        p = Proc(["workers", "start", NAP, "--queue", name, "--redis", server.url,
                  "--standby", "0", "--autoscale", "0:4,drain=1,cooldown=2"],
                 worker_env(server.url))
        try:
            q = mtq.Queue(name, client=r)
            stats = QueueKeys(name).stats
            waits, colds = [], []
            for _ in range(rounds):
                wait_for("no serving process", lambda: _serving(r, name) == 0 or None,
                         60, [p])
                # (not synchronisation: a pause so the wake comes through the wake
                # list the supervisor blocks on at zero, not its next backlog read)
                time.sleep(0.5)
                r.hdel(stats, "cold_start_ms")
                task = q.submit({"s": 0})
                task.result(timeout=60)
                info = task.info()
                assert info.created is not None and info.started is not None
                waits.append((info.started - info.created) / 1000)
                colds.append(int(wait_for("the cold start recorded",
                                          lambda: r.hget(stats, "cold_start_ms"), 10, [p]))
                             / 1000)
            note = f"{rounds} round(s): " + ", ".join(f"{w:.2f}" for w in waits)
            rows.append(("first task's wait from zero processes: submit to start",
                         statistics.median(waits), "s", note))
            rows.append(("the supervisor's figure: wake to the first claim (cold_start_ms)",
                         statistics.median(colds), "s",
                         ", ".join(f"{c:.2f}" for c in colds)))
            wait_for("back to zero", lambda: _serving(r, name) == 0 or None, 60, [p])
            time.sleep(0.5)
            t0 = time.monotonic()
            tasks = q.submit_many([{"s": 0.02}] * 400)
            reached: dict[int, float] = {}
            while len(reached) < 3 and time.monotonic() - t0 < 60:
                n = _serving(r, name)
                for k in (1, 2, 4):
                    if n >= k and k not in reached:
                        reached[k] = time.monotonic() - t0
                time.sleep(0.02)
            for t in tasks:
                t.result(timeout=120)
            drained = time.monotonic() - t0
            for k in (1, 2, 4):
                rows.append((f"step of 400 x 20 ms tasks at zero: {k} process(es) serving",
                             reached.get(k), "s", "from the submit; drain=1 s, MAX 4"
                             if k == 1 else ""))
            rows.append(("step of 400 x 20 ms tasks: all done", drained, "s", ""))
        finally:
            p.stop()
            out = p.output()
            p.close()
        changes = sum("autoscale:" in ln and "->" in ln for ln in out.splitlines())
        rows.append(("scale changes logged over the run", changes, "",
                     f"{rounds} wake(s) and return(s) to zero, then the step up and down"))
    finally:
        mtq.replies.hub_of(r).close_all()
        r.close()
        server.stop()
    return {"rows": rows, "targets": []}


def _chain_times(chain: mtq.Chain) -> list[tuple[int, int, int]]:
    """(previous finished, created, started) of each step after the first (server ms)."""
    infos = [t.info() for t in chain.tasks]
    out = []
    for prev, cur in itertools.pairwise(infos):
        assert prev.finished is not None and cur.created is not None \
            and cur.started is not None
        out.append((prev.finished, cur.created, cur.started))
    return out


def _stream_gaps(tasks: list[mtq.Task]) -> list[float]:
    """Each task's function start minus the end of the one before it (us; the tasks of
    one stream, in their order), once all ended."""
    got = [t.result(timeout=60) for t in tasks]
    return [(b["start"] - a["end"]) * 1e6 for a, b in itertools.pairwise(got)]


def measure_chain(quick: bool = False) -> dict[str, Any]:
    n = 40 if quick else 200
    server = Server()
    server.start()
    r = redis.Redis.from_url(server.url)
    procs: list[Proc] = []
    try:
        names = [uniq(f"chain{i}") for i in range(3)]
        procs = [Proc(["worker", "run", NAP, "--queue", q, "--redis", server.url],
                      worker_env(server.url)) for q in names]
        for name in names:
            wait_for(f"a worker of {NAP} on {name}", partial(list_workers, r, name), 120, procs)
        qs = [mtq.Queue(name, client=r) for name in names]
        for q in qs:
            q.submit({"s": 0}).result(timeout=30)  # warm: imported, claiming
        # nap returns its payload's "i": each step's result holds the one before it
        steps = [mtq.Step(name, payload={"s": 0}, field="i") for name in names[1:]]
        start = time.monotonic()
        hand, submit, queue, gaps = [], [], [], []
        for _ in range(n):
            task = qs[0].submit({"s": 0}, then=steps)
            chain = task.chain()
            last = chain.result(timeout=30)
            for fin, created, started in _chain_times(chain):
                hand.append(started - fin)
                submit.append(created - fin)
                queue.append(started - created)
            while last.get("i"):  # a function's end to the next one's start (us)
                gaps.append((last["start"] - last["i"]["end"]) * 1e6)
                last = last["i"]
        chains_s = time.monotonic() - start
        base, base_us = [], []
        for _ in range(n):
            sent = time.time()
            t = qs[1].submit({"s": 0})
            got = t.result(timeout=30)
            base_us.append((got["start"] - sent) * 1e6)
            info = t.info()
            assert info.created is not None and info.started is not None
            base.append(info.started - info.created)
        # one stream: its tasks one after another on the first queue, submitted at once;
        # a chained one's stream is held until its hand-off went in (the stream's order
        # across queues), a plain one's is released at its ack
        held_us = _stream_gaps([qs[0].submit({"s": 0}, stream="held", then=steps[:1])
                                for _ in range(n)])
        plain_us = _stream_gaps([qs[0].submit({"s": 0}, stream="plain") for _ in range(n)])
        left = sum(int(r.zcard(QueueKeys(q).handoffs)) for q in names)
    finally:
        for p in procs:
            p.stop()
            p.close()
        mtq.replies.hub_of(r).close_all()
        r.close()
        server.stop()
    note = (f"{n} chains of 3 no-op steps one at a time ({len(hand)} hand-offs), "
            f"{chains_s:.1f} s; Redis server ms")
    rows = [
        ("hand-off: previous step's ack to the next step's start, p50",
         statistics.median(hand), "ms", note),
        ("hand-off: previous step's ack to the next step's start, p99", _pct(hand, 99), "ms",
         f"max {max(hand)} ms"),
        ("of which ack to the next step's submit (created), p50 / p99",
         statistics.median(submit), "ms", f"p99 {_pct(submit, 99)} ms"),
        ("of which the next step's submit to its start, p50 / p99",
         statistics.median(queue), "ms", f"p99 {_pct(queue, 99)} ms"),
        ("baseline: plain submit to start of one no-op, p50", statistics.median(base), "ms",
         f"{n} tasks one at a time, same run and workers; p99 {_pct(base, 99)} ms"),
        ("hand-off, a step's function end to the next one's start, p50",
         statistics.median(gaps), "us", f"p99 {_pct(gaps, 99):.0f} us (time.time() in the "
         "workers, one host): the ack's round trip included"),
        ("baseline: the client's submit call to the function's start, p50",
         statistics.median(base_us), "us", f"p99 {_pct(base_us, 99):.0f} us"),
        ("one stream: a chained task's end to the next task's start, p50",
         statistics.median(held_us), "us", f"{n} chains of 2 steps on one stream, submitted "
         f"at once: the stream is held until the hand-off; p99 {_pct(held_us, 99):.0f} us"),
        ("baseline: one stream, a plain task's end to the next one's, p50",
         statistics.median(plain_us),
         "us", f"{n} plain tasks on one stream, submitted at once; p99 "
         f"{_pct(plain_us, 99):.0f} us"),
        ("hand-off records left at the end", left, "", "all completed"),
    ]
    return {"rows": rows, "targets": [("every hand-off record completed", left == 0,
                                       f"{left} left", True)]}


SECTIONS: dict[str, Callable[[bool], dict[str, Any]]] = {
    "delay": measure_delay,
    "schedule": measure_schedule,
    "autoscale": measure_autoscale,
    "chain": measure_chain,
}
TITLES = {
    "delay": "Delayed tasks: start past their due time (bare mtq worker run, a no-op function)",
    "schedule": "Schedules: a per-second schedule, two `mtq schedule run`, the leader "
                "SIGKILLed halfway",
    "autoscale": "Autoscaling (mtq workers start --autoscale 0:4, a 20 ms function)",
    "chain": "Chains: the hand-off between steps (three bare mtq worker run, one per queue, "
             "a no-op function)",
}


def main(argv: Sequence[str] | None = None) -> int:
    return run_sections("flow", __doc__, "about 15 s", SECTIONS, TITLES, argv)


if __name__ == "__main__":
    sys.exit(main())
