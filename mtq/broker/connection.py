"""Redis clients: one connection pool per URL per process, shared by all queues."""

from __future__ import annotations

import os
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, quote, urlparse, urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from mtq.broker import cluster
from mtq.broker.embedded import EmbeddedServer
from mtq.errors import BrokerError, ConfigError, RedisAuthError, RedisTLSError, RedisUnavailable
from mtq.settings import RedisSettings

#: redis-py retries a command this many times after a dropped or refused connection
#: (the first retry at once, then up to 1 s apart: about 5 s in all) before mtq sees
#: the error, unless the call was made inside :func:`single_attempt`;
#: ``MTQ_REDIS_RETRIES`` sets another number for the clients a process opens after
#: (0: a refused connection is an error at once; the tests of an unreachable Redis use it)
RETRIES = 10
RETRIES_ENV = "MTQ_REDIS_RETRIES"

_once = threading.local()

#: TLS errors that a dropped connection also causes (retried like one)
_TLS_DROPS = (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError)
#: how many times a client of a cluster or of a Sentinel-watched primary retries: enough
#: to ride through a failover of about 30 s (Redis's default cluster-node-timeout is 15 s)
RETRIES_HA = 64

#: the URL options that name a file for TLS (redis-py passes them to ``ssl``)
TLS_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_ca_path")


def tls_failure(error: BaseException) -> ssl.SSLError | None:
    """The TLS error behind a redis-py error that no retry can fix (a certificate not
    trusted, a handshake with a port that does not speak TLS), else None."""
    seen: BaseException | None = error
    for _ in range(8):  # the chain a redis-py error carries is short; no cycles
        if seen is None:
            return None
        if isinstance(seen, ssl.SSLError) and not isinstance(seen, _TLS_DROPS):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


class _Retry(Retry):
    """A dropped or refused connection is re-opened and the command sent again, except
    for calls made inside :func:`single_attempt` and for a refused password. Timeouts
    are not retried here (a hung server or an unreachable host would cost a socket
    timeout per try); the caller's own loop decides. The loop is written out, rather
    than redis-py's own extended, so that it works with every redis-py mtq supports
    (the signature of ``Retry.call_with_retry`` changed across releases)."""

    def call_with_retry(self, do: Any, fail: Any, is_retryable: Any = None,
                        with_failure_count: bool = False) -> Any:
        # redis-py nests retried calls (a command's retry wraps the connect, whose own
        # retry wraps the handshake's health check): only the outermost call retries,
        # or a server that accepts and then hangs up would cost 11 x 11 tries
        nested = getattr(_once, "depth", 0)
        once = getattr(_once, "on", False) or nested > 0
        self._backoff.reset()
        failures = 0
        while True:
            try:
                _once.depth = nested + 1
                try:
                    return do()
                finally:
                    _once.depth = nested
            except self._supported_errors as error:
                if is_retryable is not None and not is_retryable(error):
                    raise
                failures += 1
                if with_failure_count:
                    fail(error, failures)
                else:
                    fail(error)
                if once or isinstance(error, redis.exceptions.AuthenticationError) or \
                        failures > self._retries or tls_failure(error) is not None:
                    raise
                delay = self._backoff.compute(failures)
                if delay > 0:
                    time.sleep(delay)


def plain_retries() -> int:
    """How many times a client of one server retries: :data:`RETRIES`, or what
    ``MTQ_REDIS_RETRIES`` says (ConfigError if it is not a whole number, 0 or more)."""
    raw = os.environ.get(RETRIES_ENV, "").strip()
    if not raw:
        return RETRIES
    if not raw.isdigit():
        raise ConfigError(f"{RETRIES_ENV} must be a whole number of retries (0 or more), "
                          f"got {raw!r}; unset it for the default, {RETRIES}")
    return int(raw)


def retry_policy(retries: int | None = None) -> Retry:
    """The retry every mtq client uses: a dropped connection is re-opened and the
    command sent again at once, then with jittered backoff up to 1 s apart
    (``retries`` times; None: :func:`plain_retries`)."""
    return _Retry(ExponentialWithJitterBackoff(cap=1.0, base=0.01),
                  plain_retries() if retries is None else retries,
                  supported_errors=(redis.exceptions.ConnectionError,))


class single_attempt:
    """Send the commands of this block once, whatever the connection does: for
    operations that must not run twice without the caller knowing (a claim, a
    submit, a BLPOP whose popped marker would be lost). The caller handles
    :class:`~mtq.errors.RedisUnavailable` itself. (A class, not a generator: it is
    entered on every claim, submit and BLPOP, and a class with ``__slots__`` enters and
    leaves with less Python than a ``contextmanager`` generator.)"""

    __slots__ = ("before",)

    def __enter__(self) -> None:
        self.before = getattr(_once, "on", False)
        _once.on = True

    def __exit__(self, *exc: object) -> None:
        _once.on = self.before


class Backoff:
    """Delays between a long-lived loop's tries to reach Redis again: the first retry
    at once, then 50 ms doubling up to 1 s (:meth:`reset` after a success)."""

    def __init__(self, first: float = 0.05, cap: float = 1.0) -> None:
        self.first, self.cap = first, cap
        self.failures = 0

    def next(self) -> float:
        """The delay before the next try (0.0 for the first retry after a success)."""
        self.failures += 1
        if self.failures == 1:
            return 0.0
        return min(self.cap, self.first * 2 ** (self.failures - 2))

    def reset(self) -> None:
        self.failures = 0


_lock = threading.Lock()
_clients: dict[tuple[str, RedisSettings, str | None], redis.Redis] = {}


class redis_errors:
    """Turn redis-py errors raised inside the block into BrokerError.

    ``doing`` completes the message ("while waiting for work"). The one place
    that words these errors, for every call mtq makes to Redis. (A class, not a
    generator: every call to Redis enters it, and a class with ``__slots__`` enters and
    leaves with less Python than a ``contextmanager`` generator.)
    """

    __slots__ = ("doing",)

    def __init__(self, doing: str = "") -> None:
        self.doing = doing

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> None:
        if exc is not None:
            _reword(exc, f" {self.doing}" if self.doing else "")


def _reword(exc: BaseException, where: str) -> None:
    """Raise the BrokerError that words ``exc`` (see :class:`redis_errors`); return if
    it is not an error of redis-py's (it goes on as it was)."""
    E = redis.exceptions
    if isinstance(exc, E.AuthenticationError):  # a ConnectionError: looked at first
        raise RedisAuthError(
            f"Redis refused mtq's credentials{where} ({exc}); put the right user and "
            "password in the URL (redis://USER:PASSWORD@HOST:PORT/DB, or rediss:// for "
            "TLS) given with --redis or MTQ_REDIS_URL") from exc
    if isinstance(exc, E.NoPermissionError):
        raise RedisAuthError(
            f"the Redis user may not do this{where} ({exc}); mtq needs its keys and "
            "channels and a few commands: ACL SETUSER USER ~mtq:* resetchannels &mtq:* "
            "+@all -@dangerous +info +client|setname +client|list (see docs/guarantees.md)"
        ) from exc
    if isinstance(exc, (E.ConnectionError, E.TimeoutError)):
        tls = tls_failure(exc)
        if isinstance(tls, ssl.SSLCertVerificationError):
            why = tls.verify_message or str(tls)
            raise RedisTLSError(
                f"Redis's TLS certificate is not trusted{where} ({why}); name the CA "
                "that signed it in the URL: "
                "rediss://HOST:PORT/DB?ssl_ca_certs=/path/to/ca.crt") from exc
        if tls is not None and "CERTIFICATE_REQUIRED" in str(tls):
            raise RedisTLSError(
                f"Redis asks for a client certificate{where} ({tls}); add yours to the "
                "URL: rediss://HOST:PORT/DB?ssl_ca_certs=CA.crt&ssl_certfile=CLIENT.crt"
                "&ssl_keyfile=CLIENT.key") from exc
        if tls is not None:
            raise RedisTLSError(
                f"the TLS handshake with Redis failed{where} ({tls}); a rediss:// URL "
                "needs the server's TLS port (tls-port), a redis:// URL its plain port"
            ) from exc
        raise RedisUnavailable(
            f"cannot reach Redis{where} ({exc}); check MTQ_REDIS_URL (rediss:// for a "
            "TLS port, with ssl_certfile= and ssl_keyfile= if it asks for a client "
            "certificate) or start the embedded server with 'mtq server start'"
        ) from exc
    if isinstance(exc, E.RedisError):
        raise BrokerError(f"Redis answered with an error{where}: {exc}") from exc
    if isinstance(exc, RedisClusterException):  # not a RedisError: cross-slot, no node
        raise BrokerError(f"the Redis cluster refused a command{where}: {exc}") from exc


