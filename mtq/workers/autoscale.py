"""The autoscaler of ``mtq workers start ... --autoscale MIN:MAX`` (docs/autoscaling.md).

A daemon thread of the supervisor. Every ``tick_s`` it reads the queue's backlog
(:func:`read_backlog`: waiting + running + due delayed tasks, from the counters the
Lua scripts keep: three commands a tick, none per task) and the measured service
rate of one process (tasks per busy second, from the worker registry), and asks
:class:`Decider` for a process count:

    target = ceil(backlog / (rate x drain_s)), clamped to MIN..MAX

(at least 1 while there is a backlog and MAX >= 1). A larger target is applied at
once; a smaller one only after every target for ``cooldown_s`` was below the
current count, and then to the largest of them (no flapping on a steady load).
It applies a count through the supervisor's own ``scale`` command
(:meth:`Supervisor.request`), as ``mtq workers scale N`` does.

At zero processes it does not tick: it blocks on the queue's wake-up list (BLPOP on
``mtq:{q}:wake``, where a submit that finds no sleeping worker pushes its marker), so
the first task wakes it at once, and it starts one process. The first task's wait
from that wake to its claim is logged and written to the queue's stats hash
(``cold_start_ms``: the exporter's ``mtq_queue_cold_start_seconds``).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from mtq.broker import cluster
from mtq.broker.keys import QueueKeys
from mtq.broker.registry import list_workers
from mtq.errors import BrokerError, ConfigError

__all__ = ["Autoscaler", "Decider", "Policy", "parse_range", "read_backlog"]


log = logging.getLogger(__name__)

#: how long one blocked wait at zero lasts before it looks at the delayed set again
IDLE_WAIT_S = 5.0


def parse_range(text: str) -> Policy:
    """``"MIN:MAX[,drain=S][,cooldown=S]"`` -> a :class:`Policy`; raises ConfigError
    naming the mistake."""
    head, *extra = text.split(",")
    try:
        lo_s, hi_s = head.split(":")
        lo, hi = int(lo_s), int(hi_s)
    except ValueError:
        raise ConfigError(f"--autoscale takes MIN:MAX (two whole numbers, e.g. 0:4), "
                          f"got {text!r}") from None
    if lo < 0 or hi < 1 or lo > hi:
        raise ConfigError(f"--autoscale {text}: need 0 <= MIN <= MAX and MAX >= 1")
    policy = Policy(lo, hi)
    for item in extra:
        name, _, value = item.partition("=")
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if name not in ("drain", "cooldown") or not seconds > 0:
            raise ConfigError(f"--autoscale {text}: after MIN:MAX give drain=SECONDS or "
                              f"cooldown=SECONDS (positive), got {item!r}")
        setattr(policy, f"{name}_s", seconds)
    return policy


@dataclass
class Policy:
    """MIN..MAX processes; ``drain_s``: the time a backlog should take to drain;
    ``cooldown_s``: how long every target must stay below the count to scale down."""

    low: int
    high: int
    drain_s: float = 10.0
    cooldown_s: float = 30.0
    tick_s: float = 1.0

    def target(self, backlog: float, rate: float | None, current: int) -> int:
        """The process count for ``backlog`` tasks at ``rate`` tasks/s per process
        (None: not measured yet: keep what runs, at least one with a backlog)."""
        if backlog <= 0:
            want = 0
        elif rate is None or rate <= 0:
            want = max(current, 1)
        else:
            want = max(1, math.ceil(backlog / (rate * self.drain_s)))
        return min(self.high, max(self.low, want))


@dataclass
class Decider:
    """Up at once, down after ``cooldown_s`` of lower targets, to the highest of them."""

    policy: Policy
    _below_since: float | None = None
    _below_peak: int = 0

    def decide(self, now: float, backlog: float, rate: float | None,
               current: int) -> int | None:
        want = self.policy.target(backlog, rate, current)
        if want > current:
            self._below_since = None
            return want
        if want == current:
            self._below_since = None
            return None
        if self._below_since is None:
            self._below_since, self._below_peak = now, want
            return None
        self._below_peak = max(self._below_peak, want)
        if now - self._below_since < self.policy.cooldown_s:
            return None
        self._below_since = None
        return self._below_peak


#: the stats counters a claimed task ends in (their sum grows once a claim settles)
_SETTLED = ("succeeded", "failed", "retried", "dead_total", "expired")


def read_backlog(client: redis.Redis, queue: str) -> tuple[int, int, int, int]:
    """(waiting, running, due delayed, settled) of ``queue``, from the counters the
    scripts keep: the stats hash's ``waiting`` (and the outcomes' counters), ZCOUNT of
    the leases, ZCOUNT of the delayed set up to now (one round trip)."""
    k = QueueKeys(queue)
    c = cluster.for_queue(client, queue)
    pipe = c.pipeline(transaction=False)
    pipe.hmget(k.stats, ["waiting", *_SETTLED])
    pipe.zcount(k.leases, "-inf", "(+inf")
    pipe.zcount(k.delayed, "-inf", int(time.time() * 1000))
    counts, running, due = pipe.execute()
    settled = sum(int(v or 0) for v in counts[1:])
    return max(int(counts[0] or 0), 0), int(running), int(due), settled


def measured_rate(client: redis.Redis, queue: str) -> float | None:
    """Tasks per busy second of one process of ``queue`` (its live workers' totals in
    the registry), or None before any has been busy for a quarter second."""
    tasks = busy = 0.0
    for w in list_workers(client, queue):
        tasks += float(w.get("tasks") or 0)
        busy += float(w.get("busy_s", w.get("predict_s", 0.0)) or 0.0)
    return tasks / busy if busy >= 0.25 and tasks > 0 else None


class Autoscaler:
    """The thread; ``supervisor`` is a :class:`~mtq.workers.supervisor.Supervisor`."""

    def __init__(self, supervisor: Any, policy: Policy,
                 on_event: Callable[[str], None] | None = None) -> None:
        self.sup = supervisor
        self.policy = policy
        self.decider = Decider(policy)
        self.queue = supervisor.queue
        self.client = cluster.for_queue(supervisor.consumer.redis, self.queue)
        self.keys = QueueKeys(self.queue)
        self.on_event = on_event or supervisor.on_event
        self.ndev = max(len(supervisor.devices), 1)
        self._woke_at: float | None = None
        self._settled_at_wake = 0
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mtq-autoscale", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=0.2)  # a daemon: a BLPOP in flight ends with the process

    def processes(self) -> int:
        return int(self.sup.replicas) * self.ndev

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                self._step()
            except (redis.RedisError, OSError, BrokerError) as exc:
                log.warning("autoscale: cannot read the backlog (%s); trying again", exc)
                self._closed.wait(self.policy.tick_s)

    def _step(self) -> None:
        if self.sup.stopping or self.sup.draining:
            self._closed.wait(self.policy.tick_s)
            return
        waiting, running, due, settled = read_backlog(self.client, self.queue)
        backlog = waiting + running + due
        current = self.processes()
        now = time.monotonic()
        if self._woke_at is not None and (running > 0 or settled > self._settled_at_wake):
            wait_s = now - self._woke_at
            self._woke_at = None
            self.client.hset(self.keys.stats, "cold_start_ms", int(wait_s * 1000))
            self.on_event(f"autoscale: the first task after scaling from zero was claimed "
                          f"{wait_s:.2f} s after it woke the supervisor")
        if current == 0 and backlog == 0:
            # asleep: a submit that finds no sleeping worker pushes a wake marker, and
            # one that makes the delayed set's first entry earlier does too: the wait
            # ends by the first delayed task's due time
            got = self.client.blpop([self.keys.wake], timeout=self._sleep_s())
            if got is None or self._closed.is_set():
                return
            woke = time.monotonic()
            waiting, running, due, settled = read_backlog(self.client, self.queue)
            if waiting + running + due == 0:
                return  # a marker left by a release or retry, no work: sleep again
            self._woke_at, self._settled_at_wake = woke, settled
            self._scale(max(1, self.policy.low), "woken from zero by a submit")
            self._closed.wait(0.05)
            return
        rate = measured_rate(self.client, self.queue) if backlog else None
        n = self.decider.decide(now, backlog, rate, current)
        if n is not None and n != current:
            per = "unmeasured" if rate is None else f"{rate:.2f} tasks/s per process"
            why = f"backlog {backlog} ({waiting} waiting, {running} running), {per}"
            if current == 0:  # a task came while this thread was not waiting on the list
                self._woke_at, self._settled_at_wake = now, settled
                why = f"woken from zero: {why}"
            self._scale(n, why)
            if n == 0:
                return  # straight to the blocked wait: the next task wakes it at once
        self._closed.wait(0.05 if self._woke_at is not None else self.policy.tick_s)

    def _sleep_s(self) -> float:
        """How long to wait asleep: until the first delayed task is due, at most
        :data:`IDLE_WAIT_S`."""
        first = self.client.zrange(self.keys.delayed, 0, 0, withscores=True)
        if not first:
            return IDLE_WAIT_S
        return min(IDLE_WAIT_S, max(0.01, first[0][1] / 1000 - time.time()))

    def _scale(self, n: int, why: str) -> None:
        replicas = math.ceil(n / self.ndev)
        self.on_event(f"autoscale: {self.processes()} -> {replicas * self.ndev} "
                      f"process(es): {why}")
        self.sup.replicas = replicas  # read back by processes() before the loop applies it
        self.sup.request({"cmd": "scale", "replicas": replicas})
