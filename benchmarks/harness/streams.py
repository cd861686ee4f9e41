"""Token streams read as a client reads them: requests submitted at once, each read in a
thread of its own (``Task.events``); and the worker's registry entry (streaming, gpu)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

import mtq
from benchmarks.harness.procs import Proc, wait_for
from mtq.workers.registry import list_workers


@dataclass
class Stream:
    """What a reader thread saw of one request."""

    submitted: float                                   # time.time() at submit
    tokens: list[tuple[int, float, float]] = field(default_factory=list)  # index, ts, now
    ended: float = 0.0
    error: str = ""


def read_requests(q: mtq.Queue, payloads: list[dict[str, Any]], proc: Proc,
                  timeout: float = 120) -> list[Stream]:
    """Submit ``payloads`` at once and read each request's events in a thread; fail with
    the worker's output if a request fails or comes short of its ``max_tokens``."""
    t0 = time.time()
    tasks = q.submit_many(payloads)
    streams = [Stream(t0) for _ in tasks]

    def read(t: mtq.Task, out: Stream) -> None:
        try:
            for ev in t.events(timeout=timeout):
                now = time.time()
                if ev.kind == "token":
                    out.tokens.append((int(ev.index or 0), ev.ts, now))
                elif ev.terminal:
                    out.ended = now
                    if ev.kind != "succeeded":
                        out.error = f"{t.id} ended {ev.kind}: {ev.data}"
        except Exception as exc:  # reported below with the worker's log
            out.error = f"{t.id}: {exc!r}"

    threads = [threading.Thread(target=read, args=x, daemon=True) for x in zip(tasks, streams)]
    for th in threads:
        th.start()
    deadline = time.monotonic() + timeout + 10
    for th in threads:
        th.join(max(0.1, deadline - time.monotonic()))
        if th.is_alive():
            raise proc.fail(f"a reader still waits for its request after {timeout:.0f} s")
    bad = [x.error for x in streams if x.error]
    short = [(len(x.tokens), p["max_tokens"]) for x, p in zip(streams, payloads)
             if len(x.tokens) != p["max_tokens"]]
    if bad or short:
        raise proc.fail(f"requests failed: {bad[:3]}; (tokens, asked) {short[:3]}")
    return streams


def wait_ready(r: redis.Redis, procs: Sequence[tuple[Proc, str]]) -> None:
    """Until each (worker, queue) pair's worker is in the queue's registry."""
    for p, q in procs:
        wait_for(f"a worker on {q}", lambda q=q: bool(list_workers(r, q)), 120,  # type: ignore[misc]
                 [p])


def worker_entry(r: redis.Redis, queue: str, proc: Proc) -> dict[str, Any]:
    """The worker's registry entry, from a heartbeat written after this call."""
    after, got = time.time(), {}

    def fresh() -> bool:
        ws = list_workers(r, queue)
        if ws and float(ws[0].get("beat", 0)) > after:
            got.update(ws[0])
        return bool(got)

    wait_for("a fresh worker heartbeat", fresh, 10, [proc], every=0.1)
    return got
