"""Job functions for tests/integration/test_rq_worker.py (importable by rq and mtq workers)."""

from __future__ import annotations

import os
import time

import redis
from rq import Retry, get_current_job

import mtq
import mtq.rq


def _r() -> redis.Redis:
    return redis.Redis.from_url(os.environ["MTQ_TEST_REDIS_URL"])


def noop() -> None:
    return None


def add(a: int, b: int) -> int:
    return a + b


def boom(msg: str = "boom") -> None:
    raise ValueError(msg)


def record(key: str, tag: str, sleep_s: float = 0.0) -> str:
    """Appends this job's id to the list ``key`` (a side effect to count), after a sleep."""
    if sleep_s:
        time.sleep(sleep_s)
    job = get_current_job()
    _r().rpush(key, f"{tag}:{job.id if job else '?'}")
    return tag


def flaky(key: str) -> str:
    """Fails the first time it runs for ``key``, succeeds after."""
    if _r().incr(key) == 1:
        raise RuntimeError("first try fails")
    return "ok"


def retry_once(key: str) -> object:
    if _r().incr(key) == 1:
        return Retry(max=2)
    return "retried"


def sleeper(s: float) -> str:
    time.sleep(s)
    return "slept"


def unstorable() -> object:
    return {1, 2, 3}


def on_ok(job, connection, result, *args, **kwargs) -> None:
    connection.rpush(f"cb:{job.id}", f"ok:{result}")


def on_bad(job, connection, typ, value, tb) -> None:
    connection.rpush(f"cb:{job.id}", f"bad:{typ.__name__}")


@mtq.rq.batched(max_batch_size=16, max_wait_ms=50)
def double(xs: list) -> list:
    """Records each call's batch size in MTQ_TEST_BATCH_KEY; a payload 'bad' raises."""
    key = os.environ.get("MTQ_TEST_BATCH_KEY")
    if key:
        _r().rpush(key, len(xs))
    if "bad" in xs:
        raise ValueError("bad payload")
    return [x * 2 for x in xs]


@mtq.rq.batched(max_batch_size=64, max_wait_ms=5)
def record_batch(items: list) -> list:
    """items: [key, tag] pairs; appends each tag to its key (after an optional sleep)."""
    pause = float(os.environ.get("MTQ_TEST_BATCH_SLEEP", "0") or 0)
    if pause:
        time.sleep(pause)
    r = _r()
    with r.pipeline() as p:
        for key, tag in items:
            p.rpush(key, tag)
        p.execute()
    return [tag for _, tag in items]


class Upper(mtq.Model):
    max_batch_size = 8
    max_wait_ms = 20

    def setup(self, device):
        self.device = str(device)

    def predict(self, batch):
        return [str(x).upper() for x in batch]


class Tagged(mtq.Model):
    """A model with options (``--set tests.rq_jobs.Tagged.prefix=...``): ``prefix``
    (required) before each item, ``upper`` it, ``repeat`` it."""

    max_batch_size = 8
    max_wait_ms = 20
    prefix = mtq.Option(str)
    upper = mtq.Option(bool, False)
    repeat = mtq.Option(int, 1, min=1, max=3)

    def setup(self, device):
        self.seen = (self.prefix, self.upper, self.repeat)

    def predict(self, batch):
        prefix, upper, repeat = self.seen
        return [prefix + (str(x).upper() if upper else str(x)) * repeat for x in batch]


def die(key: str) -> None:
    """A poison job: counts its runs in ``key``, then kills its own process (as a
    segfault or the out-of-memory killer would)."""
    import signal

    _r().incr(key)
    os.kill(os.getpid(), signal.SIGKILL)


def stuck_in_c(key: str) -> str:
    """A call that SIGALRM cannot interrupt: hashlib's PBKDF2 runs in C (with the GIL
    released) for minutes and never returns to the interpreter, so the Python-level
    handler of RQ's alarm only runs when it returns, as with a hung GPU kernel or a
    blocking call in an extension."""
    import hashlib

    _r().incr(key)
    hashlib.pbkdf2_hmac("sha256", b"x", b"y", 2_000_000_000)
    return "finished?!"


@mtq.rq.batched(max_batch_size=8, max_wait_ms=200)
def die_on(items: list) -> list:
    """A batched function whose payload "die" kills the process (the whole call)."""
    import signal

    if "die" in items:
        os.kill(os.getpid(), signal.SIGKILL)
    return [f"ok:{x}" for x in items]


def rendezvous(key: str, n: int) -> str:
    """Counts itself in ``key`` and waits (10 s at most) until ``n`` jobs run at once:
    finishes only if as many processes serve the queue in parallel."""
    r = _r()
    r.incr(key)
    deadline = time.monotonic() + 10
    while int(r.get(key) or 0) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {r.get(key)} of {n} jobs ran at once")
        time.sleep(0.01)
    job = get_current_job()
    return job.worker_name if job else "?"


def fail_counting(key: str) -> None:
    """Counts its attempts in ``key``, and fails each."""
    n = _r().incr(key)
    raise RuntimeError(f"attempt {n} fails")


def retry_later(key: str, interval: int) -> object:
    """Returns ``Retry(max=1, interval=interval)`` the first time it runs for ``key``."""
    if _r().incr(key) == 1:
        return Retry(max=1, interval=interval)
    return "retried"


def always_retry() -> object:
    """Asks for one retry, every time: its second attempt exhausts it."""
    return Retry(max=1)


def until_flag(key: str) -> str:
    """Waits (10 s at most) until ``key`` exists in Redis, then returns "done"."""
    deadline = time.monotonic() + 10
    while not _r().exists(key):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{key} was never set")
        time.sleep(0.01)
    return "done"


def term_self() -> str:
    """Sends SIGTERM to its own process (a warm stop asked while it runs)."""
    import signal

    os.kill(os.getpid(), signal.SIGTERM)
    return "stopping"
