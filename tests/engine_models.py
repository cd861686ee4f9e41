"""Targets for the engine tests (tests/integration/test_engines.py): small models
whose setups, teardowns and resets are counted, whose weights are a real torch tensor
of a size given as an option, and whose setup can be held or made to fail."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import mtq

#: tag -> how many times each hook ran (this process)
SETUPS: Counter[str] = Counter()
TEARDOWNS: Counter[str] = Counter()
RESETS: Counter[str] = Counter()
#: payloads "crash-once" crashed already (the next delivery runs)
CRASHED: set[str] = set()
#: tag -> an event a setup with that tag waits for (a slow load the test releases)
GATES: dict[str, threading.Event] = {}
#: tag -> set while a setup with that tag waits at its gate
HELD: dict[str, threading.Event] = {}


class EngineCrash(BaseException):
    """Escapes the worker's handling of a model's exceptions (they catch Exception):
    the engine's loop itself ends."""


class Sized(mtq.Model):
    """Weights of ``floats`` float32 (a torch tensor); answers ``{"tag", "x"}``."""

    name = "sized"
    version = "1"
    max_batch_size = 8
    max_wait_ms = 0.0
    tag = mtq.Option(str, "a", help="what its results carry")
    floats = mtq.Option(int, 1000, min=1, help="its weights' size")
    fail = mtq.Option(bool, False, help="its setup raises")
    work_ms = mtq.Option(float, 0.0, min=0, help="milliseconds per predict call")

    def setup(self, device: Any) -> None:
        import torch

        SETUPS[self.tag] += 1
        gate = GATES.get(self.tag)
        if gate is not None:
            HELD.setdefault(self.tag, threading.Event()).set()
            assert gate.wait(30), "the test never released the setup"
        if self.fail:
            raise RuntimeError(f"setup of {self.tag} failed: no weights")
        self.weights = torch.ones(self.floats, device=device)

    def predict(self, batch: list[Any]) -> list[Any]:
        if self.work_ms:
            time.sleep(self.work_ms / 1000)
        if "crash" in batch:
            raise EngineCrash("the engine's loop broke")
        if "crash-once" in batch and "crash-once" not in CRASHED:
            CRASHED.add("crash-once")
            raise EngineCrash("the engine's loop broke once")
        return [{"tag": self.tag, "x": p, "w": float(self.weights[0])} for p in batch]

    def reset(self) -> None:
        RESETS[self.tag] += 1

    def teardown(self) -> None:
        TEARDOWNS[self.tag] += 1


class Steps(mtq.Generator):
    """A generator: ``{"n": N}`` streams 0..N-1, ``step_ms`` per decode step."""

    name = "steps"
    max_running = 4
    outlet = False

    def setup(self, device: Any) -> None:
        SETUPS["steps"] += 1
        self.step_s = 0.0

    def admit(self, r: mtq.Generation) -> None:
        r.prompt_tokens = 1
        r.max_tokens = int(r.payload["n"])
        self.step_s = max(self.step_s, float(r.payload.get("step_ms", 0)) / 1000)

    def prefill(self, requests: list[mtq.Generation]) -> list[Any]:
        return [self._next(r) for r in requests]

    def decode(self, requests: list[mtq.Generation]) -> list[Any]:
        if self.step_s:
            time.sleep(self.step_s)
        return [self._next(r) for r in requests]

    def _next(self, r: mtq.Generation) -> int:
        if len(r.tokens) + 1 >= r.max_tokens:
            r.finish()
        return len(r.tokens)

    def teardown(self) -> None:
        TEARDOWNS["steps"] += 1


class Stalls(mtq.Model):
    """For the kill tests (tests/integration/test_engine_faults.py): a model whose
    setup or teardown stalls, as a load from a slow disk does, while the file
    ``<dir>/setup-stall`` (or ``teardown-stall``) exists; it writes
    ``<dir>/setup-stalled.<pid>`` (or ``teardown-stalled.<pid>``) when it stalls, and
    one line per payload it ran to ``<dir>/ran`` (``<pid> <payload>``)."""

    name = "stalls"
    max_batch_size = 4
    max_wait_ms = 0.0
    dir = mtq.Option(str, help="the folder of the markers and the log")

    def _stall(self, what: str) -> None:
        import os
        from pathlib import Path

        d = Path(self.dir)
        if not (d / f"{what}-stall").exists():
            return
        (d / f"{what}-stalled.{os.getpid()}").touch()
        deadline = time.monotonic() + 60
        while (d / f"{what}-stall").exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # a load that takes as long as the test wants (it kills it)

    def setup(self, device: Any) -> None:
        self._stall("setup")

    def teardown(self) -> None:
        self._stall("teardown")

    def predict(self, batch: list[Any]) -> list[Any]:
        import os
        from pathlib import Path

        time.sleep(0.02)
        with open(Path(self.dir) / "ran", "a") as f:
            for p in batch:
                f.write(f"{os.getpid()} {p}\n")
        return batch
