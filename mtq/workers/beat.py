"""A supervised child's sign of life, for its supervisor's fence (mtq.workers.fencing).

A daemon thread writes ``time.monotonic()`` into the child's slot of the shared array
every :data:`BEAT_EVERY_S`, and each engine's lease beside it. It touches no Redis and
no lock of the worker's, so a Redis outage or a long CPU-bound predict (the
interpreter switches threads every few milliseconds) does not stop it; a stopped
process, or a call into C that holds the GIL, does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

#: how often a child's beat thread writes its sign of life
BEAT_EVERY_S = 0.1


class Beat:
    """The thread: ``shared[index]`` gets the time, ``shared[lease_at(i)]`` engine
    ``i``'s lease (``leases[i]()``, seconds; 0: not known yet)."""

    def __init__(self, shared: Any, index: int, lease_at: Callable[[int], int]) -> None:
        self.shared = shared
        self.index = index
        self.lease_at = lease_at
        self.leases: list[Callable[[], float]] = []

    def start(self) -> None:
        self.shared[self.index] = time.monotonic()
        threading.Thread(target=self._loop, name="mtq-beat", daemon=True).start()

    def _loop(self) -> None:
        shared, index = self.shared, self.index
        while True:
            shared[index] = time.monotonic()
            for i, lease in enumerate(self.leases):
                shared[self.lease_at(i)] = lease()
            time.sleep(BEAT_EVERY_S)
