"""A supervisor's slots and their restarts: which slots should run a serving process,
when a dead one's replacement is due, and when set-up failing again and again
means giving up.

A crash restarts its slot after ``RESTART_BASE_S * 2**(crashes in a row - 1)``
seconds, at most ``RESTART_MAX_S``; a task settled since the last restart resets
the count (a process the supervisor killed to stop a call past its timeout, or
cancelled, ended its tasks: the supervisor counts it so). A process that dies
before its set-up ends, ``MAX_SETUP_FAILURES`` times in a row, stops the
supervisor (the warm standby and the quarantine process, which restart with the
same backoff, are given up on instead).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

#: a child that dies before set-up this many times in a row stops the supervisor
MAX_SETUP_FAILURES = 3
#: restart delay after a crash: BASE * 2**(crashes in a row - 1), at most MAX
RESTART_BASE_S, RESTART_MAX_S = 0.1, 30.0


def backoff(crashes: int) -> float:
    """The delay before the next start after ``crashes`` failures in a row (s)."""
    return min(RESTART_MAX_S, RESTART_BASE_S * 2 ** (crashes - 1))


@dataclass
class Slot:
    index: int
    device: str
    crashes: int = 0        # in a row without progress
    due: float = 0.0        # when to (re)start it
    progress: bool = False  # a task settled since the last restart
    restarts: int = 0       # times its process was replaced (reported by the worker)


class Slots:
    """The slots a supervisor keeps a serving process in: replicas x devices."""

    def __init__(self, devices: Sequence[str]) -> None:
        self.devices = list(devices)
        self.by_index: dict[int, Slot] = {}
        self._next = 0

    def __len__(self) -> int:
        return len(self.by_index)

    def get(self, index: int) -> Slot | None:
        return self.by_index.get(index)

    def remove(self, index: int) -> None:
        self.by_index.pop(index, None)

    def used_devices(self) -> set[str]:
        return {slot.device for slot in self.by_index.values()}

    def resize(self, want: int) -> list[int]:
        """Add slots on the least used devices, or remove the newest slots of the most
        used ones, until there are ``want``; returns the indices removed (their
        processes are to retire)."""
        removed: list[int] = []

        def by_device() -> dict[str, list[int]]:
            load: dict[str, list[int]] = {d: [] for d in self.devices}
            for slot in self.by_index.values():
                load.setdefault(slot.device, []).append(slot.index)
            return load

        while len(self.by_index) < want:
            load = by_device()
            device = min(self.devices, key=lambda d: len(load[d]))
            index = self._next
            self._next += 1
            self.by_index[index] = Slot(index, device)
        while len(self.by_index) > want:
            load = by_device()
            busiest = max(load.values(), key=len)
            index = max(busiest)
            self.by_index.pop(index)
            removed.append(index)
        return removed

    # -- the main loop's questions -----------------------------------------------------
    def due(self, now: float, running: Collection[int]) -> list[Slot]:
        """Slots with no process whose (re)start is due."""
        return [slot for slot in list(self.by_index.values())
                if slot.index not in running and slot.due <= now]

    def deadline(self, now: float, running: Collection[int]) -> float | None:
        """Seconds until the next (re)start is due; None: none waits."""
        return min((slot.due - now for slot in self.by_index.values()
                    if slot.index not in running), default=None)

    # -- what the children report ------------------------------------------------------
    def progressed(self, index: int) -> None:
        """A task settled in slot ``index``: its crashes in a row start over."""
        slot = self.by_index.get(index)
        if slot is not None:
            slot.progress = True
            slot.crashes = 0

    @staticmethod
    def crashed(slot: Slot, ready: bool) -> float | None:
        """Count a crash of ``slot``'s process (``ready``: it had finished set-up);
        the delay before its restart, or None when set-up failed too often in a row."""
        if not ready:
            slot.crashes += 1
            if slot.crashes >= MAX_SETUP_FAILURES:
                return None
        elif not slot.progress:
            slot.crashes += 1
        else:
            slot.crashes = 1
        slot.restarts += 1
        return backoff(slot.crashes)
