"""A Prometheus exporter for mtq's queues (``mtq metrics serve``; needs ``mtq[metrics]``).

:class:`MtqCollector` reads, at each scrape, every exported queue's O(1) counters,
the histograms its workers aggregate and its result cache's size in ONE
round trip (:mod:`mtq.broker.scrape`; plus one SMEMBERS for the list of queues
when no queue is named), and the worker registry (O(workers)), and turns them
into metric families. It never raises on an unreachable Redis: the scrape then
reports ``mtq_up 0`` with nothing else but the scrape's duration, and the next
scrape tries again, so the exporter keeps serving through an outage.

Metrics (see docs/operations.md for the table):

- per queue (label ``queue``): gauges ``mtq_queue_waiting_tasks``,
  ``mtq_queue_running_tasks`` (leased), ``mtq_queue_delayed_tasks`` (waiting for a
  retry's delay), ``mtq_queue_dead_tasks`` (dead letters kept),
  ``mtq_queue_backlog_tasks`` and ``mtq_queue_backlog_cost`` (waiting + running +
  due: :mod:`mtq.observe.backlog`), ``mtq_queue_cold_start_seconds`` (--autoscale),
  ``mtq_queue_streams`` (streams with waiting work), ``mtq_queue_busy_streams``
  (streams with a running task); counters ``mtq_tasks_<event>_total`` for
  submitted, succeeded, failed, retried, expired, cancelled, dead_lettered and
  redelivered (lease expired, task queued again);
- per queue, histograms the workers aggregate (:mod:`mtq.observe.histograms`; a
  queue's series appear once it has an observation): ``mtq_queue_wait_seconds``
  (submit to claim, per delivery), ``mtq_task_run_seconds`` (start of the batch
  or prefill that ran a task to its outcome), ``mtq_task_latency_seconds``
  (submit to the outcome that ends the task), ``mtq_generation_ttft_seconds``
  (submit to the first token), ``mtq_generation_tokens_per_second`` (decode rate
  after the first token);
- per queue, tenant and band (scheduling on; the busiest 20 tenants by cost served,
  the rest summed as tenant="other": :mod:`mtq.observe.tenants`): gauges
  ``mtq_tenant_waiting``, ``mtq_tenant_waiting_cost``, ``mtq_tenant_running``,
  counters ``mtq_tenant_served_cost_total``, ``mtq_tenant_held_total``,
  ``mtq_tenant_refused_total``;
- the result cache, per queue: counters ``mtq_cache_hits_total``,
  ``mtq_cache_misses_total``, ``mtq_cache_joined_total``, gauges
  ``mtq_cache_entries`` (0 when there is no cache);
- per live worker process (labels ``queue``, ``worker``, ``host``, ``device``,
  ``model``; read from the worker registry): histogram ``mtq_worker_batch_size``, counters
  ``mtq_worker_busy_seconds_total`` (busy fraction: its rate),
  ``mtq_worker_restarts_total``, ``mtq_worker_tasks_total``, gauge
  ``mtq_worker_device_memory_bytes{kind=allocated|reserved|total}`` (CUDA only);
  and ``mtq_workers{queue,state}``, live workers by state;
- ``mtq_up`` (1: this scrape read Redis) and ``mtq_scrape_duration_seconds``.

The HTTP server renders the text format itself (:meth:`MtqCollector.render`, the
same families as :meth:`MtqCollector.collect` yields, which prometheus_client's
registries use): prometheus_client's generic writer spends Python on every sample,
too much for a thousand queues with histograms (docs/benchmarks.md, Observability).

No torch import here: the exporter runs beside the workers, not in them, and reads
the worker registry (:mod:`mtq.broker.registry`) without importing the worker side.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import redis
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from mtq.broker.cluster import shared
from mtq.broker.keys import QUEUES
from mtq.broker.registry import list_workers
from mtq.broker.scrape import ScrapeReader
from mtq.broker.tenants import DEFAULT_TOP, TenantRow, parse_rows, top_tenants
from mtq.errors import BrokerError
from mtq.observe.backlog import backlog
from mtq.observe.histograms import BOUNDS
from mtq.observe.tenants import tenant_families

log = logging.getLogger(__name__)

DEFAULT_PORT = 9808
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: gauge name -> (key of the queue's stats, help)
GAUGES = {
    "mtq_queue_waiting_tasks": ("waiting", "Tasks waiting to be claimed."),
    "mtq_queue_running_tasks": ("running", "Tasks claimed by a worker (leased)."),
    "mtq_queue_delayed_tasks": ("delayed", "Tasks waiting for a retry's delay or a delayed "
                                "submit's due time."),
    "mtq_queue_dead_tasks": ("dead", "Dead letters kept (see mtq dlq list)."),
    "mtq_queue_backlog_tasks": ("backlog", "Tasks waiting, running, or delayed and due: "
                                "what workers have yet to finish (docs/scaling.md)."),
    "mtq_queue_backlog_cost": ("backlog_cost", "The backlog in cost (scheduling's costs; "
                               "without scheduling, each task costs 1)."),
    "mtq_queue_cold_start_seconds": ("cold_start", "--autoscale: from the submit that woke "
                                     "a supervisor at zero processes to the first claim."),
    "mtq_queue_streams": ("streams", "Streams with waiting tasks."),
    "mtq_queue_busy_streams": ("busy_streams", "Streams with a running task (or a "
                               "retry waiting, or a chain step's hand-off pending)."),
    "mtq_cache_entries": ("cache_entries", "Entries the result cache holds (about 150 bytes "
                                           "each, naming the task that holds the result, at "
                                           "most 64 KiB); capped by cache_max_entries."),
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
    "mtq_cache_hits": ("cache_hits", "Submits answered from the result cache."),
    "mtq_cache_misses": ("cache_misses", "Cacheable submits the result cache could not answer."),
    "mtq_cache_joined": ("cache_joined", "Submits that joined an identical running task."),
}
#: the queue's stats fields read (every other one is ignored)
_STAT_FIELDS = ("waiting", "streams", "submitted", "succeeded", "failed", "dead_total",
                "cancelled", "expired", "retried", "redelivered", "cache_hits",
                "cache_misses", "cache_joined", "cold_start_ms")
_STAT_KEYS = {f.encode(): f for f in _STAT_FIELDS}
_ZERO: dict[str, int | float] = dict.fromkeys(_STAT_FIELDS, 0)
#: histogram metric of mtq.observe.histograms -> (family name, help)
HISTOGRAMS = {
    "queue_wait": ("mtq_queue_wait_seconds",
                   "Seconds from submit to claim, per delivery (worker clocks, per beat)."),
    "run": ("mtq_task_run_seconds",
            "Seconds from the start of the batch (or prefill) that ran a task to its outcome."),
    "latency": ("mtq_task_latency_seconds",
                "Seconds from submit to the outcome that ended the task (succeeded, failed, "
                "dead; not retries)."),
    "ttft": ("mtq_generation_ttft_seconds", "Seconds from submit to a generation's first token."),
    "tokens_per_s": ("mtq_generation_tokens_per_second",
                     "A generation's tokens after the first per second from the first to its end."),
    "load": ("mtq_engine_load_seconds",
             "Seconds an engine took to set its model up (loaded on demand: the wait of the "
             "tasks that came for it)."),
}
#: the fields of a "hist" hash laid out flat: each metric's buckets, then its sum
_HIST_SPANS: list[tuple[str, int, int]] = []  # metric, first bucket, its sum's position
_HIST_POS: dict[bytes, int] = {}
for _m, _b in BOUNDS.items():
    _lo = len(_HIST_POS)
    _HIST_POS.update({f"{_m}:{i}".encode(): _lo + i for i in range(len(_b) + 1)})
    _HIST_POS[f"{_m}:sum".encode()] = _lo + len(_b) + 1
    _HIST_SPANS.append((_m, _lo, _lo + len(_b) + 1))
_HIST_SIZE = len(_HIST_POS)
_LE = {m: (*(floatToGoString(b) for b in bounds), "+Inf") for m, bounds in BOUNDS.items()}
#: a worker's batch sizes
BATCH_BOUNDS = tuple(2 ** i for i in range(11))  # 1 .. 1024
_BATCH_LE = (*(floatToGoString(b) for b in BATCH_BOUNDS), "+Inf")
WORKER_LABELS = ("queue", "worker", "host", "device", "model")

#: reads the worker registry: every live worker process's entry (a dict with at least
#: ``id``, ``queue``, ``state``); raises redis-py's errors or :class:`BrokerError`
WorkerReader = Callable[[redis.Redis], list[dict[str, Any]]]


def exporter_client(url: str) -> redis.Redis:
    """A client for scrapes: short timeouts and one immediate retry (a connection
    dropped by a restarted Redis is re-opened once), so that a scrape during an
    outage answers ``mtq_up 0`` within about a second rather than hanging."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from mtq.broker.connection import check_tls_options, open_client
    from mtq.settings import RedisSettings

    check_tls_options(url)
    return open_client(url, RedisSettings(socket_timeout=2.0, connect_timeout=1.0),
                       "mtq-metrics", retry=Retry(NoBackoff(), 1))


