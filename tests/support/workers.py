"""Workers for the tests: an in-process :class:`~mtq.workers.worker.Worker` run in a
thread (:class:`Running`, :func:`serving`), a model that records its calls
(:class:`Recorder`), and ``mtq worker run`` processes waited for in the registry."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis

import mtq
from mtq.settings import QueueSettings
from mtq.workers import registry
from mtq.workers.model import FunctionModel, Model
from mtq.workers.worker import Worker
from tests.support.paths import PY
from tests.support.waits import wait_for

#: a lease short enough for the heartbeat (every lease/3) to beat twice a second
FAST = QueueSettings(lease_ms=1500, retry_backoff_ms=0)


class Running:
    """A Worker whose run() is going in a thread."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.totals: dict[str, int] | None = None
        self.error: BaseException | None = None

        def body() -> None:
            try:
                self.totals = worker.run()
            except BaseException as exc:
                self.error = exc

        self.thread = threading.Thread(target=body, name="test-worker", daemon=True)
        self.thread.start()

    def join(self, timeout: float = 20.0) -> dict[str, int]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "Worker.run() did not return"
        if self.error is not None:
            raise self.error
        alive = [t.name for t in self.worker.threads if t.is_alive()]
        assert not alive, f"worker threads still running after run() returned: {alive}"
        assert self.totals is not None
        return self.totals

    def stop(self, timeout: float = 20.0) -> dict[str, int]:
        self.worker.stop()
        return self.join(timeout)


@contextmanager
def serving(worker: Worker, *gates: threading.Event) -> Iterator[Running]:
    """Run the worker; on the way out open any gates and stop it (bounded)."""
    running = Running(worker)
    try:
        yield running
    finally:
        for g in gates:
            g.set()
        if running.thread.is_alive():
            running.stop()


class Recorder(Model):
    """Records every predict call; ``fn`` maps a payload to its result; ``gate``
    (when set) holds the first call until released."""

    name = "recorder"
    version = "7"
    max_batch_size = 32
    max_wait_ms = 0.0

    def __init__(self, fn: Callable[[Any], Any] | None = None, *,
                 gate: threading.Event | None = None, fail_if: Callable[[Any], bool] | None = None,
                 max_batch_size: int | None = None, max_wait_ms: float | None = None) -> None:
        self.fn = fn or (lambda p: p)
        self.gate = gate
        self.fail_if = fail_if
        self.calls: list[list[Any]] = []
        self.times: list[float] = []
        self.started = threading.Event()
        self.lock = threading.Lock()
        if max_batch_size is not None:
            self.max_batch_size = max_batch_size  # type: ignore[misc]
        if max_wait_ms is not None:
            self.max_wait_ms = max_wait_ms  # type: ignore[misc]

    def predict(self, batch: list[Any]) -> list[Any]:
        with self.lock:
            self.calls.append(list(batch))
            self.times.append(time.monotonic())
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(20), "test gate never opened"
        if self.fail_if is not None and any(self.fail_if(p) for p in batch):
            raise ValueError("bad payload in batch")
        return [self.fn(p) for p in batch]

    def seen(self) -> list[Any]:
        with self.lock:
            return [p for call in self.calls for p in call]


def make_worker(model: Model | str, qname: str, url: str,
                settings: QueueSettings | None = None, **kw: Any) -> Worker:
    return Worker(model, qname, url=url, settings=settings or FAST, **kw)


def serve_one(url: str, queue: str) -> None:
    """A task submitted, run by a worker in this process, its result waited for."""
    q = mtq.Queue(queue, url)
    t = q.submit({"x": 21})
    w = Worker(FunctionModel(lambda p: p["x"] * 2), queue, url=url)
    runner = threading.Thread(target=w.run, daemon=True)
    runner.start()
    try:
        assert t.result(timeout=15) == 42
    finally:
        w.stop()
        runner.join(15)


@contextmanager
def registered_worker(target: str, qname: str, env: dict[str, str], log: Path, *extra: str
                      ) -> Iterator[subprocess.Popen[bytes]]:
    """A ``mtq worker run`` process serving ``target``, in the registry before it yields;
    ``MTQ_TEST_LOG`` (the handlers' and models' call log) is ``log``."""
    out = (log.parent / f"{log.name}.{target.replace(':', '-')}.out").open("ab")
    proc = subprocess.Popen([PY, "-m", "mtq", "worker", "run", target, "--queue",
                             qname, *extra], env={**env, "MTQ_TEST_LOG": str(log)},
                            stdout=out, stderr=subprocess.STDOUT)
    r = redis.Redis.from_url(env["MTQ_REDIS_URL"])
    try:
        wait_for(lambda: [w for w in registry.list_workers(r, qname) if w["pid"] == proc.pid],
                 30, "the worker process never appeared in the registry")
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        out.close()
        r.close()
