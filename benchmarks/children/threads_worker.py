"""benchmarks.threads' worker: ``mtq worker run`` of a no-op handler in a process that
appends each thread's CPU time to a file on SIGUSR1. Run by file path with ``python -P``
and the measured tree first on ``PYTHONPATH``.

    python -P threads_worker.py CLOCKS_FILE QUEUE
"""

from __future__ import annotations

import importlib.util
import signal
import sys
import threading
import time
from typing import Any


def dump(out: str) -> None:
    clocks = {}
    for t in threading.enumerate():
        try:
            clocks[t.name] = time.clock_gettime(time.pthread_getcpuclockid(t.ident or 0))
        except (OSError, TypeError):  # a thread that just ended
            pass
    with open(out, "a") as f:
        f.write(repr(clocks) + "\n")


def main(out: str, queue: str) -> None:
    def on_signal(*_: Any) -> None:
        dump(out)

    signal.signal(signal.SIGUSR1, on_signal)
    # the no-op handler where the measured tree keeps it
    noop = ("benchmarks.children.noop" if importlib.util.find_spec("benchmarks.children")
            else "benchmarks.noop")
    sys.argv = ["mtq", "worker", "run", f"{noop}:handle", "--queue", queue]
    from mtq.cli.main import main as cli

    cli()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
