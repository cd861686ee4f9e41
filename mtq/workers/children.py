"""A supervisor's child processes: their typed configuration, how they start, what
the supervisor knows of each, and how a dead one's tasks go back.

A child's configuration is a :class:`~mtq.workers.child.ChildConfig` (defined
beside the child's entry point, which this module starts: the child's side imports
nothing of the supervisor's). It crosses the process boundary as the plain dict of
:meth:`~mtq.workers.child.ChildConfig.to_dict`.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from mtq.broker import registry
from mtq.broker.consumer import Consumer, Outcome, connection_name
from mtq.broker.records import Claimed
from mtq.errors import BrokerError
from mtq.workers import child
from mtq.workers.child import ChildConfig

log = logging.getLogger("mtq.workers.supervisor")  # the supervisor's log, as its users read it


@dataclass
class Abort:
    """A running call whose every task was cancelled or timed out (the child's
    "aborted"): the supervisor kills the process if it still runs at ``until``."""

    #: per task: id, token, attempts, deliveries, retries, reason ("cancel" or
    #: "timeout"), error (a timeout's "TaskTimeout: ...")
    tasks: list[list[Any]]
    until: float
    grace_s: float
    #: the call's start, as in the shared array (another value: that call ended)
    started: float

    def outcomes(self) -> list[Outcome]:
        """How its tasks end: cancelled, or a retryable TaskTimeout failure (their
        retry policy applies), as the worker would have settled them."""
        out = []
        for t_id, token, attempts, deliveries, retries, why, error in self.tasks:
            t = Claimed(t_id, token, b"", None, attempts, deliveries, retries)
            out.append(Outcome(t, ok=False, cancelled=True) if why == "cancel" else
                       Outcome(t, ok=False, error=error or "TaskTimeout", retryable=True))
        return out


@dataclass
class Engine:
    """What the supervisor knows of one engine of a child process (a process of one
    worker has one; a host process one per queue)."""

    queue: str
    worker_id: str = ""
    ready: bool = False
    timeout_s: float | None = None
    model: str = ""
    held: dict[str, str] = field(default_factory=dict)   # id -> token
    batch: list[tuple[str, str]] = field(default_factory=list)
    #: its running call was wholly cancelled or timed out (mtq.workers.fencing)
    aborted: Abort | None = None


@dataclass
class Child:
    """What the supervisor knows of one child process."""

    slot: int
    device: str
    process: Any
    conn: Connection
    shared: Any
    started: float
    engines: list[Engine] = field(default_factory=list)
    ready: bool = False
    error: str = ""
    fatal: bool = False
    retiring: bool = False
    killed_for: str = ""
    #: killed because this engine's predict call overran its timeout: only that call
    #: counts against its tasks (the other engines' running calls go back uncounted)
    overran: int | None = None
    forced: bool = False    # killed on the operator's order: nothing it ran counts
    spare: bool = False     # a warm standby: set up, claiming nothing until promoted
    quarantine: bool = False  # runs the suspects its siblings hand over, one at a time
    bye: bool = False       # it said goodbye: it exits (no longer fenced)
    #: killed because an aborted call ran past its grace: those tasks are settled as
    #: their stops say, everything else it held goes back uncounted
    abandoned: bool = False

    # engine 0's, for the parts that know processes of one worker (quarantine, standby)
    @property
    def worker_id(self) -> str:
        return self.engines[0].worker_id if self.engines else ""

    @property
    def held(self) -> dict[str, str]:
        return self.engines[0].held

    def has(self, worker_id: str | None) -> bool:
        """Whether one of its engines has this worker id."""
        return any(e.worker_id == worker_id for e in self.engines)

    def models(self, host: bool) -> str:
        """Its model (a host: each engine's queue and model), for the supervisor's log."""
        if not host:
            return self.engines[0].model
        return ", ".join(f"{e.queue}: {e.model}" for e in self.engines)

    def next_timeout(self, now: float) -> float | None:
        """Seconds until a running predict call of one of its engines overruns its
        timeout (a quarter of it when none runs); None: no engine has a timeout."""
        out: float | None = None
        for i, e in enumerate(self.engines):
            if e.timeout_s:
                started = self.predict_started(i)
                d = (started + e.timeout_s - now) if started else e.timeout_s / 4
                out = d if out is None else min(out, d)
        return out

    def overrunning(self, now: float) -> int | None:
        """The engine whose running predict call is past its timeout, if one is."""
        for i, e in enumerate(self.engines):
            started = self.predict_started(i)
            if e.timeout_s and started and now - started > e.timeout_s:
                return i
        return None

    def send(self, msg: dict[str, Any]) -> None:
        """A command down its pipe (nothing if it is gone)."""
        try:
            self.conn.send(msg)
        except (OSError, ValueError):
            pass

    def predict_started(self, engine: int = 0) -> float:
        """When the current predict call of ``engine`` started (monotonic; 0: none runs)."""
        return float(self.shared[child.at(engine, child.STARTED)])


def drop(held: dict[str, str], leases: list[list[str]]) -> None:
    """Forget the deliveries a child settled (by token: the id may be held again, under
    a new lease, by the time its settle is read)."""
    for i, token in leases:
        if held.get(i) == token:
            del held[i]


def context() -> Any:
    """How worker processes start: forked from a fork server that imported torch and
    mtq once (never CUDA: nothing there touches a device), so a start or restart costs
    a fork and the model's own ``setup``, not a new interpreter importing torch (see
    docs/workers.md, Failure isolation; docs/benchmarks.md, Faults). Where there is no
    fork server, spawned."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["mtq.workers.child", "torch"])  # a missing module is skipped
    return ctx


