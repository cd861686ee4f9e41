"""A Prometheus exporter for mtq's queues (``mtq metrics serve``; needs ``mtq[metrics]``).

:class:`MtqCollector` reads, at each scrape, the O(1) counters of every queue
(those of :meth:`mtq.Queue.stats`) in one pipelined round trip (plus one SMEMBERS
for the list of queues when no queue is named), and turns them into metric
families. It never raises on an unreachable Redis: the scrape then reports
``mtq_up 0`` with nothing else but the scrape's duration, and the next scrape
tries again, so the exporter keeps serving through an outage.

Metrics (label ``queue`` on all but ``mtq_up`` and ``mtq_scrape_duration_seconds``):

- gauges ``mtq_queue_waiting_tasks``, ``mtq_queue_running_tasks`` (leased),
  ``mtq_queue_delayed_tasks`` (waiting for a retry's delay),
  ``mtq_queue_dead_tasks`` (dead letters kept), ``mtq_queue_streams`` (streams with
  waiting work), ``mtq_queue_busy_streams`` (streams with a running task);
- counters ``mtq_tasks_<event>_total`` for submitted, succeeded, failed, retried,
  expired, cancelled, dead_lettered and redelivered (lease expired, task queued
  again);
- ``mtq_up`` (1: this scrape read Redis) and ``mtq_scrape_duration_seconds``.

No torch import here: the exporter runs beside the workers, not in them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from mtq.broker.keys import QUEUES
from mtq.broker.protocol import stats_many

log = logging.getLogger(__name__)

DEFAULT_PORT = 9808

#: gauge name -> (key of the queue's stats, help)
GAUGES = {
    "mtq_queue_waiting_tasks": ("waiting", "Tasks waiting to be claimed."),
    "mtq_queue_running_tasks": ("running", "Tasks claimed by a worker (leased)."),
    "mtq_queue_delayed_tasks": ("delayed", "Tasks waiting for a retry's delay."),
    "mtq_queue_dead_tasks": ("dead", "Dead letters kept (see mtq dlq list)."),
    "mtq_queue_streams": ("streams", "Streams with waiting tasks."),
    "mtq_queue_busy_streams": ("busy_streams", "Streams with a running task."),
}
#: counter name (without _total) -> (key of the queue's stats, help)
COUNTERS = {
    "mtq_tasks_submitted": ("submitted", "Tasks submitted."),
    "mtq_tasks_succeeded": ("succeeded", "Tasks that succeeded."),
    "mtq_tasks_failed": ("failed", "Tasks that ended failed (retries spent, no dead letter)."),
    "mtq_tasks_retried": ("retried", "Handler errors followed by a retry."),
    "mtq_tasks_expired": ("expired", "Tasks whose deadline passed before a worker ran them."),
    "mtq_tasks_cancelled": ("cancelled", "Tasks cancelled (or purged)."),
    "mtq_tasks_dead_lettered": ("dead_total", "Tasks moved to the dead letters."),
    "mtq_tasks_redelivered": ("redelivered", "Leases that expired; task queued again."),
}


def exporter_client(url: str) -> redis.Redis:
    """A client for scrapes: short timeouts and one immediate retry (a connection
    dropped by a restarted Redis is re-opened once), so that a scrape during an
    outage answers ``mtq_up 0`` within about a second rather than hanging."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from mtq.broker.connection import check_tls_options

    check_tls_options(url)
    return redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=1.0,
                                retry=Retry(NoBackoff(), 1), client_name="mtq-metrics")


def known_queues(client: redis.Redis) -> list[str]:
    """Every queue that was ever submitted to (sorted); raises redis-py's errors."""
    return sorted(v.decode() if isinstance(v, bytes) else str(v)
                  for v in client.smembers(QUEUES))


class MtqCollector(Collector):
    """Reads the queues' counters at each scrape (see the module's docstring).

    ``queues``: the queues to export, in this order; None: every known queue, read
    anew at each scrape (a queue created later appears, a deleted one goes)."""

    def __init__(self, client: redis.Redis, queues: Sequence[str] | None = None) -> None:
        self.client = client
        self.queues = list(queues) if queues is not None else None

    def read(self) -> dict[str, dict[str, Any]]:
        """The counters of each exported queue; raises redis-py's errors."""
        names = self.queues if self.queues is not None else known_queues(self.client)
        return stats_many(self.client, names)

    def collect(self) -> Iterable[Metric]:
        started = time.perf_counter()
        try:
            stats: dict[str, dict[str, Any]] | None = self.read()
        except redis.RedisError as exc:
            log.warning("scrape could not read Redis: %s", exc)
            stats = None
        up = GaugeMetricFamily("mtq_up", "1 if this scrape read Redis, else 0.",
                               value=0 if stats is None else 1)
        yield from self._families(stats or {})
        yield up
        yield GaugeMetricFamily("mtq_scrape_duration_seconds",
                                "Seconds this scrape spent reading Redis.",
                                value=time.perf_counter() - started)

    @staticmethod
    def _families(stats: dict[str, dict[str, Any]]) -> Iterator[Metric]:
        if not stats:
            return
        for name, (key, doc) in GAUGES.items():
            g = GaugeMetricFamily(name, doc, labels=["queue"])
            for queue, values in stats.items():
                g.add_metric([queue], values[key])
            yield g
        for name, (key, doc) in COUNTERS.items():
            c = CounterMetricFamily(name, doc, labels=["queue"])
            for queue, values in stats.items():
                c.add_metric([queue], values[key])
            yield c


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per scrape would flood the log


def make_exporter(collector: MtqCollector, host: str = "127.0.0.1",
                  port: int = DEFAULT_PORT) -> WSGIServer:
    """An HTTP server (not yet serving: call ``serve_forever``) answering every path
    with the collector's metrics in Prometheus' text format. Raises OSError when the
    address cannot be bound (a port in use)."""
    from prometheus_client import make_wsgi_app

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return make_server(host, port, make_wsgi_app(registry), server_class=_Server,
                       handler_class=_QuietHandler)


__all__ = ["COUNTERS", "DEFAULT_PORT", "GAUGES", "MtqCollector", "exporter_client",
           "known_queues", "make_exporter"]
