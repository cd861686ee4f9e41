"""The web dashboard's tests' world: real queues with real workers in this process
(a served queue with tasks done, failed and dead-lettered, a scheduled queue with
tenants and bands, a generator streaming tokens), values that are markup everywhere
Redis lets them be, and the dashboard under a real uvicorn in a thread."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import redis
import uvicorn
from starlette.applications import Starlette

import mtq
from mtq.broker import keys
from mtq.broker.keys import QueueKeys
from mtq.settings import QueueSettings
from mtq.workers.model import FunctionModel
from mtq.workers.registry import list_workers
from mtq.workers.worker import Worker
from tests.models import Counter
from tests.support.processes import free_port
from tests.support.waits import wait_for
from tests.support.web import events
from tests.support.workers import Running

#: markup in every value Redis lets hold it (payloads, errors, streams, tenants, workers)
EVIL = "<script>alert(1)</script><b>bold</b>"
#: a stream name may hold markup (no whitespace): it does here
EVIL_STREAM = "<script>alert(2)</script>"
FAST = QueueSettings(lease_ms=1500, retry_backoff_ms=0)


#: what the storyteller tells, a word a token
STORY = ("Once upon a time a queue held every request in order , and the workers "
         "took them one batch at a time , never losing one .").split()


class Storyteller(Counter):
    """:class:`tests.models.Counter` telling :data:`STORY`, a word (and a space) a token."""

    name = "storyteller"

    def _next(self, r: mtq.Generation) -> Any:
        i = r.state + len(r.tokens)
        if len(r.tokens) + 1 >= r.max_tokens:
            r.finish()
        return STORY[i % len(STORY)] + " "

    def result(self, r: mtq.Generation) -> Any:
        return {"text": "".join(r.tokens), "tokens": len(r.tokens)}


def handle(payload: Any) -> Any:
    if payload.get("fail"):
        raise ValueError(EVIL + " went wrong")
    return {"echo": payload.get("text"), "big": "y" * payload.get("big", 0)}


class Uvicorn:
    """``app`` under a real uvicorn server in a thread of this process."""

    def __init__(self, app: Starlette) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)

    def __enter__(self) -> Uvicorn:
        self.thread.start()
        wait_for(lambda: self.server.started, 15, "uvicorn did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        dashboard = getattr(self.server.config.app.state, "dashboard", None)
        if dashboard is not None:  # its live streams end (else uvicorn waits for them)
            dashboard.sampler.stop_soon()
        self.server.should_exit = True
        self.thread.join(15)


@dataclass
class Site:
    base: str
    app: Starlette
    redis: redis.Redis
    served: str
    sched: str
    gen: str
    done: list[str] = field(default_factory=list)
    dead: str = ""
    big: str = ""
    streaming: mtq.Task | None = None
    workers: list[Running] = field(default_factory=list)
    fake_worker: str = ""

    @property
    def dashboard(self) -> Any:
        return self.app.state.dashboard


def fake_worker(r: redis.Redis, served: str) -> str:
    """A registry entry whose every text field is markup (what a hostile or broken
    process could write)."""
    wid = "evil-" + uuid.uuid4().hex[:8]
    fields = {"queue": EVIL, "host": EVIL, "pid": 7, "state": EVIL, "model": EVIL,
              "version": EVIL, "device": EVIL, "engine": EVIL, "batch": 1,
              "typical_batch": 2, "beat": time.time()}
    r.hset(keys.worker(wid), mapping={k: json.dumps(v) for k, v in fields.items()})
    r.expire(keys.worker(wid), 600)
    r.zadd(keys.WORKERS, {wid: time.time()})
    return wid


@contextmanager
def site(redis_url: str, refresh_s: float = 0.2, *, stream_steps: int = 6000,
         step_ms: int = 20) -> Iterator[Site]:
    """The world (see the module docstring); its generation streams for
    ``stream_steps`` x ``step_ms`` (two minutes: it runs through the tests, and is
    cancelled at the end)."""
    from mtq.dashboard.web.app import create_dashboard

    tag = uuid.uuid4().hex[:8]
    r = redis.Redis.from_url(redis_url)
    s = Site("", Starlette(), r, f"dw-served-{tag}", f"dw-sched-{tag}", f"dw-gen-{tag}")
    served = mtq.Queue(s.served, redis_url, settings=FAST)
    gen = mtq.Queue(s.gen, redis_url, settings=FAST)
    sched = mtq.Queue(s.sched, redis_url)
    try:
        # one at a time: two workers starting at once in one process may import the
        # same modules concurrently
        for model, queue in ((FunctionModel(handle), s.served), (Storyteller(), s.gen)):
            s.workers.append(Running(Worker(model, queue, url=redis_url, settings=FAST)))
            wait_for(lambda q=queue: list_workers(r, q), 30, f"no worker of {queue} registered")
        ok = [served.submit({"text": EVIL, "i": i}, stream=EVIL_STREAM) for i in range(3)]
        big = served.submit({"text": "x" * 9000, "big": 9000})
        dead = served.submit({"text": EVIL, "fail": True}, retries=0)
        for t in [*ok, big]:
            t.result(timeout=20)
        wait_for(lambda: dead.status() == "dead", 20, "the failing task was not dead-lettered")
        s.done, s.big, s.dead = [t.id for t in ok], big.id, dead.id
        # the scheduled queue: no worker, so its tasks wait, in two tenants and bands
        sched.submit_many([{"n": i} for i in range(4)], stream=EVIL_STREAM, tenant="acme",
                          priority="batch")
        sched.submit_many([{"n": i} for i in range(2)], tenant="bob", priority="interactive")
        sched.submit({"text": EVIL}, stream="user-1", tenant="bob")
        # a tenant that is markup, as Redis could hold it (validation forbids it at submit)
        r.hset(QueueKeys(s.sched).sched_count, f"s:{EVIL}|w", 3)
        s.fake_worker = fake_worker(r, s.served)
        s.streaming = gen.submit({"text": EVIL, "n": stream_steps, "step_ms": step_ms})
        wait_for(lambda: s.streaming.status() == "running", 20,  # type: ignore[union-attr]
                 "the generation did not start")
        s.app = create_dashboard(client=r, refresh_s=refresh_s)
        with Uvicorn(s.app) as server:
            s.base = server.base
            try:
                yield s
            finally:  # its token streams end (else uvicorn waits for them), and stopping
                s.streaming.cancel()  # its worker would wait for its end
    finally:
        for w in s.workers:
            w.worker.stop()
        for w in s.workers:
            w.join(20)
        if s.fake_worker:
            r.zrem(keys.WORKERS, s.fake_worker)
            r.delete(keys.worker(s.fake_worker))
        r.close()


class Live:
    """A live stream of the dashboard (``path``) read in a thread: its fragments as they
    come (id -> the HTML of each, in order), and whether it ended (``event: end``, or
    the server closing it)."""

    def __init__(self, base: str, path: str) -> None:
        self.fragments: dict[str, list[str]] = {}
        self.events: list[str] = []
        self.ended = threading.Event()
        self.status: int | None = None
        self._http = httpx.Client(base_url=base, timeout=httpx.Timeout(10, read=30))
        self._resp: httpx.Response | None = None
        self._opened = threading.Event()  # the response is there (or the reader ended)
        self._stop = False
        self.thread = threading.Thread(target=self._read, args=(path,), daemon=True)
        self.thread.start()

    def _read(self, path: str) -> None:
        try:
            with self._http.stream("GET", path) as resp:
                self._resp = resp
                self._opened.set()
                self.status = resp.status_code
                for ev in events(resp):
                    if self._stop:
                        return
                    self.events.append(ev.event if ev.comment is None else ":" + ev.comment)
                    if ev.event == "fragment":
                        f = ev.json()
                        self.fragments.setdefault(f["id"], []).append(f["html"])
                    elif ev.event == "end":
                        return
        except httpx.HTTPError:
            pass
        finally:
            self._opened.set()
            self.ended.set()

    def latest(self, section: str) -> str:
        got = self.fragments.get(section)
        return got[-1] if got else ""

    def close(self) -> None:
        self._stop = True
        # the server may count the stream before its headers reach the reader: a close
        # before then would leave the connection open until the next keep-alive
        self._opened.wait(10)
        if self._resp is not None:
            self._resp.close()
        self._http.close()
        self.thread.join(10)


@contextmanager
def traffic(redis_url: str, queue: str, per_tick: int = 4, tick_s: float = 0.2
            ) -> Iterator[None]:
    """Tasks submitted to ``queue`` every ``tick_s`` until the block ends (charts that
    move); the last of them waited for."""
    q = mtq.Queue(queue, redis_url, settings=FAST)
    stop = threading.Event()
    last: list[mtq.Task] = []

    def body() -> None:
        i = 0
        while not stop.wait(tick_s):
            last[:] = q.submit_many([{"text": f"request {i + k}"} for k in range(per_tick)])
            i += per_tick

    thread = threading.Thread(target=body, name="test-traffic", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)
        for t in last:
            t.result(timeout=20)
