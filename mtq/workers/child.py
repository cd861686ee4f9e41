"""The entry point of a worker process started by the supervisor (spawned, never forked).

It reports to the supervisor over a pipe: its worker id, that its model is set up,
which tasks it holds and which it is running (so a supervisor that sees it die can
give them back at once), and, through a small shared array, when the current
predict call started (so the supervisor can kill it when the call overruns its
timeout; a hung kernel cannot be interrupted from a thread).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from mtq.workers.signals import on_stop_signals
from mtq.workers.worker import Monitor

#: exit codes the supervisor reads
EXIT_OK = 0
EXIT_TARGET = 3   # the target cannot be loaded: do not restart, report
EXIT_SETUP = 4    # setup() raised: restart with backoff, give up after a few in a row

# shared array layout: predict call started at (time.monotonic(), 0 = idle), first, end item
STARTED, LO, HI = 0, 1, 2

log = logging.getLogger("mtq.workers.child")


@dataclass(frozen=True)
class ChildConfig:
    """What a worker process is started with."""

    target: str
    queue: str
    url: str | None
    #: the queue's settings as this supervisor was given them (mtq.broker.config.to_wire)
    settings: Any
    #: the device as the child sees it (after its pinning), and the environment that pins it
    device: str
    env: Mapping[str, str]
    #: max_batch_size, max_wait_ms, timeout_s given on the command line
    overrides: Mapping[str, Any]
    supervisor: str
    #: its slot's index, or "standby" / "quarantine" (for its log lines)
    slot: int | str
    log_level: int
    #: a quarantine process: it claims nothing and runs the suspects it is handed
    quarantine: bool = False
    #: offer the suspects it claims to the supervisor's quarantine process
    hand_off: bool = True
    #: the state a replacement starts in, before it claims
    paused: bool = False
    draining: bool = False
    #: a warm standby: set up, claiming nothing, until promoted ("go")
    standby: bool = False
    #: times its slot's process was replaced (reported by the worker)
    restarts: int = 0
    #: the model's options (``--set KEY=VALUE``, as text)
    options: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The plain form that crosses the process boundary."""
        out = dataclasses.asdict(self)
        out["env"], out["overrides"] = dict(self.env), dict(self.overrides)
        out["options"] = dict(self.options)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ChildConfig:
        return cls(**data)


class PipeMonitor(Monitor):
    """The child's side of the supervisor link (thread-safe)."""

    def __init__(self, conn: Connection, shared: Any) -> None:
        self.conn = conn
        self.shared = shared
        self.lock = threading.Lock()

    def send(self, *msg: Any) -> None:
        with self.lock:
            try:
                self.conn.send(msg)
            except (OSError, ValueError):  # the supervisor is gone; the reader thread stops us
                pass

    def held(self, leases: Sequence[tuple[str, str]]) -> None:
        self.send("held", list(leases))

    def batch(self, leases: Sequence[tuple[str, str]]) -> None:
        self.send("batch", list(leases))

    def call(self, lo: int, hi: int) -> None:
        import time

        self.shared[LO] = lo
        self.shared[HI] = hi
        self.shared[STARTED] = time.monotonic()

    def idle(self) -> None:
        self.shared[STARTED] = 0.0

    def settled(self, leases: Sequence[tuple[str, str]]) -> None:
        self.send("settled", list(leases))

    def reloaded(self, timeout_s: float | None, model: str,
                 options: dict[str, str] | None = None) -> None:
        self.send("reloaded", {"timeout_s": timeout_s, "model": model,
                               "options": None if options is None else dict(options)})

    def quarantine(self, task: Any) -> bool:
        self.send("quarantine", [task.id, task.token, task.payload, task.stream, task.attempts,
                                 task.deliveries, task.retries, task.age_ms, task.live_until,
                                 task.traceparent, task.claimed_at])
        return True


def _await_promotion(conn: Connection) -> dict[str, Any] | None:
    """A standby's wait: the "go" message (with the state to start in: paused,
    draining), or None when told to stop or when the supervisor is gone."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return None
        if msg.get("cmd") == "go":
            return {"paused": bool(msg.get("paused")), "draining": bool(msg.get("draining")),
                    "restarts": int(msg.get("restarts") or 0)}
        if msg.get("cmd") == "stop":
            return None


def main(wire: Mapping[str, Any], conn: Connection, shared: Any) -> None:
    """Run one worker process. ``wire``: its :class:`ChildConfig`, as a plain dict
    (:meth:`ChildConfig.to_dict`)."""
    config = ChildConfig.from_dict(wire)
    os.environ.update(config.env)  # already in the spawn environment
    logging.basicConfig(level=config.log_level,
                        format=f"%(asctime)s [worker {config.slot}] %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the supervisor, which leads
    monitor = PipeMonitor(conn, shared)

    from mtq.broker.config import from_wire
    from mtq.broker.connection import connect
    from mtq.broker.consumer import Consumer, connection_name, default_worker_id
    from mtq.errors import MtqError, TargetError
    from mtq.workers.worker import Worker

    try:
        # named connections: once they are gone, the supervisor knows that no claim of
        # this process can still run, and sweeps what it held (Consumer.give_back_all)
        worker_id = default_worker_id()
        os.environ["MTQ_WORKER_ID"] = worker_id  # for the model's own logs
        consumer = Consumer(config.queue, settings=from_wire(config.settings),
                            worker_id=worker_id,
                            client=connect(config.url, name=connection_name(worker_id)))
        worker = Worker(config.target, config.queue, device=config.device,
                        monitor=monitor, supervisor=config.supervisor, consumer=consumer,
                        quarantine=config.quarantine, hand_off=config.hand_off,
                        options=dict(config.options), **config.overrides)
    except TargetError as exc:
        monitor.send("fatal", str(exc))
        sys.exit(EXIT_TARGET)
    except MtqError as exc:  # Redis unreachable, a bad URL: the supervisor restarts it
        monitor.send("setup_failed", f"{type(exc).__name__}: {exc}")
        sys.exit(EXIT_SETUP)
    monitor.send("hello", worker.worker_id)
    try:
        worker.setup()
    except Exception as exc:
        text = "".join(traceback.format_exception_only(exc)).strip()
        log.error("setup failed:\n%s", traceback.format_exc())
        monitor.send("setup_failed", text)
        sys.exit(EXIT_SETUP)
    monitor.send("ready", {"timeout_s": worker.policy.timeout_s,
                           "model": "/".join(worker.model.describe())})

    on_stop_signals(worker.stop, signals=(signal.SIGTERM,), exit_code=None)
    if config.standby:
        # a warm spare: set up, claiming nothing, until the supervisor promotes it in
        # place of a process that died (or stops it)
        go = _await_promotion(conn)
        if go is None:
            monitor.send("bye", worker.totals)
            sys.exit(EXIT_OK)
        config = dataclasses.replace(config, **go)

    def read_commands() -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the supervisor died: stop gracefully
                log.warning("lost the supervisor; stopping")
                worker.stop()
                return
            worker.command(msg)

    worker.restarts = config.restarts  # for the registry (and exporter)
    if config.draining:
        worker.command({"cmd": "drain"})
    elif config.paused:
        worker.slot.set_paused(True)
    threading.Thread(target=read_commands, name="mtq-control", daemon=True).start()
    worker.freeze_startup()
    worker.run()
    monitor.send("bye", worker.totals)
    sys.exit(EXIT_OK)
