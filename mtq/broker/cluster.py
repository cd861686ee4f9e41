"""Redis Cluster and Sentinel: the URL forms that select them, and how a queue finds
the node that serves it.

Every key of a queue carries the hash tag ``{queue}`` (:mod:`mtq.broker.keys`), so a
queue lives in one hash slot, on one primary. mtq does not send a queue's commands
through redis-py's cluster client, which routes each command anew, cannot pipeline
scripts and retries without backoff. A queue gets a **slot client** instead
(:func:`for_queue`): a plain :class:`redis.Redis` whose connections go to the primary
that owns the queue's slot *now*. Everything mtq does on one Redis works on it as it
is: scripts and pipelines of scripts (one round trip), ``WAIT`` after a submit on the
same connection, ``BLPOP`` on the queue's wake lists, ``CLIENT LIST`` of the queue's
node, and pub/sub. When the slot moves (a failover promotes a replica, or a reshard)
the node answers ``MOVED`` or ``CLUSTERDOWN``, or stops answering: the connection is
dropped, the slot map is read again, and the command is sent again (with mtq's retry
policy and its backoff), to the new owner. A ``MOVED`` or ``CLUSTERDOWN`` reply means
the command did not run, so sending it again is safe.

The cluster client itself (:class:`redis.cluster.RedisCluster`) serves the few keys
that belong to no queue (the list of queues, the worker registry, the model history):
:func:`shared` gives it for any client.

Pub/sub on a cluster of Redis 7 or later is *sharded*: the scripts ``SPUBLISH`` to the
queue's channels (each carries the queue's hash tag), so an event reaches only the
shard that owns the queue, and a listener ``SSUBSCRIBE``\\ s on its slot client's
connection (:func:`sharded`). On an older cluster they fall back to PUBLISH and
SUBSCRIBE, which Redis broadcasts to every node.

URLs (``rediss`` for TLS; user and password apply to every node)::

    redis+cluster://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...][/0][?OPTIONS]
    redis+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[?db=N&OPTIONS]

Any one reachable node of a cluster is enough to find the others; name several so
that start-up does not depend on one. A Sentinel URL names the sentinels and the
service (the name in ``sentinel monitor``); ``sentinel_password=`` authenticates to
the sentinels if they ask.
"""

from __future__ import annotations

import threading
import time
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import Connection, ConnectionPool, SSLConnection, parse_url
from redis.exceptions import (
    AskError,
    ClusterDownError,
    ConnectionError,
    MovedError,
    ReadOnlyError,
    RedisClusterException,
    TryAgainError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError

from mtq.errors import ConfigError

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")

#: the least time between two reads of the slot map (s): every connection of a process
#: that loses its node asks for one, and one read answers them all
REFRESH_EVERY_S = 0.1


def scheme(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else ""


def is_cluster_url(url: str) -> bool:
    return scheme(url) in CLUSTER_SCHEMES


def is_sentinel_url(url: str) -> bool:
    return scheme(url) in SENTINEL_SCHEMES


def _hosts(url: str) -> tuple[list[tuple[str, int]], str]:
    """The HOST:PORT list of a cluster or sentinel URL, and the URL with only its first
    host and a plain scheme (for redis-py's own parser of the rest)."""
    parts = urlsplit(url)
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    hosts: list[tuple[str, int]] = []
    for item in hostlist.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"invalid Redis URL: {item.strip()!r} is not HOST:PORT; write "
                              f"{parts.scheme}://HOST:PORT[,HOST:PORT...]")
        hosts.append((host.strip("[]"), int(port)))
    plain = "rediss" if parts.scheme.lower().startswith("rediss") else "redis"
    first = f"{userinfo}@" if userinfo else ""
    first += f"{hosts[0][0]}:{hosts[0][1]}"
    return hosts, urlunsplit((plain, first, parts.path, parts.query, ""))


def _kwargs(single: str, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """Connection options of a one-host URL, as redis-py reads them."""
    try:
        kw = dict(parse_url(single))
    except ValueError as exc:
        raise ConfigError(f"invalid Redis URL: {exc}") from exc
    for k in ("host", "port", *drop):
        kw.pop(k, None)
    return kw


def cluster_client(url: str, *, socket_timeout: float, connect_timeout: float,
                   client_name: str | None, retry: Any) -> RedisCluster:
    """The cluster client of a ``redis+cluster://`` URL (it reads the slot map)."""
    hosts, single = _hosts(url)
    path = urlsplit(single).path.strip("/")
    if path not in ("", "0"):
        raise ConfigError(f"invalid Redis URL: a cluster has only database 0, not {path!r}")
    kw = _kwargs(single, drop=("db", "path"))
    if kw.pop("connection_class", None) is SSLConnection:
        kw["ssl"] = True
    try:
        client = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in hosts],
                              socket_timeout=socket_timeout,
                              socket_connect_timeout=connect_timeout,
                              client_name=client_name, retry=retry, **kw)
    except RedisClusterException as exc:
        if "auth" in str(exc).lower() or "WRONGPASS" in str(exc):
            raise redis.exceptions.AuthenticationError(str(exc)) from exc
        raise redis.exceptions.ConnectionError(
            f"no node of the cluster {', '.join(f'{h}:{p}' for h, p in hosts)} answered "
            f"as a cluster ({exc})") from exc
    client.mtq_url = url  # type: ignore[attr-defined]
    client.mtq_slots = {}  # type: ignore[attr-defined]  # slot -> its slot client
    client.mtq_options = {  # type: ignore[attr-defined]  # for the slot clients
        "socket_timeout": socket_timeout, "socket_connect_timeout": connect_timeout,
        "client_name": client_name, "retry": retry, "health_check_interval": 30, **kw}
    client.mtq_lock = threading.Lock()  # type: ignore[attr-defined]
    client.mtq_refreshed = 0.0  # type: ignore[attr-defined]
    client.mtq_sharded_pubsub = None  # type: ignore[attr-defined]  # known on first use
    return client


