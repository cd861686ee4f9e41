"""Redis over TLS (``rediss://``): producers, workers (alone and supervised, a
generator streaming tokens included), the CLI and the dashboard work against a real
redis-server started with ``--tls-port`` and certificates made here with openssl;
client certificates too. A certificate that is not trusted, a missing CA file, a
server that wants a client certificate, or TLS options on a plain URL are each a
named error at once (RedisTLSError, exit 5 on the CLI), not a traceback and not a
retry loop."""

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
from tests.support.processes import free_port
from tests.support.servers import RedisServer, find_redis7
from tests.support.waits import wait_for
from tests.support.workers import serve_one

PY = sys.executable


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_certs(d: Path) -> Path:
    """A CA, a server certificate it signs (for 127.0.0.1 and localhost), a client
    certificate it signs, and a second CA that signed none of them."""
    openssl("req", "-x509", "-new", "-nodes", "-newkey", "rsa:2048", "-days", "2",
            "-subj", "/CN=mtq test CA", "-keyout", str(d / "ca.key"), "-out", str(d / "ca.crt"))
    openssl("req", "-x509", "-new", "-nodes", "-newkey", "rsa:2048", "-days", "2",
            "-subj", "/CN=another CA", "-keyout", str(d / "other.key"),
            "-out", str(d / "other.crt"))
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, cn in (("server", "localhost"), ("client", "mtq client")):
        openssl("req", "-new", "-nodes", "-newkey", "rsa:2048", "-subj", f"/CN={cn}",
                "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.csr"))
        openssl("x509", "-req", "-days", "2", "-in", str(d / f"{name}.csr"),
                "-CA", str(d / "ca.crt"), "-CAkey", str(d / "ca.key"), "-CAcreateserial",
                "-out", str(d / f"{name}.crt"),
                *(["-extfile", str(d / "san.cnf")] if name == "server" else []))
    return d


