"""Targets of the ``cancel`` section of ``python -m benchmarks.control``: long work
of each kind that a cancel or a run timeout stops.

* :func:`tokens`: a plain generator function, a token every ``step_ms`` (default 10);
* :func:`cooperative`: a plain function that checks ``mtq.current_task()`` every
  ``check_ms`` (default 10) for ``s`` seconds (default 60);
* :class:`Steps`: an :class:`mtq.Generator` whose decode step takes ``step_ms``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import mtq


def tokens(p: dict[str, Any]) -> Iterator[int]:
    step = float(p.get("step_ms", 10)) / 1000
    for i in range(int(p.get("n", 100_000))):
        time.sleep(step)
        yield i


def cooperative(p: dict[str, Any]) -> str:
    check = float(p.get("check_ms", 10)) / 1000
    end = time.monotonic() + float(p.get("s", 60))
    cur = mtq.current_task()
    while time.monotonic() < end:
        cur.raise_if_cancelled()
        time.sleep(check)
    return "finished"


class Steps(mtq.Generator):
    """``{"n": tokens, "step_ms": ms}``: one token per decode step of ``step_ms``."""

    max_running = 8

    def admit(self, r: mtq.Generation) -> None:
        r.max_tokens = int(r.payload.get("n", 100_000))

    def prefill(self, requests: list[mtq.Generation]) -> list[Any]:
        return [0 for _ in requests]

    def decode(self, requests: list[mtq.Generation]) -> list[Any]:
        time.sleep(max(float(r.payload.get("step_ms", 10)) for r in requests) / 1000)
        return [len(r.tokens) for r in requests]

    def result(self, r: mtq.Generation) -> Any:
        return len(r.tokens)
