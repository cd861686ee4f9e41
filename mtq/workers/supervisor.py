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
  hung kernel cannot be interrupted from a thread) and handled as above.
* A target that cannot be loaded stops the supervisor at once with the error; a
  ``setup`` that fails again and again stops it after a few tries, with the error.
* SIGTERM / SIGINT: graceful drain (every child finishes its running batch and
  gives back what it claimed ahead); a second signal kills the children and gives
  their tasks back.
* Control messages on the queue's control channel: pause, resume, reload (to the
  children), drain, stop, scale (to the supervisor).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from mtq.broker.config import SettingsSpec, to_wire
from mtq.broker.consumer import Consumer, connection_name
from mtq.broker.protocol import Claimed
from mtq.errors import ConfigError, MtqError
from mtq.workers import child, control, devices, registry

log = logging.getLogger(__name__)

#: a child that dies before set-up this many times in a row stops the supervisor
MAX_SETUP_FAILURES = 3
#: restart delay after a crash: BASE * 2**(crashes in a row - 1), at most MAX
RESTART_BASE_S, RESTART_MAX_S = 0.1, 30.0
#: the quarantine process stops after this long with no suspect to run
QUARANTINE_IDLE_S = 30.0


@dataclass
class _Child:
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


@dataclass
class _Slot:
    index: int
    device: str
    crashes: int = 0        # in a row without progress
    due: float = 0.0        # when to (re)start it
    progress: bool = False  # a task settled since the last restart
    restarts: int = 0       # times its process was replaced (reported by the worker)


def _drop(held: dict[str, str], leases: list[list[str]]) -> None:
    """Forget the deliveries a child settled (by token: the id may be held again, under
    a new lease, by the time its settle is read)."""
    for i, token in leases:
        if held.get(i) == token:
            del held[i]