def known_queues(client: redis.Redis) -> list[str]:
    """Every queue that was ever submitted to (sorted); raises redis-py's errors."""
    return sorted(v.decode() if isinstance(v, bytes) else str(v)
                  for v in shared(client).smembers(QUEUES))


@dataclass
class Reading:
    """What one scrape read."""

    #: queue -> counters (the names of GAUGES and COUNTERS' keys; 0 when absent)
    stats: dict[str, dict[str, int | float]] = field(default_factory=dict)
    #: queue -> metric -> (NON-cumulative bucket counts, sum); only metrics with data
    hists: dict[str, dict[str, tuple[list[int], float]]] = field(default_factory=dict)
    #: live workers of the exported queues (registry entries)
    workers: list[dict[str, Any]] = field(default_factory=list)
    #: queue -> its scheduling rows exported (only queues with scheduling on): the
    #: tenant_top tenants by cost served, the rest summed per band (top_tenants)
    tenants: dict[str, list[TenantRow]] = field(default_factory=dict)


def _num(v: float) -> str:
    return str(v) if isinstance(v, int) else floatToGoString(v)


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


# A family, as both writers take it: (name, type, help, label names, rows); a row is
# (label values, value) for a gauge or counter, and (label values, (NON-cumulative
# bucket counts, sum), le strings) for a histogram.
Family = tuple[str, str, str, tuple[str, ...], list[Any]]


