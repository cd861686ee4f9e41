"""Racing threads for tests: ``n`` threads released together, their results, and any
error one of them raised re-raised in the test."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def run_together(n: int, fn: Callable[[], Any], timeout: float = 10) -> list[Any]:
    """Run ``fn`` in ``n`` threads started together (a barrier); their results (in no
    order). Fails when a thread is still running after ``timeout`` seconds; re-raises
    the first error a thread raised."""
    barrier = threading.Barrier(n)
    results: list[Any] = []
    errors: list[BaseException] = []

    def body() -> None:
        try:
            barrier.wait(timeout)
            results.append(fn())
        except BaseException as exc:  # re-raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=body, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    alive = sum(t.is_alive() for t in threads)
    assert not alive, f"{alive} of {n} threads still running after {timeout} s"
    if errors:
        raise errors[0]
    return results