def _context() -> Any:
    """How worker processes start: forked from a fork server that imported torch and
    mtq once (never CUDA: nothing there touches a device), so a start or restart costs
    a fork and the model's own ``setup``, not a new interpreter importing torch (about
    2 CPU-seconds). Where there is no fork server, spawned."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["mtq.workers.child", "torch"])  # a missing module is skipped
    return ctx


#: the supervisor's exit codes when it gives up (the CLI's: 2 bad input, 1 the work failed)
EXIT_BAD_TARGET, EXIT_SETUP_FAILED = 2, 1


class Supervisor:
    """Starts and keeps ``replicas`` worker processes per device for one target."""

    def __init__(self, target: str, queue: str, *, url: str | None = None,
                 devices_spec: str = "cpu", replicas: int = 1,
                 settings: SettingsSpec = None, max_batch_size: int | None = None,
                 max_wait_ms: float | None = None, timeout_s: float | None = None,
                 log_level: int = logging.INFO, on_event: Callable[[str], None] | None = None,
                 standby: int | None = None) -> None:
        if replicas < 0:
            raise ConfigError(f"--replicas must be >= 0, got {replicas}")
        if standby is not None and not 0 <= standby <= 1:
            raise ConfigError(f"--standby must be 0 or 1, got {standby}")
        self.target = target
        self.devices = devices.parse_devices(devices_spec)
        self.replicas = replicas
        self.consumer = Consumer(queue, url, settings=settings)
        self.queue = self.consumer.queue
        self.url = url
        self.id = f"{socket.gethostname()}:{os.getpid()}:{os.urandom(2).hex()}"
        self.overrides = {k: v for k, v in (("max_batch_size", max_batch_size),
                                            ("max_wait_ms", max_wait_ms),
                                            ("timeout_s", timeout_s)) if v is not None}
        self.log_level = log_level
        self.on_event = on_event or (lambda msg: log.info("%s", msg))
        self.children: dict[int, _Child] = {}
        self.slots: dict[int, _Slot] = {}
        self.stopping = False
        self.draining = False
        self.error = ""
        self.exit_code = 0
        self._ctx = _context()
        #: a warm standby per device (see the module docstring); None: 1 on the CPU,
        #: 0 on a GPU (it would hold a second copy of the model in device memory)
        self.standby = standby
        self.spares: dict[str, _Child] = {}
        self._spare_due: dict[str, float] = {}
        self._spare_failures: dict[str, int] = {}
        #: the quarantine process (started when a suspect first needs it) and the
        #: suspects waiting for it, as the fields of a Claimed
        self.quarantine: _Child | None = None
        self._suspects: list[list[Any]] = []
        self._suspects_extended = 0.0
        self._quarantine_idle_since: float | None = None
        self._quarantine_failures = 0
        self._quarantine_due = 0.0
        #: False once the quarantine process failed to set up again and again: the
        #: serving processes then run their suspects alone themselves
        self.hand_off = True
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._inbox: list[dict[str, Any]] = []
        self._inbox_lock = threading.Lock()
        self._signals = 0
        self._signals_received = 0
        self._signals_seen = 0
        self.paused = False
        self._listener: control.Listener | None = None
        self._next_slot = 0
        self._resize()

    # -- public ------------------------------------------------------------------
    def request(self, msg: dict[str, Any]) -> None:
        """Queue a control command for the main loop (thread-safe, signal-safe)."""
        with self._inbox_lock:
            self._inbox.append(msg)
        self._poke()

    def run(self) -> int:
        """Supervise until stopped; returns the exit code (0 clean, 2 a target that
        cannot be loaded, 1 set-up failing again and again), as ``mtq --help`` lists."""
        prev = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        self._listener = control.Listener(self.consumer.redis, self.queue, self.request)
        self._listener.start()
        try:
            self._loop()
        finally:
            self._listener.close()
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
                for slot in list(self.slots.values()):
                    if slot.index not in self.children and slot.due <= now:
                        self._spawn(slot)
                wanted = self._spare_devices()
                for device in wanted:
                    if device not in self.spares and self._spare_due.get(device, 0.0) <= now:
                        self._spawn(_Slot(-1, device), spare=True)
                for device, c in self.spares.items():
                    if device not in wanted and not c.retiring:
                        c.retiring = True
                        self._send(c, {"cmd": "stop"})
            if not self.stopping and self._suspects and self.quarantine is None and \
                    self._quarantine_due <= now:
                self._spawn(_Slot(-2, self.devices[0]), quarantine=True)
            self._extend_suspects(now)
            qc = self.quarantine
            if qc is not None and not qc.retiring:
                idle = qc.ready and not qc.held and not self._suspects
                if not idle:
                    self._quarantine_idle_since = None
                elif self._quarantine_idle_since is None:
                    self._quarantine_idle_since = now
                # it stops once the queue drained, or after a while with nothing to run
                if (self.draining and not self.children) or (idle and now - (
                        self._quarantine_idle_since or now) >= QUARANTINE_IDLE_S):
                    self._retire_quarantine()
            if not self.children and not self.spares and self.quarantine is None and \
                    (self.stopping or (self.draining and not self.slots)):
                return
            waitables: list[Any] = [self._wake_r]
            for c in self._all():
                waitables += [c.conn, c.process.sentinel]
            for ready in wait(waitables, timeout=self._next_deadline()):
                if ready is self._wake_r:
                    self._drain_wake()
                    continue
                for c in self._all():
                    if ready is c.conn:
                        self._read(c)
                    elif ready == c.process.sentinel:
                        self._reap(c)
            self._check_timeouts()

    def _all(self) -> list[_Child]:
        q = [self.quarantine] if self.quarantine is not None else []
        return [*self.children.values(), *self.spares.values(), *q]

    def _spare_devices(self) -> list[str]:
        """Devices that should have a warm standby now."""
        if self.draining or self.stopping:
            return []
        used = {slot.device for slot in self.slots.values()}
        out = []
        for d in self.devices:
            want = self.standby if self.standby is not None else int(d == "cpu")
            if want and d in used and self._spare_failures.get(d, 0) < MAX_SETUP_FAILURES:
                out.append(d)
        return out

    def _next_deadline(self) -> float | None:
        now = time.monotonic()
        out: float | None = None
        for c in self._running():
            if c.timeout_s and not c.killed_for:  # a killed one is waited for by its sentinel
                started = c.shared[child.STARTED]
                d = (started + c.timeout_s - now) if started else c.timeout_s / 4
                out = d if out is None else min(out, d)
        if not self.stopping:
            for slot in self.slots.values():
                if slot.index not in self.children:
                    d = slot.due - now
                    out = d if out is None else min(out, d)
            for device in self._spare_devices():
                if device not in self.spares:
                    d = self._spare_due.get(device, 0.0) - now
                    out = d if out is None else min(out, d)
        if self._suspects:
            d = self._suspects_extended + self.consumer.settings.lease_ms / 3000 - now
            out = d if out is None else min(out, d)
            if self.quarantine is None and not self.stopping:
                d = self._quarantine_due - now
                out = d if out is None else min(out, d)
        if self._quarantine_idle_since is not None:
            d = self._quarantine_idle_since + QUARANTINE_IDLE_S - now
            out = d if out is None else min(out, d)
        return None if out is None else max(out, 0.0)

    def _running(self) -> list[_Child]:
        """The processes that call the model: serving ones and the quarantine one."""
        q = [self.quarantine] if self.quarantine is not None else []
        return [*self.children.values(), *q]

    def _check_timeouts(self) -> None:
        now = time.monotonic()
        for c in self._running():
            started = c.shared[child.STARTED]
            if c.timeout_s and started and now - started > c.timeout_s and not c.killed_for:
                c.killed_for = f"predict ran past its {c.timeout_s:g} s timeout"
                who = "the quarantine process" if c.quarantine else f"worker {c.slot}"
                self.on_event(f"{who} ({c.worker_id}): {c.killed_for}; killing it")
                c.process.kill()

    # -- children ----------------------------------------------------------------
    def _spawn(self, slot: _Slot, spare: bool = False, quarantine: bool = False) -> None:
        env, device = devices.child_env(slot.device)
        config = {"target": self.target, "queue": self.queue, "url": self.url,
                  "settings": to_wire(self.consumer.broker.source), "device": device, "env": env,
                  "overrides": self.overrides, "supervisor": self.id,
                  "slot": "standby" if spare else "quarantine" if quarantine else slot.index,
                  "log_level": self.log_level, "quarantine": quarantine,
                  "hand_off": self.hand_off,
                  # a replacement starts in the state the others are in, before it claims;
                  # the quarantine process claims nothing: it runs what it is given
                  "paused": self.paused and not quarantine,
                  "draining": self.draining and not quarantine, "standby": spare,
                  "restarts": slot.restarts}
        if self._ctx.get_start_method() == "forkserver":
            # started (once) before the environment below is changed for this child:
            # the server carries no child's pinning; each child sets its own first thing
            from multiprocessing import forkserver

            forkserver.ensure_running()
        parent, kid = self._ctx.Pipe()
        shared = self._ctx.RawArray("d", 3)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # the spawned interpreter starts with this environment
        try:
            p = self._ctx.Process(target=child.main, args=(config, kid, shared),
                                  name=f"mtq-worker-{slot.index}", daemon=False)
            p.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        kid.close()
        c = _Child(slot.index, slot.device, p, parent, shared, time.monotonic(), spare=spare,
                   quarantine=quarantine)
        if quarantine:
            self.quarantine = c
        elif spare:
            self.spares[slot.device] = c
        else:
            slot.progress = False
            self.children[slot.index] = c
        log.debug("spawned %s on %s (pid %s)", "a standby" if spare else f"worker {slot.index}",
                  slot.device, p.pid)

    def _read(self, c: _Child) -> None:
        try:
            while c.conn.poll():
                self._message(c, c.conn.recv())
        except (EOFError, OSError):
            pass  # it exited; the sentinel handles the rest

    def _message(self, c: _Child, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "held":
            c.held.update(dict(msg[1]))
        elif kind == "batch":
            c.batch = list(msg[1])
        elif kind == "settled" and c.quarantine:
            _drop(c.held, msg[1])
        elif kind == "settled":
            slot = self.slots.get(c.slot)
            _drop(c.held, msg[1])
            if slot is not None and msg[1]:
                slot.progress = True
                slot.crashes = 0
        elif kind == "hello":
            c.worker_id = msg[1]
        elif kind == "quarantine":  # a suspect c claimed: it runs in the quarantine process
            if self.stopping:  # nothing will run it: back to its stream, unrun
                self._release_suspects([list(msg[1])])
            else:
                self._suspects.append(list(msg[1]))
                self._dispatch_suspects()
        elif kind == "ready":
            c.ready = True
            c.timeout_s = msg[1].get("timeout_s")
            if c.quarantine:
                self._quarantine_failures = 0
                self._dispatch_suspects()
            elif c.spare:
                self._spare_failures[c.device] = 0
                self.on_event(f"standby ready on {c.device} (pid {c.process.pid})")
            else:
                self.on_event(f"worker {c.slot} ready on {c.device} (pid {c.process.pid}, "
                              f"{msg[1].get('model')})")
        elif kind == "reloaded":
            c.timeout_s = msg[1].get("timeout_s")
            self.on_event(f"worker {c.slot} reloaded ({msg[1].get('model')})")
        elif kind == "fatal":
            c.fatal, c.error = True, msg[1]
        elif kind == "setup_failed":
            c.error = msg[1]

    def _reap(self, c: _Child) -> None:
        self._read(c)
        c.process.join(timeout=5)
        code = c.process.exitcode
        c.conn.close()
        if c.spare:
            self._reap_spare(c, code)
            return
        if c.quarantine:
            self.quarantine = None
            self._quarantine_idle_since = None
            self._give_back(c)  # what it ran goes back counted: dead at max_deliveries
            if c.worker_id and code != 0:
                try:
                    registry.remove(self.consumer.redis, c.worker_id)
                except MtqError:
                    log.debug("could not remove worker %s from the registry", c.worker_id)
            if c.fatal and not self.stopping:  # cannot load the target: no use trying again
                self._quarantine_failures = MAX_SETUP_FAILURES - 1
                self._quarantine_setup_failed(c, code)
            elif not c.ready and not self.stopping:
                self._quarantine_setup_failed(c, code)
            elif code != 0 and not self.stopping:
                self.on_event(f"the quarantine process ({c.worker_id}) died "
                              f"({c.killed_for or f'exit code {code}'}) running a suspect; "
                              f"{len(self._suspects)} more wait")
            return
        del self.children[c.slot]
        self._give_back(c)
        if c.worker_id and code != 0:  # it could not remove its own registry entry
            try:
                registry.remove(self.consumer.redis, c.worker_id)
            except MtqError:
                log.debug("could not remove worker %s from the registry", c.worker_id)
        slot = self.slots.get(c.slot)
        if c.fatal:
            self.error, self.exit_code = c.error, EXIT_BAD_TARGET
            self._stop_all()
            return
        if slot is None or self.stopping or c.retiring or (self.draining and code == 0):
            if slot is not None and (self.draining or c.retiring):
                self.slots.pop(c.slot, None)
            return
        if not c.ready:
            slot.crashes += 1
            if slot.crashes >= MAX_SETUP_FAILURES:
                self.error = (f"worker {c.slot} failed during setup {slot.crashes} times in a "
                              f"row; last error: {c.error or f'exit code {code}'}")
                self.exit_code = EXIT_SETUP_FAILED
                self._stop_all()
                return
        elif not slot.progress:
            slot.crashes += 1
        else:
            slot.crashes = 1
        delay = min(RESTART_MAX_S, RESTART_BASE_S * 2 ** (slot.crashes - 1))
        slot.restarts += 1
        why = c.killed_for or f"exit code {code}"
        spare = self.spares.get(c.device)
        if c.ready and spare is not None and spare.ready and not spare.retiring:
            # the warm standby takes its place at once; a new standby follows
            del self.spares[c.device]
            spare.spare, spare.slot = False, c.slot
            self.children[c.slot] = spare
            slot.progress = False
            self._send(spare, {"cmd": "go", "paused": self.paused, "draining": self.draining,
                               "restarts": slot.restarts})
            if not self.hand_off:
                self._send(spare, {"cmd": "hand_off", "on": False})
            self._spare_due[c.device] = time.monotonic() + delay
            self.on_event(f"worker {c.slot} ({c.worker_id}) died ({why}); its standby (pid "
                          f"{spare.process.pid}) took over")
            return
        slot.due = time.monotonic() + delay
        self.on_event(f"worker {c.slot} ({c.worker_id or 'starting'}) died ({why}); "
                      f"restarting in {delay:.1f} s")

    def _quarantine_setup_failed(self, c: _Child, code: int | None) -> None:
        """The quarantine process died before it was set up (out of device memory for
        a second copy of the model, say): try again later; after a few tries, let the
        serving processes run their suspects alone themselves."""
        self._quarantine_failures += 1
        why = c.error or f"exit code {code}"
        if self._quarantine_failures < MAX_SETUP_FAILURES:
            self._quarantine_due = time.monotonic() + RESTART_BASE_S * 2 ** (
                self._quarantine_failures - 1)
            return
        self.on_event(f"the quarantine process failed during setup "
                      f"{self._quarantine_failures} times ({why}); suspects run alone in "
                      "the serving processes instead")
        self.hand_off = False
        for ch in self.children.values():
            self._send(ch, {"cmd": "hand_off", "on": False})
        # back to their streams, uncounted: a serving process runs each alone
        self._release_suspects(self._suspects)
        self._suspects = []

    def _release_suspects(self, suspects: list[list[Any]]) -> None:
        if not suspects:
            return
        try:
            self.consumer.release_leases([(f[0], f[1]) for f in suspects])
        except MtqError:
            log.warning("could not give back %d suspect(s); they return when their "
                        "leases expire", len(suspects), exc_info=True)

    def _dispatch_suspects(self) -> None:
        """Hand the waiting suspects to the quarantine process once it is ready."""
        qc = self.quarantine
        if qc is None or not qc.ready or not self._suspects:
            return
        for fields in self._suspects:
            qc.held[fields[0]] = fields[1]
            self._send(qc, {"cmd": "run", "task": fields})
        self._suspects = []

    def _extend_suspects(self, now: float) -> None:
        """Keep the leases of suspects waiting for the quarantine process (nobody else
        holds them meanwhile)."""
        if not self._suspects or now - self._suspects_extended < self.consumer.settings.lease_ms / 3000:
            return
        self._suspects_extended = now
        tasks = [Claimed(*f) for f in self._suspects]
        try:
            lost, _ = self.consumer.extend(tasks)
        except MtqError:
            log.warning("could not extend the leases of %d suspect(s)", len(tasks),
                        exc_info=True)
            return
        if lost:
            gone = set(lost)
            self._suspects = [f for f in self._suspects if f[0] not in gone]

    def _reap_spare(self, c: _Child, code: int | None) -> None:
        """A standby exited: told to (stop, reload), or it failed; start another later."""
        if self.spares.get(c.device) is c:
            del self.spares[c.device]
        if c.retiring or self.stopping:
            return
        if c.fatal:  # the target cannot be loaded any more (a broken reload): the
            # serving processes keep the old model; a new standby waits for the next reload
            self._spare_failures[c.device] = MAX_SETUP_FAILURES
            self.on_event(f"the standby on {c.device} cannot load the target ({c.error}); "
                          "running without one until the next reload")
            return
        failures = self._spare_failures.get(c.device, 0) + 1
        self._spare_failures[c.device] = failures
        if failures >= MAX_SETUP_FAILURES:
            self.on_event(f"the standby on {c.device} failed {failures} times in a row "
                          f"({c.error or f'exit code {code}'}); running without one")
            return
        self._spare_due[c.device] = time.monotonic() + min(
            RESTART_MAX_S, RESTART_BASE_S * 2 ** (failures - 1))

    def _give_back(self, c: _Child) -> None:
        """Return the dead child's tasks: the running call's items counted, the rest not,
        including those it claimed just before it died and never reported (found in
        Redis by its worker id once its connections are gone)."""
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
                if not self.consumer.wait_disconnected(connection_name(c.worker_id)):
                    log.debug("worker %s: its Redis connections did not close (or CLIENT "
                              "LIST is not allowed); sweeping its tasks now", c.worker_id)
                elsewhere = {f[0] for f in self._suspects}
                if self.quarantine is not None:
                    elsewhere.update(self.quarantine.held)
                self.consumer.give_back_all(c.worker_id, running, rest, reason,
                                            skip=elsewhere)
            else:
                self.consumer.give_back(running, rest, reason)
        except MtqError:
            log.warning("could not give back the tasks of worker %d; they return when their "
                        "leases expire", c.slot, exc_info=True)
        c.held.clear()

    def _stop_all(self, force: bool = False) -> None:
        self.stopping = True
        self._release_suspects(self._suspects)
        self._suspects = []
        for c in self._all():
            if force:
                c.forced = True
                c.process.kill()
            else:
                self._send(c, {"cmd": "stop"})

    def _send(self, c: _Child, msg: dict[str, Any]) -> None:
        try:
            c.conn.send(msg)
        except (OSError, ValueError):
            pass

    # -- control -----------------------------------------------------------------
    def _resize(self) -> None:
        """Add slots on the least used devices, or retire the newest slots of the most
        used ones, until there are replicas x devices."""
        want = self.replicas * len(self.devices)

        def by_device() -> dict[str, list[int]]:
            load: dict[str, list[int]] = {d: [] for d in self.devices}
            for slot in self.slots.values():
                load.setdefault(slot.device, []).append(slot.index)
            return load

        while len(self.slots) < want:
            load = by_device()
            device = min(self.devices, key=lambda d: len(load[d]))
            index = self._next_slot
            self._next_slot += 1
            self.slots[index] = _Slot(index, device)
        while len(self.slots) > want:
            load = by_device()
            busiest = max(load.values(), key=len)
            index = max(busiest)
            self.slots.pop(index)
            c = self.children.get(index)
            if c is not None:
                c.retiring = True
                self._send(c, {"cmd": "stop"})

    def _handle_inbox(self) -> None:
        received = self._signals_received
        pending, self._signals_seen = received - self._signals_seen, received
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
        elif cmd in ("pause", "resume", "reload"):
            if not worker and cmd != "reload":
                self.paused = cmd == "pause"
            for c in self.children.values():
                if not worker or worker == c.worker_id:
                    self._send(c, {"cmd": cmd})
            if cmd == "reload" and not worker:
                # they hold the old code; fresh ones import the new (and may fail again)
                self._spare_failures.clear()
                self._retire_spares()
                self._retire_quarantine()
        elif cmd == "cancel":  # published by cancel.lua, addressed to the task's worker
            for c in self.children.values():
                if not worker or worker == c.worker_id:
                    self._send(c, {"cmd": "cancel", "ids": msg.get("ids") or []})
            if self.quarantine is not None:  # it runs suspects under their claimer's id
                self._send(self.quarantine, {"cmd": "cancel", "ids": msg.get("ids") or []})
        elif cmd == "stop" and not worker:
            self.on_event("stop requested")
            self._stop_all()
        elif cmd == "drain" and not worker:
            self.on_event("drain requested: working until the queue is empty")
            self.draining = True
            for c in self.children.values():
                self._send(c, {"cmd": "drain"})
            self._retire_spares()
        elif cmd in ("stop", "drain"):  # one worker: it leaves for good
            for c in self.children.values():
                if worker == c.worker_id:
                    c.retiring = True
                    self._send(c, {"cmd": cmd})
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

    def _retire_quarantine(self) -> None:
        qc = self.quarantine
        if qc is not None and not qc.retiring:
            qc.retiring = True  # it finishes what it runs; a new one starts on need
            self._quarantine_idle_since = None
            self._send(qc, {"cmd": "stop"})

    def _retire_spares(self) -> None:
        for c in self.spares.values():
            c.retiring = True
            self._spare_due[c.device] = 0.0
            self._send(c, {"cmd": "stop"})

    def _on_signal(self, signum: int, frame: Any) -> None:
        # no lock and no read-modify-write shared with the loop: the handler runs
        # on the main thread between any two bytecodes
        self._signals_received += 1
        self._poke()

    def _poke(self) -> None:
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):
            pass  # already pending

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass
