"""Supervised ``mtq rq worker`` processes: ``replicas`` per device, each pinned
(``CUDA_VISIBLE_DEVICES`` set before it starts, see :mod:`mtq.workers.devices`),
restarted with backoff when it dies, and whose jobs are given back to the head of
their queues the moment it dies (by its RQ worker name, through the lease index).
Each process reports what it runs (:mod:`mtq.rq.faults`): a job that was running
each of the last ``max_deliveries`` times a process died is failed rather than given
back (a poison job), and a call that overruns its jobs' ``job_timeout`` by
``hang_grace_s`` (stuck where SIGALRM cannot reach) has its process killed and its
jobs failed with RQ's timeout message.

mtq's own :class:`mtq.workers.supervisor.Supervisor` is built around mtq's broker
(streams, standby processes, quarantine, control channel); an RQ queue has none of
those, so this is a small supervisor of its own that reuses the device pinning.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

from mtq.errors import ConfigError
from mtq.rq.faults import (
    SHARED_SLOTS,
    STARTED,
    TIMEOUT,
    fail_held,
    hang_message,
    poison_message,
    running,
)
from mtq.rq.leases import count_deliveries
from mtq.workers import devices

log = logging.getLogger(__name__)

RESTART_BASE_S, RESTART_MAX_S = 0.1, 30.0
#: a child's exit codes: 0 done (burst, max jobs, stopped), 2 bad configuration (do
#: not restart), 5 Redis unreachable at start
EXIT_OK, EXIT_CONFIG, EXIT_UNREACHABLE = 0, 2, 5
#: how often a running call's time is checked against its timeout (shared memory only)
HANG_CHECK_S = 0.25


def child_main(config: dict[str, Any], conn: Any = None, shared: Any = None) -> None:
    """A worker process: one BatchWorker until stopped (spawned, never forked);
    ``conn`` and ``shared`` are its link to the supervisor (:class:`ChildLink`)."""
    os.environ.update(config.get("env") or {})
    import redis

    from mtq.rq.faults import ChildLink
    from mtq.rq.worker import BatchWorker

    logging.basicConfig(level=config.get("log_level", "INFO"),
                        format=f"%(asctime)s [{config['name']}] %(levelname)s %(message)s")
    if os.environ.get("DJANGO_SETTINGS_MODULE"):
        # a Django project's jobs (django-rq) use its apps and ORM: set it up once, as
        # manage.py rqworker does
        try:
            import django

            django.setup()
        except Exception as exc:
            log.error("DJANGO_SETTINGS_MODULE is set but Django cannot be set up: %s", exc)
            raise SystemExit(EXIT_CONFIG) from None
    try:
        # every connection of the pool carries the worker's name (CLIENT LIST shows them)
        client = redis.Redis.from_url(config["url"], client_name=config["name"])
        client.ping()
    except redis.RedisError as exc:
        log.error("cannot reach Redis at %s: %s", config["url"], exc)
        raise SystemExit(EXIT_UNREACHABLE) from None
    try:
        link = ChildLink(conn, shared) if conn is not None else None
        worker = BatchWorker(config["queues"], name=config["name"], connection=client,
                             link=link, **config["worker"])
    except (ValueError, TypeError) as exc:
        log.error("bad worker configuration: %s", exc)
        raise SystemExit(EXIT_CONFIG) from None
    worker.work(burst=config.get("burst", False), logging_level=config.get("log_level", "INFO"),
                max_jobs=config.get("max_jobs"), with_scheduler=config.get("with_scheduler", False),
                max_idle_time=config.get("max_idle_time"),
                dequeue_strategy=config.get("dequeue_strategy", "default"))
    raise SystemExit(EXIT_OK)


@dataclass
class _Child:
    slot: int
    device: str
    name: str
    process: Any
    started: float
    conn: Any = None     # the supervisor's end of the link's pipe
    shared: Any = None   # the link's shared array (mtq.rq.faults slots)
    order: list[tuple[str, str]] = field(default_factory=list)  # its batch's call order
    hung: tuple[float, float] | None = None  # killed for a hung call: (timeout, waited)


def mark_dead(client: Any, name: str, queues: list[str]) -> None:
    """What RQ's register_death would have written for a worker killed before it could."""
    from rq.worker_registration import REDIS_WORKER_KEYS, WORKERS_BY_QUEUE_KEY

    key = f"rq:worker:{name}"
    with client.pipeline() as pipe:
        pipe.srem(REDIS_WORKER_KEYS, key)
        for q in queues:
            pipe.srem(WORKERS_BY_QUEUE_KEY % q, key)
        pipe.hset(key, "death", time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime()))
        pipe.expire(key, 60)
        pipe.execute()


