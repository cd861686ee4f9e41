"""The engine commands as one engine carries them out: load, unload, reload, reset,
loading on demand and unloading when idle (docs/workers.md, "Engines").

Every command but a reload with new options that fits beside the serving model
runs on the model thread at a batch boundary: the engine stops claiming, gives
back what it claimed ahead, finishes its running batch (``unload --now``: a
generator gives its running requests back), then acts. A reload without options
re-imports the code, so it runs only once the old model is unloaded (the module
is executed again in place; the old model's code would see the new globals). A
reload with options keeps the code: a loader thread sets the new model up while
the old one serves where memory allows (:class:`~mtq.workers.residency.Residency`,
and the device's free memory), else the old one is unloaded first. A failing
reload leaves the old model serving. Each command's answer (a dict; see
:meth:`EngineOps.answer`) goes to ``op.reply``.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

from mtq.broker.consumer import Consumer
from mtq.broker.protocol import Claimed
from mtq.errors import TargetError
from mtq.observe.histograms import Histograms
from mtq.workers import catalogue, devices
from mtq.workers.batching import BatchSlot
from mtq.workers.batchlog import BatchLog
from mtq.workers.fetcher import Fetcher
from mtq.workers.ledger import Ledger, Lifecycle, Monitor
from mtq.workers.residency import (
    FAILED,
    LOADED,
    LOADING,
    UNLOADED,
    UNLOADING,
    EngineOp,
    Residency,
)
from mtq.workers.target import BatchPolicy, load_model

log = logging.getLogger(__name__)

#: a reload sets the new model up beside the serving one when the device has this
#: much more free memory than the model's size (a GPU; the budget is checked too)
BESIDE_HEADROOM = 1.2


class Engine(Protocol):
    """What the engine commands use of their :class:`~mtq.workers.worker.Worker`."""

    # what it serves
    spec: str | None
    options: dict[str, str]
    overrides: dict[str, Any]
    model: Any
    policy: BatchPolicy
    device: Any
    device_name: str
    queue: str
    worker_id: str
    supervisor: str
    # the engine's state (see Worker.__init__)
    loaded: bool
    engine_state: str
    memory_bytes: int
    loaded_at: float
    load_s: float
    pinned: bool
    abandon: bool
    reloading: bool
    user_paused: bool
    idle_unload_s: float | None
    last_error: str
    # its parts
    life: Lifecycle
    ledger: Ledger
    slot: BatchSlot
    fetcher: Fetcher
    consumer: Consumer
    monitor: Monitor
    batchlog: BatchLog
    stats: Histograms
    residency: Residency

    @property
    def last_used(self) -> float: ...

    def evictable(self, busy_ok: bool = False) -> bool: ...

    def give_back(self, tasks: Sequence[Claimed]) -> None: ...

    def request(self, op: EngineOp) -> None: ...


class _Stopping(Exception):
    """The engine stopped while it waited for room to load."""


def _mib(n: int) -> str:
    """A size for people: 524 B, 8.0 KiB, 32.0 MiB, 1.5 GiB."""
    size = float(n)
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _teardown(model: Any) -> None:
    """The model's ``teardown()``, if it has one (what it raises is logged: the model
    is dropped anyway)."""
    hook = getattr(model, "teardown", None)
    if callable(hook):
        try:
            hook()
        except Exception:
            log.warning("teardown() raised; the model is dropped anyway", exc_info=True)


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class EngineOps:
    """The engine commands of one worker (``w``): asked from any thread, carried out
    on its model thread (a beside reload: on a loader thread, then the model thread)."""

    def __init__(self, w: Engine) -> None:
        self.w = w
        self._lock = threading.Lock()
        self._pending: list[EngineOp] = []
        #: a loader thread sets up a reload's new model beside the serving one
        self.loader: threading.Thread | None = None

    # -- any thread -------------------------------------------------------------------
    def request(self, op: EngineOp) -> None:
        """Ask for ``op``; it is answered through ``op.reply`` once done."""
        w = self.w
        if w.life.stop.is_set():
            self.answer(op, ok=False, error="the engine is stopping")
            return
        if op.kind in ("load", "reload") and op.options is not None and self._beside(op):
            return
        with self._lock:
            self._pending.append(op)
        if op.kind == "unload" and op.now:
            w.abandon = True
        w.life.reload = True
        w.fetcher.give_back(w.slot.set_paused(True))
        w.fetcher.interrupt()
        w.slot.kick()

    @property
    def pending(self) -> bool:
        return bool(self._pending) or self.loader is not None

    def answer(self, op: EngineOp, *, ok: bool, detail: str = "", error: str = "") -> None:
        """Send ``op``'s answer: what happened, the engine's state now, how long it took."""
        w = self.w
        kind = "reload" if op.kind == "swap" else op.kind
        result = {"op": kind, "ok": ok, "queue": w.queue, "worker": w.worker_id,
                  "host": socket.gethostname(), "pid": os.getpid(), "supervisor": w.supervisor,
                  "state": w.engine_state, "took_s": round(time.monotonic() - op.asked, 3),
                  "detail": detail, "error": error, "reason": op.reason,
                  "memory_bytes": w.memory_bytes if w.loaded else 0}
        (log.info if ok else log.error)("engine %s (%s): %s %s", w.worker_id, w.queue, kind,
                                        detail if ok else error)
        if op.reply is None:
            return
        try:
            op.reply(result)
        except Exception:  # Redis away: the command times out and says so
            log.warning("could not answer a %s command", kind, exc_info=True)

    def idle_check(self) -> None:
        """(The heartbeat, once a beat) unload an engine idle for longer than its
        ``idle_unload_s``; it loads again when a task comes."""
        w = self.w
        if not w.idle_unload_s or not w.loaded or not w.evictable():
            return
        if time.time() - w.last_used >= w.idle_unload_s:
            self.request(EngineOp("unload", reason="idle"))

    # -- the model thread --------------------------------------------------------------
    def run_due(self) -> None:
        """Carry out the commands asked since the last boundary (nothing runs now)."""
        w = self.w
        w.life.reload = False
        w.reloading = True
        with self._lock:
            ops, self._pending = self._pending, []
        try:
            for op in ops:
                try:
                    self._run(op)
                except _Stopping:
                    self.answer(op, ok=False, error="the engine stopped while it waited "
                                                    "for room to load")
        finally:
            w.abandon = False
            w.reloading = False
        if w.life.reload:  # asked again meanwhile: the model loop goes round
            w.slot.kick()
        elif not w.life.stop.is_set() and not w.user_paused and not w.pinned \
                and w.engine_state != FAILED:
            w.slot.set_paused(False)

    def _run(self, op: EngineOp) -> None:
        w = self.w
        if op.kind == "swap":
            self._swap(op)
        elif op.kind == "reset":
            self._reset(op)
        elif op.kind == "unload":
            if not w.loaded:
                w.pinned = w.pinned or op.reason == "command"
                self.answer(op, ok=True, detail="was not loaded")
                return
            freed = w.memory_bytes
            self.unload()
            w.pinned = op.reason == "command"
            then = "claims nothing until loaded" if w.pinned else "loads again on its next task"
            self.answer(op, ok=True, detail=f"unloaded ({_mib(freed)} freed; {then})")
        elif op.kind == "load" and w.loaded and {**w.options, **(op.options or {})} == w.options:
            w.pinned = False
            self.answer(op, ok=True, detail="already loaded")
        elif op.kind in ("load", "reload"):
            self._reload_here(op)
        else:
            self.answer(op, ok=False, error=f"unknown engine command {op.kind!r}")

    def ensure_loaded(self, tasks: Sequence[Claimed]) -> bool:
        """Load an unloaded engine for ``tasks`` it took (on demand): their wait is
        the load time, in their trace (a "load" record) and the load histogram. False
        if it could not: ``tasks`` went back to their streams uncounted."""
        w = self.w
        if w.loaded:
            return True
        t0 = time.time()
        try:
            self.load(reason="demand")
        except _Stopping:
            w.give_back(tasks)
            return False
        except Exception as exc:
            w.last_error = f"load failed: {_error(exc)}"
            log.error("engine %s (%s): %s; it claims nothing until loaded by a command",
                      w.worker_id, w.queue, w.last_error, exc_info=True)
            w.engine_state = FAILED
            w.give_back([*tasks, *w.slot.set_paused(True)])
            return False
        w.batchlog.record("load", t0, time.time(), tasks)
        return True

    # -- loading and unloading ------------------------------------------------------------
    def load(self, reason: str = "command", record: bool = True) -> None:
        """Set the (unloaded) model up, within the budget; raises what ``setup``
        raises (the engine is then failed). Model thread, or start-up."""
        w = self.w
        r = w.residency
        t0 = time.monotonic()
        w.engine_state = LOADING
        try:
            with r.load_lock:
                # (at start no model thread runs yet to unload one for room: Host.setup)
                if reason != "start" and not r.make_room(w, w.memory_bytes, w.life.stop):
                    raise _Stopping()
                before = devices.allocated(w.device)
                w.model.setup(w.device)
                devices.settle(w.device)  # its engine's stream does not wait for this one
                w.memory_bytes = devices.model_bytes(w.model) or \
                    max(0, devices.allocated(w.device) - before)
                w.loaded = True
        except BaseException:
            w.engine_state = UNLOADED if w.life.stop.is_set() else FAILED
            raise
        w.load_s = time.monotonic() - t0
        w.engine_state = LOADED
        w.loaded_at = time.time()
        if w.last_error.startswith("load failed"):  # (an engine made again keeps its error)
            w.last_error = ""
        r.notify()
        if reason != "start":  # (at start the queue's settings are not read yet)
            w.stats.observe("load", w.load_s)
            log.info("engine %s (%s) loaded %s in %.2f s (%s)", w.worker_id, w.queue,
                     "/".join(w.model.describe()), w.load_s, _mib(w.memory_bytes))
        if record:  # (a reload records "reloaded" once the new model serves)
            self.catalogue("loaded", w.model)
        if reason != "start":  # it was bigger than thought (at start: Host.setup warns)
            r.make_room(w, w.memory_bytes, w.life.stop, wait=False)

    def unload(self, record: bool = True) -> None:
        """Drop the model (its ``teardown()`` first) and free what it held."""
        w = self.w
        w.engine_state = UNLOADING
        old = w.model
        _teardown(old)
        w.model = self.fresh(w.options)
        del old
        self._free()
        w.loaded = False
        w.engine_state = UNLOADED
        w.residency.notify()
        if record:
            self.catalogue("unloaded")

    def fresh(self, options: dict[str, str]) -> Any:
        """A new instance of the served target, not set up (the module as imported now)."""
        w = self.w
        if w.spec is None:
            raise TargetError("this engine was given a model object, not a target name: it "
                              "cannot make a new one (serve a target name to unload it)")
        return load_model(w.spec, options=options)

    def catalogue(self, event: str, model: Any = None, error: str = "") -> None:
        """Record ``event`` in the model catalogue; with ``model`` (just set up), its
        version and record become the queue's (mtq.workers.catalogue.record_event)."""
        w = self.w
        catalogue.record_event(w.consumer, w.queue, event, spec=w.spec, current=w.model,
                               model=model, error=error, worker=w.worker_id,
                               device=w.device_name, supervisor=w.supervisor)

    def _free(self) -> None:
        gc.collect()
        devices.empty_cache(self.w.device)

    # -- reload ------------------------------------------------------------------------------
    @staticmethod
    def _reimports(op: EngineOp) -> bool:
        """A reload without options re-imports the code; with options it keeps it."""
        return op.kind == "reload" and op.options is None

    def _new(self, op: EngineOp) -> tuple[Any, BatchPolicy, dict[str, str]]:
        """The target (re-imported for a code reload), with the op's options (or the
        engine's)."""
        w = self.w
        if w.spec is None:
            raise TargetError("this worker was given a model object, not a target name; "
                              "it cannot re-import it")
        # the options it names change; the others keep the values served now
        options = {**w.options, **(op.options or {})}
        model = load_model(w.spec, reload=self._reimports(op), options=options)
        return model, BatchPolicy.of(model, **w.overrides), options

    def _beside(self, op: EngineOp) -> bool:
        """Start a reload beside the serving model if memory allows; False: it runs
        at the boundary (unloading the old one first)."""
        w = self.w
        if not w.loaded or w.spec is None or self.loader is not None or self._reimports(op):
            return False
        if not w.residency.fits(w, extra=2 * w.memory_bytes):
            return False
        free = devices.free_bytes(w.device)
        if free is not None and free < BESIDE_HEADROOM * w.memory_bytes:
            return False
        self.loader = threading.Thread(target=self._load_beside, args=(op, w.model),
                                       name=f"mtq-loader-{w.queue}", daemon=True)
        self.loader.start()
        return True

    def _load_beside(self, op: EngineOp, serving: Any) -> None:
        w = self.w
        t0 = time.monotonic()
        try:
            with w.residency.load_lock:
                model, policy, options = self._new(op)
                with devices.engine_stream(w.device):
                    model.setup(w.device)
                    devices.settle(w.device)  # the engine's stream does not wait for it
                nbytes = devices.model_bytes(model)
        except Exception as exc:
            self.loader = None
            w.last_error = f"reload failed, kept the old model: {_error(exc)}"
            log.error("%s", w.last_error, exc_info=True)
            self.catalogue("reload_failed", error=w.last_error[:300])
            self.answer(op, ok=False, error=f"{_error(exc)}; the old model goes on serving")
            return
        staged = (model, policy, options, nbytes, time.monotonic() - t0, serving)
        self.loader = None
        self.request(EngineOp("swap", reply=op.reply, asked=op.asked, staged=staged,
                              reason=op.reason))

    def _install(self, model: Any, policy: BatchPolicy, options: dict[str, str],
                 event: str = "reloaded") -> None:
        """``model`` (set up) serves from now on; ``event`` goes in the catalogue."""
        w = self.w
        w.model, w.policy, w.options = model, policy, options
        self.catalogue(event, model)
        # one batch ahead until the new model has shown itself fast (claim_ahead)
        w.ledger.batch_s = float("inf")
        w.slot.claim_ahead(1)
        w.slot.configure(policy.max_batch_size, policy.max_wait_ms)
        w.last_error = ""
        w.pinned = False
        w.loaded_at = time.time()
        w.monitor.reloaded(policy.timeout_s, "/".join(model.describe()), options=dict(options))

    def _swap(self, op: EngineOp) -> None:
        w = self.w
        model, policy, options, nbytes, load_s, serving = op.staged
        op.staged = None
        dropped = w.model is not serving or not w.loaded  # a command ran meanwhile
        old = model if dropped else w.model
        if not dropped:
            self._install(model, policy, options)
            w.memory_bytes, w.load_s = nbytes, load_s
        _teardown(old)
        del old, model, serving
        self._free()
        w.residency.notify()
        if dropped:
            self.answer(op, ok=False, error="an unload or reload ran meanwhile: it stands")
            return
        self.answer(op, ok=True, detail=f"reloaded beside the serving model in {load_s:.2f} s "
                                        f"({_mib(nbytes)})")

    def _reload_here(self, op: EngineOp) -> None:
        """A load with new options, or a reload with no room beside: the old model is
        unloaded, the new one set up; if that fails, the old one is set up again."""
        w = self.w
        try:
            model, policy, options = self._new(op)
        except Exception as exc:  # an import or options error: nothing was touched
            w.last_error = f"{op.kind} failed, kept the old model: {_error(exc)}"
            log.error("%s", w.last_error, exc_info=True)
            self.catalogue("reload_failed", error=w.last_error[:300])
            self.answer(op, ok=False, error=f"{_error(exc)}; the engine is as it was")
            return
        was_loaded = w.loaded
        if was_loaded:
            self.unload(record=False)
        old, old_options = w.model, w.options  # (unloaded: a fresh instance of the old code)
        w.model = model
        try:
            self.load(record=False)
        except _Stopping:
            w.model = old
            raise
        except Exception as exc:
            error = _error(exc)
            w.model, w.options = old, old_options
            w.last_error = f"{op.kind} failed: {error}"
            log.error("%s", w.last_error, exc_info=True)
            self.catalogue("reload_failed", error=w.last_error[:300])
            if not was_loaded:
                w.engine_state = FAILED if op.kind == "load" else UNLOADED
                self.answer(op, ok=False, error=error)
                return
            self._free()
            try:
                self.load(record=False)
            except Exception as again:
                self.answer(op, ok=False, error=f"{error}; the old model failed to load "
                                                f"again too: {_error(again)}")
                return
            self.answer(op, ok=False, error=f"{error}; the old model was loaded again")
            return
        self._install(model, policy, options, "reloaded" if was_loaded else "loaded")
        what = "reloaded (old model unloaded first)" if was_loaded else "loaded"
        self.answer(op, ok=True, detail=f"{what} in {w.load_s:.2f} s ({_mib(w.memory_bytes)})")

    # -- reset --------------------------------------------------------------------------------
    def _reset(self, op: EngineOp) -> None:
        w = self.w
        if not w.loaded:
            self.answer(op, ok=True, detail="not loaded: nothing to reset")
            return
        hook = getattr(w.model, "reset", None)
        if callable(hook):
            try:
                hook()
            except Exception as exc:
                self.answer(op, ok=False, error=f"the model's reset() raised: {_error(exc)}")
                return
        # the batch sizes lowered after running out of memory come back (the model loop
        # makes new limits after every command), and the measured batch times go
        w.ledger.batch_s = float("inf")
        w.slot.claim_ahead(1)
        w.slot.configure(w.policy.max_batch_size, w.policy.max_wait_ms)
        self._free()
        self.answer(op, ok=True, detail="state dropped"
                    + (" (the model's reset() ran)" if callable(hook) else "")
                    + f"; batches up to {w.policy.max_batch_size} again")
