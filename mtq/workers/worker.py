"""One worker process: a model served in dynamic batches, as in an inference engine.

Threads, each with one job:

* **model thread** (the caller of :meth:`Worker.run`): takes a due batch from the
  :class:`~mtq.workers.batching.BatchSlot`, decodes it, runs ``predict`` (bisecting
  a batch that raises) and hands the outcomes to the publisher. It never talks to
  Redis, so a slow network never stalls the device.
* **fetcher**: claims tasks into the slot (one round trip per claim), keeping up to
  one batch claimed ahead while the model runs (two or more for a fast model on a deep
  queue, many small ones in a claim: see :meth:`Worker._claim_ahead`); sleeps on the
  wake list (BLPOP) when there is
  nothing to claim.
* **publisher**: settles outcomes (acks with results, retries, failures) in one
  pipelined round trip for everything that finished since its last trip. A
  :class:`~mtq.workers.generator.Generator` publishes from a process of its own
  instead (:mod:`mtq.workers.outlet`); the thread is its fallback.
* **heartbeat**: extends the leases of every task this process holds, reports to
  the worker registry, picks up cancel requests, and runs the reaper on a schedule.

Control commands (pause, resume, drain, stop, reload) arrive through
:meth:`Worker.command` from the supervisor's pipe or the queue's control channel.
"""

from __future__ import annotations

import collections
import gc
import inspect
import logging
import os
import queue as queue_mod
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from mtq import serialization
from mtq.broker import catalogue as broker_catalogue
from mtq.broker.cluster import shared
from mtq.broker.config import SettingsSpec
from mtq.broker.connection import Backoff, client_url, redis_errors, single_attempt
from mtq.broker.consumer import (
    OUTCOME_COUNTERS,
    Chunk,
    Consumer,
    Outcome,
    SettleReport,
    format_traceback,
)
from mtq.broker.keys import QUEUES, QueueKeys
from mtq.broker.lane import yielding
from mtq.broker.protocol import LOST, Claimed
from mtq.errors import (
    LeaseLost,
    MtqError,
    PayloadError,
    PermanentError,
    RedisUnavailable,
    TargetError,
)
from mtq.settings import QueueSettings
from mtq.workers import catalogue, devices, registry
from mtq.workers.batching import (
    NOT_TAKEN,
    OFFERED,
    BatchShapeError,
    BatchSlot,
    ItemResult,
    run_isolated,
    run_one,
)
from mtq.workers.batchlog import BatchLog
from mtq.workers.generator import Generator
from mtq.workers.model import FunctionModel, Progress, is_per_item
from mtq.workers.outlet import Outlet
from mtq.workers.stats import Histograms
from mtq.workers.target import BatchPolicy, Target, load_model

log = logging.getLogger(__name__)

#: how often the heartbeat reports to the registry (leases are extended at least
#: every lease/3, whichever comes first)
BEAT_S = 1.0
#: a task whose lease is known live for less than this share of the lease is checked
#: with Redis before the model is called on it (a heartbeat extends every lease/3 at
#: most, so this happens only when the process was frozen, starved or cut off)
REVALIDATE_BELOW = 0.5
#: a batch that ran in less than this is a fast model's: while its claims come back
#: full, the fetcher keeps two batches claimed ahead (see Worker._claim_ahead)
FAST_BATCH_S = 0.01
#: ... or, when its batches are small, as many as hold about this much of its work (by
#: its last batch), in claims of many batches each ...
AHEAD_WORK_S = 0.002
#: ... and no more tasks than this (a claim the size of the default batch)
AHEAD_MOST = 64

Lease = tuple[str, str]


def _uses_device(model: Any) -> bool:
    """Whether ``model``'s setup may look at its device (a plain function's never does:
    it runs on the CPU with no torch.device built for it)."""
    return not isinstance(model, FunctionModel)


class Monitor:
    """What a worker tells its supervisor (nothing, when it runs alone).

    The supervisor uses it to give back the tasks of a process that died and to kill
    a process whose predict call overran the timeout; see :mod:`mtq.workers.supervisor`.
    """

    def held(self, leases: Sequence[Lease]) -> None:
        """Tasks were claimed into this process."""

    def batch(self, leases: Sequence[Lease]) -> None:
        """The model thread started on these tasks, in this order."""

    def call(self, lo: int, hi: int) -> None:
        """predict started on items lo..hi-1 of the current batch."""

    def idle(self) -> None:
        """predict returned."""

    def settled(self, leases: Sequence[Lease]) -> None:
        """These deliveries left this process (settled or given back)."""

    def reloaded(self, timeout_s: float | None, model: str) -> None:
        """A reload swapped the model in; its timeout may have changed."""

    def quarantine(self, task: Claimed) -> bool:
        """A claimed task is a suspect (a process died while running it): True if the
        supervisor takes it, to run it alone in its quarantine process; False (no
        supervisor) and this process runs it alone itself."""
        return False