def sentinel_client(url: str, *, socket_timeout: float, connect_timeout: float,
                    client_name: str | None, retry: Any) -> redis.Redis:
    """The client of a ``redis+sentinel://`` URL: it asks the sentinels where the
    primary of SERVICE is on every new connection, so it follows a failover."""
    from redis.sentinel import Sentinel

    hosts, single = _hosts(url)
    parts = urlsplit(single)
    service = parts.path.strip("/")
    if not service or "/" in service:
        raise ConfigError(f"invalid Redis URL: name the service the sentinels watch, "
                          f"{scheme(url)}://HOST:PORT[,HOST:PORT...]/SERVICE (got path "
                          f"{parts.path!r})")
    query = parse_qs(parts.query)
    sentinel_password = (query.pop("sentinel_password", [None]) or [None])[0]
    rest = urlencode(query, doseq=True)
    kw = _kwargs(urlunsplit((parts.scheme, parts.netloc, "", rest, "")), drop=("path",))
    ssl = kw.pop("connection_class", None) is SSLConnection
    sentinel_kw: dict[str, Any] = {"socket_timeout": min(socket_timeout, 5.0),
                                   "socket_connect_timeout": connect_timeout}
    if sentinel_password:
        sentinel_kw["password"] = sentinel_password
    if ssl:
        sentinel_kw.update({k: v for k, v in kw.items() if k.startswith("ssl")}, ssl=True)
        kw["ssl"] = True
    sentinel = Sentinel(hosts, sentinel_kwargs=sentinel_kw)
    connection_class = _SentinelSSLConnection if kw.pop("ssl", False) else _SentinelConnection
    client = sentinel.master_for(service, socket_timeout=socket_timeout,
                                 socket_connect_timeout=connect_timeout,
                                 client_name=client_name, retry=retry,
                                 connection_class=connection_class,
                                 health_check_interval=30, **kw)
    client.mtq_url = url
    return client


def _sentinel_classes() -> tuple[type, type]:
    from redis.sentinel import SentinelManagedConnection, SentinelManagedSSLConnection

    class SentinelConnection(SentinelManagedConnection):
        """redis-py's, asking the sentinels where the primary is on every way of
        connecting: its own asks only in connect(), and a command sent again after a
        failure reconnects without it, to the dead primary, until the retries run out."""

        def connect_check_health(self, *args: Any, **kwargs: Any) -> None:
            if self._sock:
                return
            if self.connection_pool.is_master:
                self.host, self.port = self.connection_pool.get_master_address()
            super().connect_check_health(*args, **kwargs)

    class SentinelSSLConnection(SentinelConnection, SentinelManagedSSLConnection):
        pass

    return SentinelConnection, SentinelSSLConnection


_SentinelConnection, _SentinelSSLConnection = _sentinel_classes()


# -- slot clients ------------------------------------------------------------------------

def _refresh(cluster: RedisCluster) -> None:
    """Read the slot map again (at most every REFRESH_EVERY_S)."""
    now = time.monotonic()
    with cluster.mtq_lock:  # type: ignore[attr-defined]
        if now - cluster.mtq_refreshed < REFRESH_EVERY_S:  # type: ignore[attr-defined]
            return
        cluster.mtq_refreshed = now  # type: ignore[attr-defined]
    try:
        cluster.nodes_manager.initialize()
    except Exception:
        pass


