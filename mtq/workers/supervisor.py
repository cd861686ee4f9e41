"""The supervisor: one worker process per device slot, kept alive and under control.

``mtq workers start TARGET --queue Q --devices cuda:0,cuda:1 --replicas 2`` runs a
:class:`Supervisor`. It starts ``replicas`` processes per device, forked from a fork
server that imported torch and mtq but never touched a device (so a start costs a
fork and the model's ``setup``), each pinned with ``CUDA_VISIBLE_DEVICES`` before
torch initialises CUDA, and then waits, without polling, on three things at once:
its children's pipes, their exit sentinels, and a wake-up socket (signals and
control messages).

* A child that dies is replaced at once by the device's warm standby (a process
  set up and waiting, claiming nothing; by default on the CPU only), or restarted
  with backoff. The tasks it was running go back to the head of their streams at
  once with the delivery counted (so a request that always kills its process ends
  dead-lettered after ``max_deliveries``); the tasks it had claimed but not
  started go back uncounted, including a claim it never got to report (found in
  Redis by its worker id once its connections are gone).
* A suspect (a task whose delivery ended with its process) is not run by the
  serving process that claims it: the supervisor runs it alone in a quarantine
  process, so that a poison request kills a serving process at most once.
* A child whose predict call runs past the model's ``timeout_s`` is killed (a
  hung kernel cannot be interrupted from a thread) and handled as above; so is one
  that froze (its beat, written without Redis, older than its fence), before
  another worker can take its tasks; and one whose call, every task of it cancelled
  or timed out, still runs ``cancel_grace_s`` later (:mod:`mtq.workers.fencing`).
* A target that cannot be loaded stops the supervisor at once with the error; a
  ``setup`` that fails again and again stops it after a few tries, with the error.
* SIGTERM / SIGINT: graceful drain (every child finishes its running batch and
  gives back what it claimed ahead); a second signal kills the children and gives
  their tasks back. Either ends within its bound whatever Redis does
  (:mod:`mtq.workers.stops`).
* Control messages on the queue's control channel: pause, resume, and the engine
  commands load, unload, reload, reset (to the children, whose engines answer
  them), drain, stop, scale (to the supervisor). A load or reload with new options
  that succeeds makes them the options of every process started after it.

A host (``mtq workers start --config host.toml``, :mod:`mtq.workers.hostfile`) is a
supervisor of several queues: each process runs one engine per queue
(:class:`~mtq.workers.host.Host`), with a consumer and a control channel per queue.
A dead process's tasks go back per engine, with its queue's consumer; a predict call
that overruns its engine's timeout kills the process, and only that call counts
against its tasks. Commands about an engine (load, unload, reload, reset, cancel) go to
the engine of the queue they came on; pause, resume, drain, stop and scale act on the whole host.
A host hands no suspect to a quarantine process: each process runs its suspects
alone itself (a quarantine process would host every engine again).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import wait
from typing import Any

from mtq.broker.config import SettingsSpec, to_wire
from mtq.errors import ConfigError
from mtq.workers import children, control, devices
from mtq.workers.child import ChildConfig
from mtq.workers.children import Child, drop
from mtq.workers.fencing import Fence
from mtq.workers.quarantine import Quarantine
from mtq.workers.restarts import Slot, Slots
from mtq.workers.served import Served
from mtq.workers.signals import Wakeup
from mtq.workers.standby import Standby
from mtq.workers.stops import Stops

# the tunables live in the part that reads them (restarts.RESTART_BASE_S,
# quarantine.QUARANTINE_IDLE_S ...): set them there
__all__ = ["EXIT_BAD_TARGET", "EXIT_SETUP_FAILED", "Supervisor"]

log = logging.getLogger(__name__)

#: the supervisor's exit codes when it gives up (the CLI's: 2 bad input, 1 the work failed)
EXIT_BAD_TARGET, EXIT_SETUP_FAILED = 2, 1


def _earliest(*deadlines: float | None) -> float | None:
    return min((d for d in deadlines if d is not None), default=None)


class Supervisor:
    """Starts and keeps ``replicas`` worker processes per device for one target.

    Its parts: the slots and their restarts (:mod:`mtq.workers.restarts`), the warm
    standbys (:mod:`mtq.workers.standby`), the quarantine process
    (:mod:`mtq.workers.quarantine`); each child is a :class:`~mtq.workers.children.Child`.
    The main loop asks each part what is due and when it next needs the loop."""

    def __init__(self, target: str = "", queue: str = "", *, url: str | None = None,
                 devices_spec: str = "cpu", replicas: int = 1,
                 settings: SettingsSpec = None, max_batch_size: int | None = None,
                 max_wait_ms: float | None = None, timeout_s: float | None = None,
                 log_level: int = logging.INFO, on_event: Callable[[str], None] | None = None,
                 standby: int | None = None, options: dict[str, str] | None = None,
                 engines: Sequence[Mapping[str, Any]] = (), memory_budget: int | None = None,
                 max_loaded: int | None = None) -> None:
        """``engines`` (a host: see mtq.workers.hostfile.EngineSpec.to_dict) in place of
        ``target`` and ``queue``; ``memory_budget`` and ``max_loaded`` are then each
        process's."""
        if replicas < 0:
            raise ConfigError(f"--replicas must be >= 0, got {replicas}")
        if standby is not None and not 0 <= standby <= 1:
            raise ConfigError(f"--standby must be 0 or 1, got {standby}")
        self.target = target
        self.devices = devices.parse_devices(devices_spec)
        self.replicas = replicas
        #: what its processes serve: one queue, or a host's engines (a consumer each)
        self.served = Served(target, queue, engines, url=url, settings=settings,
                             options=options)
        self.host, self.consumers = self.served.host, self.served.consumers
        self.consumer = self.consumers[0]
        self.queue = self.consumer.queue
        self.memory_budget, self.max_loaded = memory_budget, max_loaded
        self.url = url
        self.id = f"{socket.gethostname()}:{os.getpid()}:{os.urandom(2).hex()}"
        self.overrides = {k: v for k, v in (("max_batch_size", max_batch_size),
                                            ("max_wait_ms", max_wait_ms),
                                            ("timeout_s", timeout_s)) if v is not None}
        self.log_level = log_level
        self.on_event = on_event or (lambda msg: log.info("%s", msg))
        #: slot index -> its serving process
        self.children: dict[int, Child] = {}
        self.slots = Slots(self.devices)
        self.stopping = False
        self.draining = False
        self.error = ""
        self.exit_code = 0
        self._ctx = children.context()
        self._wake = Wakeup()
        self.stops = Stops(self.consumers, on_event=self.on_event, poke=self._wake.poke)
        self.standby = Standby(self.devices, standby, on_event=self.on_event,
                               spawn=lambda device: self._spawn(Slot(-1, device), spare=True))
        self.quarantine = Quarantine(
            self.consumer, on_event=self.on_event, on_give_up=self._no_hand_off,
            spawn=lambda: self._spawn(Slot(-2, self.devices[0]), quarantine=True),
            stops=self.stops)
        if self.host:
            self.quarantine.hand_off = False  # each process runs its suspects alone
        self._inbox: list[dict[str, Any]] = []
        self._inbox_lock = threading.Lock()
        self._signals = 0
        self.paused = False
        self._listeners: list[control.Listener] = []
        #: kills a child whose call overran its timeout, or that froze
        self.fence = Fence(min(c.lease_s() for c in self.consumers), self.host, self.on_event)
        #: the --autoscale thread (mtq.workers.autoscale.Autoscaler), set before run()
        self.autoscaler: Any = None
        self._resize()

    # -- public ------------------------------------------------------------------
    def _tagged(self, queue: str) -> Callable[[dict[str, Any]], None]:
        return lambda msg: self.request({**msg, "queue": queue})

    def request(self, msg: dict[str, Any]) -> None:
        """Queue a control command for the main loop (thread-safe, signal-safe)."""
        with self._inbox_lock:
            self._inbox.append(msg)
        self._wake.poke()

    def run(self) -> int:
        """Supervise until stopped; returns the exit code (0 clean, 2 a target that
        cannot be loaded, 1 set-up failing again and again), as ``mtq --help`` lists."""
        prev = {s: signal.signal(s, self._wake.on_signal) for s in (signal.SIGTERM,
                                                                     signal.SIGINT)}
        # each queue's commands, tagged with it (a host routes them to its engine)
        self._listeners = [control.Listener(c.redis, c.queue, self._tagged(c.queue))
                           for c in self.consumers]
        for listener in self._listeners:
            listener.start()
        if self.autoscaler is not None:
            self.autoscaler.start()
        try:
            self._loop()
        finally:
            if self.autoscaler is not None:
                self.autoscaler.close()
            self.stops.finish()
            for listener in self._listeners:  # a forced stop does not wait on Redis
                listener.close(timeout=0.1 if self.stops.forced_at else 2.0)
            for s, h in prev.items():
                signal.signal(s, h)
        if self.error:
            self.on_event(f"stopped: {self.error}")
            return self.exit_code
        return 0

    # -- main loop ---------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            self._handle_inbox()
            now = time.monotonic()
            if not self.stopping:
                for slot in self.slots.due(now, self.children):
                    self._spawn(slot)
                self.standby.tick(now, self.slots.used_devices(), self.draining)
            self.quarantine.tick(now, self.stopping, self.draining, bool(self.children))
            for line in self.stops.news():
                self.on_event(line)
            if self.stops.overdue(now):
                self.on_event("Redis still unreachable: forcing the stop")
                self._stop_all(force=True)
            if not self.children and not self.standby.spares and \
                    self.quarantine.process is None and self.stops.settled(now) and \
                    (self.stopping or (self.draining and not len(self.slots))):
                return
            waitables: list[Any] = [self._wake.reader]
            for c in self._all():
                waitables += [c.conn, c.process.sentinel]
            for ready in wait(waitables, timeout=self._next_deadline()):
                if ready is self._wake.reader:
                    self._wake.drain()
                    continue
                for c in self._all():
                    if ready is c.conn:
                        self._read(c)
                    elif ready == c.process.sentinel:
                        self._reap(c)
            self.fence.check(time.monotonic(), self._running())

    def _all(self) -> list[Child]:
        q = self.quarantine.process
        return [*self.children.values(), *self.standby.spares.values(),
                *([q] if q is not None else [])]

    def _running(self) -> list[Child]:
        """The processes that call the model: serving ones and the quarantine one."""
        q = self.quarantine.process
        return [*self.children.values(), *([q] if q is not None else [])]

    def _next_deadline(self) -> float | None:
        now = time.monotonic()
        out = self.fence.deadline(now, self._running())
        if not self.stopping:
            out = _earliest(out, self.slots.deadline(now, self.children),
                            self.standby.deadline(now, self.slots.used_devices(),
                                                  self.draining))
        out = _earliest(out, self.quarantine.deadline(now, self.stopping),
                        self.stops.next_in(now))
        return None if out is None else max(out, 0.0)

    # -- children ----------------------------------------------------------------
    def _spawn(self, slot: Slot, spare: bool = False, quarantine: bool = False) -> Child:
        """Start a process for ``slot`` (a serving one is recorded here; a standby or
        the quarantine process by its part)."""
        env, device = devices.child_env(slot.device)
        config = ChildConfig(
            target=self.target, queue=self.queue, url=self.url,
            settings=to_wire(self.consumer.broker.source), device=device, env=env,
            overrides=self.overrides, supervisor=self.id,
            slot="standby" if spare else "quarantine" if quarantine else slot.index,
            log_level=self.log_level, quarantine=quarantine,
            hand_off=self.quarantine.hand_off,
            # a replacement starts in the state the others are in, before it claims;
            # the quarantine process claims nothing: it runs what it is given
            paused=self.paused and not quarantine,
            draining=self.draining and not quarantine, standby=spare,
            restarts=slot.restarts, options=self.served.options, engines=self.served.wire(),
            memory_budget=self.memory_budget, max_loaded=self.max_loaded)
        c = children.start(self._ctx, config, slot.index, slot.device, spare=spare,
                           quarantine=quarantine)
        if not spare and not quarantine:
            slot.progress = False
            self.children[slot.index] = c
        log.debug("spawned %s on %s (pid %s)", "a standby" if spare else f"worker {slot.index}",
                  slot.device, c.process.pid)
        return c

    def _read(self, c: Child) -> None:
        try:
            while c.conn.poll():
                self._message(c, c.conn.recv())
        except (EOFError, OSError):
            pass  # it exited; the sentinel handles the rest

    def _message(self, c: Child, msg: tuple[Any, ...]) -> None:
        kind, i, body = msg  # (kind, engine index or -1 for the process, body)
        e = c.engines[i] if 0 <= i < len(c.engines) else None
        if kind == "held" and e is not None:
            e.held.update(dict(body))
        elif kind == "batch" and e is not None:
            e.batch = list(body)
        elif kind == "settled" and e is not None:
            drop(e.held, body)
            if body and not c.quarantine:
                self.slots.progressed(c.slot)
        elif kind == "hello" and e is not None:
            e.worker_id = body
        elif kind == "quarantine":  # a suspect c claimed: it runs in the quarantine process
            self.quarantine.suspect(list(body), self.stopping)
        elif kind == "ready" and e is not None:
            e.ready, e.timeout_s, e.model = True, body.get("timeout_s"), body.get("model")
            if not all(x.ready for x in c.engines):
                return
            c.ready = True
            if c.quarantine:
                self.quarantine.ready()
            elif c.spare:
                self.standby.ready(c)
            else:
                self.on_event(f"worker {c.slot} ready on {c.device} (pid {c.process.pid}, "
                              f"{c.models(self.host)})")
        elif kind == "reloaded" and e is not None:
            e.timeout_s, e.model = body.get("timeout_s"), body.get("model")
            of = f" queue {e.queue!r}" if self.host else ""
            self.on_event(f"worker {c.slot}{of} reloaded ({e.model})")
            self._adopt_options(i, body.get("options"))
        elif kind == "bye":
            c.bye = True
        elif kind == "aborted" and e is not None:  # killed if that call outlives the grace
            self.fence.aborted(c, i, dict(body), time.monotonic())
        elif kind in ("fatal", "setup_failed"):
            c.fatal = c.fatal or kind == "fatal"
            c.error = f"queue {e.queue!r}: {body}" if self.host and e is not None else body

    def _adopt_options(self, i: int, options: Any) -> None:
        """Engine ``i`` of a process loaded its model with ``options``: if a load or
        reload to every process asked for them, the processes started from now on
        (restarts, scale-ups, standbys) start with them, and the standby and
        quarantine processes, which hold the old ones, are replaced (Served.adopt)."""
        adopted = self.served.adopt(i, options)
        if adopted is not None:
            self.on_event(adopted)
            self.standby.retire_all(reload=True)
            self.quarantine.retire()

    def _reap(self, c: Child) -> None:
        self._read(c)
        c.process.join(timeout=5)
        code = c.process.exitcode
        c.conn.close()
        if c.spare:
            self.standby.reaped(c, code, self.stopping)
            return
        if c.quarantine:
            self.quarantine.reaped(c, code, self.stopping)
            return
        del self.children[c.slot]
        self.stops.give_back(self.consumers, c, self.quarantine.elsewhere(), code)
        slot = self.slots.get(c.slot)
        if c.fatal:
            self.error, self.exit_code = c.error, EXIT_BAD_TARGET
            self._stop_all()
            return
        if slot is None or self.stopping or c.retiring or (self.draining and code == 0):
            if slot is not None and (self.draining or c.retiring):
                self.slots.remove(c.slot)
            return
        if c.abandoned or c.overran is not None:
            # killed on purpose to stop a call past its timeout or that nobody wanted
            # any more: its tasks settled (TaskTimeout, cancelled), not a crash in a row
            slot.progress = True
        delay = self.slots.crashed(slot, c.ready)
        if delay is None:
            self.error = (f"worker {c.slot} failed during setup {slot.crashes} times in a "
                          f"row; last error: {c.error or f'exit code {code}'}")
            self.exit_code = EXIT_SETUP_FAILED
            self._stop_all()
            return
        why = c.killed_for or f"exit code {code}"
        spare = self.standby.promote(c.device, delay) if c.ready else None
        if spare is not None:
            # the warm standby takes its place at once; a new standby follows
            spare.slot = c.slot
            self.children[c.slot] = spare
            slot.progress = False
            spare.send({"cmd": "go", "paused": self.paused, "draining": self.draining,
                        "restarts": slot.restarts})
            if not self.quarantine.hand_off:
                spare.send({"cmd": "hand_off", "on": False})
            self.on_event(f"worker {c.slot} ({c.worker_id}) died ({why}); its standby (pid "
                          f"{spare.process.pid}) took over")
            return
        slot.due = time.monotonic() + delay
        self.on_event(f"worker {c.slot} ({c.worker_id or 'starting'}) died ({why}); "
                      f"restarting in {delay:.1f} s")

    def _no_hand_off(self) -> None:
        """The quarantine process cannot be had: each serving process runs its suspects
        alone itself."""
        for ch in self.children.values():
            ch.send({"cmd": "hand_off", "on": False})

    def _stop_all(self, force: bool = False) -> None:
        self.stopping = True
        self.stops.begin(force)  # from now on, give-backs are bounded
        self.quarantine.release_all()
        for c in self._all():
            if force:
                c.forced = True
                c.process.kill()
            else:
                c.send({"cmd": "stop"})

    # -- control -----------------------------------------------------------------
    def _resize(self) -> None:
        """Add slots on the least used devices, or retire the newest slots of the most
        used ones, until there are replicas x devices."""
        for index in self.slots.resize(self.replicas * len(self.devices)):
            c = self.children.get(index)
            if c is not None:
                c.retiring = True
                c.send({"cmd": "stop"})

    def _handle_inbox(self) -> None:
        pending = self._wake.new_signals()
        with self._inbox_lock:
            msgs, self._inbox = self._inbox, []
        msgs += [{"cmd": "signal"}] * pending
        for msg in msgs:
            self._command(msg)

    def _command(self, msg: dict[str, Any]) -> None:
        cmd = msg.get("cmd")
        if msg.get("supervisor") not in (None, "", self.id):
            return
        worker = msg.get("worker")
        if cmd == "signal":
            self._signals += 1
            if self._signals == 1:
                self.on_event("stopping: finishing running batches (signal again to force)")
                self._stop_all()
            else:
                self.on_event("forced stop: killing workers, giving their tasks back")
                self._stop_all(force=True)
        elif cmd in ("pause", "resume"):
            if not worker:
                self.paused = cmd == "pause"
            for c in self.children.values():
                if not worker or c.has(worker):
                    c.send({"cmd": cmd})  # (a host: every engine)
        elif cmd in control.ENGINE_COMMANDS:  # load, unload, reload, reset: each engine answers
            fields = ("cmd", "reply", "options", "now", "worker", "queue")
            forward: dict[str, Any] = {k: msg[k] for k in fields if k in msg}
            for c in self.children.values():
                if not worker or c.has(worker):
                    c.send(self.served.route(forward, msg))
            if cmd in ("load", "reload") and msg.get("options") and not worker:
                # adopted for the processes started from now on once one of them
                # reports it loaded with these ("reloaded")
                self.served.ask(msg.get("queue"), msg["options"])
            if cmd == "reload" and not worker:
                # they hold the old code; fresh ones import the new (and may fail again)
                self.standby.retire_all(reload=True)
                self.quarantine.retire()
        elif cmd == "cancel":  # published by cancel.lua, addressed to the task's worker
            for c in self.children.values():
                if not worker or c.has(worker):
                    c.send(self.served.route({"cmd": "cancel", "ids": msg.get("ids") or []}, msg))
            qc = self.quarantine.process
            if qc is not None:  # it runs suspects under their claimer's id
                qc.send({"cmd": "cancel", "ids": msg.get("ids") or []})
        elif cmd == "stop" and not worker:
            self.on_event("stop requested")
            self._stop_all()
        elif cmd == "drain" and not worker:
            self.on_event("drain requested: working until the queue is empty")
            self.draining = True
            for c in self.children.values():
                c.send({"cmd": "drain"})
            self.standby.retire_all()
        elif cmd in ("stop", "drain"):  # one worker: it leaves for good
            for c in self.children.values():
                if c.has(worker):  # in a host, the process of that engine
                    c.retiring = True
                    c.send({"cmd": cmd})
        elif cmd == "scale":
            try:
                n = int(msg["replicas"])
                if n < 0:
                    raise ValueError(n)
            except (KeyError, TypeError, ValueError):
                log.warning("bad scale command %r ignored", msg)
                return
            self.on_event(f"scaling to {n} replica(s) per device")
            self.replicas = n
            self._resize()
        else:
            log.warning("unknown control command %r ignored", msg)
