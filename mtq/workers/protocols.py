"""What the parts of a worker need of each other, named.

The continuous-batching engine (:mod:`mtq.workers.engine`) and the outlet
(:mod:`mtq.workers.outlet`) never see :class:`~mtq.workers.worker.Worker`: they
receive the shared state (:mod:`mtq.workers.ledger`) and one of these.

* :class:`OutcomeSink`: where outcomes and chunks go to be settled in Redis: the
  publisher thread (:class:`~mtq.workers.publisher.Publisher`) or the outlet
  process (:class:`~mtq.workers.outlet.Outlet`).
* :class:`SettleReports`: what the outlet reports back to (the publisher: it
  counts what was settled and forgets those deliveries).
* :class:`EngineHost`: what the engine uses of the worker that runs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from mtq.broker.consumer import Chunk, Outcome, SettleReport
    from mtq.broker.protocol import Claimed
    from mtq.observe.histograms import Histograms
    from mtq.workers.aborts import Aborts
    from mtq.workers.batching import BatchSlot
    from mtq.workers.batchlog import BatchLog
    from mtq.workers.ledger import Lease, Ledger, Lifecycle, Monitor, Tally
    from mtq.workers.target import BatchPolicy, Target


class OutcomeSink(Protocol):
    """Takes outcomes and chunks to settle in Redis, in order, fenced by their
    lease tokens."""

    def put(self, items: Sequence[Outcome | Chunk]) -> bool:
        """Take ``items``; False if this sink is gone (the caller settles them
        another way)."""
        ...


class SettleReports(Protocol):
    """Hears what a sink settled (the outlet's reports)."""

    def record(self, report: SettleReport) -> None:
        """Count a trip's outcomes; mark the tasks whose streams were lost."""
        ...

    def settled(self, leases: Sequence[Lease]) -> None:
        """These deliveries were settled (or given up): they leave the process."""
        ...


class EngineHost(Protocol):
    """What the continuous-batching engine uses of its worker: the shared state,
    the slot it takes tasks from, and seven calls."""

    @property
    def model(self) -> Target: ...
    @property
    def policy(self) -> BatchPolicy: ...
    @property
    def slot(self) -> BatchSlot: ...
    @property
    def monitor(self) -> Monitor: ...
    @property
    def ledger(self) -> Ledger: ...
    @property
    def life(self) -> Lifecycle: ...
    @property
    def tally(self) -> Tally: ...
    @property
    def batchlog(self) -> BatchLog: ...
    @property
    def stats(self) -> Histograms: ...
    @property
    def aborts(self) -> Aborts: ...
    @property
    def abandon(self) -> bool:
        """An ``unload --now`` is due: give the running requests back."""
        ...

    def ensure_loaded(self, tasks: Sequence[Claimed]) -> bool:
        """Load an unloaded engine's model for the tasks it took (False: it could not;
        the tasks went back)."""
        ...

    def publish(self, items: list[Outcome | Chunk]) -> None:
        """Hand tokens and outcomes to be settled (the outlet, or the publisher)."""
        ...

    def give_back(self, tasks: Sequence[Claimed]) -> None:
        """Release unstarted tasks to the head of their streams."""
        ...

    def live(self, tasks: Sequence[Claimed]) -> list[Claimed]:
        """The tasks whose lease this process can show to be live (asking Redis
        about doubtful ones); the others are dropped."""
        ...

    def live_floor(self) -> float:
        """How long a lease must still be known live for a task to run unasked (s)."""
        ...

    def traceback(self, exc: BaseException, task: Claimed) -> str:
        """The traceback to keep on a failed task (logged once per exception)."""
        ...

    def observe_outcome(self, o: Outcome, started: float | None,
                        now: float | None = None) -> None:
        """Count a task's run and, if the outcome ends it, its latency."""
        ...
