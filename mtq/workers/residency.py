"""Which engines of a process hold their model in memory: the commands that load,
unload, reload and reset an engine, and the budget that decides which to unload.

An :class:`EngineOp` is asked of one engine (:meth:`mtq.workers.worker.Worker.request`)
and carried out by its model thread at the next batch boundary, as a reload always
was; its answer goes to ``op.reply``. :class:`Residency` is the process's memory
budget (bytes of model tensors and a most-loaded count): an engine about to load
asks it for room, and it unloads the least recently used idle engines until the
new one fits, or waits for one to go idle. One engine loads at a time in a process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


class Resident(Protocol):
    """What the budget sees of an engine (a :class:`~mtq.workers.worker.Worker`)."""

    @property
    def loaded(self) -> bool: ...
    @property
    def memory_bytes(self) -> int: ...
    @property
    def last_used(self) -> float: ...
    @property
    def life(self) -> Any: ...

    def evictable(self, busy_ok: bool = False) -> bool:
        """Loaded and idle: nothing running, held or asked of it (``busy_ok``: running
        or holding tasks allowed)."""
        ...

    def request(self, op: EngineOp) -> None:
        """Ask it for an engine command."""
        ...

#: an engine that waits this long for room while every loaded engine is busy unloads
#: the least recently used busy one (see Residency.make_room)
BUSY_UNLOAD_S = 5.0

#: the engine commands (control messages with a reply id; see mtq.broker.answers)
OPS = ("load", "unload", "reload", "reset")

#: an engine's states as the registry shows them (its ``engine`` field)
LOADED, UNLOADED, LOADING, UNLOADING, FAILED = "loaded", "unloaded", "loading", "unloading", \
    "failed"


@dataclass
class EngineOp:
    """One command to an engine."""

    #: load, unload, reload or reset (see OPS); "swap" is internal (a model loaded
    #: beside the serving one takes its place)
    kind: str
    #: load and reload: the model options to load with (text, as --set); None: as now
    options: dict[str, str] | None = None
    #: unload: give the running requests back to their streams (uncounted) instead
    #: of finishing them (a generator; a batch model's running call cannot be cut)
    now: bool = False
    #: called once with the answer (a dict: see mtq.workers.ops.EngineOps.answer)
    reply: Callable[[dict[str, Any]], None] | None = None
    #: command (an operator), idle (idle_unload_s), budget (room for another), demand
    reason: str = "command"
    #: when it was asked (time.monotonic()): its answer's took_s counts from here
    asked: float = field(default_factory=time.monotonic)
    #: a "swap": the model loaded beside, and what the answer reports
    staged: Any = None


def _setter(event: threading.Event) -> Callable[[dict[str, Any]], None]:
    return lambda _answer: event.set()


class Residency:
    """The memory budget of the engines of one process (thread-safe)."""

    def __init__(self, memory_budget: int | None = None, max_loaded: int | None = None) -> None:
        self.memory_budget = memory_budget
        self.max_loaded = max_loaded
        self.engines: list[Resident] = []
        #: held by the engine that loads (one load at a time: what it measures is its own)
        self.load_lock = threading.Lock()
        #: notified whenever an engine is loaded, unloaded or goes idle
        self.changed = threading.Condition()

    def add(self, engine: Resident) -> None:
        self.engines.append(engine)

    def replace(self, old: Resident, new: Resident) -> None:
        """``new`` takes ``old``'s place (an engine made again after a failure)."""
        self.engines = [new if e is old else e for e in self.engines]
        self.notify()

    def notify(self) -> None:
        with self.changed:
            self.changed.notify_all()

    def used(self, but: Resident | None = None) -> tuple[int, int]:
        """(bytes, engines) loaded now, leaving ``but`` out."""
        loaded = [e for e in self.engines if e is not but and e.loaded]
        return sum(e.memory_bytes for e in loaded), len(loaded)

    def fits(self, engine: Resident, extra: int = 0, count: int = 1) -> bool:
        """Whether ``engine`` loaded (``extra`` bytes more, ``count`` more engines)
        keeps the process within its budget."""
        used, n = self.used(but=engine)
        if self.max_loaded is not None and n + count > self.max_loaded:
            return False
        if self.memory_budget is not None and used + extra > self.memory_budget:
            return False
        return True

    def make_room(self, engine: Resident, need: int, stop: threading.Event, *,
                  wait: bool = True) -> bool:
        """Unload the least recently used idle engines until ``engine`` (about to
        load, ``need`` bytes) fits; when none is idle, wait for one to be, and after
        :data:`BUSY_UNLOAD_S` unload the least recently used busy one (it finishes its
        running batch and gives back what it claimed ahead): engines whose queues all
        have a backlog take turns, none waits for ever (``wait`` False: return False
        when none is idle). Returns False if ``stop`` was set meanwhile. Call it
        holding :attr:`load_lock` (or, loaded, after it: ``wait`` False)."""
        since = time.monotonic()
        while not self.fits(engine, need):
            if stop.is_set():
                return False
            busy_ok = wait and time.monotonic() - since >= BUSY_UNLOAD_S
            idle = sorted((e for e in self.engines if e is not engine and e.loaded
                           and e.evictable(busy_ok)), key=lambda e: e.last_used)
            if idle:
                victim = idle[0]
                done = threading.Event()
                victim.request(EngineOp("unload", reply=_setter(done), reason="budget"))
                while not done.wait(0.5):  # the victim's model thread unloads it
                    # (or a command it carries out first unloads it, then waits for
                    # the load lock held here)
                    if stop.is_set() or victim.life.stop.is_set() or not victim.loaded:
                        break
                continue
            if not wait:
                return False
            with self.changed:  # every loaded engine is busy: wait for one to finish
                self.changed.wait(0.5)
        return True