class Worker:
    """Serves one model for one queue in this process until stopped."""

    def __init__(self, target: str | Target, queue: str, *, url: str | None = None,
                 settings: SettingsSpec = None, device: str = "cpu",
                 max_batch_size: int | None = None, max_wait_ms: float | None = None,
                 timeout_s: float | None = None, worker_id: str | None = None,
                 monitor: Monitor | None = None, supervisor: str = "",
                 consumer: Consumer | None = None, quarantine: bool = False,
                 hand_off: bool = True) -> None:
        self.spec = target if isinstance(target, str) else None
        self.model: Target = load_model(target) if isinstance(target, str) else target
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
        #: offer the suspects it claims to the supervisor (Monitor.quarantine)
        self.hand_off = hand_off
        #: (id, token) of suspects handed to the supervisor: they still run under this
        #: worker's id in Redis, in the quarantine process (see _release_unknown)
        self._handed: set[tuple[str, str]] = set()
        self.slot = BatchSlot(self.policy.max_batch_size, self.policy.max_wait_ms)
        self._ready = False
        self._reloading = False
        self.last_error = ""
        self._last_failure: BaseException | None = None  # logged once (see _traceback)
        self._last_traceback = ""
        # bookkeeping shared by the threads
        self._lock = threading.Lock()
        self._held: dict[str, Claimed] = {}
        self._cancel: set[str] = set()
        #: running tasks whose lease was lost: a generator stops generating them
        self._lost: set[str] = set()
        self._outbox: queue_mod.SimpleQueue[list[Outcome | Chunk] | None] = \
            queue_mod.SimpleQueue()
        #: lists put in the outbox and not yet settled by the publisher (under _lock):
        #: while any is, the model thread leaves its outcomes to the publisher too, so
        #: that a task's chunks still in hand there reach Redis before its outcome
        self._unsettled = 0
        #: a generator's publisher process (see mtq.workers.outlet); None: the thread
        self._outlet: Outlet | None = None
        self._stop = threading.Event()
        self._draining = False
        self._reload = False
        self._user_paused = False  # paused by a command (a reload pauses the slot too)
        self._beat_stop = threading.Event()  # leases are extended until the batch is settled
        self._fetcher_sleeping = False
        #: how long the model thread's last dynamic batch ran (s); inf until one has,
        #: after a reload, and always for a generator, whose engine never sets it (see
        #: _claim_ahead)
        self._batch_s = float("inf")
        self._batch_n = 1  # its size
        self._busy = False
        self._current = 0
        self.hist: collections.Counter[int] = collections.Counter()
        #: model-thread seconds inside predict, and around it (decode, hand-off)
        self.timing = {"predict_s": 0.0, "overhead_s": 0.0}
        self.totals = dict.fromkeys((*OUTCOME_COUNTERS, "lost", "revoked", "batches", "tasks",
                                     "tokens"), 0)
        self._threads: list[threading.Thread] = []
        #: the batches it ran, for `mtq trace`, and its traced tasks' spans
        self.batchlog = BatchLog(self.consumer.broker.keys.batches, self.worker_id, self.queue)
        #: histograms for the exporter (mtq.workers.stats), written once per beat
        self.stats = Histograms()
        #: task id -> when it was submitted, on this process's monotonic clock (its
        #: age at claim, server clock, taken from the time of the claim)
        self._submitted: dict[str, float] = {}
        #: the queue's max_retries as the heartbeat last read it (the model thread
        #: tells a retry from a failure that ends the task without asking Redis)
        self._max_retries = QueueSettings.max_retries
        #: times the supervisor restarted this slot's process (0 without one)
        self.restarts = 0
        #: unix time at which run() started serving
        self.started = 0.0

    # -- lifecycle ---------------------------------------------------------------
    def setup(self) -> None:
        """Build the device and run the model's ``setup`` (once per process)."""
        self.device = devices.torch_device(self.device_name, _uses_device(self.model))
        self.model.setup(self.device)
        self._catalogue("loaded", self.model)
        self._ready = True

    def _catalogue(self, event: str, model: Target | None = None, error: str = "") -> None:
        """Record ``event`` in the model catalogue (mtq.broker.catalogue); with ``model``
        (just set up), compute its version and make it the queue's model record. A
        catalogue that cannot be written is logged, never fatal."""
        now = int(time.time() * 1000)
        where = {"host": socket.gethostname(), "worker": self.worker_id}
        target = self.spec or "/".join(self.model.describe())
        version = catalogue.version_of(model) if model is not None else \
            self.model.describe()[1]
        if model is not None:
            self.consumer.broker.model_version = version
        event_fields = {"event": event, "target": target, "version": version,
                        "pid": os.getpid(), "device": self.device_name,
                        "supervisor": self.supervisor, "ts": now, **where}
        if error:
            event_fields["error"] = error
        try:
            broker_catalogue.record(
                self.consumer.redis, self.queue, event_fields,
                catalogue.model_record(model, target, version, loaded=now, **where)
                if model is not None else None)
        except MtqError:
            log.warning("could not write the model catalogue", exc_info=True)

    @property
    def state(self) -> str:
        """starting, idle, running, paused, draining, reloading or stopping."""
        if self._stop.is_set():
            return "stopping"
        if self._reloading:
            return "reloading"
        if self._busy:
            return "running"
        if not self._ready:
            return "starting"
        if self.slot.paused:
            return "paused"
        return "draining" if self._draining else "idle"

    def command(self, msg: dict[str, Any]) -> None:
        """Apply a control command: pause, resume, drain, stop, reload (thread-safe)."""
        cmd = msg.get("cmd")
        if msg.get("worker") not in (None, "", self.worker_id) or \
                msg.get("supervisor") not in (None, "", self.supervisor):
            return  # addressed to another process
        (log.debug if cmd == "run" else log.info)("worker %s: %s", self.worker_id, cmd)
        if cmd == "pause":
            self._user_paused = True
            self._give_back(self.slot.set_paused(True))
            self._interrupt_fetcher()
        elif cmd == "resume":
            self._user_paused = False
            if not self._reloading and not self._reload:
                self.slot.set_paused(False)
        elif cmd == "drain":
            self._draining = True
            self.slot.set_paused(False)
            self._interrupt_fetcher()
        elif cmd == "stop":
            self.stop()
        elif cmd == "reload":
            self._reload = True
            self._give_back(self.slot.set_paused(True))
            self._interrupt_fetcher()
            self.slot.kick()
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

    def _cancel_running(self, ids: Sequence[str]) -> None:
        """A cancel was requested for tasks this worker may hold: those waiting in the
        slot are settled cancelled now; a generator drops running ones at its next
        step; a batch model's result for them is discarded if it fails."""
        with self._lock:
            mine = {i for i in ids if isinstance(i, str) and i in self._held}
            self._cancel.update(mine)
            tokens = {i: self._held[i].token for i in mine}
        if not mine:
            return
        dropped = self.slot.remove(mine, tokens)
        if dropped:
            self._publish([Outcome(t, ok=False, cancelled=True) for t in dropped])

    def _take_suspect(self, fields: Sequence[Any]) -> None:
        """A suspect handed over by the supervisor (quarantine): held and run here,
        alone, under the lease its claimer took (fenced by its token as ever)."""
        t = Claimed(*fields)
        with self._lock:
            self._held[t.id] = t
            self._submitted.setdefault(t.id, time.monotonic() - t.age_ms / 1000)
        self.monitor.held([(t.id, t.token)])
        refused = self.slot.put([t], time.monotonic())
        if refused:
            self._give_back(refused)

    @staticmethod
    def freeze_startup() -> None:
        """For a process that exists to run this worker (``mtq worker run``, a supervised
        child), once it is set up: what start-up made (modules, the model) lives as long
        as the process, so leave it out of every later collection, or each full one walks
        it all (23 ms measured in a plain worker, far more next to torch): a stall in
        whatever task is running. Not done by :meth:`run` itself, which may be called in
        a process that is not only a worker (it would freeze that process's objects)."""
        gc.freeze()

    def stop(self) -> None:
        """Graceful stop: finish the running batch, give back what was claimed ahead."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._give_back(self.slot.close())
        self._interrupt_fetcher()

    def run(self) -> dict[str, int]:
        """Serve until stopped (or drained). Returns the totals."""
        if self.device is None:
            self.setup()
        self.started = time.time()
        self._read_stats_settings()
        self._start_outlet()
        # its fetcher sleeps in Consumer.wait and takes what a submit hands over there
        self.consumer.direct = not self.quarantine
        for name, fn in (("fetcher", self._fetch_loop), ("publisher", self._publish_loop),
                         ("heartbeat", self._heartbeat_loop)):
            t = threading.Thread(target=fn, name=f"mtq-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        try:
            self._model_loop()
        finally:
            self.stop()
            for t in self._threads[:1]:  # the fetcher may hold a claim in flight
                t.join(timeout=10)
            self._retire()
            if self._outlet is not None:
                self._outlet.close()
            self._outbox.put(None)
            self._threads[1].join(timeout=30)
            self._beat_stop.set()
            self._threads[2].join(timeout=5)
            self._flush_stats()
            try:
                self.batchlog.flush(self.consumer.redis)  # the last batch records
                registry.remove(self.consumer.redis, self.worker_id)
                self.consumer.clear_interrupts()
            except MtqError:
                log.warning("could not leave the worker registry", exc_info=True)
            if self._ready:
                self._catalogue("stopped")
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
        outlet = Outlet(self, url, getattr(self.model, "stream_interval_ms", 0.0))
        try:
            outlet.start()
        except OSError:
            log.warning("could not start the outlet process; publishing from a thread",
                        exc_info=True)
            return
        self._outlet = outlet

    def _publish(self, items: list[Outcome | Chunk], last: bool = False) -> None:
        """Hand outcomes and chunks to the outlet process, or the publisher thread;
        ``last`` (the model thread, with a dynamic batch's last outcomes): settle them
        here if nothing else waits (see :meth:`_settle_here`)."""
        if self.batchlog.open:  # traced tasks run: close those that ended
            self.batchlog.ended(items)
        if last and self._settle_here(items):  # type: ignore[arg-type]
            return
        if self._outlet is None or not self._outlet.put(items):
            self._enqueue(items)

    def _enqueue(self, items: list[Outcome | Chunk]) -> None:
        with self._lock:
            self._unsettled += 1
        self._outbox.put(items)

    def _settle_here(self, outcomes: list[Outcome]) -> bool:
        """Settle a batch's last outcomes in the model thread, when no batch waits in the
        slot and the publisher has nothing in hand: the model thread would only go to
        sleep, and the hand-off to the publisher (its wake-up, a switch of the GIL) is
        saved on every round trip of an idle worker. Under load the next batch waits
        in the slot, and the publisher settles while the model runs it.

        One try (:class:`single_attempt`): False if it failed, and the publisher takes
        the outcomes over (retrying with backoff while Redis is away; an ack whose
        reply was lost is then refused by its lease token, never applied twice).
        As the ack's reply comes in, this thread yields its CPU once (lane.yielding),
        before it reads the reply: Redis published the outcome to the task's client in
        the same moment, and a client on the same CPU (a co-located web app, the
        benchmarks) reads it before this thread's bookkeeping runs."""
        if not outcomes or self._outlet is not None or self._unsettled or len(self.slot):
            return False
        try:
            with single_attempt(), yielding():
                report = self.consumer.settle(outcomes)
        except Exception as exc:  # Redis unreachable (or worse): the publisher's way
            log.debug("settling %d task(s) failed (%s); the publisher retries",
                      len(outcomes), exc)
            return False
        self._record(report)
        self._forget([(o.task.id, o.task.token) for o in outcomes])
        if self._draining and self._fetcher_sleeping:
            self._interrupt_fetcher()  # as the publisher does (see _publish_loop)
        return True

    # -- model thread --------------------------------------------------------------
    def _model_loop(self) -> None:
        while True:
            if isinstance(self.model, Generator):
                from mtq.workers.engine import GenerationEngine

                if not GenerationEngine(self).run():
                    return
                self._do_reload()
            elif not self._batch_loop():
                return

    def _batch_loop(self) -> bool:
        """Dynamic batching until stopped (False) or the model changed kind on a
        reload (True)."""
        per_item = is_per_item(self.model)
        while True:
            batch = self.slot.take()
            if batch is None:
                return False
            if batch is OFFERED:
                self._wait_here()
                continue
            if self._reload:
                self._give_back(batch)  # taken just as the reload came in: not started
                self._do_reload()
                if isinstance(self.model, Generator):
                    return True
                per_item = is_per_item(self.model)
                continue
            batch = self._live(batch)
            if not batch:
                continue
            with self._lock:
                self._busy = True
                self._current = len(batch)
            self.monitor.batch([(t.id, t.token) for t in batch])
            t0 = time.perf_counter()
            self._run_batch(batch, per_item)
            self._batch_s, self._batch_n = time.perf_counter() - t0, len(batch)
            with self._lock:
                self._busy = False
                self._current = 0
            if self._draining:  # the publisher lets the fetcher check if the queue is empty
                self._enqueue([])

    def _wait_here(self) -> None:
        """The fetcher's wait on Redis, offered to this thread (see :meth:`_wait`): wait
        for work (Consumer.wait). Tasks handed over are taken as the fetcher takes them
        (:meth:`_take_handed`) and run next, and the wait stays here while the worker is
        registered; anything else (a wake-up marker, the end of the registration, an
        error) goes back to the fetcher."""
        c = self.consumer
        if self._batch_s >= FAST_BATCH_S:  # the model showed itself slow meanwhile
            self.slot.return_wait(NOT_TAKEN)
            return
        try:
            woke = c.wait()
        except MtqError as exc:  # the fetcher's business (see _fetch_loop)
            self.slot.return_wait(exc)
            return
        if not (isinstance(woke, list) and woke):
            self.slot.return_wait(woke)
            return
        self._take_handed(woke)
        if not (c.registered and self.slot.max_wait_s == 0):
            self.slot.return_wait(True)  # the fetcher claims, or waits for more

    def _run_batch(self, batch: list[Claimed], per_item: bool) -> None:
        self.hist[len(batch)] += 1
        self.totals["batches"] += 1
        self.totals["tasks"] += len(batch)
        self.batchlog.start(batch)
        outcomes: list[Outcome | None] = [None] * len(batch)
        payloads: list[Any] = []
        index: list[int] = []
        for i, t in enumerate(batch):
            try:
                payloads.append(serialization.loads(t.payload))
                index.append(i)
            except PayloadError as exc:
                outcomes[i] = Outcome(t, ok=False, error=f"PayloadError: {exc}", retryable=False)
        model = self.model

        start = time.perf_counter()
        start_mono = time.monotonic()
        in_predict = 0.0
        floor = self._live_floor()  # once a batch: a settings read

        def call(lo: int, hi: int) -> Any:
            nonlocal in_predict
            # never call the model on a lease this process cannot show to be live: a
            # freeze may have fallen between two calls (per item, or bisection)
            tasks = [batch[index[j]] for j in range(lo, hi)]
            live = self._live(tasks, floor)
            if len(live) < len(tasks):
                return self._call_live(call, lo, tasks, live)
            self.monitor.call(index[lo], index[hi - 1] + 1)
            t0 = time.perf_counter()
            try:
                out = model.predict(payloads[lo:hi])  # type: ignore[union-attr]
                if inspect.isgenerator(out):
                    out = self._stream(out, tasks)
                return out
            finally:
                in_predict += time.perf_counter() - t0
                self.monitor.idle()

        if per_item:  # one call per payload; each outcome leaves as soon as it exists
            done: list[Outcome | Chunk] = [o for o in outcomes if o is not None]
            for bad in outcomes:  # payloads that could not be decoded
                if bad is not None:
                    self._observe_outcome(bad, start_mono)
            if done:
                self._publish(done)
            ran: list[tuple[Outcome, float, float | None]] = []
            submitted = self._submitted
            for j, i in enumerate(index):
                o = self._outcome(batch[i], run_one(call, j))
                if o is not None:
                    # its submit time, before the publisher settles it and forgets it
                    ran.append((o, time.monotonic(), submitted.get(o.task.id)))
                    self._publish([o], last=j == len(index) - 1)
            self._observe_items(ran, start_mono)
        else:
            results = run_isolated(call, len(payloads))
            for i, r in zip(index, results):
                outcomes[i] = self._outcome(batch[i], r)
            self.batchlog.end()
            self._observe_batch(outcomes, start_mono)
            self._publish([o for o in outcomes if o is not None], last=True)
        self.batchlog.end()  # (per item: after the last one)
        self.timing["predict_s"] += in_predict
        self.timing["overhead_s"] += time.perf_counter() - start - in_predict

    def _stream(self, gen: Any, tasks: list[Claimed]) -> list[Any]:
        """Run a streaming predict: hand each ``(i, chunk)`` it yields to the publisher
        (chunk indices restart at 0 on every call: a re-run after bisection or a
        redelivery is deduplicated by index in Redis). Returns its results."""
        counters = [0] * len(tasks)
        chunks: list[list[Any]] = [[] for _ in tasks]
        while True:
            try:
                item = next(gen)
            except StopIteration as stop:
                return chunks if stop.value is None else stop.value
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], int)
                    and 0 <= item[0] < len(tasks)):
                raise BatchShapeError(f"a streaming predict must yield (item index, chunk) "
                                      f"with an index in 0..{len(tasks) - 1}, got {item!r:.80}")
            i, value = item
            if isinstance(value, Progress):
                self._publish([Chunk(tasks[i], -1, value.value)])
                continue
            chunks[i].append(value)
            self._publish([Chunk(tasks[i], counters[i], value)])
            counters[i] += 1

    def _call_live(self, call: Callable[[int, int], Any], lo: int, tasks: list[Claimed],
                   live: list[Claimed]) -> list[Any]:
        """A call on items lo.. of which only ``live`` still belong to this worker: the
        model runs on those alone (through ``call``, item by item, so each is checked
        again), and each lost one gets a LeaseLost in its place (never settled)."""
        alive = {id(t) for t in live}
        out: list[Any] = []
        for k, t in enumerate(tasks):
            if id(t) not in alive:
                out.append(LeaseLost([t.id]))
                continue
            res = call(lo + k, lo + k + 1)
            if isinstance(res, (str, bytes, dict)) or not hasattr(res, "__len__") \
                    or len(res) != 1:
                raise BatchShapeError(f"predict must return a list of 1 result for 1 payload, "
                                      f"got {res!r:.80}")
            out.append(next(iter(res)))
        return out

    def _live_floor(self) -> float:
        """How long a lease must still be known live for a task to run unasked (s)."""
        return self.consumer.lease_s() * REVALIDATE_BELOW

    def _live(self, tasks: Sequence[Claimed], floor: float | None = None) -> list[Claimed]:
        """The tasks whose lease this process can show to be live, the others dropped
        unrun (Redis gave them to another worker after their lease ran out).

        A lease is known live until its claim or last extend was sent plus the lease
        (local monotonic clock, which keeps counting while a process is stopped). One
        that is known live for less than half a lease more, as after a freeze, a
        starved heartbeat or a lost connection, is checked with Redis first (one
        extend round trip, from the model thread: the rare path)."""
        now = time.monotonic()
        if floor is None:
            floor = self._live_floor()
        doubtful = [t for t in tasks if t.live_until - now < floor]
        if not doubtful:
            return list(tasks)
        lost = self._revalidate(doubtful)
        return [t for t in tasks if t.id not in lost] if lost else list(tasks)

    def _revalidate(self, tasks: Sequence[Claimed]) -> set[str]:
        """Ask Redis which of ``tasks`` this worker still owns (their leases are
        extended); returns the ids of the others, now forgotten. Tasks Redis already
        reported lost are not asked about; if Redis cannot be reached, every task
        asked about is treated as lost (it comes back when its lease expires)."""
        known = {t.id for t in tasks if t.live_until == LOST}
        ask = [t for t in tasks if t.live_until != LOST]
        lost = set(known)
        tokens = {t.id: t.token for t in tasks}
        if ask:
            backoff = Backoff()
            for attempt in range(4):
                try:
                    gone, _cancel = self.consumer.extend(ask)
                    lost.update(gone)
                    break
                except MtqError:
                    if attempt == 3 or self._stop.wait(backoff.next()):
                        log.warning("could not check %d lease(s) with Redis; not running "
                                    "those tasks (they return when their leases expire)",
                                    len(ask), exc_info=True)
                        for t in ask:  # dropped for good: a later check must not revive it
                            t.live_until = LOST
                        lost.update(t.id for t in ask)
                        break
        if lost:
            with self._lock:  # the same lease: an id may be held again under a new one
                fresh = [i for i in sorted(lost)
                         if i in self._held and self._held[i].token == tokens[i]]
            if fresh:
                log.warning("worker %s: the lease of %d task(s) ran out while this process "
                            "was stopped or starved; another worker owns them, so they are "
                            "dropped unrun", self.worker_id, len(fresh))
                self.totals["revoked"] += len(fresh)
                self._forget([(i, tokens[i]) for i in fresh])
            self.slot.remove(lost, {t.id: t.token for t in tasks if t.id in lost})
        return lost

    def _outcome(self, task: Claimed, r: ItemResult) -> Outcome | None:
        if r.ok:
            return Outcome(task, ok=True, value=r.value)
        exc = r.error
        if isinstance(exc, LeaseLost):  # not ours any more: nothing to settle
            return None
        with self._lock:
            cancelled = task.id in self._cancel
        if exc is None:
            return Outcome(task, ok=False, error="error", cancelled=cancelled)
        return Outcome(task, ok=False, error=f"{type(exc).__name__}: {exc}", cancelled=cancelled,
                       retryable=not isinstance(exc, (PermanentError, PayloadError)),
                       traceback=self._traceback(exc, task))

    def _traceback(self, exc: BaseException, task: Claimed) -> str:
        """The traceback kept on a failed task, logged once per exception (a batch
        that raised fails all its tasks with the same one)."""
        if exc is not self._last_failure:
            self._last_failure = exc
            self._last_traceback = format_traceback(exc)
            # its frames' locals (a batch's inputs, tensors on the device) are freed
            # now, not when the next failure replaces it (after a CUDA OOM, that matters)
            traceback.clear_frames(exc.__traceback__)
            log.warning("task %s failed (%s attempt(s) before this one):\n%s", task.id,
                        task.attempts, self._last_traceback)
        return self._last_traceback

    def _do_reload(self) -> None:
        """Re-import the target and set the new model up; keep the old one if that fails."""
        self._reload = False
        self._reloading = True
        try:
            if self.spec is None:
                raise TargetError("this worker was given a model object, not a target name; "
                                  "it cannot re-import it")
            model = load_model(self.spec, reload=True)
            policy = BatchPolicy.of(model, **self.overrides)
            if isinstance(self.device, str) and _uses_device(model):
                self.device = devices.torch_device(self.device_name)  # was a function's
            model.setup(self.device)
        except Exception as exc:
            self.last_error = f"reload failed, kept the old model: {type(exc).__name__}: {exc}"
            log.error("%s", self.last_error, exc_info=True)
            self._catalogue("reload_failed", error=self.last_error[:300])
        else:
            self._catalogue("reloaded", model)
            self.model, self.policy = model, policy
            # one batch ahead until the new model has shown itself fast (_claim_ahead)
            self._batch_s = float("inf")
            self.slot.claim_ahead(1)
            self.slot.configure(policy.max_batch_size, policy.max_wait_ms)
            self.last_error = ""
            log.info("worker %s reloaded %s", self.worker_id, "/".join(model.describe()))
            self.monitor.reloaded(policy.timeout_s, "/".join(model.describe()))
        self._reloading = False
        if self._reload:  # asked again while this one ran: the model loop goes round
            self.slot.kick()
        elif not self._stop.is_set() and not self._user_paused:
            self.slot.set_paused(False)

    # -- fetcher -------------------------------------------------------------------
    def _interrupt_fetcher(self) -> None:
        try:
            self.consumer.interrupt()
        except MtqError:
            log.warning("could not wake the fetcher", exc_info=True)

    def _fetch_loop(self) -> None:
        if self.quarantine:  # its tasks come from the supervisor
            self._stop.wait()
            return
        c = self.consumer
        backoff = Backoff()
        in_doubt = False  # a claim failed: it may have run, its reply lost with the connection
        handed = False  # its last wait returned tasks handed over (taken already)
        tasks: list[Claimed] = []
        while True:
            if c.registered and (self.slot.paused or self.slot.full()):
                # paused (or reloading), or its slot filled by what it was handed, with
                # its registration left: a submit must not hand it tasks it would hold
                # unstarted until it resumes or has room (another worker may be idle)
                self._retire()
            need = self.slot.wait_space()
            if need <= 0:
                return
            # handed over: it sleeps again while registered, else claims
            if not (handed and c.registered):
                try:
                    if in_doubt:
                        self._release_unknown()
                        in_doubt = False
                    # registered (it took all there was) with the room of one batch at
                    # most, however many it claims ahead (see _claim_ahead)
                    tasks = c.claim(need, room=self.slot.max_batch_size)
                    now = time.monotonic()
                    backoff.reset()
                except Exception as exc:  # Redis unreachable, or a reply we did not expect
                    in_doubt = True
                    delay = backoff.next()
                    (log.warning if backoff.failures in (1, 2) else log.debug)(
                        "claim failed (%s); retrying in %.2f s", exc, delay,
                        exc_info=not isinstance(exc, RedisUnavailable))
                    if self._stop.wait(delay):
                        return
                    continue
                full = len(tasks) == need
                self._claim_ahead(full)
                tasks = self._accept(tasks, now)
                if full:
                    continue
            handed = False
            # set before the drain check: whoever makes the worker idle after the check
            # sees it and wakes the fetcher (see _publish_loop)
            self._fetcher_sleeping = True
            woke: list[Claimed] | bool = False
            try:
                if self._draining and not tasks and c.next_timer_ms < 0 and self._idle():
                    log.info("worker %s drained the queue; stopping", self.worker_id)
                    self.stop()
                    self.slot.kick()
                    return
                woke = self._wait()
            except MtqError as exc:
                # the wake-up may have been lost with the connection, or tasks handed
                # over: claim again now, after giving back any such (see _release_unknown)
                log.debug("waiting for work failed (%s); claiming again", exc)
                in_doubt = True
                if self._stop.wait(backoff.next()):
                    return
            finally:
                self._fetcher_sleeping = False
            if isinstance(woke, list):
                # a slot they filled ends the registration (above), and the loop waits
                # for room before it waits for more
                tasks = self._take_handed(woke)
                handed = True

    def _take_handed(self, tasks: list[Claimed]) -> list[Claimed]:
        """Take tasks a submit handed over (the fetcher's wait, or the model thread's in
        its place) at once: held, so their leases are kept, whatever room the slot has."""
        self._claim_ahead(not self.consumer.registered)
        return self._accept(tasks, time.monotonic())

    def _accept(self, tasks: list[Claimed], now: float) -> list[Claimed]:
        """Take claimed or handed-over tasks into the slot (the fetcher, or the model
        thread waiting in its place): suspects go to the supervisor's quarantine, the
        rest are held, and given back if the slot refuses them (paused, closed).
        Returns the tasks less those sent to the quarantine."""
        if self.hand_off and any(t.suspect for t in tasks):
            # a process died running these: under a supervisor they run in its
            # quarantine process, so that if they kill it again, no batch is lost
            handed = [t for t in tasks if t.suspect and self.monitor.quarantine(t)]
            if handed:
                self._handed.update((t.id, t.token) for t in handed)
                tasks = [t for t in tasks if t not in handed]
        if tasks:
            with self._lock:
                for t in tasks:
                    self._held[t.id] = t
            if self.stats.enabled:
                waits = [t.age_ms / 1000 for t in tasks]
                self._submitted.update((t.id, now - w) for t, w in zip(tasks, waits))
                self.stats.observe_many("queue_wait", waits)
            self.monitor.held([(t.id, t.token) for t in tasks])
            refused = self.slot.put(tasks, now)
            if refused:
                self._give_back(refused)
        return tasks

    def _wait(self) -> list[Claimed] | bool:
        """Consumer.wait, for the fetcher. While the worker is registered for direct
        delivery (idle, a queue with nothing to claim) and its model is fast, the wait
        is offered to the model thread, which takes it when it has nothing to run: a
        submit then wakes the thread that runs the task, and the hand-off from the
        fetcher (a wake-up, a switch of the GIL) is saved on every round trip (p50
        about 0.88x, docs/benchmarks.md). The fetcher sleeps until the wait comes back
        with anything but a task to run now. Only for a model whose tasks run as soon
        as they come (``max_wait_ms`` 0): a batch that waits to fill needs the fetcher
        collecting hand-offs meanwhile."""
        c = self.consumer
        if c.registered and not self._draining and self._batch_s < FAST_BATCH_S and \
                self.slot.max_wait_s == 0:
            got = self.slot.offer_wait()
            if isinstance(got, MtqError):
                raise got
            if got is not NOT_TAKEN:
                return got
        return c.wait()

    def _claim_ahead(self, full: bool) -> None:
        """How many batches the fetcher keeps claimed ahead, after a claim: one, or, while
        the claims come back full (a deep queue) and the model's last batch ran in less
        than FAST_BATCH_S, two; and more than two when its batches are small: as many
        as hold AHEAD_WORK_S of its work by its last batch, AHEAD_MOST tasks at most.

        The model thread's Python holds the GIL while it runs a batch, so the claim the
        fetcher makes when the model takes a batch goes out only when that batch ends:
        with one batch ahead, a fast model then waits for that claim's round trip after
        every batch (Redis and the worker take turns instead of overlapping; steady
        drain of no-op tasks about 1.3x with two, docs/benchmarks.md). A slow model
        hides the claim behind its batch and keeps one, so that on a queue shared by
        several workers the last batches spread over them; a generator keeps one (its
        running batch holds places in the slot; only dynamic batches set _batch_s).

        Small batches of a fast model (``--batch-size 1`` of a function that returns
        in microseconds) would otherwise cost a claim, with its fixed cost in Redis and
        in this process, for every batch or two. With more than two batches ahead the
        fetcher waits until half of them are taken, then claims all the room in one
        call (the slot's refill); one that comes back short registers the worker idle
        with the room of one batch, as any other claim (the most one submit hands it).
        The work held stays under AHEAD_WORK_S beyond the two batches, so the last
        tasks of a queue still spread over its workers."""
        if not (full and self._batch_s < FAST_BATCH_S):
            self.slot.claim_ahead(1)
            return
        size = self.slot.max_batch_size
        fit = AHEAD_MOST if self._batch_s <= 0 else \
            min(AHEAD_MOST, int(AHEAD_WORK_S * self._batch_n / self._batch_s))
        ahead = max(2, fit // size)
        self.slot.claim_ahead(ahead, ahead * size // 2 if ahead > 2 else 0)

    def _release_unknown(self) -> None:
        """After a claim (or a wait) whose reply was lost: give back the tasks Redis shows
        running under this worker that it does not hold (that claim ran, or a submit
        handed them over), uncounted. Its idle registration goes first, so that nothing
        is handed over while it looks."""
        self.consumer.retire()
        mine = self.consumer.broker.orphans(self.worker_id)
        self._handed &= set(mine)  # those no longer running are done with
        with self._lock:
            unknown = [(i, t) for i, t in mine
                       if i not in self._held and (i, t) not in self._handed]
        if unknown:
            n = self.consumer.release_leases(unknown)
            log.info("worker %s: gave back %d task(s) of a claim whose reply was lost",
                     self.worker_id, n)

    def _idle(self) -> bool:
        """Nothing running, waiting in the slot or waiting to be settled here."""
        with self._lock:
            return not self._busy and not self._held and len(self.slot) == 0

    def _retire(self) -> None:
        """No more direct deliveries: take the idle registration back, and give back what
        was handed over and not taken."""
        if not self.consumer.direct:
            return
        try:
            handed = self.consumer.retire()
        except MtqError:
            log.warning("could not take back the idle registration; tasks handed to this "
                        "worker as it stopped return when their leases expire", exc_info=True)
            return
        self._give_back(handed)

    def _give_back(self, tasks: Sequence[Claimed]) -> None:
        """Release unstarted tasks to the head of their streams (no delivery counted)."""
        if not tasks:
            return
        try:
            self.consumer.release(tasks)
        except MtqError:
            log.warning("could not give back %d task(s); they return when their leases "
                        "expire", len(tasks), exc_info=True)
        self._forget([(t.id, t.token) for t in tasks])

    def _forget(self, leases: Iterable[Lease]) -> None:
        """These deliveries left this process. By (id, token): a task settled as a
        retry can be back in its stream and claimed here again before this runs; its
        new delivery stays held (its lease extended, its figures kept)."""
        gone: list[Lease] = []
        with self._lock:
            for i, token in leases:
                t = self._held.get(i)
                if t is not None and t.token != token:
                    continue
                self._held.pop(i, None)
                self._submitted.pop(i, None)
                self._cancel.discard(i)
                self._lost.discard(i)
                gone.append((i, token))
        if gone:
            self.monitor.settled(gone)

    # -- publisher -----------------------------------------------------------------
    def _publish_loop(self) -> None:
        done = False
        last = 0.0
        while not done:
            item = self._outbox.get()
            gap = getattr(self.model, "stream_interval_ms", 0.0) / 1000 - (time.monotonic() - last)
            if gap > 0 and item is not None:  # let a few decode steps' tokens gather
                time.sleep(gap)
            last = time.monotonic()
            batch: list[Outcome | Chunk] = []
            took = 0  # lists taken from the outbox (see _unsettled)
            if item is None:
                done = True
            else:
                batch.extend(item)
                took += 1
            while True:  # everything that finished meanwhile goes in the same trip
                try:
                    more = self._outbox.get_nowait()
                except queue_mod.Empty:
                    break
                if more is None:
                    done = True
                else:
                    batch.extend(more)
                    took += 1
            if batch:
                outcomes = [o for o in batch if isinstance(o, Outcome)]
                chunks = [c for c in batch if isinstance(c, Chunk)]
                try:
                    self._settle(outcomes, give_up_after=10.0 if done else None, chunks=chunks)
                except Exception:  # never let the publisher die: nothing would settle again
                    log.exception("settling %d task(s) failed; they run again when their "
                                  "leases expire", len(outcomes))
                    self._forget([(o.task.id, o.task.token) for o in outcomes])
            with self._lock:
                self._unsettled -= took
            if self._draining and self._fetcher_sleeping:
                # a stream's next task may be claimable now, or the queue is empty
                self._interrupt_fetcher()

    def _settle(self, outcomes: list[Outcome], give_up_after: float | None,
                chunks: Sequence[Chunk] = ()) -> None:
        report = self.consumer.settle_retrying(outcomes, chunks, give_up_after)
        if report is not None:
            self._record(report)
        self._forget([(o.task.id, o.task.token) for o in outcomes])

    def _record(self, report: SettleReport) -> None:
        with self._lock:  # the publisher and the model thread (_settle_here) both record
            for name in OUTCOME_COUNTERS:
                self.totals[name] += getattr(report, name)
            self.totals["lost"] += len(report.lost)
            self.totals["tokens"] += report.streamed
            if report.stream_lost:
                self._lost.update(i for i in report.stream_lost if i in self._held)
        if report.lost:
            log.warning("lease lost on %d task(s); their results were discarded", len(report.lost))

    # -- heartbeat -----------------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        last_reap = time.monotonic()
        last_tasks, last_t = 0, time.monotonic()
        while True:
            # the queue's lease may change while it runs (mtq queue config): the beat
            # follows it, or leases shortened under it would expire
            lease_ms = self._lease_ms()
            interval = min(BEAT_S, lease_ms / 3000)
            reap_every = max(interval, lease_ms / 2000)
            try:
                self.batchlog.spans()
                self._extend()
                now = time.monotonic()
                rate = (self.totals["tasks"] - last_tasks) / max(now - last_t, 1e-6)
                last_tasks, last_t = self.totals["tasks"], now
                registry.beat(self.consumer.redis, self.worker_id,
                              self.report(rate), ttl_s=max(3 * interval, 5.0),
                              extra=self.batchlog.write)
                self.batchlog.written()
                self._read_stats_settings()
                self._flush_stats()
                if now - last_reap >= reap_every:
                    self.consumer.reap()
                    last_reap = now
            except MtqError as exc:  # Redis away: one line, no traceback
                log.warning("heartbeat failed (%s); will retry", exc)
            except Exception:  # a report that cannot be encoded
                log.warning("heartbeat failed; will retry", exc_info=True)
            if self._beat_stop.wait(interval):
                return

    def _lease_ms(self) -> int:
        try:
            return self.consumer.settings.lease_ms
        except MtqError:  # the settings could never be read: Redis away since the start
            return QueueSettings.lease_ms

    def _extend(self) -> None:
        with self._lock:
            tasks = list(self._held.values())
        if not tasks:
            return
        lost, cancel = self.consumer.extend(tasks)
        tokens = {t.id: t.token for t in tasks}
        if cancel:
            with self._lock:
                self._cancel.update(cancel)
            dropped = self.slot.remove(set(cancel), tokens)
            if dropped:  # not started: settle them as cancelled now
                self._publish([Outcome(t, ok=False, cancelled=True) for t in dropped])
        if lost:
            self._forget([(t.id, t.token) for t in self.slot.remove(set(lost), tokens)])
            with self._lock:  # a generator stops generating the ones it runs
                self._lost.update(i for i in lost if i in self._held)

    # -- histograms (mtq.workers.stats) ------------------------------------------------
    def _read_stats_settings(self) -> None:
        """Follow the queue's ``metrics`` and ``max_retries`` settings (heartbeat)."""
        try:
            s = self.consumer.settings
        except MtqError:  # never read: Redis away since the start; the defaults stand
            return
        self.stats.enabled = s.metrics
        self._max_retries = s.max_retries

    def _flush_stats(self) -> None:
        """Write the histograms gathered since the last write (one MULTI/EXEC: applied
        whole or not at all; kept for the next beat when Redis cannot be reached). Two
        round trips a beat, only when there is something to write."""
        try:
            with redis_errors("while writing the histograms"):
                pipe = self.consumer.redis.pipeline(transaction=True)
                sent = self.stats.flush(pipe, QueueKeys(self.queue).hist)
                if sent is None:
                    return
                # a queue deleted under its workers (mtq queue delete --force) stays
                # deleted: what they observed of it is dropped, not written back
                if shared(self.consumer.redis).sismember(QUEUES, self.queue):
                    pipe.execute()
                self.stats.commit(sent)
        except MtqError as exc:
            log.warning("could not write the histograms (%s); kept for the next beat", exc)

    def _ends(self, o: Outcome) -> bool:
        """The outcome ends its task (succeeded, failed, dead): not a retry, not a
        cancel (as Consumer._plan decides, from the settings last read)."""
        if o.ok:
            return True
        if o.cancelled:
            return False
        allowed = self._max_retries if o.task.retries is None else o.task.retries
        return not (o.retryable and o.task.attempts < allowed)

    def _observe_outcome(self, o: Outcome, started: float | None,
                         now: float | None = None) -> None:
        """Count a task's run (from ``started``, monotonic; None: it never ran) and,
        if the outcome ends it, its latency since submit."""
        st = self.stats
        if not st.enabled or o.cancelled:
            return
        now = time.monotonic() if now is None else now
        if started is not None:
            st.observe("run", now - started)
        if self._ends(o):
            since = self._submitted.get(o.task.id)
            if since is not None:
                st.observe("latency", max(0.0, now - since))

    def _observe_items(self, ran: Sequence[tuple[Outcome, float, float | None]],
                       started: float) -> None:
        """:meth:`_observe_outcome` of many outcomes, in one call a metric: each (outcome,
        when it ended, when its task was submitted: taken before it was published, since
        the publisher forgets it once settled), monotonic."""
        st = self.stats
        if not st.enabled:
            return
        runs: list[float] = []
        lats: list[float] = []
        for o, now, since in ran:
            if o.cancelled:
                continue
            runs.append(now - started)
            if since is not None and (o.ok or self._ends(o)):
                lats.append(max(0.0, now - since))
        st.observe_many("run", runs)
        st.observe_many("latency", lats)

    def _observe_batch(self, outcomes: Sequence[Outcome | None], started: float) -> None:
        """:meth:`_observe_items` of a whole batch's outcomes, all ended now."""
        if not self.stats.enabled:
            return
        now = time.monotonic()
        submitted = self._submitted
        self._observe_items([(o, now, submitted.get(o.task.id)) for o in outcomes
                             if o is not None], started)

    def report(self, rate: float = 0.0) -> dict[str, Any]:
        """The registry entry of this worker."""
        name, version = self.model.describe()
        with self._lock:
            current = self._current
            held = len(self._held)
        typical = self.hist.most_common(1)[0][0] if self.hist else 0
        entry: dict[str, Any] = {
            "host": socket.gethostname(), "pid": os.getpid(), "queue": self.queue,
            "device": self.device_name, "model": name, "version": version,
            "state": self.state, "batch": current, "typical_batch": typical,
            "role": "quarantine" if self.quarantine else "serving",
            "max_batch_size": self.policy.max_batch_size, "held": held,
            "histogram": {str(k): v for k, v in sorted(self.hist.items())},
            "tasks_per_s": round(rate, 2), "supervisor": self.supervisor,
            "visible_devices": devices.visible() or "", "last_error": self.last_error,
            **{k: v for k, v in self.totals.items()},
            "predict_s": round(self.timing["predict_s"], 4),
            # seconds in predict (prefill and decode steps for a generator)
            "busy_s": round(self.timing["predict_s"], 6),
            "restarts": self.restarts, "started": round(self.started, 3),
            "overhead_ms_per_batch": round(
                1000 * self.timing["overhead_s"] / max(1, self.totals["batches"]), 4),
        }
        mem = devices.memory(self.device)
        if mem:
            entry["memory"] = mem
        return entry
