"""The quarantine process: suspects (tasks whose delivery ended with their process)
run alone, one at a time, in a worker process of their own, so that a poison
request kills a serving process at most once.

A serving process that claims a suspect hands it to the supervisor (the child's
"quarantine" message) instead of running it; the supervisor keeps its lease
extended until the quarantine process, started when a suspect first needs it, is
ready to take it. The process stops after ``QUARANTINE_IDLE_S`` with nothing to
run. If it fails to set up again and again, the serving processes run their
suspects alone themselves (``hand_off`` off).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from mtq.broker.consumer import Consumer
from mtq.broker.protocol import Claimed
from mtq.errors import BrokerError
from mtq.workers import restarts
from mtq.workers.children import Child
from mtq.workers.restarts import backoff
from mtq.workers.stops import Stops

log = logging.getLogger("mtq.workers.supervisor")  # the supervisor's log, as its users read it

#: the quarantine process stops after this long with no suspect to run
QUARANTINE_IDLE_S = 30.0


class Quarantine:
    """A supervisor's quarantine process and the suspects waiting for it."""

    def __init__(self, consumer: Consumer, *, spawn: Callable[[], Child],
                 on_event: Callable[[str], None], on_give_up: Callable[[], None],
                 stops: Stops) -> None:
        self.consumer = consumer
        #: gives back what it held (bounded once the supervisor stops)
        self.stops = stops
        #: starts the quarantine process
        self.spawn = spawn
        self.on_event = on_event
        #: the serving processes are to run their suspects alone from now on
        self.on_give_up = on_give_up
        #: the quarantine process (started when a suspect first needs it)
        self.process: Child | None = None
        #: suspects waiting for it, as the fields of a Claimed
        self.suspects: list[list[Any]] = []
        self._extended = 0.0
        self._idle_since: float | None = None
        self._failures = 0
        self._due = 0.0
        #: False once the quarantine process failed to set up again and again: the
        #: serving processes then run their suspects alone themselves
        self.hand_off = True

    def elsewhere(self) -> set[str]:
        """Ids that run, or wait to run, here (not in the process that claimed them)."""
        out = {f[0] for f in self.suspects}
        if self.process is not None:
            out.update(self.process.held)
        return out

    # -- the main loop's questions -----------------------------------------------------
    def tick(self, now: float, stopping: bool, draining: bool, serving: bool) -> None:
        """Start the process if a suspect waits; keep the suspects' leases; stop the
        process once the queue drained (``serving``: serving processes remain), or
        after a while with nothing to run."""
        if not stopping and self.suspects and self.process is None and self._due <= now:
            self.process = self.spawn()
        self.extend(now)
        qc = self.process
        if qc is not None and not qc.retiring:
            idle = qc.ready and not qc.held and not self.suspects
            if not idle:
                self._idle_since = None
            elif self._idle_since is None:
                self._idle_since = now
            if (draining and not serving) or (idle and now - (
                    self._idle_since or now) >= QUARANTINE_IDLE_S):
                self.retire()

    def deadline(self, now: float, stopping: bool) -> float | None:
        """Seconds until it next has something to do; None: nothing waits."""
        out: list[float] = []
        if self.suspects:
            out.append(self._extended + self.consumer.settings.lease_ms / 3000 - now)
            if self.process is None and not stopping:
                out.append(self._due - now)
        if self._idle_since is not None:
            out.append(self._idle_since + QUARANTINE_IDLE_S - now)
        return min(out, default=None)

    # -- suspects ----------------------------------------------------------------------
    def suspect(self, fields: list[Any], stopping: bool) -> None:
        """A serving process claimed a suspect and handed it over."""
        if stopping:  # nothing will run it: back to its stream, unrun
            self.release([fields])
        else:
            self.suspects.append(fields)
            self.dispatch()

    def dispatch(self) -> None:
        """Hand the waiting suspects to the quarantine process once it is ready."""
        qc = self.process
        if qc is None or not qc.ready or not self.suspects:
            return
        for fields in self.suspects:
            qc.held[fields[0]] = fields[1]
            qc.send({"cmd": "run", "task": fields})
        self.suspects = []

    def extend(self, now: float) -> None:
        """Keep the leases of suspects waiting for the quarantine process (nobody else
        holds them meanwhile)."""
        if not self.suspects or now - self._extended < self.consumer.settings.lease_ms / 3000:
            return
        self._extended = now
        tasks = [Claimed(*f) for f in self.suspects]
        try:
            lost, _ = self.consumer.extend(tasks)
        except BrokerError:
            log.warning("could not extend the leases of %d suspect(s)", len(tasks),
                        exc_info=True)
            return
        if lost:
            gone = set(lost)
            self.suspects = [f for f in self.suspects if f[0] not in gone]

    def release(self, suspects: list[list[Any]]) -> None:
        self.stops.release(self.consumer, [(f[0], f[1]) for f in suspects])

    def release_all(self) -> None:
        """Stopping: the waiting suspects go back to their streams, unrun."""
        self.release(self.suspects)
        self.suspects = []

    # -- its process -------------------------------------------------------------------
    def ready(self) -> None:
        self._failures = 0
        self.dispatch()

    def retire(self) -> None:
        qc = self.process
        if qc is not None and not qc.retiring:
            qc.retiring = True  # it finishes what it runs; a new one starts on need
            self._idle_since = None
            qc.send({"cmd": "stop"})

    def reaped(self, c: Child, code: int | None, stopping: bool) -> None:
        """The quarantine process exited: what it ran goes back counted (dead at
        max_deliveries); one that could not set up is tried again later."""
        self.process = None
        self._idle_since = None
        self.stops.give_back([self.consumer], c, self.elsewhere(), code)
        if c.fatal and not stopping:  # cannot load the target: no use trying again
            self._failures = restarts.MAX_SETUP_FAILURES - 1
            self._setup_failed(c, code)
        elif not c.ready and not stopping:
            self._setup_failed(c, code)
        elif code != 0 and not stopping:
            self.on_event(f"the quarantine process ({c.worker_id}) died "
                          f"({c.killed_for or f'exit code {code}'}) running a suspect; "
                          f"{len(self.suspects)} more wait")

    def _setup_failed(self, c: Child, code: int | None) -> None:
        """The quarantine process died before it was set up (out of device memory for
        a second copy of the model, say): try again later; after a few tries, let the
        serving processes run their suspects alone themselves."""
        self._failures += 1
        why = c.error or f"exit code {code}"
        if self._failures < restarts.MAX_SETUP_FAILURES:
            self._due = time.monotonic() + backoff(self._failures)
            return
        self.on_event(f"the quarantine process failed during setup "
                      f"{self._failures} times ({why}); suspects run alone in "
                      "the serving processes instead")
        self.hand_off = False
        self.on_give_up()
        # back to their streams, uncounted: a serving process runs each alone
        self.release_all()