class RQSupervisor:
    """Runs the worker processes of ``mtq rq worker`` (see the module docstring)."""

    def __init__(self, queues: list[str], url: str, *, devices_spec: str = "cpu",
                 replicas: int = 1, name: str | None = None, burst: bool = False,
                 max_jobs: int | None = None, with_scheduler: bool = False,
                 max_idle_time: int | None = None, dequeue_strategy: str = "default",
                 log_level: str = "INFO", worker: dict[str, Any] | None = None,
                 max_deliveries: int = 3, hang_grace_s: float = 10.0,
                 on_event: Callable[[str], None] | None = None) -> None:
        self.queues = queues
        self.url = url
        self.devices = devices.parse_devices(devices_spec)
        self.replicas = replicas
        self.base = name or f"mtq-{socket.gethostname()}-{os.getpid()}"
        self.burst = burst
        self.max_jobs = max_jobs
        self.with_scheduler = with_scheduler
        if dequeue_strategy not in ("default", "round_robin", "random"):
            raise ConfigError(f"dequeue strategy {dequeue_strategy!r} is not allowed: use "
                             "default, round_robin or random")
        self.max_idle_time = max_idle_time
        self.dequeue_strategy = dequeue_strategy
        self.log_level = log_level
        self.worker = worker or {}
        if max_deliveries < 1:
            raise ConfigError(f"max_deliveries must be >= 1, got {max_deliveries}")
        self.max_deliveries = max_deliveries
        self.hang_grace_s = float(hang_grace_s)
        self.on_event = on_event or (lambda m: log.info("%s", m))
        self.children: dict[int, _Child] = {}
        self.crashes: dict[int, int] = {}
        self.due: dict[int, float] = {}
        self.finished: set[int] = set()
        self.stopping = False
        self.signals = 0
        self.exit_code = 0
        self._ctx = mp.get_context("spawn")
        self._gen = 0
        import redis

        self.client = redis.Redis.from_url(url)
        from mtq.rq.leases import Scripts

        self.scripts = Scripts(self.client)

    def _start(self, slot: int, device: str) -> None:
        self._gen += 1
        name = self.base if self.replicas * len(self.devices) == 1 and self._gen == 1 \
            else f"{self.base}.{slot}.{self._gen}"
        env, local_device = devices.child_env(device)
        worker = {**self.worker, "device": local_device}
        config = {"queues": self.queues, "url": self.url, "name": name, "worker": worker,
                  "burst": self.burst, "max_jobs": self.max_jobs, "env": env,
                  "with_scheduler": self.with_scheduler and slot == 0,
                  "max_idle_time": self.max_idle_time,
                  "dequeue_strategy": self.dequeue_strategy, "log_level": self.log_level}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # a spawned child copies the environment at its start
        ours, theirs = self._ctx.Pipe(duplex=False)
        shared = self._ctx.RawArray("d", SHARED_SLOTS)
        try:
            p = self._ctx.Process(target=child_main, args=(config, theirs, shared), name=name,
                                  daemon=False)
            p.start()
        finally:
            theirs.close()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.children[slot] = _Child(slot, device, name, p, time.monotonic(), ours, shared)
        self.on_event(f"worker {name} (pid {p.pid}) on {device} serving {', '.join(self.queues)}")

    def give_back(self, name: str) -> list[str]:
        """Give back every job the worker ``name`` held, to the head of its queue."""
        from mtq.rq.leases import reap_worker

        back: list[str] = []
        for q in self.queues:
            back += reap_worker(self.scripts, self.client, q, name)
        return back

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.signals += 1
        self.stopping = True
        for c in self.children.values():
            try:
                os.kill(c.process.pid, signal.SIGKILL if self.signals > 1 else signal.SIGTERM)
            except (ProcessLookupError, TypeError):
                pass

    def run(self) -> int:
        """Supervise until every child is done (burst, max jobs) or a signal stops it;
        returns the exit code (0, or 2 / 5 when the children cannot start)."""
        prev = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        slots = [(i, d) for i, d in enumerate(
            d for d in self.devices for _ in range(self.replicas))]
        try:
            for slot, device in slots:
                self._start(slot, device)
            while self.children or (not self.stopping and self.due):
                now = time.monotonic()
                for slot, when in list(self.due.items()):
                    if when <= now and not self.stopping:
                        del self.due[slot]
                        self._start(slot, dict(slots)[slot])
                timeout = max(0.0, min(self.due.values()) - now) if self.due else None
                watch = self._check_hangs(now)
                if watch is not None:
                    timeout = watch if timeout is None else min(timeout, watch)
                sentinels = {c.process.sentinel: c for c in self.children.values()}
                if not sentinels:
                    time.sleep(timeout or 0.1)
                    continue
                conns = {c.conn: c for c in self.children.values() if c.conn is not None}
                ready = wait([*sentinels, *conns], timeout)
                for r in ready:
                    if r in conns:
                        self._read(conns[r])
                for r in ready:
                    if r in sentinels:
                        self._reap(sentinels[r])
        finally:
            for s, h in prev.items():
                signal.signal(s, h)
        return self.exit_code

    def _read(self, c: _Child) -> None:
        """The child's messages: the call order of each batch it starts."""
        try:
            while c.conn.poll():
                kind, body = c.conn.recv()
                if kind == "batch":
                    c.order = body
        except (EOFError, OSError):
            c.conn.close()
            c.conn = None

    def _check_hangs(self, now: float) -> float | None:
        """Kill a child whose call overran its timeout by the grace (SIGALRM could not
        stop it); returns how long the loop may wait before the next check. A call's
        start is only written to shared memory (nothing per call crosses the pipe), so
        while children live the loop looks every HANG_CHECK_S: a read of local memory."""
        nxt: float | None = None
        for c in self.children.values():
            if c.shared is None or c.hung is not None:
                continue
            nxt = HANG_CHECK_S
            started, timeout = c.shared[STARTED], c.shared[TIMEOUT]
            if not started or timeout <= 0:
                continue
            waited = now - started
            if waited >= timeout + self.hang_grace_s and c.shared[STARTED] == started:
                c.hung = (timeout, waited)
                self.on_event(f"worker {c.name}: a call of job_timeout {timeout:.0f} s still "
                              f"runs after {waited:.1f} s (SIGALRM could not stop it); "
                              "killing the process")
                try:
                    os.kill(c.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        return nxt

    def _settle_running(self, c: _Child) -> str:
        """What the dead child was running: count (poison) or fail (hung) those jobs."""
        if c.conn is not None:
            self._read(c)
        run = running(c.order, c.shared) if c.shared is not None else []
        if not run:
            return ""
        by_queue: dict[str, list[str]] = {}
        for qname, job_id in run:
            by_queue.setdefault(qname, []).append(job_id)
        failed: list[str] = []
        for qname, ids in by_queue.items():
            if c.hung is not None:
                msg = hang_message(*c.hung)
                failed += [i for i in ids if fail_held(self.client, qname, c.name, i, msg)]
                continue
            counts = count_deliveries(self.scripts, qname, c.name, ids, len(run))
            for job_id, n in counts.items():
                # only a call that ran it alone convicts a job: in a batched call the
                # innocent share its deaths, and are split off (half the call each time)
                if n >= self.max_deliveries and len(run) == 1 and fail_held(
                        self.client, qname, c.name, job_id, poison_message(n)):
                    failed.append(job_id)
        if not failed:
            return ""
        why = "timed out" if c.hung is not None else \
            f"was running each of the last {self.max_deliveries} times a worker died"
        return f"; failed {len(failed)} job(s) that {why}: {', '.join(failed[:10])}"

    def _reap(self, c: _Child) -> None:
        c.process.join()
        code = c.process.exitcode
        del self.children[c.slot]
        try:
            settled = self._settle_running(c)
        except Exception:
            log.warning("could not settle the running jobs of worker %s; they go back to "
                        "the queue", c.name, exc_info=True)
            settled = ""
        if c.conn is not None:
            c.conn.close()
        back = self.give_back(c.name)
        if code != 0:
            try:
                mark_dead(self.client, c.name, self.queues)
            except Exception:
                log.warning("could not mark worker %s dead in RQ's registry", c.name)
        gave = settled + (f"; gave back {len(back)} job(s) to the head of the queue"
                          if back else "")
        if code == 0 or self.stopping:
            self.on_event(f"worker {c.name} exited ({code}){gave}")
            self.finished.add(c.slot)
            return
        if code in (EXIT_CONFIG, EXIT_UNREACHABLE):
            self.on_event(f"worker {c.name} cannot start (exit {code}); stopping")
            self.exit_code = code
            self.stopping = True
            self._on_signal(signal.SIGTERM, None)
            self.signals -= 1
            return
        lived = time.monotonic() - c.started
        crashes = 0 if lived > 60 else self.crashes.get(c.slot, 0) + 1
        self.crashes[c.slot] = crashes
        delay = min(RESTART_MAX_S, RESTART_BASE_S * 2 ** max(0, crashes - 1))
        self.on_event(f"worker {c.name} died (exit {code}){gave}; restarting in {delay:.1f} s")
        self.due[c.slot] = time.monotonic() + delay
