"""Stop signals that reach a worker process whichever of its threads the kernel
delivers them to.

Python runs a signal handler in the main thread, between two bytecodes. A worker's
main thread sleeps in an untimed wait while it is idle, and wakes for a signal only
when the signal is delivered to it. Libraries loaded by a model's ``setup`` can make
that fail: a native library that blocks SIGTERM in the thread that loads it (the
main thread) has the kernel give the signal to another thread, and the idle worker
then never stops.

So the process's C-level handler, which runs on whichever thread got the signal,
writes the signal's number to a socket (``signal.set_wakeup_fd``), and a thread of
ours reads it and asks the worker to stop. Must be called from the main thread.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Callable, Iterable

__all__ = ["Wakeup", "on_stop_signals"]

#: the wakeup sockets' write ends, kept open for the process's life
_open: list[socket.socket] = []


def _noop(_signum: int, _frame: object) -> None:
    """The Python-level handler: the watcher thread does the work (see the module)."""


def on_stop_signals(stop: Callable[[], None], signals: Iterable[int] = (signal.SIGTERM,
                                                                        signal.SIGINT),
                    exit_code: int | None = 130) -> None:
    """On the first of ``signals``, call ``stop`` in a thread of its own; on a second
    one, ``os._exit(exit_code)`` (None: call ``stop`` again; it must be idempotent)."""
    wanted = {int(s) for s in signals}
    reader, writer = socket.socketpair()
    writer.setblocking(False)  # a full buffer drops a byte rather than block the handler
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    for s in wanted:
        signal.signal(s, _noop)

    def watch() -> None:
        seen = 0
        while True:
            data = reader.recv(64)
            if not data:
                return
            for signum in data:
                if signum not in wanted:
                    continue
                seen += 1
                if seen > 1 and exit_code is not None:
                    os._exit(exit_code)
                threading.Thread(target=stop, name="mtq-stop", daemon=True).start()

    _open.append(writer)  # the wakeup fd must stay open as long as the process
    threading.Thread(target=watch, name="mtq-signals", daemon=True).start()


class Wakeup:
    """A supervisor's wake-up socket: its loop waits on :attr:`reader` beside its
    children's pipes; :meth:`poke` (thread-safe, signal-safe) wakes it, and
    :meth:`on_signal`, a signal handler, counts a signal and wakes it."""

    def __init__(self) -> None:
        self.reader, self._writer = socket.socketpair()
        self.reader.setblocking(False)
        self._writer.setblocking(False)
        #: signals received so far (written only by the handler)
        self.signals = 0
        self._seen = 0

    def on_signal(self, signum: int, frame: object) -> None:
        # no lock and no read-modify-write shared with the loop: the handler runs on
        # the main thread between any two bytecodes
        self.signals += 1
        self.poke()

    def new_signals(self) -> int:
        """How many signals came since the last call (the loop's side)."""
        received = self.signals
        pending, self._seen = received - self._seen, received
        return pending

    def poke(self) -> None:
        try:
            self._writer.send(b"x")
        except (BlockingIOError, OSError):
            pass  # already pending

    def drain(self) -> None:
        try:
            while self.reader.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass
