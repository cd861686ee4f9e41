"""Redis clients: one connection pool per URL per process, shared by all queues."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import quote

import redis

from mtq.broker.embedded import EmbeddedServer
from mtq.errors import BrokerError
from mtq.settings import RedisSettings

_lock = threading.Lock()
_clients: dict[tuple[str, RedisSettings, str | None], redis.Redis] = {}


@contextmanager
def redis_errors(doing: str = "") -> Iterator[None]:
    """Turn redis-py errors raised inside the block into BrokerError.

    ``doing`` completes the message ("while waiting for work"). The one place
    that words these errors, for every call mtq makes to Redis.
    """
    where = f" {doing}" if doing else ""
    try:
        yield
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        raise BrokerError(
            f"cannot reach Redis{where} ({exc}); check MTQ_REDIS_URL or start the "
            "embedded server with 'mtq server start'"
        ) from exc
    except redis.exceptions.RedisError as exc:
        raise BrokerError(f"Redis answered with an error{where}: {exc}") from exc


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
            try:
                client = redis.Redis.from_url(
                    resolved, socket_timeout=s.socket_timeout,
                    socket_connect_timeout=s.connect_timeout, health_check_interval=30,
                    client_name=name)
            except ValueError as exc:
                raise BrokerError(f"invalid Redis URL {resolved!r}: {exc}") from exc
            _clients[key] = client
        return client


def client_url(client: redis.Redis) -> str | None:
    """A URL that reaches the same server and database as ``client``, for another
    process; None when its connection cannot be described by one (TLS options, a
    custom connection class)."""
    with _lock:
        for (url, _, _), c in _clients.items():
            if c is client:
                return url
    pool = client.connection_pool
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
