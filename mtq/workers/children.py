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
from collections.abc import Collection
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from mtq.broker import registry
from mtq.broker.consumer import Consumer, connection_name
from mtq.errors import BrokerError
from mtq.workers import child
from mtq.workers.child import ChildConfig

log = logging.getLogger("mtq.workers.supervisor")  # the supervisor's log, as its users read it


@dataclass
class Child:
    """What the supervisor knows of one child process."""

    slot: int
    device: str
    process: Any
    conn: Connection
    shared: Any
    started: float
    worker_id: str = ""
    ready: bool = False
    timeout_s: float | None = None
    held: dict[str, str] = field(default_factory=dict)   # id -> token
    batch: list[tuple[str, str]] = field(default_factory=list)
    error: str = ""
    fatal: bool = False
    retiring: bool = False
    killed_for: str = ""
    forced: bool = False    # killed on the operator's order: nothing it ran counts
    spare: bool = False     # a warm standby: set up, claiming nothing until promoted
    quarantine: bool = False  # runs the suspects its siblings hand over, one at a time

    def send(self, msg: dict[str, Any]) -> None:
        """A command down its pipe (nothing if it is gone)."""
        try:
            self.conn.send(msg)
        except (OSError, ValueError):
            pass

    def predict_started(self) -> float:
        """When its current predict call started (monotonic; 0: none runs)."""
        return float(self.shared[child.STARTED])


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
    shared = ctx.RawArray("d", 3)
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
    return Child(index, device, p, parent, shared, time.monotonic(), spare=spare,
                 quarantine=quarantine)


def give_back(consumer: Consumer, c: Child, elsewhere: Collection[str]) -> None:
    """Return a dead child's tasks: the running call's items counted, the rest not,
    including those it claimed just before it died and never reported (found in
    Redis by its worker id once its connections are gone). ``elsewhere``: ids
    another process runs now (suspects in the quarantine process)."""
    if c.spare or (not c.held and not c.worker_id):
        return
    running: list[tuple[str, str]] = []
    started = c.shared[child.STARTED]
    if started and c.batch and not c.forced:  # it died inside predict: those items are suspects
        lo, hi = int(c.shared[child.LO]), int(c.shared[child.HI])
        running = [(i, t) for i, t in c.batch[lo:hi] if c.held.get(i) == t]
    counted = {i for i, _ in running}
    rest = [(i, t) for i, t in c.held.items() if i not in counted]
    reason = c.killed_for or "worker process died"
    try:
        if c.worker_id:
            if not consumer.wait_disconnected(connection_name(c.worker_id)):
                log.debug("worker %s: its Redis connections did not close (or CLIENT "
                          "LIST is not allowed); sweeping its tasks now", c.worker_id)
            consumer.give_back_all(c.worker_id, running, rest, reason, skip=elsewhere)
        else:
            consumer.give_back(running, rest, reason)
    except BrokerError:
        log.warning("could not give back the tasks of worker %d; they return when their "
                    "leases expire", c.slot, exc_info=True)
    c.held.clear()


def unregister(consumer: Consumer, c: Child, code: int | None) -> None:
    """Remove a child that did not exit cleanly from the worker registry (it could not
    remove its own entry)."""
    if c.worker_id and code != 0:
        try:
            registry.remove(consumer.redis, c.worker_id)
        except BrokerError:
            log.debug("could not remove worker %s from the registry", c.worker_id)
