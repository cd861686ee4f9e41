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
engine (its tasks go back to their streams) and is reported in its registry entry;
the others go on serving.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from mtq.errors import BrokerError
from mtq.workers import devices
from mtq.workers.residency import Residency
from mtq.workers.worker import Worker

log = logging.getLogger(__name__)


class Host:
    """Runs ``workers`` (engines, each serving its own queue) in this process."""

    def __init__(self, workers: Sequence[Worker], *, memory_budget: int | None = None,
                 max_loaded: int | None = None) -> None:
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
        #: queue -> the exception that ended its engine (it stopped; the others go on)
        self.failed: dict[str, BaseException] = {}

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
        for w in self.workers:
            w.stop()

    def _serve(self, w: Worker) -> None:
        try:
            w.prepare()  # (its device, for its stream: run() without setup())
            with devices.engine_stream(w.device):
                self.totals[w.queue] = w.run()
        except BaseException as exc:  # contained: this engine stops, the others go on
            log.exception("the engine of queue %r stopped on an error", w.queue)
            self.failed[w.queue] = exc
            w.last_error = f"engine stopped: {type(exc).__name__}: {exc}"
            self._give_back(w, w.last_error)

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
        for w in self.workers:
            t = threading.Thread(target=self._serve, args=(w,), name=f"mtq-engine-{w.queue}",
                                 daemon=True)
            t.start()
            self._threads.append(t)
        for t in self._threads:
            t.join()
        return dict(self.totals)
