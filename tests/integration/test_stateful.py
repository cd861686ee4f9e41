"""Hypothesis stateful test of the broker's invariants against a real Redis.

A Python model tracks what each task's state must be; after every step the
test reads Redis and checks:

* each task is in exactly one state, and in exactly the structure that state
  implies (queued: once in its stream's list; running: in leases; delayed: in
  the retry set; terminal: in none);
* at most one task per stream is running or waiting for a retry;
* FIFO per stream across retries, lease expiry and cancellation: the live ids
  of each stream's list equal the model's queue, and every claim takes heads;
* nothing lost: every submitted task has a state; a claim never leaves work
  behind (it returns min(B, claimable) tasks);
* the waiting counter matches.

:class:`SchedMachine` runs the same rules with scheduling on (random priority, tenant
and cost per task, costs reported by some settles) and checks the served cost too.
"""

from __future__ import annotations

import uuid
from collections import deque
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import mtq

STREAMS = [None, "a", "b", "c"]
MAX_DELIVERIES = 3
MAX_RETRIES = 2


class BrokerMachine(RuleBasedStateMachine):
    url: str = ""

    def config(self) -> mtq.QueueSettings:
        return mtq.QueueSettings(max_deliveries=MAX_DELIVERIES, max_retries=MAX_RETRIES,
                                 retry_backoff_ms=0, retry_backoff_max_ms=0)

    # what a subclass checks beyond these (SchedMachine: the cost served)
    def claimed(self, t: mtq.Claimed) -> None:
        pass

    def settled(self, t: mtq.Claimed, cost: float | None) -> None:
        pass

    def released(self, t: mtq.Claimed) -> None:
        pass

    def free_lists(self) -> list[str]:
        """The lists that hold stream-less waiting ids."""
        return [self.keys.free]

    @initialize()
    def setup(self) -> None:
        self.name = "h-" + uuid.uuid4().hex[:10]
        cfg = self.config()
        self.r = redis.Redis.from_url(self.url)
        self.q = mtq.Queue(self.name, self.url, settings=cfg)
        self.c = mtq.Consumer(self.name, self.url, settings=cfg)
        self.keys = self.q.broker.keys
        self.stream_of: dict[str, str | None] = {}
        self.status: dict[str, str] = {}
        self.deliveries: dict[str, int] = {}
        self.attempts: dict[str, int] = {}
        self.queues: dict[str | None, deque[str]] = {s: deque() for s in STREAMS}
        self.running: dict[str, mtq.Claimed] = {}
        self.expired: set[str] = set()      # running, lease forced into the past
        self.retrying: set[str] = set()     # delayed, due at once
        self.stale: list[mtq.Claimed] = []  # handles whose lease was lost
        self.cancel_requested: set[str] = set()
        self.counter = 0

    # -- the model's view of timers, applied when Redis applies them (claim / reap) ----
    def _apply_timers(self) -> None:
        for task_id in sorted(self.expired):
            self.expired.discard(task_id)
            held = self.running.pop(task_id)
            self.stale.append(held)
            if task_id in self.cancel_requested:
                self.status[task_id] = "cancelled"
            elif self.deliveries[task_id] >= MAX_DELIVERIES:
                self.status[task_id] = "dead"
            else:
                self._to_head(task_id)
        for task_id in list(self.retrying):
            self.retrying.discard(task_id)
            self._to_head(task_id)

    def _to_head(self, task_id: str) -> None:
        self.status[task_id] = "queued"
        self.queues[self.stream_of[task_id]].appendleft(task_id)

    def _busy(self, stream: str | None) -> bool:
        return stream is not None and any(
            self.stream_of[t] == stream for t in list(self.running) + list(self.retrying))

    # -- rules -------------------------------------------------------------------------
    @rule(stream=st.sampled_from(STREAMS), n=st.integers(1, 3))
    def submit(self, stream: str | None, n: int) -> None:
        self.submit_requests(stream, [{} for _ in range(n)])

    def submit_requests(self, stream: str | None, options: list[dict[str, Any]]) -> None:
        """Submit one task per entry of ``options`` (Request's keywords) to ``stream``."""
        reqs = []
        for kw in options:
            self.counter += 1
            reqs.append(mtq.Request({"n": self.counter}, id=f"t{self.counter:04d}", **kw))
        for t in self.q.submit_many(reqs, stream=stream):
            self.stream_of[t.id] = stream
            self.status[t.id] = "queued"
            self.deliveries[t.id] = 0
            self.attempts[t.id] = 0
            self.queues[stream].append(t.id)

    @rule(b=st.integers(1, 5))
    def claim(self, b: int) -> None:
        self._apply_timers()
        claimable = sum(1 for s in STREAMS[1:] if self.queues[s] and not self._busy(s))
        claimable += len(self.queues[None])
        got = self.c.claim(b)
        assert len(got) == min(b, claimable), "claim left claimable work behind"
        seen_streams = set()
        for t in got:
            assert t.stream not in seen_streams or t.stream is None, "two tasks of one stream"
            seen_streams.add(t.stream)
            assert t.stream == self.stream_of[t.id]
            if t.stream is None:
                self.queues[None].remove(t.id)
            else:
                assert not self._busy(t.stream)
                assert self.queues[t.stream][0] == t.id, "claim did not take the stream head"
                self.queues[t.stream].popleft()
            self.deliveries[t.id] += 1
            assert t.deliveries == self.deliveries[t.id]
            assert t.attempts == self.attempts[t.id]
            self.status[t.id] = "running"
            self.running[t.id] = t
            self.claimed(t)

    def _pick_running(self, data: st.DataObject) -> mtq.Claimed:
        live = sorted(t for t in self.running if t not in self.expired)
        return self.running[data.draw(st.sampled_from(live))]

    def draw_cost(self, data: st.DataObject) -> float | None:
        """The cost a settle reports (None: none)."""
        return None

    def _has_live(self) -> bool:
        return any(t not in self.expired for t in self.running)

    @precondition(_has_live)
    @rule(data=st.data())
    def ack(self, data: st.DataObject) -> None:
        t = self._pick_running(data)
        cost = self.draw_cost(data)
        report = self.c.settle([mtq.Outcome(t, ok=True, value=t.id, cost=cost)])
        self.settled(t, cost)
        del self.running[t.id]
        if t.id in self.cancel_requested:  # a cancel asked while it ran: never succeeded
            self.status[t.id] = "cancelled"
            assert report.succeeded == 0, report
        else:
            self.status[t.id] = "succeeded"
            assert report.succeeded == 1, report

    @precondition(_has_live)
    @rule(data=st.data())
    def fail(self, data: st.DataObject) -> None:
        t = self._pick_running(data)
        cost = self.draw_cost(data)
        self.c.settle([mtq.Outcome(t, ok=False, error="E: x", cost=cost)])
        self.settled(t, cost)
        del self.running[t.id]
        self.attempts[t.id] += 1
        if t.id in self.cancel_requested:
            self.status[t.id] = "cancelled"
        elif self.attempts[t.id] <= MAX_RETRIES:
            self.status[t.id] = "delayed"
            self.retrying.add(t.id)
        else:
            self.status[t.id] = "dead"

    @precondition(_has_live)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        t = self._pick_running(data)
        self.c.release([t])
        self.released(t)
        del self.running[t.id]
        self.deliveries[t.id] -= 1
        if t.id in self.cancel_requested:
            self.status[t.id] = "cancelled"
        else:
            self._to_head(t.id)

    @precondition(_has_live)
    @rule(data=st.data())
    def lease_expires(self, data: st.DataObject) -> None:
        t = self._pick_running(data)
        self.r.zadd(self.keys.leases, {t.id: 0}, xx=True)
        self.expired.add(t.id)

    @rule()
    def reap(self) -> None:
        self._apply_timers()
        self.c.reap()

    @precondition(lambda self: bool(self.stale))
    @rule(data=st.data())
    def late_ack(self, data: st.DataObject) -> None:
        t = data.draw(st.sampled_from(sorted(self.stale, key=lambda h: (h.id, h.token))))
        report = self.c.settle([mtq.Outcome(t, ok=True, value="late")])
        assert report.lost == [t.id], "an ack from an expired lease was accepted"

    @precondition(lambda self: bool(self.status))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        task_id = data.draw(st.sampled_from(sorted(self.status)))
        state = self.status[task_id]
        if task_id in self.expired:
            return  # its fate is decided by the next reap; covered by cancel-then-die tests
        cancelled_now = self.q.task(task_id).cancel()
        if state == "queued":
            assert cancelled_now
            self.queues[self.stream_of[task_id]].remove(task_id)
            self.status[task_id] = "cancelled"
        elif state == "delayed":
            assert cancelled_now
            self.retrying.discard(task_id)
            self.status[task_id] = "cancelled"
        elif state == "running":
            assert not cancelled_now
            self.cancel_requested.add(task_id)
        else:
            assert not cancelled_now

    # -- invariants ------------------------------------------------------------------
    @invariant()
    def structures_match_states(self) -> None:
        if not hasattr(self, "q"):
            return
        ids = sorted(self.status)
        if not ids:
            return
        pipe = self.r.pipeline(transaction=False)
        for task_id in ids:
            pipe.hget(self.keys.task(task_id), "status")
        stored = dict(zip(ids, (v.decode() if v else None for v in pipe.execute())))
        leases = {x.decode() for x in self.r.zrangebyscore(self.keys.leases, "-inf", "(+inf")}
        delayed = {x.decode() for x in self.r.zrange(self.keys.delayed, 0, -1)}
        for task_id in ids:
            want = self.status[task_id]
            if task_id in self.expired or task_id in self.retrying:
                # Redis applies these timers at the next claim or reap.
                assert stored[task_id] in ("running", "delayed"), (task_id, stored[task_id])
            else:
                assert stored[task_id] == want, (task_id, stored[task_id], want)
            assert (task_id in leases) == (stored[task_id] == "running")
            assert (task_id in delayed) == (stored[task_id] == "delayed")
        for stream in STREAMS:
            keys = self.free_lists() if stream is None else [self.keys.stream(stream)]
            live = [x.decode() for key in keys for x in self.r.lrange(key, 0, -1)
                    if stored.get(x.decode()) == "queued"]
            if stream is None:
                assert sorted(live) == sorted(self.queues[None])
            else:
                assert live == list(self.queues[stream]), f"FIFO broken in stream {stream}"
            active = [t for t in ids if self.stream_of[t] == stream and stream is not None
                      and stored[t] in ("running", "delayed")]
            assert len(active) <= 1, f"stream {stream} has {active} active at once"
        waiting = sum(1 for s in stored.values() if s == "queued")
        assert self.q.stats()["waiting"] == waiting

    def teardown(self) -> None:
        if hasattr(self, "r"):
            self.r.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_broker_invariants(redis_url: str) -> None:
    from hypothesis.stateful import run_state_machine_as_test

    BrokerMachine.url = redis_url
    run_state_machine_as_test(BrokerMachine, settings=settings(
        max_examples=150, stateful_step_count=50, deadline=None,
        suppress_health_check=list(HealthCheck)))


