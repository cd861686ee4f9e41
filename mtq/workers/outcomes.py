"""The model thread's side of outcomes: an outcome from what predict gave, the
traceback kept on a failure (logged once), and the run and latency histograms.

Used by the dynamic-batch loop (:mod:`mtq.workers.dynamic`) and, through the
worker, by the continuous-batching engine.
"""

from __future__ import annotations

import logging
import time
import traceback as traceback_mod
from collections.abc import Sequence

from mtq.broker import outcomes
from mtq.broker.consumer import Outcome, format_traceback
from mtq.broker.protocol import Claimed
from mtq.errors import InvalidArgument, LeaseLost, PayloadError, PermanentError
from mtq.observe.histograms import Histograms
from mtq.settings import QueueSettings
from mtq.validation import check_cost
from mtq.workers.aborts import Aborts
from mtq.workers.batching import Costed
from mtq.workers.ledger import Ledger
from mtq.workers.splitting import ItemResult

log = logging.getLogger("mtq.workers.worker")


class Outcomes:
    """Builds and observes outcomes for one worker (model thread)."""

    def __init__(self, ledger: Ledger, stats: Histograms, aborts: Aborts) -> None:
        self.ledger = ledger
        self.aborts = aborts
        self.stats = stats
        #: the queue's max_retries as the heartbeat last read it (the model thread
        #: tells a retry from a failure that ends the task without asking Redis)
        self.max_retries = QueueSettings.max_retries
        self._last_failure: BaseException | None = None  # logged once (see traceback)
        self._last_traceback = ""

    def outcome(self, task: Claimed, r: ItemResult) -> Outcome | None:
        if isinstance(r.error, LeaseLost):  # not ours any more: nothing to settle
            return None
        # a task cancelled or past its run timeout ends so, whatever its call gave
        if self.aborts.stopped((task.id,)):
            return self.aborts.outcome(task, self.aborts.reason(task.id) or "cancel")
        if r.ok:
            if isinstance(r.value, Costed):
                return Outcome(task, ok=True, value=r.value.value, cost=_cost(r.value.cost))
            return Outcome(task, ok=True, value=r.value)
        exc = r.error
        cancelled = self.ledger.cancelled(task.id)
        if exc is None:
            return Outcome(task, ok=False, error="error", cancelled=cancelled)
        return Outcome(task, ok=False, error=f"{type(exc).__name__}: {exc}", cancelled=cancelled,
                       retryable=not isinstance(exc, (PermanentError, PayloadError)),
                       traceback=self.traceback(exc, task))

    def traceback(self, exc: BaseException, task: Claimed) -> str:
        """The traceback kept on a failed task, logged once per exception (a batch
        that raised fails all its tasks with the same one)."""
        if exc is not self._last_failure:
            self._last_failure = exc
            self._last_traceback = format_traceback(exc)
            # its frames' locals (a batch's inputs, tensors on the device) are freed
            # now, not when the next failure replaces it (after a CUDA OOM, that matters)
            traceback_mod.clear_frames(exc.__traceback__)
            log.warning("task %s failed (%s attempt(s) before this one):\n%s", task.id,
                        task.attempts, self._last_traceback)
        return self._last_traceback

    def ends(self, o: Outcome) -> bool:
        """The outcome ends its task (succeeded, failed, dead): not a retry, not a
        cancel (:func:`mtq.broker.outcomes.ends`, from the settings last read)."""
        return outcomes.ends(o, self.max_retries)

    # -- histograms (mtq.observe.histograms) ---------------------------------------------
    def observe_outcome(self, o: Outcome, started: float | None,
                        now: float | None = None) -> None:
        """Count a task's run (from ``started``, monotonic; None: it never ran) and,
        if the outcome ends it, its latency since submit."""
        st = self.stats
        if not st.enabled or o.cancelled:
            return
        now = time.monotonic() if now is None else now
        if started is not None:
            st.observe("run", now - started)
        if self.ends(o):
            since = self.ledger.submitted.get(o.task.id)
            if since is not None:
                st.observe("latency", max(0.0, now - since))

    def observe_items(self, ran: Sequence[tuple[Outcome, float, float | None]],
                      started: float) -> None:
        """:meth:`observe_outcome` of many outcomes, in one call a metric: each (outcome,
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
            if since is not None and (o.ok or self.ends(o)):
                lats.append(max(0.0, now - since))
        st.observe_many("run", runs)
        st.observe_many("latency", lats)

    def observe_batch(self, outcomes: Sequence[Outcome | None], started: float) -> None:
        """:meth:`observe_items` of a whole batch's outcomes, all ended now."""
        if not self.stats.enabled:
            return
        now = time.monotonic()
        submitted = self.ledger.submitted
        self.observe_items([(o, now, submitted.get(o.task.id)) for o in outcomes
                            if o is not None], started)


def _cost(cost: object) -> float | None:
    """A reported cost, or None (the estimate stands) if it is not a finite number of 0
    or more: a model's bad report must not fail the task it computed."""
    try:
        return check_cost(cost)
    except InvalidArgument:
        log.warning("a model reported the cost %r; the task keeps its estimate", cost)
        return None
