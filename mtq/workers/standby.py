"""Warm standbys: per device, a worker process set up and waiting, claiming nothing,
that takes the place of a serving process that dies (promoted with a "go"), so a
crash costs no model set-up. By default one on the CPU and none on a GPU (it
would hold a second copy of the model in device memory)."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence

from mtq.workers import restarts
from mtq.workers.children import Child
from mtq.workers.restarts import backoff


class Standby:
    """The standby processes of a supervisor, one per device at most."""

    def __init__(self, devices: Sequence[str], want: int | None, *,
                 spawn: Callable[[str], Child], on_event: Callable[[str], None]) -> None:
        self.devices = list(devices)
        #: standbys per device: 0 or 1; None: 1 on the CPU, 0 on a GPU
        self.want = want
        #: starts a standby on a device
        self.spawn = spawn
        self.on_event = on_event
        self.spares: dict[str, Child] = {}
        self._due: dict[str, float] = {}
        self._failures: dict[str, int] = {}

    def wanted(self, used: Collection[str], closing: bool) -> list[str]:
        """Devices that should have a warm standby now (``used``: the devices the
        slots are on; ``closing``: draining or stopping)."""
        if closing:
            return []
        out = []
        for d in self.devices:
            want = self.want if self.want is not None else int(d == "cpu")
            if want and d in used and self._failures.get(d, 0) < restarts.MAX_SETUP_FAILURES:
                out.append(d)
        return out

    def tick(self, now: float, used: Collection[str], closing: bool) -> None:
        """Start the standbys that are due; retire those no longer wanted."""
        wanted = self.wanted(used, closing)
        for device in wanted:
            if device not in self.spares and self._due.get(device, 0.0) <= now:
                self.spares[device] = self.spawn(device)
        for device, c in self.spares.items():
            if device not in wanted and not c.retiring:
                c.retiring = True
                c.send({"cmd": "stop"})

    def deadline(self, now: float, used: Collection[str], closing: bool) -> float | None:
        """Seconds until the next standby is due to start; None: none waits."""
        return min((self._due.get(device, 0.0) - now for device in self.wanted(used, closing)
                    if device not in self.spares), default=None)

    def ready(self, c: Child) -> None:
        self._failures[c.device] = 0
        self.on_event(f"standby ready on {c.device} (pid {c.process.pid})")

    def promote(self, device: str, delay: float) -> Child | None:
        """The standby of ``device``, taken to replace a process that died (it stops
        being a standby; a new one starts after ``delay``), or None if it has none
        ready."""
        spare = self.spares.get(device)
        if spare is None or not spare.ready or spare.retiring:
            return None
        del self.spares[device]
        spare.spare = False
        self._due[device] = time.monotonic() + delay
        return spare

    def reaped(self, c: Child, code: int | None, stopping: bool) -> None:
        """A standby exited: told to (stop, reload), or it failed; start another later."""
        if self.spares.get(c.device) is c:
            del self.spares[c.device]
        if c.retiring or stopping:
            return
        if c.fatal:  # the target cannot be loaded any more (a broken reload): the
            # serving processes keep the old model; a new standby waits for the next reload
            self._failures[c.device] = restarts.MAX_SETUP_FAILURES
            self.on_event(f"the standby on {c.device} cannot load the target ({c.error}); "
                          "running without one until the next reload")
            return
        failures = self._failures.get(c.device, 0) + 1
        self._failures[c.device] = failures
        if failures >= restarts.MAX_SETUP_FAILURES:
            self.on_event(f"the standby on {c.device} failed {failures} times in a row "
                          f"({c.error or f'exit code {code}'}); running without one")
            return
        self._due[c.device] = time.monotonic() + backoff(failures)

    def retire_all(self, reload: bool = False) -> None:
        """Stop every standby; a new one may start at once (``reload``: they hold the
        old code, and one that failed before may succeed with the new)."""
        if reload:
            self._failures.clear()
        for c in self.spares.values():
            c.retiring = True
            self._due[c.device] = 0.0
            c.send({"cmd": "stop"})
