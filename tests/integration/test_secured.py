"""Secured Redis: a password on the default user (``requirepass``), and an ACL user
limited to mtq's keys and channels. Producers, workers (alone and supervised), the
CLI and the dashboard work; a wrong or missing password is a named error at once,
not a traceback and not a retry loop. Each server is a real redis-server started
here with those options."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

import mtq
from tests.support.servers import RedisServer
from tests.support.waits import wait_for
from tests.support.workers import serve_one

PY = sys.executable
PASSWORD = "s3cret-pw"
#: the permissions docs/guarantees.md gives for a user limited to mtq
ACL_RULES = ("~mtq:* resetchannels &mtq:* +@all -@dangerous +info +client|setname "
             "+client|list")


class SecuredServer(RedisServer):
    def __init__(self, tmp: Path, *args: str) -> None:
        super().__init__(tmp)
        self.args = list(args)

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.dir), *self.args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def up() -> bool:
            try:
                # no retries: redis-py retries a refused handshake for ~4 s otherwise
                redis.Redis(port=self.port, socket_connect_timeout=1,
                            retry=Retry(NoBackoff(), 0)).ping()
            except redis.exceptions.AuthenticationError:
                return True  # it answers, and wants a password
            except redis.exceptions.ConnectionError:
                assert self.proc is not None and self.proc.poll() is None, "it exited"
                return False
            return True

        wait_for(up, 10, f"redis-server on port {self.port} did not start")

    def url(self, user: str = "", password: str = "") -> str:  # type: ignore[override]
        auth = f"{user}:{password}@" if password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"


@pytest.fixture(scope="module")
def with_password(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredServer]:
    server = SecuredServer(tmp_path_factory.mktemp("pw"), "--requirepass", PASSWORD)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def with_acl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredServer]:
    tmp = tmp_path_factory.mktemp("acl")
    (tmp / "users.acl").write_text(f"user default off\nuser mtq on >{PASSWORD} {ACL_RULES}\n")
    server = SecuredServer(tmp, "--aclfile", str(tmp / "users.acl"))
    server.start()
    yield server
    server.stop()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "mtq", *args], capture_output=True, text=True,
                          timeout=60)


def test_a_password_works_and_a_wrong_one_is_a_named_error(with_password: SecuredServer,
                                                           qname: str) -> None:
    serve_one(with_password.url("", PASSWORD), qname)
    for url in (with_password.url("", "wrong"), with_password.url()):
        start = time.monotonic()
        with pytest.raises(mtq.RedisAuthError, match="refused mtq's credentials"):
            mtq.Queue(qname, url).submit({"x": 1})
        assert time.monotonic() - start < 2, "a refused password is not retried"
    done = cli("status", "--redis", with_password.url("", "wrong"))
    assert done.returncode == 5, done
    assert "refused mtq's credentials" in done.stderr and "Traceback" not in done.stderr, \
        done.stderr
    assert cli("status", "--redis", with_password.url("", PASSWORD)).returncode == 0


def test_an_acl_user_limited_to_mtq_serves_everything(with_acl: SecuredServer, qname: str,
                                                      subprocess_env: dict[str, str],
                                                      tmp_path: Path) -> None:
    url = with_acl.url("mtq", PASSWORD)
    serve_one(url, qname)                                  # producer, worker, replies
    status = cli("status", "--redis", url)
    assert status.returncode == 0 and qname in status.stdout, status
    once = cli("dashboard", "--once", "--redis", url)
    assert once.returncode == 0, once
    log = tmp_path / "sup.log"
    with open(log, "wb") as out:                           # a supervisor and its processes
        sup = subprocess.Popen(
            [PY, "-m", "mtq", "workers", "start", "tests.handlers:double", "--queue", qname,
             "--redis", url], env=subprocess_env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        q = mtq.Queue(qname, url)
        assert q.submit({"x": 5}).result(timeout=30) == 10, log.read_text()
        # the supervisor's own connection and its standby work under the ACL too
        wait_for(lambda: "standby ready" in log.read_text(), 30, "no standby")
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(30) == 0, log.read_text()
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait(10)
    # outside its keys, the user is refused: the ACL is what the test thinks it is
    with pytest.raises(redis.exceptions.NoPermissionError):
        redis.Redis.from_url(url).set("not-mtq", 1)
