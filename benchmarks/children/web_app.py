"""The ASGI app benchmarks/web.py serves with one uvicorn process
(``python -m uvicorn benchmarks.children.web_app:app``), configured by environment variables:
``MTQ_REDIS_URL`` and ``MTQ_BENCH_CLIENT_NAME`` (the name every Redis connection of
the process announces, so that the benchmark counts them in CLIENT LIST).

* ``GET /events/{queue}/{task_id}``: the task's events,
  :class:`mtq.contrib.asgi.EventStreamResponse` (keep-alive every 0.5 s), in a plain
  Starlette app;
* ``GET /bare/{n}/{step_ms}``: the floor: a Starlette ``StreamingResponse`` of n
  token events, one every step_ms on a grid of the clock that every stream shares
  (a burst per step, like a worker's decode step), each carrying the server's
  ``time.time()`` when it was made (no Redis, no mtq);
* ``GET /healthz``: ``{"pid": ...}``.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import mtq
from mtq.broker.connection import connect
from mtq.contrib.asgi import EventStreamResponse

#: keep-alive comments every 0.5 s without an event: a client's first one tells it
#: that its stream is past its read of the task (see benchmarks/children/web_client.py)
KEEPALIVE_S = 0.5

client = connect(os.environ["MTQ_REDIS_URL"], name=os.environ["MTQ_BENCH_CLIENT_NAME"])
_queues: dict[str, mtq.Queue] = {}


def queue(name: str) -> mtq.Queue:
    if name not in _queues:
        _queues[name] = mtq.Queue(name, client=client)
    return _queues[name]


async def events(request: Request) -> Response:
    p = request.path_params
    return EventStreamResponse(queue(p["queue"]).task(p["task_id"]), keepalive_s=KEEPALIVE_S)


async def bare(request: Request) -> Response:
    n, step = int(request.path_params["n"]), float(request.path_params["step_ms"]) / 1000

    async def body() -> AsyncIterator[bytes]:
        yield b"retry: 1000\n\n"
        # every stream on the same grid of the clock: one burst of events per step, as
        # a worker's decode step gives every running request its token at once
        tick = math.floor(time.time() / step) + 1
        for i in range(n):
            await asyncio.sleep(max(0.0, (tick + i) * step - time.time()))
            yield f"id: {i}\nevent: token\ndata: [{i},{time.time()!r}]\n\n".encode()
        yield b'event: done\ndata: {"status":"succeeded"}\n\n'

    return StreamingResponse(body(), media_type="text/event-stream")


async def healthz(request: Request) -> Response:
    return JSONResponse({"pid": os.getpid()})


app = Starlette(routes=[
    Route("/events/{queue}/{task_id}", events),
    Route("/bare/{n:int}/{step_ms}", bare),
    Route("/healthz", healthz),
])
