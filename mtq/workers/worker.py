"""One worker process: a model served in dynamic batches, as in an inference engine.

:class:`Worker` wires the parts, each in its own module, and runs four threads:

* **model thread** (the caller of :meth:`Worker.run`): the dynamic-batch loop
  (:mod:`mtq.workers.dynamic`), or for a :class:`~mtq.workers.generator.Generator`
  the continuous-batching engine (:mod:`mtq.workers.engine`). It checks leases
  before every call (:mod:`mtq.workers.leases`). It talks to Redis only when it
  would otherwise sleep: it settles a batch that ends with nothing waiting, and an
  idle fast model takes over the fetcher's wait (docs/workers.md), so a slow network
  never stalls the device while there is work.
* **fetcher** (:mod:`mtq.workers.fetcher`): claims tasks into the
  :class:`~mtq.workers.batching.BatchSlot`, claims ahead, sleeps on the wake list
  when there is nothing to claim, gives back what will not run here.
* **publisher** (:mod:`mtq.workers.publisher`): settles outcomes in one pipelined
  round trip for everything that finished since its last trip; a generator
  publishes from a process of its own instead (:mod:`mtq.workers.outlet`).
* **heartbeat** (:mod:`mtq.workers.heartbeat`): extends leases, reports to the
  worker registry, picks up cancel requests, runs the reaper on a schedule.

What they share is typed in :mod:`mtq.workers.ledger`. Control commands (pause,
resume, drain, stop, reload) arrive through :meth:`Worker.command` from the
supervisor's pipe or the queue's control channel.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from mtq.broker import answers
from mtq.broker.config import SettingsSpec
from mtq.broker.connection import client_url
from mtq.broker.consumer import Chunk, Consumer, Outcome
from mtq.broker.protocol import Claimed
from mtq.observe.histograms import Histograms
from mtq.workers import devices
from mtq.workers.aborts import Aborts
from mtq.workers.batching import BatchSlot
from mtq.workers.batchlog import BatchLog
from mtq.workers.dynamic import DynamicBatcher
from mtq.workers.engine import GenerationEngine
from mtq.workers.fetcher import Fetcher
from mtq.workers.generator import Generator
from mtq.workers.heartbeat import Heartbeat
from mtq.workers.leases import Leases
from mtq.workers.ledger import Lease, Ledger, Lifecycle, Monitor, Tally
from mtq.workers.model import FunctionModel
from mtq.workers.ops import EngineOps
from mtq.workers.options import apply as apply_options
from mtq.workers.outcomes import Outcomes
from mtq.workers.outlet import Outlet
from mtq.workers.publisher import Publisher
from mtq.workers.residency import FAILED, LOADED, OPS, UNLOADED, EngineOp, Residency
from mtq.workers.target import BatchPolicy, Target, load_model
from mtq.workers.winddown import wind_down

# the tunables live in the part that reads them (fetcher.FAST_BATCH_S, heartbeat.BEAT_S,
# leases.REVALIDATE_BELOW ...): set them there
__all__ = ["Lease", "Monitor", "Worker"]

log = logging.getLogger(__name__)


def _uses_device(model: Any) -> bool:
    """Whether ``model``'s setup may look at its device (a plain function's never does:
    it runs on the CPU with no torch.device built for it)."""
    return not isinstance(model, FunctionModel)


class Worker:
    """Serves one model for one queue in this process until stopped.

    It is the :class:`~mtq.workers.protocols.EngineHost` of its engine."""

    def __init__(self, target: str | Target, queue: str, *, url: str | None = None,
                 settings: SettingsSpec = None, device: str = "cpu",
                 max_batch_size: int | None = None, max_wait_ms: float | None = None,
                 timeout_s: float | None = None, worker_id: str | None = None,
                 monitor: Monitor | None = None, supervisor: str = "",
                 consumer: Consumer | None = None, quarantine: bool = False,
                 hand_off: bool = True, options: dict[str, str] | None = None,
                 on_demand: bool = False, idle_unload_s: float | None = None,
                 memory_bytes: int | None = None, residency: Residency | None = None) -> None:
        self.spec = target if isinstance(target, str) else None
        #: the model's options as given (--set KEY=VALUE): set again at each reload
        self.options = dict(options or {})
        # a model object is checked too (a required option it was not given fails here)
        self.model: Target = load_model(target, options=self.options) \
            if isinstance(target, str) else apply_options(target, self.options, text=True)
        self.overrides: dict[str, Any] = {"max_batch_size": max_batch_size,
                                          "max_wait_ms": max_wait_ms, "timeout_s": timeout_s}
        self.policy = BatchPolicy.of(self.model, **self.overrides)
        self.consumer = consumer or Consumer(queue, url, settings=settings, worker_id=worker_id)
        self.queue = self.consumer.queue
        self.worker_id = self.consumer.worker_id
        self.device_name = devices.check_device(device)
        self.device: Any = None
        self.monitor = monitor or Monitor()
        self.supervisor = supervisor
        #: a supervisor's quarantine process: it claims nothing and runs the suspects
        #: its supervisor hands it (the "run" command), one at a time
        self.quarantine = quarantine
        self.slot = BatchSlot(self.policy.max_batch_size, self.policy.max_wait_ms)
        # -- the engine: its model in memory or not (mtq.workers.ops) --
        #: not loaded at start: the first task it takes loads it (and an engine unloaded
        #: when idle, or for room, loads again on its next task)
        self.on_demand = on_demand
        #: unload the model after this many seconds without a batch (None: never)
        self.idle_unload_s = idle_unload_s
        #: the model is set up; its tensors' bytes (an estimate until first loaded)
        self.loaded = False
        self.memory_bytes = int(memory_bytes or 0)
        #: loaded, unloaded, loading, unloading or failed (mtq.workers.residency)
        self.engine_state = UNLOADED
        #: unix time of its last load; seconds the last load took
        self.loaded_at = 0.0
        self.load_s = 0.0
        #: unloaded by a command: it claims nothing until loaded again
        self.pinned = False
        #: an ``unload --now`` is due: a generator gives its running requests back
        self.abandon = False
        #: the process's memory budget, shared by its engines (alone: its own)
        self.residency = residency or Residency()
        if residency is None:
            self.residency.add(self)
        self._ready = False
        self.reloading = False
        self.user_paused = False  # paused by a command (a reload pauses the slot too)
        self.last_error = ""
        # the shared state (mtq.workers.ledger)
        self.ledger = Ledger(self.monitor)
        self.life = Lifecycle()
        self.tally = Tally()
        self.totals, self.hist, self.timing = self.tally.totals, self.tally.hist, \
            self.tally.timing
        #: the batches it ran, for `mtq trace`, and its traced tasks' spans
        self.batchlog = BatchLog(self.consumer.broker.keys.batches, self.worker_id, self.queue)
        #: histograms for the exporter (mtq.observe.histograms), written once per beat
        self.stats = Histograms()
        # the parts
        self.aborts = Aborts(self.ledger, self.monitor)  # run timeouts, cancels
        self.outcomes = Outcomes(self.ledger, self.stats, self.aborts)
        self.fetcher = Fetcher(self.consumer, self.ledger, self.life, self.slot, self.monitor,
                               self.stats, quarantine=quarantine, hand_off=hand_off,
                               on_drained=self._drained)
        self.publisher = Publisher(
            self.consumer, self.ledger, self.tally, self.slot, self.batchlog,
            interval_s=lambda: getattr(self.model, "stream_interval_ms", 0.0) / 1000,
            wake=self.fetcher.wake_if_draining)
        self.leases = Leases(self.consumer, self.ledger, self.life, self.slot, self.tally)
        self.ops = EngineOps(self)
        self.heartbeat = Heartbeat(self.consumer, self.ledger, self.tally, self.slot,
                                   self.batchlog, self.stats, self.outcomes,
                                   publish=self.publisher.publish, report=self.report,
                                   tick=self.ops.idle_check)
        self.dynamic = DynamicBatcher(
            slot=self.slot, ledger=self.ledger, life=self.life, tally=self.tally,
            monitor=self.monitor, batchlog=self.batchlog, fetcher=self.fetcher,
            publisher=self.publisher, leases=self.leases, outcomes=self.outcomes,
            model=lambda: self.model, reload=self.ops.run_due,
            batch_size=lambda: self.policy.max_batch_size, ensure_loaded=self.ops.ensure_loaded)
        #: a generator's engine while one runs (its limits are in the report)
        self.engine: GenerationEngine | None = None
        #: a generator's publisher process (see mtq.workers.outlet); None: the thread
        self.outlet: Outlet | None = None
        self._threads: list[threading.Thread] = []
        #: times the supervisor restarted this slot's process (0 without one)
        self.restarts = 0
        #: unix time at which run() started serving
        self.started = 0.0

    @property
    def hand_off(self) -> bool:
        """Offer the suspects it claims to the supervisor (Monitor.quarantine)."""
        return self.fetcher.hand_off

    @hand_off.setter
    def hand_off(self, on: bool) -> None:
        self.fetcher.hand_off = on

    # -- lifecycle ---------------------------------------------------------------
    def prepare(self) -> None:
        """Build the device (an on-demand engine starts here: its first task loads it)."""
        if self.device is None:
            self.device = devices.torch_device(self.device_name, _uses_device(self.model))
        if self.on_demand:
            self._ready = True

    def setup(self) -> None:
        """Build the device and run the model's ``setup`` (within the process's memory
        budget, shared with its other engines). Raises what ``setup`` raises."""
        self.prepare()
        self.ops.load(reason="start")
        self._ready = True

    def request(self, op: EngineOp) -> None:
        """Ask this engine for a command (load, unload, reload, reset: see
        :mod:`mtq.workers.ops`); thread-safe; answered through ``op.reply``."""
        if op.kind == "unload" and self.spec is None:  # (it could not load again)
            self.ops.answer(op, ok=False, error="this engine was given a model object, not a "
                                                "target name: serve a target name to unload it")
            return
        self.ops.request(op)

    @property
    def last_used(self) -> float:
        """Unix time it last ended a batch (or loaded)."""
        return max(self.loaded_at, self.ledger.last_busy)

    def evictable(self, busy_ok: bool = False) -> bool:
        """Loaded and idle: nothing running, held or asked of it (an LRU candidate;
        ``busy_ok``: running or holding tasks allowed)."""
        ledger = self.ledger
        return self.loaded and (busy_ok or (not ledger.busy and not ledger.held)) \
            and not self.ops.pending and not self.reloading and not self.life.stop.is_set() \
            and self.spec is not None

    @property
    def state(self) -> str:
        """starting, idle, running, paused, draining, reloading, stopping, or the
        engine's loading, unloading, unloaded or failed."""
        engine = self.engine_state
        if self.life.stop.is_set():
            return "stopping"
        if engine in ("loading", "unloading"):
            return engine
        if self.reloading:
            return "reloading"
        if self.ledger.busy:
            return "running"
        if not self._ready:
            return "starting"
        if engine != LOADED:
            return engine
        if self.slot.paused:
            return "paused"
        return "draining" if self.life.draining else "idle"

    @property
    def threads(self) -> tuple[threading.Thread, ...]:
        """The threads :meth:`run` started (fetcher, publisher, heartbeat, ...): all have
        ended once it returns, but a publisher still trying to reach a Redis that was
        away for the whole wind-down (:mod:`mtq.workers.winddown`)."""
        return tuple(self._threads)

    def command(self, msg: dict[str, Any]) -> None:
        """Apply a control command: pause, resume, drain, stop, reload (thread-safe)."""
        cmd = msg.get("cmd")
        if msg.get("worker") not in (None, "", self.worker_id) or \
                msg.get("supervisor") not in (None, "", self.supervisor):
            return  # addressed to another process
        (log.debug if cmd == "run" else log.info)("worker %s: %s", self.worker_id, cmd)
        fetcher = self.fetcher
        if cmd == "pause":
            self.user_paused = True
            fetcher.give_back(self.slot.set_paused(True))
            fetcher.interrupt()
        elif cmd == "resume":
            self.user_paused = False
            # (an engine unloaded by a command, or failed, claims nothing until a load)
            if not self.reloading and not self.life.reload and not self.pinned \
                    and self.engine_state != FAILED:
                self.slot.set_paused(False)
        elif cmd == "drain":
            self.life.draining = True
            self.slot.set_paused(False)
            fetcher.interrupt()
        elif cmd == "stop":
            self.stop()
        elif cmd in OPS:
            self.request(self._op(msg))
        elif cmd == "scale":
            pass  # a supervisor's business; a worker without one has nothing to scale
        elif cmd == "cancel":
            self._cancel_running(msg.get("ids") or [])
        elif cmd == "run" and self.quarantine:
            self._take_suspect(msg["task"])
        elif cmd == "hand_off":
            self.hand_off = bool(msg.get("on"))
        else:
            log.warning("unknown control command %r ignored", cmd)

    def _op(self, msg: dict[str, Any]) -> EngineOp:
        """The engine command of a control message; its answer is posted to the reply
        id it carries (mtq.broker.answers), if any."""
        rid = msg.get("reply")
        options = msg.get("options")
        reply = None
        if isinstance(rid, str) and rid:
            def reply(result: dict[str, Any]) -> None:
                answers.post(self.consumer.redis, self.queue, rid, result)
        return EngineOp(str(msg["cmd"]),
                        options={str(k): str(v) for k, v in options.items()}
                        if isinstance(options, dict) else None,
                        now=bool(msg.get("now")), reply=reply)

    def _cancel_running(self, ids: Sequence[str]) -> None:
        """A cancel was requested for tasks this worker may hold: those waiting in the
        slot are settled cancelled now; running ones are stopped (mtq.workers.aborts)."""
        ledger = self.ledger
        with ledger.lock:
            mine = {i for i in ids if isinstance(i, str) and i in ledger.held}
            tokens = {i: ledger.held[i].token for i in mine}
        if not mine:
            return
        ledger.add_cancel(mine)
        dropped = self.slot.remove(mine, tokens)
        if dropped:
            self.publish([Outcome(t, ok=False, cancelled=True) for t in dropped])

    def _take_suspect(self, fields: Sequence[Any]) -> None:
        """A suspect handed over by the supervisor (quarantine): held and run here,
        alone, under the lease its claimer took (fenced by its token as ever)."""
        t = Claimed(*fields)
        self.consumer.run_here(t)  # its start names this process, not its claimer
        ledger = self.ledger
        with ledger.lock:
            ledger.held[t.id] = t
            ledger.submitted.setdefault(t.id, time.monotonic() - t.age_ms / 1000)
        self.monitor.held([(t.id, t.token)])
        refused = self.slot.put([t], time.monotonic())
        if refused:
            self.fetcher.give_back(refused)

    @staticmethod
    def freeze_startup() -> None:
        """For a process that exists to run this worker (``mtq worker run``, a supervised
        child), once it is set up: what start-up made (modules, the model) lives as long
        as the process, so leave it out of every later collection, or each full one walks
        it all: a stall in whatever task is running (see docs/benchmarks.md). Not done
        by :meth:`run` itself, which may be called in a process that is not only a
        worker (it would freeze that process's objects)."""
        gc.freeze()

    def stop(self) -> None:
        """Graceful stop: finish the running batch, give back what was claimed ahead."""
        if self.life.stop.is_set():
            return
        self.life.stop.set()
        self.fetcher.give_back(self.slot.close())
        self.fetcher.interrupt()

    def _drained(self) -> None:
        """The fetcher found the drained queue empty."""
        self.stop()
        self.slot.kick()

    def run(self) -> dict[str, int]:
        """Serve until stopped (or drained). Returns the totals."""
        if self.device is None:
            self.prepare()
        if not self.loaded and not self.on_demand and self.engine_state != "failed":
            self.setup()
        self.started = time.time()
        self.heartbeat.read_settings()
        self._start_outlet()
        # its fetcher sleeps in Consumer.wait and takes what a submit hands over there
        self.consumer.direct = not self.quarantine
        for name, fn in (("fetcher", self.fetcher.loop), ("publisher", self.publisher.loop),
                         ("heartbeat", self.heartbeat.loop)):
            t = threading.Thread(target=fn, name=f"mtq-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        self.aborts.start()
        try:
            self._model_loop()
        finally:
            self.stop()
            with self.ops._lock:  # commands asked as it stopped: answered, never run
                left, self.ops._pending = self.ops._pending, []
            for op in left:
                self.ops.answer(op, ok=False, error="the engine stopped before carrying it out")
            wind_down(self)  # bounded by one lease when Redis is away (mtq.workers.winddown)
            self.loaded = False
            self.residency.notify()
        return dict(self.totals)

    def _start_outlet(self) -> None:
        """A generator publishes from a process of its own (mtq.workers.outlet) unless
        it sets ``outlet = False`` or its Redis connection cannot be named by a URL."""
        if not isinstance(self.model, Generator) or not getattr(self.model, "outlet", True):
            return
        url = client_url(self.consumer.redis)
        if url is None:
            log.info("the Redis connection has no URL form; publishing from a thread")
            return
        outlet = Outlet(self.consumer, self.ledger, self.publisher, url,
                        getattr(self.model, "stream_interval_ms", 0.0))
        try:
            outlet.start()
        except OSError:
            log.warning("could not start the outlet process; publishing from a thread",
                        exc_info=True)
            return
        self.outlet = self.publisher.outlet = outlet

    # -- model thread --------------------------------------------------------------
    def _model_loop(self) -> None:
        while True:
            if isinstance(self.model, Generator):
                self.engine = GenerationEngine(self)
                if not self.engine.run():
                    return
                self.engine = None
                self.ops.run_due()
            elif not self.dynamic.run():
                return

    def ensure_loaded(self, tasks: Sequence[Claimed]) -> bool:
        return self.ops.ensure_loaded(tasks)

    # -- EngineHost (mtq.workers.protocols) -------------------------------------------
    def publish(self, items: list[Outcome | Chunk]) -> None:
        self.publisher.publish(items)

    def give_back(self, tasks: Sequence[Claimed]) -> None:
        self.fetcher.give_back(tasks)

    def live(self, tasks: Sequence[Claimed]) -> list[Claimed]:
        return self.leases.live(tasks)

    def live_floor(self) -> float:
        return self.leases.floor()

    def traceback(self, exc: BaseException, task: Claimed) -> str:
        return self.outcomes.traceback(exc, task)

    def observe_outcome(self, o: Outcome, started: float | None,
                        now: float | None = None) -> None:
        self.outcomes.observe_outcome(o, started, now)

    # -- reports -----------------------------------------------------------------------
    def batch_cap(self) -> int:
        """The most tasks a batch takes now (a generator: requests running): the
        policy's max_batch_size, or less after running out of memory."""
        engine = self.engine  # (the model thread sets it)
        limit = engine.limits.running if engine is not None else self.dynamic.limit
        return limit.value or self.policy.max_batch_size

    def report(self, rate: float = 0.0) -> dict[str, Any]:
        """The registry entry of this worker."""
        name, version = self.model.describe()
        with self.ledger.lock:
            current = self.ledger.current
            held = len(self.ledger.held)
        typical = self.hist.most_common(1)[0][0] if self.hist else 0
        entry: dict[str, Any] = {
            "host": socket.gethostname(), "pid": os.getpid(), "queue": self.queue,
            "device": self.device_name, "model": name, "version": version,
            "state": self.state, "batch": current, "typical_batch": typical,
            "role": "quarantine" if self.quarantine else "serving",
            "max_batch_size": self.policy.max_batch_size, "held": held,
            # the batch size (a generator: the running requests) in force after running
            # out of memory: lower than max_batch_size until it has recovered
            "batch_cap": self.batch_cap(),
            "histogram": {str(k): v for k, v in sorted(self.hist.items())},
            "tasks_per_s": round(rate, 2), "supervisor": self.supervisor,
            "visible_devices": devices.visible() or "", "last_error": self.last_error,
            **{k: v for k, v in self.totals.items()},
            "predict_s": round(self.timing["predict_s"], 4),
            # seconds in predict (prefill and decode steps for a generator)
            "busy_s": round(self.timing["predict_s"], 6),
            "restarts": self.restarts, "started": round(self.started, 3),
            # the engine (mtq.workers.ops): several may share this process
            "process": f"{socket.gethostname()}:{os.getpid()}", "engine": self.engine_state,
            "memory_bytes": self.memory_bytes, "last_used": round(self.last_used, 3),
            "load_s": round(self.load_s, 3), "on_demand": self.on_demand,
            "idle_unload_s": self.idle_unload_s,
            "overhead_ms_per_batch": round(
                1000 * self.timing["overhead_s"] / max(1, self.totals["batches"]), 4),
        }
        mem = devices.memory(self.device)
        if mem:
            entry["memory"] = mem
        return entry
