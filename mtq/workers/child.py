"""The entry point of a worker process started by the supervisor (spawned, never forked).

It reports to the supervisor over a pipe: its worker id, that its model is set up,
which tasks it holds and which it is running (so a supervisor that sees it die can
give them back at once), and, through a small shared array, when the current
predict call started (so the supervisor can kill it when the call overruns its
timeout; a hung kernel cannot be interrupted from a thread).

A host process (``mtq workers start --config host.toml``) runs several engines, one
per queue, each a :class:`~mtq.workers.worker.Worker` with its own worker id, in a
:class:`~mtq.workers.host.Host`. Every message on the pipe is ``(kind, engine,
body)``: ``engine`` is the index of the engine it is about (-1: the process), and
the shared array has :data:`SLOTS` slots per engine (:func:`at`). A process with one
worker is engine 0.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from mtq.workers.signals import on_stop_signals
from mtq.workers.worker import Monitor, Worker

#: exit codes the supervisor reads
EXIT_OK = 0
EXIT_TARGET = 3   # the target cannot be loaded: do not restart, report
EXIT_SETUP = 4    # setup() raised: restart with backoff, give up after a few in a row

# shared array layout, per engine: predict call started at (time.monotonic(), 0 = idle),
# first, end item, its lease (s, 0 = not known yet); after the engines', the process's
# last sign of life (time.monotonic(): mtq.workers.fencing)
STARTED, LO, HI, LEASE = 0, 1, 2, 3
SLOTS = 4


def at(engine: int, slot: int) -> int:
    """The index in the shared array of ``slot`` (STARTED, LO, HI, LEASE) of ``engine``."""
    return SLOTS * engine + slot


def beat_at(engines: int) -> int:
    """The index of the process's sign of life, in a process of ``engines`` engines."""
    return SLOTS * engines

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
    #: a host process: its engines, each a plain dict (queue, target, options,
    #: overrides, on_demand, idle_unload_s, memory, settings: see
    #: mtq.workers.hostfile.EngineSpec.to_dict); empty: one worker of target and queue
    engines: Sequence[Mapping[str, Any]] = ()
    #: a host process's budget: bytes of model tensors, most engines loaded at once
    memory_budget: int | None = None
    max_loaded: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The plain form that crosses the process boundary."""
        out = dataclasses.asdict(self)
        out["env"], out["overrides"] = dict(self.env), dict(self.overrides)
        out["options"] = dict(self.options)
        out["engines"] = [dict(e) for e in self.engines]
        return out

    def engine_list(self) -> list[dict[str, Any]]:
        """Its engines; a process of one worker has one, made of target and queue."""
        if self.engines:
            return [dict(e) for e in self.engines]
        return [{"queue": self.queue, "target": self.target, "options": dict(self.options),
                 "overrides": dict(self.overrides), "settings": self.settings}]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ChildConfig:
        return cls(**data)


class Pipe:
    """The child's end of the supervisor link, shared by its engines (thread-safe)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()

    def send(self, kind: str, engine: int, body: Any = None) -> None:
        with self.lock:
            try:
                self.conn.send((kind, engine, body))
            except (OSError, ValueError):  # the supervisor is gone; the reader thread stops us
                pass


class PipeMonitor(Monitor):
    """What one engine tells the supervisor (thread-safe)."""

    def __init__(self, pipe: Pipe, shared: Any, engine: int = 0) -> None:
        self.pipe = pipe
        self.shared = shared
        self.engine = engine
        #: its worker's ledger (set once the worker is made): what an aborted call's
        #: tasks are, for the supervisor to settle them
        self.ledger: Any = None

    def send(self, kind: str, body: Any = None) -> None:
        self.pipe.send(kind, self.engine, body)

    def held(self, leases: Sequence[tuple[str, str]]) -> None:
        self.send("held", list(leases))

    def batch(self, leases: Sequence[tuple[str, str]]) -> None:
        self.send("batch", list(leases))

    def call(self, lo: int, hi: int) -> None:
        import time

        self.shared[at(self.engine, LO)] = lo
        self.shared[at(self.engine, HI)] = hi
        self.shared[at(self.engine, STARTED)] = time.monotonic()

    def idle(self) -> None:
        self.shared[at(self.engine, STARTED)] = 0.0

    def settled(self, leases: Sequence[tuple[str, str]]) -> None:
        self.send("settled", list(leases))

    def reloaded(self, timeout_s: float | None, model: str,
                 options: dict[str, str] | None = None) -> None:
        self.send("reloaded", {"timeout_s": timeout_s, "model": model,
                               "options": None if options is None else dict(options)})

    def aborted(self, reasons: Mapping[str, str], grace_s: float) -> None:
        """Tell the supervisor, with what it needs to settle them if it kills the
        process: each task's lease, attempts, deliveries, retries, reason and (a
        timeout) its error; and which call it is (its start, as in the shared array:
        the next call or idle changes it)."""
        from mtq.errors import TaskTimeout

        tasks: list[list[Any]] = []
        ledger = self.ledger
        if ledger is not None:
            with ledger.lock:
                for i, why in reasons.items():
                    t = ledger.held.get(i)
                    if t is None:
                        continue
                    dl = ledger.deadlines.get(i)
                    error = f"TaskTimeout: {TaskTimeout(dl[1] if dl else None)}" \
                        if why == "timeout" else ""
                    tasks.append([t.id, t.token, t.attempts, t.deliveries, t.retries, why,
                                  error])
        self.send("aborted", {"tasks": tasks, "grace_s": float(grace_s),
                              "started": float(self.shared[at(self.engine, STARTED)])})

    def quarantine(self, task: Any) -> bool:
        self.send("quarantine", [task.id, task.token, task.payload, task.stream, task.attempts,
                                 task.deliveries, task.retries, task.age_ms, task.live_until,
                                 task.traceparent, task.claimed_at, task.timeout_ms])
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


def _engine(config: ChildConfig, spec: Mapping[str, Any], monitor: PipeMonitor,
            first: bool) -> Worker:
    """One engine: a Worker with a Consumer, worker id and named connections of its own
    (once they are gone, the supervisor knows that no claim of it can still run, and
    sweeps what it held: Consumer.give_back_all)."""
    from mtq.broker.config import from_wire
    from mtq.broker.connection import connect
    from mtq.broker.consumer import Consumer, connection_name, default_worker_id
    from mtq.workers.worker import Worker

    worker_id = default_worker_id()
    if first:
        os.environ["MTQ_WORKER_ID"] = worker_id  # for the model's own logs
    consumer = Consumer(spec["queue"], settings=from_wire(spec.get("settings")),
                        worker_id=worker_id,
                        client=connect(config.url, name=connection_name(worker_id)))
    w = Worker(spec["target"], spec["queue"], device=config.device, monitor=monitor,
               supervisor=config.supervisor, consumer=consumer,
               quarantine=config.quarantine, hand_off=config.hand_off,
               options=dict(spec.get("options") or {}), **dict(spec.get("overrides") or {}),
               on_demand=bool(spec.get("on_demand")), idle_unload_s=spec.get("idle_unload_s"),
               memory_bytes=spec.get("memory"))
    monitor.ledger = w.ledger
    return w


def _lease_of(w: Worker) -> Callable[[], float]:
    """The lease ``w``'s heartbeat last extended with (s; no Redis asked)."""
    return lambda: w.heartbeat.lease_s


def _describe(w: Worker) -> str:
    return "/".join(w.model.describe())


def main(wire: Mapping[str, Any], conn: Connection, shared: Any) -> None:
    """Run one worker process. ``wire``: its :class:`ChildConfig`, as a plain dict
    (:meth:`ChildConfig.to_dict`)."""
    config = ChildConfig.from_dict(wire)
    os.environ.update(config.env)  # already in the spawn environment
    logging.basicConfig(level=config.log_level,
                        format=f"%(asctime)s [worker {config.slot}] %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the supervisor, which leads
    pipe = Pipe(conn)

    from mtq.errors import MtqError, TargetError
    from mtq.workers.beat import Beat
    from mtq.workers.host import Host

    # its sign of life, from the start (set-up included), to the supervisor's fence
    beat = Beat(shared, beat_at(len(config.engine_list())), lambda i: at(i, LEASE))
    beat.start()

    workers: list[Worker] = []
    for i, spec in enumerate(config.engine_list()):
        try:
            w = _engine(config, spec, PipeMonitor(pipe, shared, i), first=not workers)
        except TargetError as exc:
            pipe.send("fatal", i, str(exc))
            sys.exit(EXIT_TARGET)
        except MtqError as exc:  # Redis unreachable, a bad URL: the supervisor restarts it
            pipe.send("setup_failed", i, f"{type(exc).__name__}: {exc}")
            sys.exit(EXIT_SETUP)
        pipe.send("hello", i, w.worker_id)
        workers.append(w)
        beat.leases.append(_lease_of(w))
    specs = config.engine_list()

    def rebuild(i: int, options: dict[str, str]) -> Worker:
        """Engine ``i`` made again after it failed, with the options it served."""
        w = _engine(config, {**specs[i], "options": options}, PipeMonitor(pipe, shared, i),
                    first=False)
        pipe.send("hello", i, w.worker_id)
        beat.leases[i] = _lease_of(w)
        return w

    host = Host(workers, memory_budget=config.memory_budget, max_loaded=config.max_loaded,
                rebuild=rebuild) if config.engines else None
    try:
        if host is not None:
            host.setup()  # the engines not loaded on demand, within the budget
        else:
            workers[0].setup()
    except Exception as exc:
        text = "".join(traceback.format_exception_only(exc)).strip()
        log.error("setup failed:\n%s", traceback.format_exc())
        pipe.send("setup_failed", -1, text)
        sys.exit(EXIT_SETUP)
    for i, w in enumerate(workers):
        pipe.send("ready", i, {"timeout_s": w.policy.timeout_s, "model": _describe(w)})

    stop = host.stop if host is not None else workers[0].stop
    command = host.command if host is not None else workers[0].command
    on_stop_signals(stop, signals=(signal.SIGTERM,), exit_code=None)
    if config.standby:
        # a warm spare: set up, claiming nothing, until the supervisor promotes it in
        # place of a process that died (or stops it)
        go = _await_promotion(conn)
        if go is None:
            pipe.send("bye", -1, {})
            sys.exit(EXIT_OK)
        config = dataclasses.replace(config, **go)

    def read_commands() -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the supervisor died: stop gracefully
                log.warning("lost the supervisor; stopping")
                stop()
                return
            command(msg)

    for w in workers:
        w.restarts = config.restarts  # for the registry (and exporter)
    if config.draining:
        command({"cmd": "drain"})
    elif config.paused:
        for w in workers:
            w.slot.set_paused(True)
    threading.Thread(target=read_commands, name="mtq-control", daemon=True).start()
    Worker.freeze_startup()
    totals: Any = host.run() if host is not None else workers[0].run()
    pipe.send("bye", -1, totals)
    sys.exit(EXIT_OK)
