"""A throw-away redis-server on a free loopback port, for benchmarks and tests."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis
from redis.connection import Connection

from mtq.broker.embedded import find_redis_server

ROOT = Path(__file__).resolve().parent.parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def uniq(prefix: str) -> str:
    """A fresh queue name: ``bench-PREFIX-xxxxxxxx``."""
    return f"bench-{prefix}-{uuid.uuid4().hex[:8]}"


def bench_binary() -> str:
    """The redis-server the benchmarks run: ``$MTQ_BENCH_REDIS_SERVER`` (a production
    Redis 7, say), else the one mtq's embedded server finds."""
    return os.environ.get("MTQ_BENCH_REDIS_SERVER") or find_redis_server()


def compile_tree(tree: Path = ROOT, python: str = sys.executable) -> None:
    """Compile ``tree``'s mtq package to bytecode, as pip does when it installs a wheel:
    the benchmarks run their processes with PYTHONDONTWRITEBYTECODE=1, and a worker
    started from a source tree would otherwise compile mtq as it starts."""
    subprocess.run([python, "-m", "compileall", "-q", str(tree / "mtq")], check=True)


class RedisServer:
    """A redis-server on a free loopback port, persistence off (``appendonly``: an AOF in
    ``dir``, kept across a stop and a start). Without ``dir`` it makes a temporary one
    and removes it at :meth:`stop`."""

    def __init__(self, dir: Path | str | None = None, appendonly: bool = False,
                 binary: str | None = None, args: tuple[str, ...] = ()) -> None:
        self.binary = binary or find_redis_server()
        self.port = free_port()
        self.owned = dir is None
        self.dir = Path(dir) if dir is not None else Path(tempfile.mkdtemp(prefix="mtq-bench-"))
        self.appendonly = appendonly
        self.args = args
        self.prefix: tuple[str, ...] = ()  # a command the server runs under (valgrind)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10) -> None:
        self.proc = subprocess.Popen(
            [*self.prefix, self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes" if self.appendonly else "no", "--dir", str(self.dir),
             *self.args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        probe = redis.Redis(port=self.port)
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    if probe.ping():
                        return
                except redis.exceptions.ConnectionError:
                    if self.proc.poll() is not None:
                        raise RuntimeError(f"redis-server ({self.binary}) exited at start-up"
                                           ) from None
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"redis-server on port {self.port} did not accept "
                                           f"connections within {timeout:.0f} s") from None
                    time.sleep(0.01)
        finally:
            probe.close()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        if self.owned:
            shutil.rmtree(self.dir, ignore_errors=True)


class Counting(Connection):
    """A connection that counts what it writes: one ``send_packed_command`` is one
    request sent (a whole pipeline is one), i.e. one round trip."""

    sent = 0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        Counting.sent += 1
        super().send_packed_command(command, check_health)


class Server(RedisServer):
    """The benchmarks' server: ``$MTQ_BENCH_REDIS_SERVER`` or the embedded one, clients
    whose round trips are counted, and their reply listeners closed before it stops (a
    listener that outlives its server logs that it is reconnecting)."""

    def __init__(self, binary: str | None = None, args: tuple[str, ...] = ()) -> None:
        super().__init__(binary=binary or bench_binary(), args=args)
        self.clients: list[redis.Redis] = []

    def client(self) -> redis.Redis:
        pool = redis.ConnectionPool(connection_class=Counting, host="127.0.0.1",
                                    port=self.port)
        client = redis.Redis(connection_pool=pool)
        client.ping()  # connect (and its handshake) before anything is counted
        self.clients.append(client)
        return client

    def stop(self) -> None:
        from mtq.replies import hub_of

        for client in self.clients:
            hub_of(client).close_all()
            client.close()
        self.clients.clear()
        super().stop()


def callgrind_total(dump: Path) -> int:
    """The instruction count of a callgrind dump ("totals:" at its end; the "summary:"
    at its top is written before the run)."""
    totals = re.findall(r"^totals:\s*(\d+)", dump.read_text(encoding="utf-8", errors="replace"),
                        flags=re.M)
    if not totals or not int(totals[-1]):
        raise SystemExit(f"no instruction count in {dump}")
    return int(totals[-1])


class CallgrindServer(RedisServer):
    """redis-server under valgrind's callgrind, counting instructions only between
    ``instrument(True)`` and ``instrument(False)``; :meth:`total` stops it and reads the
    count. Counts repeat to about 0.1 %, where timings here move by 10-30 %."""

    def __init__(self, binary: str | None = None, args: tuple[str, ...] = ()) -> None:
        super().__init__(binary=binary or bench_binary(), args=args)
        self.dump = self.dir / "callgrind.out"
        self.prefix = ("valgrind", "--tool=callgrind", "--instr-atstart=no",
                       f"--callgrind-out-file={self.dump}")

    def instrument(self, on: bool) -> None:
        assert self.proc is not None
        subprocess.run(["callgrind_control", "-i", "on" if on else "off", str(self.proc.pid)],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def total(self) -> int:
        assert self.proc is not None
        try:
            redis.Redis(port=self.port).shutdown(nosave=True)
        except redis.ConnectionError:
            pass
        self.proc.wait(120)
        count = callgrind_total(self.dump)
        self.stop()
        return count
