"""A worker's wind-down once its model loop ended: its threads joined, what it holds
given back, its last records written, its registry entry removed.

Each step talks to Redis. With Redis there, the steps take milliseconds. With Redis
away at the stop (one PING, sent once, answered within :data:`CHECK_TIMEOUT_S`), the
worker says so in one line and gives the wind-down one lease (the queue's
``lease_ms``) in all: its publisher goes on trying to record the running batch's
results, and every step after it is sent once, not retried. What is not recorded by
then returns to the queue when its lease expires (its result is fenced off: another
worker runs the task again), as a forced stop would leave it; the process exits. A
supervisor bounds its own stop the same way (:mod:`mtq.workers.stops`); this bounds
a bare ``mtq worker run`` and each process of a supervisor.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from mtq.broker import registry
from mtq.broker.connection import client_url, open_client, safe_url, single_attempt
from mtq.errors import BrokerError
from mtq.settings import RedisSettings

log = logging.getLogger("mtq.workers.worker")

#: how long the PING at the stop may take before Redis counts as away (s)
CHECK_TIMEOUT_S = 0.5


def redis_away(w: Any) -> str:
    """Why Redis does not answer now ('' if it does): one PING, sent once."""
    client = w.consumer.redis
    url = client_url(client)
    if url is not None:  # a connection of its own, with a short timeout
        client = open_client(url, RedisSettings(url=url, socket_timeout=CHECK_TIMEOUT_S,
                                                connect_timeout=CHECK_TIMEOUT_S), None)
    try:
        with single_attempt():
            client.ping()
    except Exception as exc:  # any failure to answer: away
        return str(exc) or type(exc).__name__
    finally:
        if url is not None:
            client.close()
    return ""


def wind_down(w: Any) -> None:
    """After the model loop of ``w`` (a :class:`mtq.workers.worker.Worker`, which
    imports this module): join its threads, give back, write the last records."""
    threads = w.threads
    deadline: float | None = None
    away = redis_away(w)
    if away:
        lease_s = w.heartbeat.lease_ms() / 1000
        deadline = time.monotonic() + lease_s
        url = client_url(w.consumer.redis)
        log.warning("stopping with Redis at %s unreachable (%s): waiting at most %g s (the "
                    "lease) to record the running batch's results; what is not recorded by "
                    "then returns to the queue when its lease expires",
                    safe_url(url) if url else "its address", away, lease_s)

    def left(cap: float) -> float:
        return cap if deadline is None else max(0.0, min(cap, deadline - time.monotonic()))

    once = single_attempt() if away else contextlib.nullcontext()
    threads[0].join(timeout=left(10))  # the fetcher may hold a claim in flight
    with once:
        w.fetcher.retire()
    if w.outlet is not None:
        w.outlet.close()
    w.publisher.close()
    threads[1].join(timeout=left(30))
    if away and threads[1].is_alive():
        log.warning("Redis did not come back within the lease: stopping without recording "
                    "what the publisher holds (those tasks return when their leases expire)")
    w.heartbeat.stop.set()
    threads[2].join(timeout=left(5))
    w.aborts.close()
    with once:
        try:
            w.heartbeat.flush_stats()
            w.batchlog.flush(w.consumer.redis)  # the last batch records
            registry.remove(w.consumer.redis, w.worker_id)
            w.consumer.clear_interrupts()
        except BrokerError:
            if away:
                log.info("the worker registry and the last records were not written "
                         "(Redis away)")
            else:
                log.warning("could not leave the worker registry", exc_info=True)
        if w._ready:
            try:
                w.ops.catalogue("stopped")
            except BrokerError as exc:
                log.warning("could not record the stop in the model catalogue (%s)", exc)
