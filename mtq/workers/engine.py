"""The continuous-batching engine: the model thread's loop for a :class:`Generator`.

As in an LLM serving scheduler, each turn of the loop:

1. drops the requests that were cancelled or whose lease was lost (cooperative
   abort: at most one step after the worker heard of it);
2. admits claimed requests into the running batch, within ``max_running`` and the
   token budgets (prompt tokens per prefill step, tokens in flight);
3. prefills the admitted ones (a prefill that raises is split, as a batch model's
   batch is, so one bad request fails alone);
4. runs one decode step for every running request (one that runs out of memory
   gives the most recently admitted half back to their streams, uncounted, lowers
   the limits and runs the step again: :mod:`mtq.workers.memory`);
5. hands the new tokens, and the outcome of each request that finished, to the
   worker's outlet process (:mod:`mtq.workers.outlet`), which streams and
   acknowledges them: the model thread never waits on Redis, and never shares
   the GIL with a Redis client.

When nothing runs and nothing is claimed, it blocks on the batch slot (a
condition variable) until the fetcher puts a task there: no spinning.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import TYPE_CHECKING, Any

from mtq import serialization
from mtq.broker.consumer import Chunk, Outcome
from mtq.broker.protocol import Claimed
from mtq.errors import DeviceOutOfMemory, InvalidArgument, PayloadError, PermanentError
from mtq.validation import check_cost
from mtq.workers import memory
from mtq.workers.batching import BatchShapeError
from mtq.workers.generator import Generation, Generator
from mtq.workers.splitting import run_isolated

if TYPE_CHECKING:
    from mtq.workers.protocols import EngineHost

log = logging.getLogger(__name__)


class _Request:
    __slots__ = ("alone", "began", "first_at", "gen", "next_index", "task")

    def __init__(self, task: Claimed, gen: Generation, alone: bool = False) -> None:
        self.task = task
        self.gen = gen
        #: it runs with no other request: a suspect, or it ran out of memory alone before
        self.alone = alone
        self.next_index = 0
        #: time.monotonic() at its prefill's start and at its first token (histograms)
        self.began: float | None = None
        self.first_at = 0.0


def _cost(g: Generation) -> float | None:
    """The cost a generation really had (scheduling: settled against the estimate its
    claim charged): the tokens it processed, its prompt's and those it generated. None
    (the estimate stands) if the model set ``prompt_tokens`` to something that makes
    no cost (a negative number, say): the settle would refuse it."""
    try:
        return check_cost(g.prompt_tokens + len(g.tokens))
    except (InvalidArgument, TypeError):
        log.warning("prompt_tokens %r makes no cost; the task keeps its estimate",
                    g.prompt_tokens)
        return None


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _load(r: _Request) -> int:
    """What a request counts against max_total_tokens: its prompt and its most tokens."""
    return r.gen.prompt_tokens + r.gen.max_tokens


class GenerationEngine:
    """Runs a worker's Generator until the worker stops (or asks for a reload).

    ``host`` is the worker, seen through :class:`~mtq.workers.protocols.EngineHost`."""

    def __init__(self, host: EngineHost) -> None:
        self.w = host
        self.model: Generator = host.model  # type: ignore[assignment]
        m = self.model
        #: the load in force: the model's, lowered after running out of memory
        self.limits = memory.GeneratorLimits(host.policy.max_batch_size, m.max_total_tokens,
                                             m.max_prefill_tokens)
        self.running: list[_Request] = []
        #: claimed and admitted, waiting for room in the budgets
        self.waiting: collections.deque[_Request] = collections.deque()
        self.steps = 0
        self._state: tuple[bool, int, int] | None = None  # what _set_busy last told
        #: monotonic time at which a running request's lease needs checking again
        self._check_at = float("inf")

    # -- bookkeeping -------------------------------------------------------------
    def _room(self) -> int:
        cap = self.limits.running.value or self.w.policy.max_batch_size
        return max(0, cap - len(self.running) - len(self.waiting))

    def _send(self, chunks: list[Chunk], outcomes: list[Outcome]) -> None:
        if chunks or outcomes:
            self.w.publish([*chunks, *outcomes])

    def _release(self, reqs: list[_Request]) -> None:
        if not reqs:
            return
        try:
            self.model.release([r.gen for r in reqs])
        except Exception:
            log.exception("release() raised; the requests' state may leak")

    def _fail(self, r: _Request, exc: BaseException) -> Outcome:
        o = Outcome(r.task, ok=False, error=_error(exc),
                    retryable=not isinstance(exc, (PermanentError, PayloadError)),
                    traceback=self.w.traceback(exc, r.task), cost=_cost(r.gen))
        self.w.observe_outcome(o, r.began)
        return o

    def _monitor(self) -> None:
        self.w.monitor.batch([(r.task.id, r.task.token) for r in self.running])

    def _call(self, fn: Any, reqs: list[_Request]) -> Any:
        w = self.w
        w.monitor.call(0, len(reqs))
        w.aborts.begin([r.task for r in reqs])  # run timeouts start at a request's prefill
        t0 = time.perf_counter()
        try:
            return fn([r.gen for r in reqs])
        finally:
            w.tally.timing["predict_s"] += time.perf_counter() - t0
            w.aborts.end()
            w.monitor.idle()

    # -- the loop ------------------------------------------------------------------
    def run(self) -> bool:
        """Serve until the worker stops (False) or a reload is due and the running
        batch has finished (True: the caller reloads and dispatches again)."""
        w = self.w
        life = w.life
        tally = w.tally
        closed = False
        while True:
            self._drop_aborted()
            reload_due = life.reload
            if reload_due and w.abandon and self.running:  # unload --now
                self._give_back_running()
            if (closed or reload_due) and self.waiting:  # admitted, never started
                w.give_back([r.task for r in self.waiting])
                self.waiting.clear()
            if not closed and not reload_due:
                idle = not self.running and not self.waiting
                if idle:  # free the slot's room before sleeping on it
                    self._set_busy(False)
                limit = self._room() if (self.model.continuous or idle) else 0
                tasks = w.slot.take_now(limit, block=idle)
                if tasks is None:  # stopping: finish what runs, give back the rest
                    closed = True
                    continue
                if tasks:
                    self._intake(tasks)
            if not self.running and not self.waiting:
                self._set_busy(False)
                if closed:
                    return False
                if life.reload:
                    return True
                continue
            self._set_busy(True)
            start = time.perf_counter()
            predict_before = tally.timing["predict_s"]
            admitting = not closed and not reload_due and (self.model.continuous
                                                           or not self.running)
            new = self._admit() if admitting else []
            if self.running and time.monotonic() >= self._check_at:
                self._check_leases(self.running)
            if new:
                new = self._check_leases(new)
            chunks: list[Chunk] = []
            outcomes: list[Outcome] = []
            if new:
                w.batchlog.start([r.task for r in new])  # an admission group: a batch record
                self._prefill(new, chunks, outcomes)
                w.batchlog.end("prefill")
                if self.running and time.monotonic() >= self._check_at:
                    # the prefill outlived a lease (a freeze, a long prompt): no decode
                    # on a request another worker may have taken over meanwhile
                    self._check_leases(self.running)
            if self.running:
                self._decode(chunks, outcomes)
            self._send(chunks, outcomes)
            self.steps += 1
            tally.totals["batches"] += 1
            tally.hist[len(self.running)] += 1
            tally.timing["overhead_s"] += (time.perf_counter() - start
                                           - (tally.timing["predict_s"] - predict_before))

    def _set_busy(self, busy: bool) -> None:
        w = self.w
        current = len(self.running)
        # continuous: claim only into the room the running batch leaves; static: the
        # next batch gathers in the slot while this one runs
        reserve = current + len(self.waiting) if self.model.continuous else 0
        state = (busy, current, reserve)
        if state == self._state:  # most steps: nothing to tell (no lock taken)
            return
        self._state = state
        w.ledger.set_busy(busy, current)
        w.slot.reserve(reserve)

    def _check_leases(self, reqs: list[_Request]) -> list[_Request]:
        """Keep the requests whose lease this process can show to be live (see
        ``EngineHost.live``); the others were reclaimed while it was stopped or starved:
        running ones are dropped before the next step, admitted ones are never
        prefilled. Returns the live ones of ``reqs``."""
        w = self.w
        live = w.live([r.task for r in reqs])
        if len(live) < len(reqs):
            kept = {id(t) for t in live}
            gone = {id(r) for r in reqs if id(r.task) not in kept}
            was_running = [r for r in self.running if id(r) in gone]
            if was_running:  # prefilled: their state is freed as for any request leaving
                self.running = [r for r in self.running if id(r) not in gone]
                self._release(was_running)
                self._monitor()
            reqs = [r for r in reqs if id(r) not in gone]
        # the next check is due when the earliest of these leases is no longer known live
        floor = w.live_floor()
        self._check_at = min((r.task.live_until for r in (*self.running, *reqs)),
                             default=float("inf")) - floor
        return reqs

    def _drop_aborted(self) -> None:
        ledger = self.w.ledger
        if not ledger.cancel and not ledger.lost and not ledger.deadlines:  # most steps
            return  # (a set's truth needs no lock)
        cancel, lost = ledger.take_aborted()
        aborts = self.w.aborts
        timed = set(aborts.stopped([r.task.id for r in self.running])) - cancel
        cancel |= timed
        if not cancel and not lost:
            return
        gone = [r for r in self.running if r.task.id in cancel or r.task.id in lost]
        gone += [r for r in self.waiting if r.task.id in cancel or r.task.id in lost]
        if not gone:
            return
        ids = {r.task.id for r in gone}
        self.running = [r for r in self.running if r.task.id not in ids]
        self.waiting = collections.deque(r for r in self.waiting if r.task.id not in ids)
        self._release(gone)
        self._monitor()
        cancelled = [aborts.outcome(r.task, "timeout" if r.task.id in timed else "cancel",
                                    _cost(r.gen)) for r in gone
                     if r.task.id in cancel and r.task.id not in lost]
        self._send([], cancelled)
        ledger.forget([(r.task.id, r.task.token) for r in gone if r.task.id in lost])

    def _give_back_running(self) -> None:
        """Every running request back to the head of its stream, uncounted (each starts
        over later with its seed; its client's stream goes on where it was)."""
        gone, self.running = self.running, []
        self._release(gone)
        self._send([], [Outcome(r.task, ok=False, released=True) for r in reversed(gone)])
        self._monitor()

    def _intake(self, tasks: list[Claimed]) -> None:
        """Decode and check newly taken tasks; those that fail leave at once. An
        unloaded engine loads its model first (on demand)."""
        if not self.w.ensure_loaded(tasks):
            return
        outcomes = []
        self.w.tally.totals["tasks"] += len(tasks)
        for t in tasks:
            try:
                payload = serialization.loads(t.payload)
            except PayloadError as exc:
                outcomes.append(Outcome(t, ok=False, error=f"PayloadError: {exc}",
                                        retryable=False))
                continue
            r = _Request(t, Generation(t.id, payload), self.w.slot.solo(t))
            try:
                self.model.admit(r.gen)
            except Exception as exc:
                outcomes.append(self._fail(r, exc))
                continue
            self.waiting.append(r)
        self._send([], outcomes)

    def _admit(self) -> list[_Request]:
        """Move waiting requests into the batch within max_running and the budgets.
        A suspect (it took a process down before) runs alone."""
        lim = self.limits
        if not self.waiting or any(r.alone for r in self.running):
            return []
        cap = (lim.running.value or self.w.policy.max_batch_size) - len(self.running)
        prefill_left = lim.prefill.value
        max_total = lim.tokens.value
        in_flight = sum(_load(r) for r in self.running)
        new: list[_Request] = []
        while self.waiting and len(new) < cap:
            r = self.waiting[0]
            if r.alone and (self.running or new):
                break
            cost = r.gen.prompt_tokens
            first = not new and not self.running
            if not first:
                if prefill_left is not None and cost > prefill_left and new:
                    break
                if max_total is not None and in_flight + cost + r.gen.max_tokens > max_total:
                    break
            self.waiting.popleft()
            new.append(r)
            in_flight += cost + r.gen.max_tokens
            if prefill_left is not None:
                prefill_left -= cost
            if r.alone:
                break
        return new

    def _emit(self, r: _Request, token: Any, chunks: list[Chunk]) -> None:
        if token is None:
            return
        r.gen.tokens.append(token)
        chunks.append(Chunk(r.task, r.next_index, token))
        if r.next_index == 0:  # time to first token, from submit
            r.first_at = now = time.monotonic()
            since = self.w.ledger.submitted.get(r.task.id)
            if since is not None:
                self.w.stats.observe("ttft", max(0.0, now - since))
        r.next_index += 1

    def _finish(self, r: _Request, outcomes: list[Outcome]) -> None:
        g = r.gen
        stop = self.w.aborts.reason(r.task.id)
        if stop is not None:  # (cancelled or timed out as it finished: never a success)
            outcomes.append(self.w.aborts.outcome(r.task, stop, _cost(g)))
            return
        try:
            value = g.given_result if g.has_result else self.model.result(g)
            o = Outcome(r.task, ok=True, value=value, cost=_cost(g))
            outcomes.append(o)
            now = time.monotonic()
            self.w.observe_outcome(o, r.began, now)
            if r.next_index >= 2 and now > r.first_at:  # the decode rate after the first
                self.w.stats.observe("tokens_per_s", (r.next_index - 1) / (now - r.first_at))
        except Exception as exc:
            outcomes.append(self._fail(r, exc))

    def _prefill(self, new: list[_Request], chunks: list[Chunk], outcomes: list[Outcome]) -> None:
        began = time.monotonic()
        for r in new:
            r.began = began
        self.running.extend(new)
        self._monitor()
        released: set[int] = set()

        def call(items: list[int]) -> list[Any]:
            reqs = [new[j] for j in items]
            try:
                first = self._call(self.model.prefill, reqs)
                if first is not None and len(first) != len(reqs):
                    raise BatchShapeError(f"prefill returned {len(first)} tokens for "
                                          f"{len(reqs)} requests")
            except Exception:
                self._release(reqs)  # the parts run again, once this is handled
                released.update(id(r) for r in reqs)
                raise
            return [None] * len(reqs) if first is None else list(first)

        calls: list[tuple[list[int], str]] = []
        results = run_isolated(call, len(new), calls=calls)
        failed = [(new[j], res.error) for j, res in enumerate(results) if not res.ok]
        if len(calls) > 1:  # split: learn the prefill budget from what ran
            alone = {j for j, res in enumerate(results)
                     if isinstance(res.error, DeviceOutOfMemory)}
            if alone:  # these run alone when they come back
                self.w.slot.run_alone([new[j].task.id for j in alone])
            memory.learn(self.limits.prefill, calls, lambda j: results[j].ok,
                         lambda items: sum(new[j].gen.prompt_tokens for j in items))
        elif self.limits.prefill.lowered:
            self.limits.prefill.ran(sum(r.gen.prompt_tokens for r in new))
        for r, res in zip(new, results):
            if res.ok:
                self._emit(r, res.value, chunks)
        if failed:
            bad = {id(r) for r, _ in failed}
            self.running = [r for r in self.running if id(r) not in bad]
            self._release([r for r, _ in failed if id(r) not in released])
            outcomes.extend(self._fail(r, exc or BatchShapeError("no token")) for r, exc in failed)
            self._monitor()
        self._retire(chunks, outcomes, new)

    def _decode(self, chunks: list[Chunk], outcomes: list[Outcome]) -> None:
        reqs = [r for r in self.running if not r.gen.finished]
        if not reqs:
            return
        before = None  # the limits before this step ran out of memory
        while True:
            tokens, exc = self._step(reqs)
            if exc is None:
                break
            if len(reqs) > 1 and memory.is_oom(exc):
                memory.drop(exc)  # its frames hold the step's tensors
                exc = None
                before = before or self.limits.snapshot()
                reqs = self._shed(reqs, outcomes)
                memory.free_memory()
                continue
            # it cannot be pinned on one request and the batch state may be broken:
            # every request of the step is released and retried (or failed)
            if memory.is_oom(exc):  # alone: it does not fit, and it was in every step
                exc = memory.alone(exc)  # that failed before (the oldest are kept)
                self.w.slot.run_alone([r.task.id for r in reqs])
                if before is not None and len(reqs) == 1:
                    self.limits.restore(before)
                    self.w.slot.set_batch_size(self.limits.running.value or 1)
            log.error("decode raised on %d request(s): %s", len(reqs), _error(exc))
            self._release(self.running)
            outcomes.extend(self._fail(r, exc) for r in self.running)
            self.running = []
            self._monitor()
            return
        lim = self.limits
        if lim.lowered and lim.ran(len(reqs), sum(_load(r) for r in reqs)):
            self.w.slot.set_batch_size(lim.running.value or 1)  # (after a run of steps)
        for r, tok in zip(reqs, tokens):
            self._emit(r, tok, chunks)
        self._retire(chunks, outcomes, reqs)

    def _step(self, reqs: list[_Request]) -> tuple[list[Any], BaseException | None]:
        """One decode step: (its tokens, None), or ([], what it raised), returned to be
        handled outside the ``except`` block (a retry must not run while the failed
        step's frames, and their tensors, are still held)."""
        try:
            tokens = self._call(self.model.decode, reqs)
            if tokens is None or len(tokens) != len(reqs):
                raise BatchShapeError(f"decode returned {0 if tokens is None else len(tokens)} "
                                      f"tokens for {len(reqs)} requests")
        except Exception as exc:
            return [], exc
        return tokens, None

    def _shed(self, reqs: list[_Request], outcomes: list[Outcome]) -> list[_Request]:
        """A decode step on ``reqs`` ran out of memory: lower the limits on running
        requests and tokens in flight, keep the oldest requests within them (at least
        one), and give the others back to the head of their streams without counting a
        delivery (each starts over later with its seed; its client's stream goes on
        where it was). Returns the requests kept."""
        lim = self.limits
        n = lim.shed([_load(r) for r in reqs])  # the oldest n stay
        keep, gone = reqs[:n], reqs[n:]
        cap = lim.running.value or 1
        self.w.slot.set_batch_size(cap)
        out = {id(r) for r in gone}
        self.running = [r for r in self.running if id(r) not in out]
        self._release(gone)
        # through the outlet, after their tokens: each goes back to the head of its
        # stream (the last first, as a drain gives tasks back)
        outcomes.extend(Outcome(r.task, ok=False, released=True) for r in reversed(gone))
        self._monitor()
        log.warning("decode ran out of memory with %d requests running: %d given back to "
                    "run later, %d go on (running requests now at most %d, tokens in "
                    "flight %s)", len(reqs), len(gone), len(keep), cap,
                    lim.tokens.value if lim.tokens.value is not None else "unlimited")
        return keep

    def _retire(self, chunks: list[Chunk], outcomes: list[Outcome], reqs: list[_Request]) -> None:
        """Finish the requests that ended this step (or reached their max_tokens)."""
        ended = False
        for r in reqs:
            g = r.gen
            if not g.finished and g.max_tokens and len(g.tokens) >= g.max_tokens:
                g.finish()
            ended = ended or g.finished
        if not ended:  # most steps
            return
        live = {id(r) for r in self.running}
        done = [r for r in reqs if id(r) in live and r.gen.finished]
        if not done:
            return
        ids = {id(r) for r in done}
        self.running = [r for r in self.running if id(r) not in ids]
        for r in done:
            self._finish(r, outcomes)
        self._release(done)
        self._monitor()
