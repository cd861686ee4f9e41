"""Commits of finished batches on a thread of their own, so the next batch runs meanwhile.

A batch's commit (:meth:`mtq.rq.finishing.Finishing._finish`: WATCH, the fencing
read, then one MULTI/EXEC holding RQ's writes for every job) keeps Redis busy for a
while per job (docs/benchmarks.md, RQ), and the worker's thread would only wait for
it: with Redis on another core, handing the commit to this thread lets the worker
claim, prepare and run the next batch in the meantime (the thread waits on the
socket without the GIL).

Commits stay in order (one thread), at most ``depth`` finished batches wait (the
worker blocks past that, so jobs never pile up uncommitted), and an error of a
commit (Redis gone) is raised in the worker's thread at its next :meth:`put` or at
:meth:`drain`. A job stays leased, and its lease extended, until its commit is done,
so a worker killed with batches waiting here loses nothing: their jobs are given
back and run again (their results were never written).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Committer(Generic[T]):
    """Runs ``commit(item)`` for each item :meth:`put`, in order, on one thread."""

    def __init__(self, commit: Callable[[T], None], depth: int = 1,
                 name: str = "mtq-rq-commit") -> None:
        self._commit = commit
        self._items: queue.Queue[T | None] = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._items.get()
            try:
                if item is None:
                    return
                if self._error is None:  # after an error: drop the rest, raised already
                    self._commit(item)
            except BaseException as exc:  # handed to the worker's thread
                self._error = exc
            finally:
                self._items.task_done()

    def _raise(self) -> None:
        if self._error is not None:
            exc, self._error = self._error, None
            raise exc

    def put(self, item: T) -> None:
        """Queue a commit (blocks while ``depth`` wait); raises a failed commit's error."""
        self._raise()
        self._items.put(item)

    def drain(self) -> None:
        """Wait until every queued commit is done; raises a failed commit's error."""
        self._items.join()
        self._raise()

    def close(self) -> None:
        """Drain, then end the thread (errors of the last commits are raised)."""
        try:
            self.drain()
        finally:
            self._items.put(None)
            self._thread.join()
