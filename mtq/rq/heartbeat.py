"""The heartbeat thread of a :class:`mtq.rq.worker.BatchWorker`: every third of a
lease it extends the leases of the jobs held (noting those lost), beats RQ's worker
and execution heartbeats, and gives back the jobs of the worker's queues whose lease
expired (a frozen or killed worker's). At the end of the loop, the jobs claimed and
not started are given back.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import redis

from mtq.rq import leases
from mtq.rq.claims import Claims

if TYPE_CHECKING:
    from rq.worker import SimpleWorker as _Base
else:
    _Base = object


class Heartbeat(_Base):
    """The heartbeat half of BatchWorker (a mixin: it uses the worker's connection,
    name, queues and the claims it holds)."""

    scripts: leases.Scripts
    claims: Claims
    lease_ms: int
    _beat_stop: threading.Event

    def _beat_loop(self) -> None:
        interval = max(0.05, min(self.lease_ms / 1000 / 3, 5.0))
        while not self._beat_stop.wait(interval):
            try:
                self._beat()
            except Exception:
                self.log.warning("Worker %s: heartbeat failed", self.name, exc_info=True)

    def _beat(self) -> None:
        claims = self.claims
        with claims.lock:
            held = dict(claims.held)
            running = list(claims.running.values())
        t0 = time.monotonic()
        lost: set[str] = set()
        for qname, pairs in Claims.by_queue(held.items()).items():
            lost |= leases.extend(self.scripts, qname, pairs, self.lease_ms)
        with claims.lock:
            claims.lost |= lost
            if held:
                claims.vouch(t0, self.lease_ms)
        with self.connection.pipeline(transaction=False) as pipe:
            self.heartbeat(self.job_monitoring_interval + 60, pipeline=pipe)
            for p in running:
                if p.execution is not None and p.job.id not in lost:
                    ttl = int(self.get_heartbeat_ttl(p.job))
                    p.execution.heartbeat(p.job.started_job_registry, ttl, pipeline=pipe)
            pipe.execute()
        for q in self.queues:
            back = leases.reap_expired(self.scripts, self.connection, q.name)
            if back:
                self.log.warning("Worker %s: gave back %d job(s) of %s whose lease expired "
                                 "(a frozen or dead worker): %s", self.name, len(back), q.name,
                                 ", ".join(back[:10]))

    def _give_back_unstarted(self) -> None:
        claims = self.claims
        with claims.lock:
            held = {k: v for k, v in claims.held.items() if k not in claims.running}
            claims.held = {k: v for k, v in claims.held.items() if k in claims.running}
        for qname, pairs in Claims.by_queue(held.items()).items():
            try:
                leases.give_back(self.scripts, qname, pairs)
            except redis.RedisError:
                self.log.warning("Worker %s: could not give back %d job(s); their leases "
                                 "expire instead", self.name, len(pairs))