def start(ctx: Any, config: ChildConfig, index: int, device: str, *, spare: bool = False,
          quarantine: bool = False) -> Child:
    """Start a worker process in slot ``index`` on ``device`` (its pinning in
    ``config.env``, set in this process's environment while it starts)."""
    if ctx.get_start_method() == "forkserver":
        # started (once) before the environment below is changed for this child:
        # the server carries no child's pinning; each child sets its own first thing
        from multiprocessing import forkserver

        forkserver.ensure_running()
    parent, kid = ctx.Pipe()
    engines = [Engine(e["queue"]) for e in config.engine_list()]
    shared = ctx.RawArray("d", child.beat_at(len(engines)) + 1)
    env = dict(config.env)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the spawned interpreter starts with this environment
    try:
        p = ctx.Process(target=child.main, args=(config.to_dict(), kid, shared),
                        name=f"mtq-worker-{index}", daemon=False)
        p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    kid.close()
    return Child(index, device, p, parent, shared, time.monotonic(), engines=engines,
                 spare=spare, quarantine=quarantine)


def give_back(consumers: Sequence[Consumer], c: Child, elsewhere: Collection[str], *,
              strict: bool = False) -> None:
    """Return a dead child's tasks, each engine's with its queue's consumer (in the
    order of ``c.engines``): the running call's items counted, the rest not,
    including those it claimed just before it died and never reported (found in
    Redis by its worker id once its connections are gone). ``elsewhere``: ids
    another process runs now (suspects in the quarantine process). ``strict``: a
    failure to reach Redis raises (:class:`~mtq.errors.BrokerError`) rather than being
    logged, and the engines after it are not tried (a stop: mtq.workers.stops)."""
    if c.spare:
        return
    for i, e in enumerate(c.engines):
        _give_back(consumers[i], c, i, e, elsewhere, strict)


def _give_back(consumer: Consumer, c: Child, i: int, e: Engine,
               elsewhere: Collection[str], strict: bool) -> None:
    if not e.held and not e.worker_id:
        return
    running: list[tuple[str, str]] = []
    started = c.shared[child.at(i, child.STARTED)]
    # it died inside predict: those items are suspects (unless it was killed on order,
    # for another engine's call that overran, or for a call nobody wanted any more)
    if started and e.batch and not c.forced and not c.abandoned and c.overran in (None, i):
        lo, hi = int(c.shared[child.at(i, child.LO)]), int(c.shared[child.at(i, child.HI)])
        running = [(t_id, t) for t_id, t in e.batch[lo:hi] if e.held.get(t_id) == t]
    # the abandoned call's tasks end as their stops say (cancelled, TaskTimeout)
    stopped = e.aborted.outcomes() if c.abandoned and e.aborted is not None else []
    counted = {t_id for t_id, _ in running} | {o.task.id for o in stopped}
    rest = [(t_id, t) for t_id, t in e.held.items() if t_id not in counted]
    reason = c.killed_for or "worker process died"
    try:
        if e.worker_id:
            if not consumer.wait_disconnected(connection_name(e.worker_id)):
                log.debug("worker %s: its Redis connections did not close (or CLIENT "
                          "LIST is not allowed); sweeping its tasks now", e.worker_id)
            if stopped:
                consumer.settle(stopped)
            consumer.give_back_all(e.worker_id, running, rest, reason,
                                   skip={*elsewhere, *counted})
        else:
            if stopped:
                consumer.settle(stopped)
            consumer.give_back(running, rest, reason)
    except BrokerError:
        if strict:
            raise
        log.warning("could not give back the tasks of worker %d (queue %s); they return "
                    "when their leases expire", c.slot, e.queue, exc_info=True)
    e.held.clear()


def unregister(consumers: Sequence[Consumer], c: Child, code: int | None) -> None:
    """Remove a child that did not exit cleanly from the worker registry (it could not
    remove its own entries), each engine's with its queue's consumer."""
    if code == 0:
        return
    for i, e in enumerate(c.engines):
        if e.worker_id:
            try:
                registry.remove(consumers[i].redis, e.worker_id)
            except BrokerError:
                log.debug("could not remove worker %s from the registry", e.worker_id)