# -- scheduling ------------------------------------------------------------------------------
TENANTS = [None, "A", "B"]
WEIGHTS = {"A": 2.0}
PRIORITIES = [None, "interactive", "batch"]
BAND = {None: "s", "interactive": "i", "batch": "b"}
COSTS = [None, 0.0, 0.5, 3.0, 100.0]     # None: the default, 1
REPORTS = [None, None, 0.0, 2.0, 40.0]   # what a settle reports (None: nothing)


class SchedMachine(BrokerMachine):
    """The same rules and invariants with scheduling on: each task has a random band,
    tenant and cost, and settles sometimes report a cost. Beyond them: the served cost
    of each lane is what the model charged (each claim its cost, each report the
    difference, each release a refund; a lease that expired keeps its charge), a claimed
    task stores its tenant's weight, and each band's candidates carry their tenants'
    virtual times."""

    def config(self) -> mtq.QueueSettings:
        return super().config().replace(tenant_weights=WEIGHTS, band_min_share=10)

    @initialize()
    def setup(self) -> None:
        super().setup()
        self.lane: dict[str, str] = {}
        self.cost: dict[str, float] = {}
        self.want: dict[str, float] = {}  # lane -> the served cost the model expects
        self.on = False  # scheduling is on (from the first task with a band or a tenant)
        self.charged: set[str] = set()  # tasks a claim charged (scheduling on)

    @rule(stream=st.sampled_from(STREAMS), data=st.data())
    def submit(self, stream: str | None, data: st.DataObject) -> None:  # type: ignore[override]
        options = [{"priority": data.draw(st.sampled_from(PRIORITIES)),
                    "tenant": data.draw(st.sampled_from(TENANTS)),
                    "cost": data.draw(st.sampled_from(COSTS))}
                   for _ in range(data.draw(st.integers(1, 3)))]
        first = self.counter + 1
        self.submit_requests(stream, options)
        self.on = self.on or any(kw["priority"] or kw["tenant"] for kw in options)
        for i, kw in enumerate(options):
            task_id = f"t{first + i:04d}"
            self.lane[task_id] = f"{BAND[kw['priority']]}:{kw['tenant'] or ''}"
            self.cost[task_id] = 1.0 if kw["cost"] is None else kw["cost"]

    def draw_cost(self, data: st.DataObject) -> float | None:
        return data.draw(st.sampled_from(REPORTS))

    def claimed(self, t: mtq.Claimed) -> None:
        weight = self.r.hget(self.keys.task(t.id), "weight")
        if not self.on:  # a claim before scheduling was on charges nothing
            assert weight is None and t.id not in self.charged
            return
        lane = self.lane[t.id]
        # a cost given with no band or tenant before the queue scheduled is not stored:
        # the task counts 1, as the turn-on counted it (submit.lua)
        stored = self.r.hget(self.keys.task(t.id), "cost")
        self.cost[t.id] = 1.0 if stored is None else float(stored)
        self.want[lane] = self.want.get(lane, 0.0) + self.cost[t.id]
        self.charged.add(t.id)
        # the charge its claim stored: "weight|band|tenant"
        assert weight is not None and weight.decode() == \
            f"{WEIGHTS.get(lane[2:], 1.0):g}|{lane[0]}|{lane[2:]}", weight

    def settled(self, t: mtq.Claimed, cost: float | None) -> None:
        if cost is not None and t.id in self.charged:
            self.want[self.lane[t.id]] += cost - self.cost[t.id]

    def released(self, t: mtq.Claimed) -> None:
        if t.id in self.charged:
            self.want[self.lane[t.id]] -= self.cost[t.id]

    def free_lists(self) -> list[str]:
        return [self.keys.free] + [self.keys.sched + f"free:{b}:{t or ''}"
                                   for b in "isb" for t in TENANTS if (b, t) != ("s", None)]

    @invariant()
    def served_cost_is_what_was_charged_and_settled(self) -> None:
        if not hasattr(self, "want"):
            return
        got = {k.decode(): float(v)
               for k, v in self.r.hgetall(self.keys.sched + "served").items()}
        for lane in set(got) | set(self.want):
            assert got.get(lane, 0.0) == pytest.approx(self.want.get(lane, 0.0), abs=1e-6), \
                (lane, got, self.want)
        vts = {k.decode(): float(v) for k, v in self.r.hgetall(self.keys.sched + "vt").items()
               if v != b""}
        for b in "isb":
            for tenant, score in self.r.zrange(self.keys.sched + f"band:{b}", 0, -1,
                                               withscores=True):
                assert score == pytest.approx(vts.get(tenant.decode(), 0.0), abs=1e-6), \
                    (b, tenant, score, vts)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_broker_invariants_with_scheduling(redis_url: str) -> None:
    from hypothesis.stateful import run_state_machine_as_test

    SchedMachine.url = redis_url
    run_state_machine_as_test(SchedMachine, settings=settings(
        max_examples=75, stateful_step_count=50, deadline=None,
        suppress_health_check=list(HealthCheck)))
