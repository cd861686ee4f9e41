"""TinyGPT (mtq.reference.gpt) slowed down for tests that watch it from a browser.

A real TinyGPT (the same weights, prefill, decode and sampling) with two changes
that make a browser test deterministic on a small CPU: each decode step sleeps
``MTQ_TEST_STEP_MS`` ms (default 25), so a page can be reloaded or closed
mid-generation, and it never stops at EOS (the trained weights end a paragraph with
it, random ones emit it at random), so a request runs its ``max_tokens``. One request at a time (``max_running = 1``): a
second waits for the slot, which a cancel must free.
"""

from __future__ import annotations

import os
import time
from typing import Any

import mtq
from mtq.reference.gpt import TinyGPT


class SlowTinyGPT(TinyGPT):
    max_running = 1

    def setup(self, device: Any = "cpu") -> None:
        super().setup(device)
        self.step_s = float(os.environ.get("MTQ_TEST_STEP_MS", "25")) / 1000

    def admit(self, request: mtq.Generation) -> None:
        super().admit(request)
        request.state.stop_at_eos = False

    def decode(self, requests: list[mtq.Generation]) -> list[Any]:
        time.sleep(self.step_s)
        return super().decode(requests)
