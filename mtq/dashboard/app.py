"""The live dashboard (``mtq dashboard``): one :func:`mtq.admin.snapshot` per
refresh, drawn full screen by :mod:`mtq.dashboard.view`.

It outlives Redis: while a snapshot fails it shows the last good one under a red
banner and tries again every refresh, and recovers by itself. ``q`` (when stdin
is a terminal), Ctrl-C and SIGTERM quit cleanly; the terminal is restored
whatever happens.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import redis
from rich.console import Console
from rich.live import Live

from mtq.admin import Snapshot, snapshot
from mtq.broker.connection import client_url, connect
from mtq.dashboard.view import Frame, History, render
from mtq.errors import MtqError
from mtq.validation import check_queue_name

#: the shortest refresh interval :func:`run` accepts (each refresh is a snapshot:
#: four round trips, whatever the number of tasks)
MIN_REFRESH_S = 0.2


def run(url: str | None, queues: list[str] | None = None, refresh_s: float = 1.0,
        once: bool = False, console: Console | None = None) -> int:
    """Show the dashboard of the Redis at ``url`` (default: MTQ_REDIS_URL, else the
    embedded server) until the user quits; returns the exit code, 0.

    ``queues``: only these (default: every queue). ``refresh_s``: seconds between
    snapshots, at least :data:`MIN_REFRESH_S` (smaller values are raised to it).
    ``once``: print one frame and return, 0, or 1 if Redis could not be read (a
    single frame has no throughput: that needs two snapshots).
    Raises InvalidName for a bad queue name, BrokerError for a URL that cannot be
    used at all; once running, Redis errors are shown, not raised.
    """
    queues = None if queues is None else [check_queue_name(q) for q in queues]
    console = console or Console()
    refresh_s = max(MIN_REFRESH_S, float(refresh_s))
    client = connect(url)
    shown_url = client_url(client) or url or "redis"
    history = History()
    hint = "" if once else "q quits" if _terminal() is not None else "Ctrl-C quits"

    def frame() -> Frame:
        error = _refresh(client, queues, history)
        return render(history.last, history, url=shown_url, refresh_s=refresh_s,
                      now=time.time(), error=error, hint=hint)

    if once:
        first = frame()
        console.print(first)
        return 0 if first.error is None else 1

    stop = threading.Event()
    try:
        with _stop_on_sigterm(stop), _quit_key(stop), \
                Live(console=console, screen=True, auto_refresh=False) as live:
            while True:
                live.update(frame(), refresh=True)
                if stop.wait(refresh_s):
                    break
    except KeyboardInterrupt:
        pass
    return 0


def _refresh(client: redis.Redis, queues: list[str] | None, history: History) -> str | None:
    """Add a snapshot to ``history``; the error that prevented it, if any."""
    try:
        snap: Snapshot = snapshot(client, queues)
    except MtqError as exc:
        return str(exc)
    history.add(snap)
    return None


@contextmanager
def _stop_on_sigterm(stop: threading.Event) -> Iterator[None]:
    """Turn SIGTERM into ``stop`` (so the terminal is restored), from the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda _sig, _frame: stop.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _terminal() -> int | None:
    """stdin's descriptor when it is a terminal, else None."""
    try:
        fd = sys.stdin.fileno()
    except (AttributeError, OSError, ValueError):  # no stdin, or a test's stand-in
        return None
    return fd if os.isatty(fd) else None


@contextmanager
def _quit_key(stop: threading.Event) -> Iterator[None]:
    """Set ``stop`` when ``q`` is typed, while stdin is a terminal.

    The terminal is put in cbreak mode (keys arrive one by one, unechoed; Ctrl-C
    still interrupts) and restored on the way out, whatever happened. A thread
    waits on stdin and on a pipe that wakes it to leave: no polling.
    """
    fd = _terminal()
    try:
        import termios
        import tty
    except ImportError:  # not a POSIX terminal: Ctrl-C still quits
        fd = None
    if fd is None:
        yield
        return
    saved = termios.tcgetattr(fd)
    wake_r, wake_w = os.pipe()

    def read() -> None:
        while True:
            ready, _, _ = select.select([fd, wake_r], [], [])
            if wake_r in ready:
                return
            data = os.read(fd, 64)
            if not data:  # stdin closed: nothing more to read
                return
            if b"q" in data.lower():
                stop.set()

    thread = threading.Thread(target=read, name="mtq-dashboard-keys", daemon=True)
    try:
        tty.setcbreak(fd)
        thread.start()
        yield
    finally:
        os.write(wake_w, b"x")
        thread.join(1.0)
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
        os.close(wake_r)
        os.close(wake_w)