def safe_url(url: str) -> str:
    """``url`` with its password, if any, replaced by ``***`` (for messages and logs;
    any URL form, a cluster's list of hosts included)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{hosts}"))


#: how long ``mtq worker run`` / ``mtq workers start`` wait for Redis at start
REACH_TIMEOUT_S = 30.0


def reach(client: redis.Redis, url: str, say: Callable[[str], None], *,
          timeout_s: float | None = REACH_TIMEOUT_S) -> None:
    """Wait until Redis answers a PING: the first thing a worker or a supervisor does,
    so that a wrong address, password or certificate is one line, not a traceback from
    every thread. A refused password or certificate raises :class:`RedisAuthError`
    (or :class:`RedisTLSError`) at once; an unreachable server is tried again with
    backoff (0.25 s doubling up to 5 s), one line each through ``say``, until
    ``timeout_s`` has passed (then :class:`RedisUnavailable`). ``timeout_s=None``
    waits without a limit and says so once."""
    where = safe_url(url)
    backoff = Backoff(first=0.25, cap=5.0)
    start = time.monotonic()
    while True:
        try:
            with single_attempt(), redis_errors(f"at {where}"):
                client.ping()
        except RedisUnavailable as exc:
            waited = time.monotonic() - start
            cause = exc.__cause__ or exc
            if timeout_s is not None and waited >= timeout_s:
                raise RedisUnavailable(
                    f"gave up after {waited:.0f} s: cannot reach Redis at {where} ({cause});"
                    " start it or fix --redis / MTQ_REDIS_URL, or pass --wait-for-redis to "
                    "wait without a limit") from exc
            delay = max(backoff.next(), 0.25)
            if timeout_s is None:
                if backoff.failures == 1:
                    say(f"waiting for Redis at {where} ({cause}) without a limit")
            else:
                delay = min(delay, max(0.0, timeout_s - waited))
                say(f"cannot reach Redis at {where} ({cause}); retrying in {delay:.2f} s, "
                    f"giving up in {timeout_s - waited:.0f} s")
            time.sleep(delay)
            continue
        if backoff.failures:
            say(f"Redis at {where} answered after {time.monotonic() - start:.1f} s")
        return


def resolve_url(url: str | None = None) -> str:
    """The URL to use: ``url``, else ``MTQ_REDIS_URL``, else the embedded server
    (started if it is not running)."""
    if url:
        return url
    env_url = RedisSettings.from_env().url
    if env_url:
        return env_url
    return EmbeddedServer.from_env().start()


def connect(url: str | None = None, settings: RedisSettings | None = None, *,
            name: str | None = None) -> redis.Redis:
    """A shared, thread-safe client for ``url`` (see :func:`resolve_url`).

    ``name``: every connection of the client announces it (``CLIENT SETNAME``), so
    another process can tell when they are all gone (a supervisor does, after one of
    its workers died: see :meth:`mtq.broker.consumer.Consumer.wait_disconnected`).
    Replies are bytes (payloads are binary msgpack); hiredis parses them when installed.
    """
    resolved = resolve_url(url or (settings.url if settings else None))
    s = settings or RedisSettings()
    key = (resolved, s, name)
    with _lock:
        client = _clients.get(key)
        if client is None:
            check_tls_options(resolved)
            client = open_client(resolved, s, name)
            _clients[key] = client
        return client


def open_client(url: str, s: RedisSettings, name: str | None, retry: Retry | None = None
                ) -> Any:
    """A new client for ``url``: one server, a cluster (``redis+cluster://``, see
    mtq.broker.cluster), or the primary a set of sentinels watches (``redis+sentinel://``).
    ``retry``: instead of :func:`retry_policy` (longer for a cluster or Sentinel, to
    ride through a failover)."""
    try:
        if cluster.is_cluster_url(url):
            with redis_errors(f"while reading the slot map of {safe_url(url)}"):
                return cluster.cluster_client(
                    url, socket_timeout=s.socket_timeout, connect_timeout=s.connect_timeout,
                    client_name=name, retry=retry or retry_policy(RETRIES_HA))
        if cluster.is_sentinel_url(url):
            return cluster.sentinel_client(
                url, socket_timeout=s.socket_timeout, connect_timeout=s.connect_timeout,
                client_name=name, retry=retry or retry_policy(RETRIES_HA))
        return redis.Redis.from_url(
            url, socket_timeout=s.socket_timeout, socket_connect_timeout=s.connect_timeout,
            health_check_interval=30, client_name=name, retry=retry or retry_policy())
    except ConfigError:  # worded already (mtq.broker.cluster)
        raise
    except ValueError as exc:
        raise ConfigError(f"invalid Redis URL {safe_url(url)!r}: {exc}") from exc


def check_tls_options(url: str) -> None:
    """Refuse, before any connection, TLS options that would fail later: a file that
    cannot be read (RedisTLSError), TLS options in a URL that is not rediss://."""
    parts = urlparse(url)
    options = parse_qs(parts.query)
    tls = sorted(name for name in options if name.startswith("ssl_"))
    if tls and not parts.scheme.startswith("rediss"):
        raise ConfigError(
            f"invalid Redis URL {safe_url(url)!r}: {', '.join(tls)} only apply to TLS; write "
            "rediss:// (rediss+cluster://, rediss+sentinel://) for a TLS connection")
    for name in TLS_FILES:
        for path in options.get(name, []):
            if not os.access(path, os.R_OK):
                raise RedisTLSError(
                    f"the Redis URL names {name}={path}, which cannot be read; give the "
                    "path of the PEM file (the CA that signed the server's certificate "
                    "for ssl_ca_certs)")


def client_url(client: redis.Redis) -> str | None:
    """A URL that reaches the same server and database as ``client``, for another
    process; None when its connection cannot be described by one (TLS options, a
    custom connection class)."""
    with _lock:
        for (url, _, _), c in _clients.items():
            if c is client:
                return url
    own = getattr(client, "mtq_url", None)  # a cluster's, its slot clients', a sentinel's
    if own is not None:
        return str(own)
    pool = getattr(client, "connection_pool", None)
    if pool is None:
        return None
    kw = pool.connection_kwargs
    user, password = kw.get("username"), kw.get("password")
    auth = ""
    if password is not None:
        auth = f"{quote(user or '', safe='')}:{quote(str(password), safe='')}@"
    db = int(kw.get("db") or 0)
    if pool.connection_class is redis.UnixDomainSocketConnection:
        return f"unix://{auth}{kw['path']}?db={db}"
    if pool.connection_class is redis.Connection:
        return f"redis://{auth}{kw.get('host', 'localhost')}:{kw.get('port', 6379)}/{db}"
    return None