def _cumulative(counts: Sequence[int]) -> list[int]:
    return list(itertools.accumulate(counts))


class MtqCollector(Collector):
    """Reads the queues' counters at each scrape (see the module's docstring).

    ``queues``: the queues to export, in this order; None: every known queue, read
    anew at each scrape (a queue created later appears, a deleted one goes).
    ``workers``: reads the worker registry for the per-worker families (default
    :func:`mtq.broker.registry.list_workers`); None: those families stay empty.
    ``tenant_top``: per queue, the tenants (by cost served) exported under their own
    label; the rest are summed under tenant="other" (:mod:`mtq.observe.tenants`)."""

    def __init__(self, client: redis.Redis, queues: Sequence[str] | None = None,
                 workers: WorkerReader | None = list_workers,
                 tenant_top: int = DEFAULT_TOP) -> None:
        self.client = client
        self.tenant_top = tenant_top
        self.queues = list(queues) if queues is not None else None
        self._workers = workers
        self._reader = ScrapeReader(client)
        #: queue -> (its last "hist" reply, what it parsed to): most queues' histograms
        #: do not change between scrapes, and parsing them is most of a read's Python
        self._parsed: dict[str, tuple[tuple[Any, ...], dict[str, tuple[list[int], float]]]] = {}
        #: queue -> (its last two scheduling replies, the rows exported of them)
        self._tenants: dict[str, tuple[tuple[Any, ...], list[TenantRow]]] = {}
        #: (family, label text) -> (the histogram tuple it was written from, its text)
        self._written: dict[tuple[str, str], tuple[Any, str]] = {}

    def read(self) -> Reading:
        """Everything one scrape exports; raises redis-py's errors."""
        names = self.queues if self.queues is not None else known_queues(self.client)
        out = Reading()
        keys, positions, zero = _STAT_KEYS, _HIST_POS, _ZERO
        stats, hists = out.stats, out.hists
        parsed = self._parsed
        fresh: dict[str, tuple[tuple[Any, ...], dict[str, tuple[list[int], float]]]] = {}
        tenants_kept: dict[str, tuple[tuple[Any, ...], list[TenantRow]]] = {}
        for name, (counters, running, delayed, dead, busy, hist, cached, count,
                   served, due) in zip(names, self._reader.read(names)):
            if count or served:  # scheduling on; parsed again only when it changed
                raw_t = (tuple(count.items()), tuple(served.items()))
                prev_t = self._tenants.get(name)
                if prev_t is None or prev_t[0] != raw_t:
                    prev_t = (raw_t, top_tenants(parse_rows(count, served), self.tenant_top))
                out.tenants[name] = prev_t[1]
                tenants_kept[name] = prev_t
            st: dict[str, int | float] = {**zero, **{
                keys[k]: int(v) for k, v in counters.items() if k in keys}}
            tasks, cost = backlog(int(st["waiting"]), running, due, count)
            st.update(running=running, delayed=delayed, dead=dead, busy_streams=busy,
                      cache_entries=cached, backlog=tasks, backlog_cost=cost,
                      cold_start=st["cold_start_ms"] / 1000)
            stats[name] = st
            if hist:
                raw = tuple(hist.items())
                prev = parsed.get(name)
                if prev is not None and prev[0] == raw:
                    hists[name] = prev[1]  # the same objects: see render()
                    fresh[name] = prev
                    continue
                flat: list[Any] = [0] * _HIST_SIZE
                for k, v in hist.items():
                    i = positions.get(k)
                    if i is not None:
                        flat[i] = v
                got: dict[str, tuple[list[int], float]] = {}
                for metric, lo, hi in _HIST_SPANS:
                    counts = [int(c) for c in flat[lo:hi]]
                    if any(counts):
                        got[metric] = (counts, float(flat[hi]))
                hists[name] = got
                fresh[name] = (raw, got)
        self._parsed = fresh
        self._tenants = tenants_kept
        if self._workers is None:
            return out
        wanted = set(names)
        try:
            workers = self._workers(self.client)
        except BrokerError as exc:  # raised as redis-py's, as the rest of the read
            raise redis.ConnectionError(str(exc)) from exc
        out.workers = [w for w in workers if w.get("queue") in wanted]
        return out

    # -- the families --------------------------------------------------------------
    @staticmethod
    def families(reading: Reading) -> Iterator[Family]:
        """The families of one reading, for :meth:`collect` and :meth:`render`."""
        stats = reading.stats
        q = ("queue",)
        for name, (key, doc) in GAUGES.items():
            yield name, "gauge", doc, q, [((queue,), v[key]) for queue, v in stats.items()]
        for name, (key, doc) in COUNTERS.items():
            yield name, "counter", doc, q, [((queue,), v[key]) for queue, v in stats.items()]
        for metric, (name, doc) in HISTOGRAMS.items():
            le = _LE[metric]
            rows = []
            for queue, hists in reading.hists.items():
                got = hists.get(metric)
                if got is not None:
                    rows.append(((queue,), got, le))
            yield name, "histogram", doc, q, rows
        yield from tenant_families(reading.tenants)
        yield from _worker_families(reading.workers)

    def _timed_read(self) -> tuple[Reading | None, float]:
        """A scrape's reading (None: Redis could not be read, logged) and its seconds."""
        started = time.perf_counter()
        try:
            reading: Reading | None = self.read()
        except (redis.RedisError, redis.exceptions.RedisClusterException) as exc:
            log.warning("scrape could not read Redis: %s", exc)
            reading = None
        return reading, time.perf_counter() - started

    def collect(self) -> Iterable[Metric]:
        reading, read_s = self._timed_read()
        if reading is not None:
            for name, kind, doc, labels, rows in self.families(reading):
                yield _metric(name, kind, doc, labels, rows)
        yield GaugeMetricFamily("mtq_up", "1 if this scrape read Redis, else 0.",
                                value=0 if reading is None else 1)
        yield GaugeMetricFamily("mtq_scrape_duration_seconds",
                                "Seconds this scrape spent reading Redis.",
                                value=read_s)

    def render(self) -> bytes:
        """The text exposition format (0.0.4) of :meth:`collect`'s families, written
        directly (see the module's docstring)."""
        reading, read_s = self._timed_read()
        out: list[str] = []
        add = out.append
        written, kept = self._written, {}
        if reading is not None:
            label_text: dict[tuple[str, ...], str] = {}
            for name, kind, doc, names, rows in self.families(reading):
                doc_text = doc.replace("\\", "\\\\").replace("\n", "\\n")
                shown = name + "_total" if kind == "counter" else name
                add(f"# HELP {shown} {doc_text}\n# TYPE {shown} {kind}\n")
                for row in rows:
                    values = row[0]
                    lab = label_text.get(values)
                    if lab is None:
                        lab = label_text[values] = ",".join(
                            f'{n}="{_escape(v)}"' for n, v in zip(names, values))
                    if kind == "histogram":
                        _, got, le = row
                        key = (name, lab)
                        prev = written.get(key)
                        if prev is not None and prev[0] is got:  # unchanged since
                            text = prev[1]
                        else:
                            text = _template(name, le).format(lab, _num(got[1]),
                                                              *_cumulative(got[0]))
                        kept[key] = (got, text)
                        add(text)
                    else:
                        v = row[1]
                        add(f"{shown}{{{lab}}} {v if type(v) is int else _num(v)}\n")
        self._written = kept
        add("# HELP mtq_up 1 if this scrape read Redis, else 0.\n# TYPE mtq_up gauge\n"
            f"mtq_up {0 if reading is None else 1}\n")
        add("# HELP mtq_scrape_duration_seconds Seconds this scrape spent reading Redis.\n"
            "# TYPE mtq_scrape_duration_seconds gauge\n"
            f"mtq_scrape_duration_seconds {_num(read_s)}\n")
        return "".join(out).encode()


