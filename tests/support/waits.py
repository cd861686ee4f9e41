"""Bounded waits: a predicate polled until it holds, an iterator read in a thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import pytest


def wait_for(predicate: Callable[[], Any], timeout: float, message: str,
             interval: float = 0.01) -> Any:
    """Wait until ``predicate()`` is truthy; fail with ``message`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s: {message}")
        time.sleep(interval)


class Reader:
    """Collects what an iterator yields, in a thread of its own (and the error that
    ended it, if any)."""

    def __init__(self, make: Callable[[], Iterable[Any]]) -> None:
        self.items: list[Any] = []
        self.error: BaseException | None = None
        self.finished = threading.Event()

        def body() -> None:
            try:
                for x in make():
                    self.items.append(x)
            except BaseException as exc:
                self.error = exc
            finally:
                self.finished.set()

        self.thread = threading.Thread(target=body, name="test-reader", daemon=True)
        self.thread.start()

    def join(self, timeout: float = 10.0) -> list[Any]:
        if not self.finished.wait(timeout):
            pytest.fail(f"the reader did not finish within {timeout}s; it got {self.items!r:.500}")
        if self.error is not None:
            raise self.error
        return self.items
