"""benchmarks.web's server under cProfile (its event loop's thread): SIGUSR1 starts the
profile, SIGUSR2 stops it and saves it (the token phase only).

    python -m benchmarks.children.web_profiled PORT PROFILE_FILE
"""

from __future__ import annotations

import cProfile
import signal
import sys
from typing import Any

import uvicorn


def main(port: int, path: str) -> None:
    prof = cProfile.Profile()

    def save(*_: Any) -> None:
        prof.disable()
        prof.dump_stats(path)

    signal.signal(signal.SIGUSR1, lambda *_: prof.enable())
    signal.signal(signal.SIGUSR2, save)
    uvicorn.run("benchmarks.children.web_app:app", host="127.0.0.1", port=port,
                log_level="warning", access_log=False, timeout_graceful_shutdown=2)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