@functools.cache
def _template(name: str, le: tuple[str, ...]) -> str:
    """The text of one histogram series, for str.format(labels, sum, *cumulative counts):
    one call per series, not one per bucket."""
    lines = [f'{name}_bucket{{{{{{0}},le="{b}"}}}} {{{i + 2}}}\n' for i, b in enumerate(le)]
    lines.append(f"{name}_count{{{{{{0}}}}}} {{{len(le) + 1}}}\n{name}_sum{{{{{{0}}}}}} {{1}}\n")
    return "".join(lines)


def _metric(name: str, kind: str, doc: str, labels: tuple[str, ...], rows: list[Any]) -> Metric:
    m: Any
    if kind == "histogram":
        m = HistogramMetricFamily(name, doc, labels=list(labels))
        for values, (counts, total), le in rows:
            m.add_metric(list(values), list(zip(le, _cumulative(counts))), total)
    else:
        m = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
            name, doc, labels=list(labels))
        for values, value in rows:
            m.add_metric(list(values), value)
    return m


def _worker_families(workers: list[dict[str, Any]]) -> Iterator[Family]:
    states: dict[tuple[str, str], int] = {}
    batch, busy, restarts, tasks, memory = [], [], [], [], []
    for w in workers:
        labels = tuple(str(w.get(k) if k != "worker" else w.get("id")) for k in WORKER_LABELS)
        key = (str(w.get("queue")), str(w.get("state")))
        states[key] = states.get(key, 0) + 1
        counts = [0] * len(_BATCH_LE)
        total = 0
        for size, n in (w.get("histogram") or {}).items():
            size, n = int(size), int(n)
            counts[min(max(0, (size - 1).bit_length()), len(BATCH_BOUNDS))] += n
            total += size * n
        batch.append((labels, (counts, total), _BATCH_LE))
        busy.append((labels, float(w.get("busy_s", w.get("predict_s", 0.0)) or 0.0)))
        restarts.append((labels, int(w.get("restarts") or 0)))
        tasks.append((labels, int(w.get("tasks") or 0)))
        for kind, v in (w.get("memory") or {}).items():
            memory.append(((*labels, str(kind)), int(v)))
    yield ("mtq_workers", "gauge", "Live worker processes by state (absent: none).",
           ("queue", "state"), [(k, n) for k, n in sorted(states.items())])
    yield ("mtq_worker_batch_size", "histogram", "Batch sizes a worker process ran (for a "
           "generator: running requests per step).", WORKER_LABELS, batch)
    yield ("mtq_worker_busy_seconds", "counter", "Seconds a worker process spent running "
           "its model (predict; prefill and decode steps); busy fraction: "
           "rate(mtq_worker_busy_seconds_total[1m]).", WORKER_LABELS, busy)
    yield ("mtq_worker_restarts", "counter", "Times the supervisor restarted this worker's "
           "slot (0 without a supervisor).", WORKER_LABELS, restarts)
    yield ("mtq_worker_tasks", "counter", "Tasks a worker process took to run.",
           WORKER_LABELS, tasks)
    yield ("mtq_worker_device_memory_bytes", "gauge", "Device memory of a CUDA worker "
           "process (kind: allocated, reserved, total).", (*WORKER_LABELS, "kind"), memory)


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per scrape would flood the log


def make_exporter(collector: MtqCollector, host: str = "127.0.0.1",
                  port: int = DEFAULT_PORT) -> WSGIServer:
    """An HTTP server (not yet serving: call ``serve_forever``) answering every path
    with the collector's metrics in Prometheus' text format (:meth:`MtqCollector.render`).
    Raises OSError when the address cannot be bound (a port in use)."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        body = collector.render()
        start_response("200 OK", [("Content-Type", CONTENT_TYPE),
                                  ("Content-Length", str(len(body)))])
        return [body]

    return make_server(host, port, app, server_class=_Server, handler_class=_QuietHandler)


def registry_of(collector: MtqCollector) -> CollectorRegistry:
    """A prometheus_client registry holding only ``collector`` (for
    ``generate_latest`` or an app's own exporter)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


__all__ = ["BATCH_BOUNDS", "COUNTERS", "DEFAULT_PORT", "GAUGES", "HISTOGRAMS", "MtqCollector",
           "Reading", "WorkerReader", "exporter_client", "known_queues", "make_exporter",
           "registry_of"]
