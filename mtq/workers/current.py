"""``mtq.current_task()``: what a function or a model's ``predict`` can ask about the
work it runs, to stop early when nothing of it is wanted any more.

Inside a worker's call (the thread that runs ``predict`` or the plain function, while
it runs) it gives the call's :class:`CurrentTask`; anywhere else an inert one (no
tasks, never cancelled, :meth:`~CurrentTask.raise_if_cancelled` does nothing), so
a handler runs the same when called directly, in a test say.

In a batch call of several tasks, :attr:`CurrentTask.cancelled` is true only when
every task of the call is cancelled or past its run timeout (nothing of the call is
still wanted); :attr:`CurrentTask.stopped` names those that are, so a batch model can
skip them. Raising from :meth:`CurrentTask.raise_if_cancelled` ends each task of the
call as its own stop says (cancelled, or failed with TaskTimeout); a task of a call
that goes on is not harmed: whatever its call returns for it, a stopped task ends
cancelled or TaskTimeout, and the others keep their results.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol

from mtq.errors import TaskCancelled, TaskTimeout

#: the calling thread's view (a worker's model thread sets it at each call:
#: :meth:`mtq.workers.aborts.Aborts.begin`)
local = threading.local()


class Aborts(Protocol):
    """What a CurrentTask reads of its worker's :class:`mtq.workers.aborts.Aborts`."""

    @property
    def ids(self) -> tuple[str, ...]: ...
    def stopped(self, ids: Sequence[str]) -> list[str]: ...
    def reason(self, task_id: str) -> str | None: ...
    def timeout_of(self, task_id: str) -> float | None: ...


class CurrentTask:
    """The tasks of the call running in this thread, as its worker knows them now."""

    __slots__ = ("_aborts",)

    def __init__(self, aborts: Aborts | None) -> None:
        self._aborts = aborts

    @property
    def ids(self) -> tuple[str, ...]:
        """The ids of the tasks of the running call, in batch order (() outside a
        worker)."""
        return self._aborts.ids if self._aborts is not None else ()

    @property
    def id(self) -> str | None:
        """The task's id when the call runs one task (a plain function), else None."""
        ids = self.ids
        return ids[0] if len(ids) == 1 else None

    @property
    def stopped(self) -> frozenset[str]:
        """The ids of the call's tasks that were cancelled or ran past their timeout:
        their results will be dropped whatever the call returns (skip them)."""
        if self._aborts is None:
            return frozenset()
        return frozenset(self._aborts.stopped(self.ids))

    @property
    def cancelled(self) -> bool:
        """True when nothing of the running call is still wanted: every one of its
        tasks was cancelled or ran past its timeout. False outside a worker."""
        ids = self.ids
        return bool(ids) and len(self.stopped) == len(ids)

    def raise_if_cancelled(self) -> None:
        """Raise when :attr:`cancelled`: TaskTimeout if every task of the call ran past
        its timeout, else TaskCancelled. The worker ends each task as its own stop says
        (cancelled, or failed with TaskTimeout and retried). Does nothing otherwise,
        and outside a worker."""
        a = self._aborts
        if a is None or not self.cancelled:
            return
        ids = self.ids
        if all(a.reason(i) == "timeout" for i in ids):
            raise TaskTimeout(a.timeout_of(ids[0]))
        raise TaskCancelled(ids[0], "cancelled", "stopped on a cancel request")


#: what current_task() gives outside a worker's call
INERT = CurrentTask(None)


def current_task() -> CurrentTask:
    """The task(s) the calling thread runs for a worker now, to check for a cancel
    or a run timeout (``mtq.current_task().raise_if_cancelled()`` between two steps of
    long work). Outside a worker's call: an inert one (no ids, never cancelled)."""
    return getattr(local, "task", INERT)