class TLSServer(RedisServer):
    """A redis-server 7 that speaks TLS only (no plain port)."""

    def __init__(self, tmp: Path, certs: Path, client_certs: bool) -> None:
        super().__init__(tmp)
        self.binary = find_redis7()
        self.certs = certs
        self.client_certs = client_certs

    def start(self) -> None:
        c = self.certs
        self.proc = subprocess.Popen(
            [self.binary, "--port", "0", "--tls-port", str(self.port), "--bind", "127.0.0.1",
             "--tls-cert-file", str(c / "server.crt"), "--tls-key-file", str(c / "server.key"),
             "--tls-ca-cert-file", str(c / "ca.crt"),
             "--tls-auth-clients", "yes" if self.client_certs else "no",
             "--save", "", "--appendonly", "no", "--dir", str(self.dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        probe = redis.Redis(port=self.port, ssl=True, ssl_ca_certs=str(c / "ca.crt"),
                            ssl_certfile=str(c / "client.crt"),
                            ssl_keyfile=str(c / "client.key"), socket_connect_timeout=1,
                            retry=Retry(NoBackoff(), 0))  # polled: no retries of its own

        def up() -> bool:
            try:
                return bool(probe.ping())
            except redis.exceptions.ConnectionError:
                assert self.proc is not None and self.proc.poll() is None, "it exited"
                return False

        wait_for(up, 10, f"redis-server with TLS on port {self.port} did not start")
        probe.close()

    def url(self, query: str = "") -> str:  # type: ignore[override]
        return f"rediss://127.0.0.1:{self.port}/0{'?' + query if query else ''}"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory, certs: Path) -> Iterator[TLSServer]:
    server = TLSServer(tmp_path_factory.mktemp("tls"), certs, client_certs=False)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def mtls(tmp_path_factory: pytest.TempPathFactory, certs: Path) -> Iterator[TLSServer]:
    server = TLSServer(tmp_path_factory.mktemp("mtls"), certs, client_certs=True)
    server.start()
    yield server
    server.stop()


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "mtq", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_tls_serves_producers_workers_the_cli_and_the_dashboard(
        tls: TLSServer, certs: Path, qname: str, subprocess_env: dict[str, str],
        tmp_path: Path) -> None:
    url = tls.url(f"ssl_ca_certs={certs / 'ca.crt'}")
    serve_one(url, qname)                          # producer, worker, reply channel
    gen = qname + "-gen"
    log = tmp_path / "sup.log"
    with open(log, "wb") as out:                   # a supervisor, its generator and outlet
        sup = subprocess.Popen(
            [PY, "-m", "mtq", "workers", "start", "tests.models:Counter", "--queue", gen,
             "--redis", url], env=subprocess_env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        q = mtq.Queue(gen, url)
        assert list(q.submit({"n": 5, "start": 10}).tokens(timeout=30)) == \
            [10, 11, 12, 13, 14], log.read_text()
        follow = cli("submit", gen, '{"n": 4}', "--follow", "--redis", url)
        assert follow.returncode == 0, follow
        assert "0123" in follow.stdout.replace("\n", "").replace(" ", ""), follow.stdout
        status = cli("status", "--redis", url)
        assert status.returncode == 0 and gen in status.stdout, status
        once = cli("dashboard", "--once", "--redis", url)
        assert once.returncode == 0 and "counter/h-" in once.stdout, once  # its worker row (a computed version)
        wait_for(lambda: "standby ready" in log.read_text(), 30, "no standby")
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(30) == 0, log.read_text()
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait(10)
    assert "Traceback" not in log.read_text(), log.read_text()


def test_client_certificates(mtls: TLSServer, certs: Path, qname: str) -> None:
    ca = f"ssl_ca_certs={certs / 'ca.crt'}"
    mine = f"{ca}&ssl_certfile={certs / 'client.crt'}&ssl_keyfile={certs / 'client.key'}"
    serve_one(mtls.url(mine), qname)
    # Under TLS 1.3 the server refuses a missing client certificate after the
    # handshake: its alert is read (RedisTLSError, at once) or the connection is
    # found closed first, like a dropped one (RedisUnavailable after the retries);
    # either way the message says what to add
    start = time.monotonic()
    with pytest.raises((mtq.RedisTLSError, mtq.RedisUnavailable), match="client certificate"):
        mtq.Queue(qname, mtls.url(ca)).stats()
    assert time.monotonic() - start < 20, "the retries of a refused handshake nest"


@pytest.mark.parametrize("query, message", [
    ("ssl_ca_certs={other}", "certificate is not trusted"),    # the wrong CA
    ("", "certificate is not trusted"),                          # the system's CAs only
    ("ssl_ca_certs={missing}", "cannot be read"),                # no such file
])
def test_a_bad_certificate_is_a_named_error(tls: TLSServer, certs: Path, qname: str,
                                            query: str, message: str) -> None:
    url = tls.url(query.format(other=certs / "other.crt", missing=certs / "nope.crt"))
    start = time.monotonic()
    with pytest.raises(mtq.RedisTLSError, match=message):
        mtq.Queue(qname, url).submit({"x": 1})
    assert time.monotonic() - start < 2, "a certificate problem is not retried"
    for argv in (["status"], ["worker", "run", "tests.handlers:double", "--queue", qname],
                 ["workers", "start", "tests.handlers:double", "--queue", qname]):
        done = cli(*argv, "--redis", url, timeout=30)
        assert done.returncode == 5, (argv, done)
        assert message in done.stderr and "Traceback" not in done.stderr, (argv, done.stderr)
        assert done.stderr.count("\n") == 1, f"one line: {done.stderr!r}"


def test_tls_options_on_a_plain_url_and_a_plain_url_on_a_tls_port(
        tls: TLSServer, certs: Path, qname: str) -> None:
    plain = f"redis://127.0.0.1:{free_port()}/0?ssl_ca_certs={certs / 'ca.crt'}"
    with pytest.raises(mtq.ConfigError, match="rediss://"):
        mtq.Queue(qname, plain).submit({"x": 1})
    done = cli("status", "--redis", plain)
    assert done.returncode == 2 and "rediss://" in done.stderr, done
    # the TLS port spoken to in plain text: the server hangs up at once, like a
    # dropped connection; mtq gives up after its retries with a hint, no traceback
    start = time.monotonic()
    done = cli("status", "--redis", f"redis://127.0.0.1:{tls.port}/0")
    assert done.returncode == 5 and "rediss:// for a TLS port" in done.stderr, done
    # one retry loop (about 5 s), not redis-py's nested ones (11 x 11 tries, 48 s)
    assert time.monotonic() - start < 20, "the retries of a refused handshake nest"
    assert "Traceback" not in done.stderr, done.stderr
