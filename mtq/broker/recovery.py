"""Giving tasks back: released unstarted, or requeued when their process died.

A worker releases what it claimed and will not run (a pause, a drain, a stop); a
supervisor gives back what a dead child held, once Redis has closed that child's
connections (:func:`wait_disconnected`), so that no claim of it can still run. Each
is one nack call (nack.lua's ``release`` and ``requeue`` actions);
:class:`mtq.broker.consumer.Consumer` offers them as methods.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence

import redis

from mtq.broker.protocol import RELEASE, REQUEUE, Broker

log = logging.getLogger(__name__)

#: how often :func:`wait_disconnected` asks Redis again (s)
POLL_S = 0.005


def give_back(broker: Broker, running: Sequence[tuple[str, str]],
              rest: Sequence[tuple[str, str]], reason: str) -> list[int]:
    """The process holding these (id, token) tasks died or was killed; put them back
    now instead of waiting for their leases, in one round trip.

    ``running`` (the items of the predict call it died in) go back with the delivery
    counted, dead as poison at ``max_deliveries``; ``rest`` (claimed, not started) go
    back uncounted. Both go to the head of their streams, the running ones in front,
    since they were claimed first. One code per task (see nack.lua).
    """
    arg = f"{broker.settings.max_deliveries}|{reason}"
    items = [(i, t, RELEASE, "") for i, t in reversed(rest)]
    items += [(i, t, REQUEUE, arg) for i, t in reversed(running)]
    return broker.nack(items) if items else []


def give_back_all(broker: Broker, worker: str, running: Sequence[tuple[str, str]],
                  rest: Sequence[tuple[str, str]], reason: str,
                  skip: Collection[str] = ()) -> list[int]:
    """:func:`give_back` for a worker process that died, plus every task Redis still
    shows running under its id ``worker`` that the caller did not know of (a claim
    answered just before the process died, before it could report it): those were
    never started, so they go back uncounted; ``skip``: ids another process runs now
    (a suspect handed to the quarantine process). Call it once the process's
    connections are gone (:func:`wait_disconnected`), so no claim of it can still run
    after this. Its idle registration is dropped first, so that no submit hands it
    anything more; what was handed to it is running under its id, and goes back with
    the rest. Three round trips, the second O(running tasks of the queue)."""
    broker.retire(worker)
    known = {i for i, _ in running} | {i for i, _ in rest} | set(skip)
    unknown = [(i, t) for i, t in broker.orphans(worker) if i not in known]
    if unknown:
        log.info("worker %s died with %d task(s) claimed but not reported; giving "
                 "them back", worker, len(unknown))
    return give_back(broker, running, [*rest, *unknown], reason)


def release_leases(broker: Broker, leases: Sequence[tuple[str, str]]) -> int:
    """Give (id, token) tasks claimed but not started back to the head of their
    streams, without counting a delivery. Returns how many went back."""
    return sum(1 for c in give_back(broker, [], leases, "") if c == 1)


def wait_disconnected(client: redis.Redis, name: str, timeout: float = 1.0) -> bool:
    """Wait until Redis has closed every connection named ``name`` (see
    :func:`mtq.broker.connection.connect`): a command a dead process sent before it
    died has then run. Redis has no blocking call for this, so it asks again every
    :data:`POLL_S`; a killed process's connections are normally gone at the first
    look. Returns False on timeout, or when the server does not allow CLIENT LIST (an
    ACL user without it), after one look or none."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            clients = client.client_list()
        except redis.exceptions.RedisError:
            return False
        if not any(c.get("name") == name for c in clients):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