class SlotConnection(Connection):
    """A connection to whichever primary serves its pool's slot when it connects. A
    reply that says the slot is served elsewhere (MOVED, ASK), not at all
    (CLUSTERDOWN), or not yet (TRYAGAIN, READONLY) drops the connection and raises
    ConnectionError: the command did not run, and mtq's retry sends it again to the
    owner found by a fresh read of the slot map."""

    def __init__(self, **kwargs: Any) -> None:
        self.slot_pool: SlotConnectionPool = kwargs.pop("slot_pool")
        super().__init__(**kwargs)

    def connect_check_health(self, *args: Any, **kwargs: Any) -> None:
        # every way redis-py (re)connects goes through here: connect(), and a command
        # sent on a connection that a failure closed
        if self._sock:
            return
        self.host, self.port = self.slot_pool.owner()
        try:
            super().connect_check_health(*args, **kwargs)
        except ConnectionError:
            self.slot_pool.lost()
            raise
        except RedisTimeoutError as exc:  # a node that hangs: nothing was sent, try anew
            self.slot_pool.lost()
            raise ConnectionError(f"connecting to {self.host}:{self.port} timed out") from exc

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)
        except (MovedError, AskError, ClusterDownError, TryAgainError, ReadOnlyError) as exc:
            self.disconnect()
            self.slot_pool.lost()
            raise ConnectionError(f"the slot moved or is not served ({exc})") from exc
        except (ConnectionError, RedisTimeoutError):
            # a read that timed out may have run: it is not sent again here (the
            # caller's loop decides), but the next connection asks where the slot is
            self.slot_pool.lost()
            raise


class SlotSSLConnection(SlotConnection, SSLConnection):
    pass


class SlotConnectionPool(ConnectionPool):
    """Connections to the primary that serves ``slot`` of ``cluster``."""

    def __init__(self, cluster: RedisCluster, slot: int, **kwargs: Any) -> None:
        ssl = kwargs.pop("ssl", False)
        kwargs["connection_class"] = SlotSSLConnection if ssl else SlotConnection
        self.cluster, self.slot = cluster, slot
        self._stale = False
        self._address: tuple[str, int] | None = None
        super().__init__(**kwargs)
        self.connection_kwargs["slot_pool"] = self

    def owner(self) -> tuple[str, int]:
        """(host, port) of the primary that serves the slot, as last read."""
        if self._stale:
            self._stale = False
            _refresh(self.cluster)
        try:
            node = self.cluster.nodes_manager.get_node_from_slot(self.slot)
        except (RedisClusterException, IndexError, KeyError) as exc:
            self._stale = True
            raise ConnectionError(f"no node serves slot {self.slot} now ({exc})") from exc
        if node is None:
            self._stale = True
            raise ConnectionError(f"no node serves slot {self.slot} now")
        address = (node.host, node.port)
        if address != self._address:
            if self._address is not None:  # idle connections to the old owner: drop them
                self.disconnect(inuse_connections=False)
            self._address = address
        return address

    def lost(self) -> None:
        """The node did not answer for the slot: read the slot map before the next
        connection, and drop idle connections to the old owner."""
        self._stale = True

    def owns_connection(self, connection: Any) -> bool:
        return bool(super().owns_connection(connection)) and (
            self._address is None or (connection.host, connection.port) == self._address)


def is_cluster(client: Any) -> bool:
    return isinstance(client, RedisCluster)


def for_key(client: Any, key: str) -> Any:
    """The client that serves ``key``: ``client`` itself unless it is a cluster client,
    then the slot client of the key's slot (one per slot and process)."""
    if not isinstance(client, RedisCluster):
        return client
    slot = client.keyslot(key)
    slots = client.mtq_slots  # type: ignore[attr-defined]
    c = slots.get(slot)
    if c is None:
        with client.mtq_lock:  # type: ignore[attr-defined]
            c = slots.get(slot)
            if c is None:
                pool = SlotConnectionPool(client, slot, **client.mtq_options)  # type: ignore[attr-defined]
                c = redis.Redis(connection_pool=pool)
                c.mtq_cluster = client  # type: ignore[attr-defined]
                c.mtq_url = client.mtq_url  # type: ignore[attr-defined]
                slots[slot] = c
    return c


def for_queue(client: Any, queue: str) -> Any:
    """The client that serves ``queue``'s keys (see :func:`for_key`)."""
    from mtq.broker.keys import QueueKeys

    return for_key(client, QueueKeys(queue).ready)


def shared(client: Any) -> Any:
    """The client for keys that belong to no queue: the cluster client of a slot
    client, else ``client`` itself."""
    return getattr(client, "mtq_cluster", client)


def sharded(client: Any) -> bool:
    """Whether pub/sub on ``client`` is sharded (SPUBLISH / SSUBSCRIBE): a slot client
    of a cluster of Redis 7 or later."""
    cluster = getattr(client, "mtq_cluster", None)
    if cluster is None:
        return False
    known = cluster.mtq_sharded_pubsub
    if known is None:  # asked once; a RedisError goes to the caller, whose loop retries
        version = str(client.info("server").get("redis_version", "0"))
        known = cluster.mtq_sharded_pubsub = int(version.split(".")[0]) >= 7
    return bool(known)
