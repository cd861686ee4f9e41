"""The dynamic-batch loop: the model thread's loop for a batch model (not a
:class:`~mtq.workers.generator.Generator`, which the continuous-batching engine runs).

It takes a due batch from the :class:`~mtq.workers.batching.BatchSlot`, decodes it,
checks its leases, runs ``predict`` (bisecting a batch that raises, or once per
item for a per-item model) and hands the outcomes to the publisher. It never
waits on Redis for a healthy batch: the publisher settles while the next one runs.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any

from mtq import serialization
from mtq.broker.consumer import Chunk, Outcome
from mtq.broker.protocol import Claimed
from mtq.errors import DeviceOutOfMemory, LeaseLost, PayloadError, TaskCancelled, TaskTimeout
from mtq.workers import memory
from mtq.workers.batching import OFFERED, BatchShapeError, BatchSlot
from mtq.workers.batchlog import BatchLog
from mtq.workers.claims import CLAIM_AHEAD_S, ClaimSizer
from mtq.workers.fetcher import FAST_BATCH_S, Fetcher
from mtq.workers.generator import Generator
from mtq.workers.leases import Leases
from mtq.workers.ledger import Ledger, Lifecycle, Monitor, Tally
from mtq.workers.model import Progress, is_per_item
from mtq.workers.outcomes import Outcomes
from mtq.workers.publisher import Publisher
from mtq.workers.splitting import ItemResult, run_isolated, run_one
from mtq.workers.target import Target

#: how much of the slowest recent batch's time Ledger.batch_s keeps per batch (see
#: DynamicBatcher.run): a model is taken for fast after a few fast batches in a row
BATCH_S_DECAY = 0.5


class DynamicBatcher:
    """Runs a worker's batch model until it stops, or a reload changes its kind."""

    def __init__(self, *, slot: BatchSlot, ledger: Ledger, life: Lifecycle, tally: Tally,
                 monitor: Monitor, batchlog: BatchLog, fetcher: Fetcher, publisher: Publisher,
                 leases: Leases, outcomes: Outcomes, model: Callable[[], Target],
                 reload: Callable[[], None], batch_size: Callable[[], int],
                 ensure_loaded: Callable[[list[Claimed]], bool] = lambda _t: True) -> None:
        self.slot = slot
        self.ledger = ledger
        self.life = life
        self.tally = tally
        self.monitor = monitor
        self.batchlog = batchlog
        self.fetcher = fetcher
        self.publisher = publisher
        self.leases = leases
        self.outcomes = outcomes
        #: the worker's model now (a reload swaps it), and the reload itself
        self.current_model = model
        self.reload = reload
        #: the policy's max_batch_size now (a reload may change it)
        self.batch_size = batch_size
        #: loads an unloaded engine's model for the batch it took (False: it could not,
        #: and the batch went back)
        self.ensure_loaded = ensure_loaded
        #: the batch size in force: lowered when a batch runs out of memory, raised
        #: again after a run of batches that did not (mtq.workers.memory)
        self.limit = memory.Limit("batch size", batch_size(), memory.RECOVER_BATCHES)
        #: seconds per item of the recent batches that ran in one call (a decaying mean)
        self.item_s = 0.0
        #: how many tasks a claim takes, by the measured time per task (set here, before
        #: the fetcher's first claim: a per-item model starts at one)
        self.claims = ClaimSizer(slot)
        self.claims.reset(is_per_item(model()))

    def _new_limit(self) -> None:
        """The model's batch size in force from now on (a new model: the configured one)."""
        self.limit = memory.Limit("batch size", self.batch_size(), memory.RECOVER_BATCHES)
        self.item_s = 0.0
        self.claims.reset(is_per_item(self.current_model()))

    def run(self) -> bool:
        """Dynamic batching until stopped (False) or the model changed kind on a
        reload (True)."""
        model = self.current_model()
        per_item = is_per_item(model)
        self._new_limit()
        slot, ledger, life = self.slot, self.ledger, self.life
        consumer = self.fetcher.consumer
        while True:
            # A slow model on a queue that schedules claims nothing ahead while a batch
            # runs: the next claim, as the batch ends, takes what is most urgent then (an
            # interactive task waits one batch and a claim's round trip at most, not also
            # a batch claimed ahead); the round trip costs a slow model little
            if slot.hold_running:
                slot.reserve(0)  # (a batch taken and not run: its places are free again)
            slot.hold_running = consumer.scheduling and ledger.batch_s >= FAST_BATCH_S
            batch = slot.take()
            if batch is None:
                slot.hold_running = False
                return False
            if batch is OFFERED:
                self.fetcher.wait_here()
                continue
            if life.reload:
                # taken just as a command came in: not started (and an unload must not
                # load the model for it first)
                self.fetcher.give_back(batch)
                self.reload()
                model = self.current_model()
                if isinstance(model, Generator):
                    slot.hold_running = False
                    slot.reserve(0)
                    self.claims.reset(False)  # its running batch is its claim
                    return True
                per_item = is_per_item(model)
                self._new_limit()
                continue
            batch = self.leases.live(batch)
            if not batch:
                continue
            if not self.ensure_loaded(batch):
                continue
            ledger.set_busy(True, len(batch))
            self.monitor.batch([(t.id, t.token) for t in batch])
            t0 = time.perf_counter()
            self.run_batch(model, batch, per_item)
            took = time.perf_counter() - t0
            # a decaying maximum: one short batch among slow ones (an interactive task
            # between batch-band ones) does not make the model look fast to the fetcher,
            # which would claim two batches ahead and hold the next urgent task behind them
            last = ledger.batch_s
            ledger.batch_s = took if last == float("inf") else max(took, last * BATCH_S_DECAY)
            ledger.batch_n = len(batch)
            self.claims.observe(len(batch), took)  # (a batch cut short: measured already)
            if slot.hold_running:
                slot.reserve(0)
            ledger.set_busy(False, 0)
            if life.draining:  # the publisher lets the fetcher check if the queue is empty
                self.publisher.put([])

    def run_batch(self, model: Target, batch: list[Claimed], per_item: bool) -> None:
        tally = self.tally
        tally.hist[len(batch)] += 1
        tally.totals["batches"] += 1
        tally.totals["tasks"] += len(batch)
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
        monitor = self.monitor
        leases = self.leases
        publish = self.publisher.publish
        book = self.outcomes
        aborts = book.aborts

        start = time.perf_counter()
        start_mono = time.monotonic()
        in_predict = 0.0
        floor = leases.floor()  # once a batch: a settings read

        reordered = False  # the supervisor was told the batch in another order (below)

        def call(items: list[int]) -> Any:
            nonlocal in_predict, reordered
            # never call the model on a lease this process cannot show to be live: a
            # freeze may have fallen between two calls (per item, or bisection)
            tasks = [batch[index[j]] for j in items]
            live = leases.live(tasks, floor)
            if len(live) < len(tasks):
                return self.call_live(call, items, tasks, live)
            lo, hi = items[0], items[-1] + 1
            if not reordered and hi - lo == len(items):  # a run of the batch's items
                monitor.call(index[lo], index[hi - 1] + 1)
            else:  # a probe for the item that ran out of memory takes items here and
                # there: the supervisor hears the batch in an order where they are a run
                reordered = True
                inside = {index[j] for j in items}
                monitor.batch([(t.id, t.token) for t in tasks] +
                              [(t.id, t.token) for i, t in enumerate(batch) if i not in inside])
                monitor.call(0, len(items))
            t0 = time.perf_counter()
            # their run timeouts start; mtq.current_task() is theirs
            unwanted = aborts.begin(tasks)
            try:
                if unwanted:  # (each cancelled while waiting in this batch)
                    return [aborts.error(t.id) for t in tasks]
                out = model.predict(payloads[lo:hi] if hi - lo == len(items)  # type: ignore[union-attr]
                                    else [payloads[j] for j in items])
                if inspect.isgenerator(out):
                    out = self.stream(out, tasks)
                return out
            except (TaskCancelled, TaskTimeout):
                # (raise_if_cancelled): each task ends as its own stop says, unsplit
                if aborts.stopped_all(tasks):
                    return [aborts.error(t.id) for t in tasks]
                raise
            finally:
                aborts.end()
                in_predict += time.perf_counter() - t0
                monitor.idle()

        if per_item:  # one call per payload; each outcome leaves as soon as it exists
            done: list[Outcome | Chunk] = [o for o in outcomes if o is not None]
            for bad in outcomes:  # payloads that could not be decoded
                if bad is not None:
                    book.observe_outcome(bad, start_mono)
            if done:
                publish(done)
            ran: list[tuple[Outcome, float, float | None]] = []
            submitted = self.ledger.submitted
            claims = self.claims
            last = len(index) - 1
            t_item = time.monotonic()  # (one clock read an item: its end, the next start)
            for j, i in enumerate(index):
                o = book.outcome(batch[i], run_one(call, j))
                now = time.monotonic()
                took, t_item = now - t_item, now
                # a slow task with more after it: the rest may go to idle workers
                cut = took > CLAIM_AHEAD_S and j < last and claims.slow(took, last - j)
                if o is not None:
                    # its submit time, before the publisher settles it and forgets it
                    ran.append((o, now, submitted.get(o.task.id)))
                    publish([o], last=j == last or cut)
                if cut:
                    self.cut([batch[k] for k in index[j + 1:]])
                    break
            book.observe_items(ran, start_mono)
        else:
            calls: list[tuple[list[int], str]] = []
            fits = self.limit.good
            decoded = [batch[i] for i in index]
            carry: list[tuple[int, bool]] = []
            results = run_isolated(call, len(payloads), fits=fits, fitted_s=self.item_s * fits,
                                   alone=self.slot.alone_in(decoded),
                                   suspects=self.slot.suspected_in(decoded), carry=carry,
                                   calls=calls)
            self.learn(calls, results, decoded, in_predict)
            if carry:  # not run: into the next batch, not a small call of their own
                tally.totals["tasks"] -= len(carry)
                self.fetcher.give_back(self.slot.put_back(
                    [decoded[j] for j, _ in carry], [decoded[j].id for j, s in carry if s]))
            for i, r in zip(index, results):
                if not r.later:
                    outcomes[i] = book.outcome(batch[i], r)
            self.batchlog.end()
            book.observe_batch(outcomes, start_mono)
            publish([o for o in outcomes if o is not None], last=True)
        self.batchlog.end()  # (per item: after the last one)
        tally.timing["predict_s"] += in_predict
        tally.timing["overhead_s"] += time.perf_counter() - start - in_predict

    def cut(self, rest: list[Claimed]) -> None:
        """A per-item batch cut short after a slow task (ClaimSizer.slow): its tasks not
        started go back into the slot, first, and what the slot holds beyond the claims
        now sized to the work goes back to the queue, to the head of its streams, for
        idle workers to take (not counted as deliveries)."""
        self.tally.totals["tasks"] -= len(rest)
        self.fetcher.give_back(self.slot.put_back(rest))
        self.slot.claim_ahead(1)  # (as the fetcher sets it for a slow model)
        self.fetcher.give_back(self.slot.trim())

    def stream(self, gen: Any, tasks: list[Claimed]) -> list[Any]:
        """Run a streaming predict: hand each ``(i, chunk)`` it yields to the publisher
        (chunk indices restart at 0 on every call: a re-run after bisection or a
        redelivery is deduplicated by index in Redis). Returns its results."""
        counters = [0] * len(tasks)
        chunks: list[list[Any]] = [[] for _ in tasks]
        publish = self.publisher.publish
        aborts = self.outcomes.aborts
        ids = [t.id for t in tasks]
        while True:
            # between two steps: a call of which nothing is wanted any more (each task
            # cancelled or past its run timeout) stops here, its generator closed
            stopped = aborts.stopped(ids)
            if stopped and len(stopped) == len(ids):
                gen.close()
                return [aborts.error(i) for i in ids]
            try:
                item = next(gen)
            except StopIteration as stop:
                return chunks if stop.value is None else stop.value
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], int)
                    and 0 <= item[0] < len(tasks)):
                raise BatchShapeError(f"a streaming predict must yield (item index, chunk) "
                                      f"with an index in 0..{len(tasks) - 1}, got {item!r:.80}")
            i, value = item
            if stopped and ids[i] in stopped:  # (its outcome will be the stop's)
                continue
            if isinstance(value, Progress):
                publish([Chunk(tasks[i], -1, value.value)])
                continue
            chunks[i].append(value)
            publish([Chunk(tasks[i], counters[i], value)])
            counters[i] += 1

    def learn(self, calls: list[tuple[list[int], str]], results: list[ItemResult],
              tasks: list[Claimed], took: float) -> None:
        """What a batch's calls say of the load the device takes (``tasks``: the batch's
        decoded ones, as ``results``; ``took``: seconds in predict): a call that ran out
        of memory though each of its tasks ran in smaller ones lowers the batch size to
        what ran; a run of batches that did not raises it again. A task that ran out of
        memory alone runs alone next time."""
        limit = self.limit
        if len(calls) == 1:  # most batches: one call, and it ran
            items, kind = calls[0]
            if kind == "ok":
                per_item = took / len(items)
                self.item_s = per_item if not self.item_s else \
                    0.8 * self.item_s + 0.2 * per_item
                if limit.ran(len(items)):
                    self.slot.set_batch_size(limit.value or 1)
            return
        alone = {j for j, r in enumerate(results) if isinstance(r.error, DeviceOutOfMemory)}
        if alone:
            self.slot.run_alone([tasks[j].id for j in alone])
        if memory.learn(limit, calls, lambda j: results[j].ok):
            self.slot.set_batch_size(limit.value or 1)

    @staticmethod
    def call_live(call: Callable[[list[int]], Any], items: list[int], tasks: list[Claimed],
                  live: list[Claimed]) -> list[Any]:
        """A call on ``items`` of which only ``live`` still belong to this worker: the
        model runs on those alone (through ``call``, item by item, so each is checked
        again), and each lost one gets a LeaseLost in its place (never settled)."""
        alive = {id(t) for t in live}
        out: list[Any] = []
        for k, t in enumerate(tasks):
            if id(t) not in alive:
                out.append(LeaseLost([t.id]))
                continue
            res = call([items[k]])
            if isinstance(res, (str, bytes, dict)) or not hasattr(res, "__len__") \
                    or len(res) != 1:
                raise BatchShapeError(f"predict must return a list of 1 result for 1 payload, "
                                      f"got {res!r:.80}")
            out.append(next(iter(res)))
        return out
