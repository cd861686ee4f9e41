"""How a supervisor's stop ends, whatever Redis does.

A stop gives back what its processes held: a dead process's tasks, the suspects
waiting for the quarantine process. Each of those calls to Redis would, with Redis
gone, retry for seconds (redis-py's retry, then the process's connections looked for
in ``CLIENT LIST``), one process after another; with Redis hung, wait a socket
timeout each. So, once a stop began, :class:`Stops` runs them in a thread of its
own, which the stop waits for only within its bounds (retried as ever during a
graceful stop, each command sent once in a forced one):

* The first give-back that cannot reach Redis marks Redis away: that one and every
  later one is left to lease expiry at once (the tasks go back to their queue when
  their leases expire, that delivery counted, as after a crash), and the stop ends
  with one line naming how many tasks were left to their leases.
* A forced stop (the second signal) waits at most :data:`FORCED_STOP_S` for its
  give-backs; what is not given back by then is left to lease expiry too.
* A graceful stop (the first signal) checks that Redis answers, at the signal and
  every :data:`CHECK_EVERY_S` after. Finding it away, it says so and waits at most one
  lease (the longest ``lease_ms`` of its queues: after that the tasks are another
  worker's anyway) for Redis to come back and its processes to finish, then goes on
  as a forced stop. Redis answering again before then lifts that bound (the running
  batches keep their leases again): it waits for them as with Redis up.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from mtq.broker.connection import client_url, open_client, safe_url, single_attempt
from mtq.broker.consumer import Consumer
from mtq.errors import BrokerError, RedisUnavailable
from mtq.settings import RedisSettings
from mtq.workers import children
from mtq.workers.children import Child

log = logging.getLogger("mtq.workers.supervisor")  # the supervisor's log, as its users read it

#: how long a forced stop waits for its give-backs before it leaves the rest to their
#: leases (the stop returns within about this, plus the processes' kill)
FORCED_STOP_S = 1.0
#: how often a graceful stop checks that Redis answers
CHECK_EVERY_S = 1.0
#: how long that check waits for Redis's answer (connect and reply)
CHECK_TIMEOUT_S = 0.5


class Stops:
    """A supervisor's stop: its give-backs, their bounds, and what it says of them."""

    def __init__(self, consumers: Sequence[Consumer], *, on_event: Callable[[str], None],
                 poke: Callable[[], None]) -> None:
        self.consumers = consumers
        self.on_event = on_event
        #: a graceful stop with Redis away waits at most this long (read at start, and
        #: again while a graceful stop finds Redis answering)
        self.lease_s = 0.0
        self._read_lease()
        #: wakes the supervisor's loop (a give-back ended, Redis was found away)
        self.poke = poke
        self.begun = False
        self.forced_at: float | None = None
        #: a graceful stop found Redis away: it is forced at this time
        self.deadline: float | None = None
        #: why a give-back could not reach Redis (the later ones are not tried)
        self.away = ""
        #: why the graceful stop's check could not reach Redis
        self.unreachable = ""
        #: the error Redis answered a give-back with (that one left to its leases)
        self.refused = ""
        self._news: list[str] = []
        self.left = 0           # tasks left to their leases
        self.left_from = 0      # processes (or suspect lists) they were held by
        self._pending = 0
        self._pending_tasks = 0
        self._lock = threading.Lock()
        self._jobs: queue.Queue[tuple[Callable[[], Any], int]] = queue.Queue()

    def _read_lease(self) -> None:
        """The longest lease of its queues (their settings, read from Redis if not read
        yet or read long ago: call it while Redis answers)."""
        self.lease_s = max(c.lease_s() for c in self.consumers)

    # -- the supervisor's calls --------------------------------------------------------
    def begin(self, force: bool) -> None:
        """A stop began (``force``: the second signal); its give-backs go to the stop's
        thread from now on."""
        if not self.begun:
            self.begun = True
            threading.Thread(target=self._work, name="mtq-stop-give-backs",
                             daemon=True).start()
            if not force:
                threading.Thread(target=self._check, name="mtq-stop-check",
                                 daemon=True).start()
        if force and self.forced_at is None:
            self.forced_at = time.monotonic()

    def give_back(self, consumers: Sequence[Consumer], c: Child, elsewhere: Collection[str],
                  code: int | None) -> None:
        """Give back a dead process's tasks and drop it from the registry: at once
        (retried) while no stop runs, else in the stop's thread (retried in a graceful
        stop, each command sent once in a forced one)."""
        if not self.begun:
            children.give_back(consumers, c, elsewhere)
            children.unregister(consumers, c, code)
            return
        held = sum(len(e.held) for e in c.engines) if not c.spare else 0
        skip = set(elsewhere)

        def job() -> None:
            children.give_back(consumers, c, skip, strict=True)
            children.unregister(consumers, c, code)
        self._later(job, held)

    def release(self, consumer: Consumer, leases: list[tuple[str, str]]) -> None:
        """Give claimed-but-unrun tasks (suspects) back uncounted: at once (retried,
        a failure logged) while no stop runs, else in the stop's thread."""
        if not leases:
            return
        if self.begun:
            self._later(lambda: consumer.release_leases(leases), len(leases))
            return
        try:
            consumer.release_leases(leases)
        except BrokerError:
            log.warning("could not give back %d suspect(s); they return when their "
                        "leases expire", len(leases), exc_info=True)

    def settled(self, now: float) -> bool:
        """Whether the loop may end as far as the give-backs go: none pending, or a
        forced stop's bound passed."""
        with self._lock:
            if not self._pending:
                return True
        return self.forced_at is not None and now >= self.forced_at + FORCED_STOP_S

    def overdue(self, now: float) -> bool:
        """A graceful stop with Redis away waited its bound: it is to be forced."""
        return self.forced_at is None and self.deadline is not None and now >= self.deadline

    def next_in(self, now: float) -> float | None:
        """Seconds until the loop has something to do for the stop; None: nothing."""
        if self.forced_at is not None:
            with self._lock:
                pending = self._pending
            return max(0.0, self.forced_at + FORCED_STOP_S - now) if pending else None
        if self.deadline is not None:
            return max(0.0, self.deadline - now)
        return None

    def news(self) -> list[str]:
        """What the stop's threads have to say (said by the loop, on its thread)."""
        with self._lock:
            out, self._news = self._news, []
        return out

    def finish(self) -> None:
        """The stop ends: one line for the tasks it left to their leases."""
        with self._lock:
            pending = self._pending
            left, n = self.left + self._pending_tasks, self.left_from + pending
            self.left = self._pending_tasks = self._pending = 0
        if not n:
            return
        away = self.away or self.unreachable
        whys = [f"Redis unreachable: {away}"] if away else []
        if self.refused:
            whys.append(f"Redis refused: {self.refused}")
        if (pending and not away) or not whys:
            whys.append(f"Redis did not answer within {FORCED_STOP_S:g} s")
        why = "; ".join(whys)
        self.on_event(f"{left} task(s) of {n} process(es) left to their leases ({why}); "
                      f"they go back to their queue as their leases expire (within "
                      f"{self.lease_s:g} s of Redis answering), that delivery counted")

    # -- its threads -------------------------------------------------------------------
    def _later(self, job: Callable[[], Any], tasks: int) -> None:
        with self._lock:
            self._pending += 1
            self._pending_tasks += tasks
        self._jobs.put((job, tasks))

    def _work(self) -> None:
        while True:
            job, tasks = self._jobs.get()
            left = bool(self.away)
            if not left:
                try:
                    if self.forced_at is None:  # retried (a blip): the lease bounds it
                        job()
                    else:
                        with single_attempt():
                            job()
                except RedisUnavailable as exc:
                    self._found_away(exc)
                    left = True
                except BrokerError as exc:  # Redis answered, with an error: this one only
                    log.warning("could not give back a stopping process's tasks; they "
                                "return when their leases expire", exc_info=True)
                    self.refused = self.refused or str(exc.__cause__ or exc)
                    left = True
            with self._lock:
                self._pending -= 1
                self._pending_tasks -= tasks
                if left:
                    self.left += tasks
                    self.left_from += 1
            self.poke()

    def _found_away(self, exc: BaseException) -> None:
        if not self.away:
            self.away = str(exc.__cause__ or exc)
            log.debug("stop: Redis away", exc_info=True)

    def _check(self) -> None:
        """A graceful stop: ask Redis for a PING now and every CHECK_EVERY_S, until
        the stop is forced or ends (a daemon thread). A failure sets the stop's
        deadline (one lease from then); an answer after one clears it: the running
        batches' leases are kept again, so the stop waits for them as ever."""
        client = self.consumers[0].redis
        url = client_url(client)
        if url is not None:
            client = open_client(url, RedisSettings(url=url, socket_timeout=CHECK_TIMEOUT_S,
                                                    connect_timeout=CHECK_TIMEOUT_S), None)
        where = safe_url(url) if url else "its address"
        while self.forced_at is None:
            try:
                with single_attempt():
                    client.ping()
                    if self.deadline is None:
                        self._read_lease()
            except Exception as exc:  # any failure to answer: away
                if self.deadline is None:
                    self.unreachable = str(exc)
                    self.deadline = time.monotonic() + self.lease_s
                    self._say(f"stopping with Redis at {where} unreachable ({exc}): waiting "
                              f"at most {self.lease_s:g} s (the lease) for it and the "
                              "running batches, then forcing the stop")
            else:
                if self.deadline is not None and self.forced_at is None:
                    self.deadline = None
                    self.unreachable = ""
                    self._say(f"Redis at {where} answers again: waiting for the running "
                              "batches")
            time.sleep(CHECK_EVERY_S)

    def _say(self, line: str) -> None:
        with self._lock:
            self._news.append(line)
        self.poke()
