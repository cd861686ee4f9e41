"""A host process: several engines, one per queue, in one worker process.

Each engine is a :class:`~mtq.workers.worker.Worker` with its own Redis connections,
its own fetcher, publisher and heartbeat threads, and its own model thread, named
``mtq-engine-<queue>``, which runs under a CUDA stream of its own on a GPU
(:func:`mtq.workers.devices.engine_stream`): one engine's long batch or prefill
never holds up another's batches or token emission, and their kernels do not
serialise on one stream. What they share is the process (one CUDA context, one
copy of torch) and the memory budget kept by :class:`~mtq.workers.residency.Residency`:
an engine idle for longer than its ``idle_unload_s`` is unloaded, a task arriving
for an unloaded ``on_demand`` engine loads it, and a load that would pass the
budget (bytes, or a number of loaded engines) unloads the least recently used idle
engine first.

An engine's failure stays its own: an exception that escapes its loop stops that
engine (what it held goes back to its streams, the delivery counted) while the
others go on serving; given a ``rebuild`` (a supervised host process has one), the
host makes the engine again after a backoff, with the options it served, and its
registry entry counts the restart and shows the error.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from mtq.errors import BrokerError
from mtq.workers import devices
from mtq.workers.residency import Residency
from mtq.workers.worker import Worker

log = logging.getLogger(__name__)

#: a failed engine is made again after RESTART_BASE_S, doubled at each failure in a
#: row up to RESTART_MAX_S; one that served RESTART_RESET_S starts the count again
RESTART_BASE_S, RESTART_MAX_S, RESTART_RESET_S = 1.0, 30.0, 60.0


class Host:
    """Runs ``workers`` (engines, each serving its own queue) in this process."""

    def __init__(self, workers: Sequence[Worker], *, memory_budget: int | None = None,
                 max_loaded: int | None = None,
                 rebuild: Callable[[int, dict[str, str]], Worker] | None = None) -> None:
        queues = [w.queue for w in workers]
        if len(set(queues)) != len(queues):
            dup = sorted({q for q in queues if queues.count(q) > 1})
            raise ValueError(f"one engine per queue in a process; {dup} appear twice")
        self.workers = list(workers)
        self.residency = Residency(memory_budget=memory_budget, max_loaded=max_loaded)
        for w in self.workers:
            w.residency = self.residency
            self.residency.add(w)
        self._threads: list[threading.Thread] = []
        self.totals: dict[str, dict[str, int]] = {}
        #: queue -> the exception that last ended its engine (the others go on)
        self.failed: dict[str, BaseException] = {}
        #: makes engine i again (with these options) after it failed; None: it stays down
        self.rebuild = rebuild
        self._stopping = threading.Event()

    def setup(self) -> None:
        """Load the engines that are not loaded on demand, in order, within the budget."""
        for w in self.workers:
            w.prepare()
            if not w.on_demand:
                w.setup()
        used, n = self.residency.used()
        budget, most = self.residency.memory_budget, self.residency.max_loaded
        if (budget is not None and used > budget) or (most is not None and n > most):
            log.warning("the engines loaded at start hold %d bytes in %d engines, past the "
                        "budget (memory_budget %s, max_loaded %s); the least recently used "
                        "idle ones are unloaded at the next load", used, n, budget, most)

    def command(self, msg: dict[str, Any]) -> None:
        """A control command: to the engine of ``msg["queue"]``, or to all of them."""
        queue = msg.get("queue")
        for w in self.workers:
            if queue in (None, "", w.queue):
                w.command(msg)

    def stop(self) -> None:
        """Stop every engine (each finishes its running batch, gives the rest back)."""
        self._stopping.set()
        for w in self.workers:
            w.stop()

    def _serve(self, i: int) -> None:
        delay = RESTART_BASE_S
        while True:
            w = self.workers[i]
            began = time.monotonic()
            try:
                w.prepare()  # (its device, for its stream: run() without setup())
                with devices.engine_stream(w.device):
                    self.totals[w.queue] = w.run()
                return
            except BaseException as exc:  # contained: this engine stops, the others go on
                log.exception("the engine of queue %r stopped on an error", w.queue)
                self.failed[w.queue] = exc
                w.last_error = f"engine stopped: {type(exc).__name__}: {exc}"
                self._give_back(w, w.last_error)
            if self.rebuild is None:
                return
            if time.monotonic() - began >= RESTART_RESET_S:
                delay = RESTART_BASE_S
            new = self._again(i, w, delay)
            if new is None:
                return
            delay = min(2 * delay, RESTART_MAX_S)

    def _again(self, i: int, old: Worker, delay: float) -> Worker | None:
        """Engine ``i`` made again (after ``delay``, and again until it can be);
        None once the host stops."""
        assert self.rebuild is not None
        while True:
            log.warning("making the engine of queue %r again in %.1f s", old.queue, delay)
            if self._stopping.wait(delay):
                return None
            try:
                new = self.rebuild(i, dict(old.options))
            except Exception:  # Redis away, say: again later
                log.warning("could not make the engine of %r again", old.queue, exc_info=True)
                delay = min(2 * delay, RESTART_MAX_S)
                continue
            new.restarts, new.last_error = old.restarts + 1, old.last_error
            new.residency = self.residency
            self.residency.replace(old, new)
            self.workers[i] = new
            if self._stopping.is_set():  # (stop() may have missed it)
                new.stop()
            return new

    @staticmethod
    def _give_back(w: Worker, reason: str) -> None:
        """What a failed engine still held goes back to the head of its streams, the
        delivery counted (as for a process that died running it)."""
        with w.ledger.lock:
            held = [(t.id, t.token) for t in w.ledger.held.values()]
        if not held:
            return
        try:
            w.consumer.give_back(held, [], reason)
        except BrokerError:
            log.warning("could not give back the tasks of the failed engine of %r; they "
                        "return when their leases expire", w.queue, exc_info=True)
        w.ledger.forget(held)

    def run(self) -> dict[str, dict[str, int]]:
        """Serve until every engine has stopped; returns each queue's totals."""
        for i, w in enumerate(self.workers):
            t = threading.Thread(target=self._serve, args=(i,), name=f"mtq-engine-{w.queue}",
                                 daemon=True)
            t.start()
            self._threads.append(t)
        for t in self._threads:
            t.join()
        return dict(self.totals)
