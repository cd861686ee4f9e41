"""What one exporter scrape reads of many queues, in ONE round trip.

Per queue, ten reads: the stats hash, ZCARD of the leases and the
delayed set, LLEN of the dead letters, SCARD of the busy streams (as
:func:`mtq.broker.protocol.stats_many`), the ``hist`` hash the workers aggregate
(a bounded number of fields: :mod:`mtq.observe.histograms`), ZCARD of the result
cache's index, and scheduling's two hashes per tenant and band (``sched:count``,
``sched:served``: empty without scheduling, else a few fields per lane that ever had
work; :mod:`mtq.broker.tenants`), and ZCOUNT of the delayed tasks due by now (the
backlog's: docs/scaling.md; the one command written anew at each scrape).

At 1 000 queues that is 9 000 commands a scrape, and a redis-py pipeline spends
Python on each (building the command, its response callback): at that count, most of
what a scrape may take. So the commands of each queue are encoded once, in RESP,
and kept (queues come and go rarely); a scrape joins them, writes them on one
connection of the client's pool and reads the raw replies back (hiredis when
installed), which leaves little Python per command (the scrape's time:
docs/benchmarks.md, Observability). A connection that fails is
dropped, and the read is tried once more on a fresh one (a restarted Redis), as
the exporter's client would with its own retry.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import redis

from mtq.broker.cluster import for_queue, is_cluster
from mtq.broker.keys import QueueKeys

#: replies per queue, in this order
READS = ("stats", "running", "delayed", "dead", "busy_streams", "hist", "cache_entries",
         "sched_count", "sched_served", "due")


def _resp(*args: str) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def _commands(queue: str) -> bytes:
    k = QueueKeys(queue)
    return b"".join((_resp("HGETALL", k.stats), _resp("ZCOUNT", k.leases, "-inf", "(+inf"),
                     _resp("ZCARD", k.delayed), _resp("LLEN", k.dead), _resp("SCARD", k.busy),
                     _resp("HGETALL", k.hist), _resp("ZCARD", k.cache_index),
                     _resp("HGETALL", k.sched_count), _resp("HGETALL", k.sched_served)))


def _hash(reply: Any) -> dict[bytes, bytes]:
    """A HGETALL reply as a dict (RESP3 gives a map, RESP2 a flat list)."""
    if isinstance(reply, dict):
        return reply
    it = iter(reply)
    return dict(zip(it, it))


class ScrapeReader:
    """Reads :data:`READS` of many queues in one round trip; keeps each queue's encoded
    commands (a few hundred bytes a queue)."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._packed: dict[str, tuple[bytes, bytes]] = {}

    def _packed_for(self, queues: Sequence[str]) -> bytes:
        packed = self._packed
        if len(packed) > 4 * len(queues) + 1000:  # many queues deleted since: start over
            packed.clear()
        out: list[bytes] = []
        # "due" counts the delayed set up to now (ms, as the scripts' scores), so it
        # is the one command encoded at each scrape
        now = str(int(time.time() * 1000)).encode()
        due = b"$%d\r\n%s\r\n" % (len(now), now)
        for q in queues:
            b = packed.get(q)
            if b is None:
                d = QueueKeys(q).delayed.encode()
                b = packed[q] = (_commands(q), b"*4\r\n$6\r\nZCOUNT\r\n$%d\r\n%s\r\n"
                                 b"$4\r\n-inf\r\n" % (len(d), d))
            out += b
            out.append(due)
        return b"".join(out)

    def read(self, queues: Sequence[str]) -> list[tuple[dict[bytes, bytes], int, int, int, int,
                                                        dict[bytes, bytes], int,
                                                        dict[bytes, bytes], dict[bytes, bytes],
                                                        int]]:
        """One tuple per queue, in :data:`READS` order. Raises redis-py's errors."""
        if not queues:
            return []
        if not is_cluster(self.client):
            raw = self._read_on(self.client, queues)
        else:  # one round trip per primary: the queues it serves now, on one connection
            groups: dict[Any, list[str]] = {}
            via: dict[Any, Any] = {}
            for q in queues:
                c = for_queue(self.client, q)
                try:
                    node = c.connection_pool.owner()
                except redis.ConnectionError:
                    node = None  # not served now: read where it leads (and fail there)
                groups.setdefault(node, []).append(q)
                via.setdefault(node, c)
            got: dict[str, list[Any]] = {}
            for node, qs in groups.items():
                replies = self._read_on(via[node], qs)
                for i, q in enumerate(qs):
                    got[q] = replies[i * len(READS):(i + 1) * len(READS)]
            raw = [r for q in queues for r in got[q]]
        out = []
        for i in range(0, len(raw), len(READS)):
            out.append((_hash(raw[i]), int(raw[i + 1]), int(raw[i + 2]), int(raw[i + 3]),
                        int(raw[i + 4]), _hash(raw[i + 5]), int(raw[i + 6]),
                        _hash(raw[i + 7]), _hash(raw[i + 8]), int(raw[i + 9])))
        return out

    def _read_on(self, client: Any, queues: Sequence[str]) -> list[Any]:
        data = self._packed_for(queues)
        n = len(READS) * len(queues)
        try:
            return self._round_trip(client, data, n)
        except (redis.ConnectionError, redis.TimeoutError):
            return self._round_trip(client, data, n)  # once more, on a fresh connection

    def _round_trip(self, client: Any, data: bytes, n: int) -> list[Any]:
        pool = client.connection_pool
        conn = pool.get_connection()
        try:
            conn.send_packed_command([data], check_health=True)
            # hiredis' parser straight (an error reply comes back as a value, checked
            # below): redis-py's Connection.read_response around it adds health checks
            # and error mapping to every reply, 9 000 of them a scrape of 1 000 queues
            parser: Any = getattr(conn, "_parser", None)
            read = parser.read_response if getattr(parser, "_reader", None) is not None \
                else conn.read_response
            replies = [read() for _ in range(n)]
        except BaseException:
            conn.disconnect()  # replies may be left unread on it
            raise
        finally:
            pool.release(conn)
        for r in replies:
            if isinstance(r, redis.ResponseError):
                raise r
        return replies


__all__ = ["READS", "ScrapeReader"]
