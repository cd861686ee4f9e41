"""Waiting for work on several RQ queues without polling and without leaking.

Redis has no blocking command that watches several lists *without popping* (BLPOP
with several keys pops, and a job popped outside the claim script would be lost if
the worker died before it was leased). So each queue gets one waiter thread for the
worker's whole life. A waiter blocks on ``BLMOVE q q LEFT LEFT`` (a rotation of the
head onto itself: no job moves; the call returns as soon as the list is non-empty)
only while the worker's loop is idle; when the loop is busy it waits on an Event and
holds no connection. Each BLMOVE blocks at most :data:`BLOCK_S`, so a stopping
worker's waiters are gone within that time. The worker's connections are therefore
bounded: one per queue for the waiters, plus the loop's and the heartbeat's.
"""

from __future__ import annotations

import logging
import threading

import redis

log = logging.getLogger(__name__)

#: longest single BLMOVE of a waiter (seconds): bounds how long a stopped worker's
#: waiters linger; an idle worker re-issues its BLMOVEs this often (one command per
#: queue, answered by Redis without work while the lists stay empty)
BLOCK_S = 2.0


class Waiters:
    """One waiter thread per queue key, started at construction, until :meth:`close`."""

    def __init__(self, pool: redis.ConnectionPool, keys: list[str], name: str = "mtq-rq",
                 block_s: float = BLOCK_S) -> None:
        self.block_s = block_s
        self._cond = threading.Condition()
        self._gen = 0         # one per idle period of the loop
        self._idle = False    # the loop waits for work now
        self._woke = False    # a waiter saw a job in this idle period
        self._stop = False
        self._threads = [threading.Thread(target=self._run, args=(pool, key),
                                          name=f"{name}-wait-{i}", daemon=True)
                         for i, key in enumerate(keys)]
        for t in self._threads:
            t.start()

    def wait(self, timeout: float) -> bool:
        """Block the caller until one of the queues has a job, or ``timeout`` s; returns
        whether a queue had one. The caller checks the queues first: a job pushed
        between that check and this call is seen (BLMOVE returns at once on a
        non-empty list)."""
        with self._cond:
            self._gen += 1
            self._woke = False
            self._idle = True
            self._cond.notify_all()
            try:
                self._cond.wait_for(lambda: self._woke or self._stop, max(0.0, timeout))
            finally:
                self._idle = False
            return self._woke

    def close(self, timeout: float | None = None) -> None:
        """Stop the waiters; each is gone within its current BLMOVE (``block_s``)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(self.block_s + 1 if timeout is None else timeout)

    @property
    def alive(self) -> int:
        return sum(t.is_alive() for t in self._threads)

    def _run(self, pool: redis.ConnectionPool, key: str) -> None:
        client = redis.Redis(connection_pool=pool)
        fired = 0  # the idle period this waiter already woke the loop in
        while True:
            with self._cond:
                # block (holding no connection) while the loop is busy, or already woken
                while not (self._stop or (self._idle and self._gen != fired)):
                    self._cond.wait()
                if self._stop:
                    return
                gen = self._gen
            failed = False
            try:
                moved = client.blmove(key, key, self.block_s, "LEFT", "LEFT")  # type: ignore[arg-type]
            except redis.RedisError as exc:
                log.debug("waiter on %s: %s", key, exc)
                moved, failed = None, True  # wake the loop: its claim reports the error
            if moved is None and not failed:
                continue
            with self._cond:
                fired = gen
                if self._idle and self._gen == gen:
                    self._woke = True
                    self._cond.notify_all()
            if failed:
                with self._cond:  # back off rather than spin while Redis is down
                    self._cond.wait_for(lambda: self._stop, self.block_s)
