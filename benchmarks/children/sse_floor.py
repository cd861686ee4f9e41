"""The floor of benchmarks/gateway.py: a bare Starlette SSE app under uvicorn (the
same server, HTTP implementation and event loop as ``mtq serve``), with no mtq and no
Redis, that streams OpenAI-style chunks of tokens it makes itself, at the pace
:class:`benchmarks.children.gw_client.GwPaced` keeps.

    python -m benchmarks.children.sse_floor PORT

``POST /v1/chat/completions`` takes the body ``gw_client`` sends (the last message's
content says ``n=TOKENS step_ms=PACE every=K gate=PATH``) and answers
``text/event-stream``: the role chunk (its id ``chatcmpl-<stream id>``), one chunk per
token ``"t{i} "``, the finish chunk, ``data: [DONE]``. One ticker task (started by the
first request, on a fixed schedule) hands every open stream its token each step once
the gate file exists (every ``every``-th step, streams taking turns as GwPaced's do),
in this process: a deque and a future per stream, the chunk's bytes made from a
template (the cheapest way, so that what is left is what one Python process pays to
write the chunks). It keeps when it handed each token over (``time.time()``);
``GET /pushes`` answers them, ``{stream id: [[index, time], ...]}``: the client's
arrival less that time is this app's added latency, the floor of the gateway's.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

DONE = b"data: [DONE]\n\n"


class Stream:
    __slots__ = ("head", "id", "items", "n", "phase", "pushed", "sent", "tail", "waiter")

    def __init__(self, n: int, phase: int) -> None:
        self.id = uuid.uuid4().hex[:16]
        self.n, self.phase, self.sent = n, phase, 0
        self.items: collections.deque[bytes] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None
        self.pushed: list[tuple[int, float]] = []
        body = {"id": f"chatcmpl-{self.id}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": "floor", "system_fingerprint": None,
                "choices": [{"index": 0, "delta": {"content": "\x00"}, "logprobs": None,
                             "finish_reason": None}]}
        whole = f"data: {json.dumps(body, separators=(',', ':'))}\n\n".encode()
        self.head, _, self.tail = whole.partition(b'"\\u0000"')

    def push(self, chunk: bytes) -> None:
        self.items.append(chunk)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def chunk(self, text: str | None = None, role: bool = False,
              finish: str | None = None) -> bytes:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
            delta["content"] = text
        body = {"id": f"chatcmpl-{self.id}", "object": "chat.completion.chunk",
                "created": 0, "model": "floor", "system_fingerprint": None,
                "choices": [{"index": 0, "delta": delta, "logprobs": None,
                             "finish_reason": finish}]}
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n".encode()

    async def body(self) -> AsyncIterator[bytes]:
        yield self.chunk(role=True)
        loop = asyncio.get_running_loop()
        while True:
            if not self.items:
                self.waiter = loop.create_future()
                await self.waiter
                self.waiter = None
            item = self.items.popleft()
            yield item
            if item.endswith(DONE):
                return


class Ticker:
    """Every step (a fixed schedule), each stream due a token gets it."""

    def __init__(self) -> None:
        self.streams: list[Stream] = []
        self.admitted = 0
        self.task: asyncio.Task[None] | None = None
        self.pushes: dict[str, list[tuple[int, float]]] = {}

    def add(self, words: dict[str, str]) -> Stream:
        every = int(words.get("every", 1))
        st = Stream(int(words["n"]), self.admitted % every)
        self.admitted += 1
        self.streams.append(st)
        self.pushes[st.id] = st.pushed
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self.run(
                float(words.get("step_ms", 50)) / 1000, words.get("gate", ""), every))
        return st

    async def run(self, step: float, gate: str, every: int) -> None:
        steps, next_step = 0, time.monotonic()
        while True:
            next_step = max(next_step + step, time.monotonic())
            await asyncio.sleep(next_step - time.monotonic())
            steps += 1
            if gate and not os.path.exists(gate):
                continue
            live = []
            for st in self.streams:
                if (steps + st.phase) % every == 0:
                    i = st.sent
                    st.pushed.append((i, time.time()))
                    st.push(st.head + json.dumps(f"t{i} ").encode() + st.tail)
                    st.sent += 1
                    if st.sent >= st.n:
                        st.push(st.chunk(finish="length") + DONE)
                        continue
                live.append(st)
            self.streams = live


def create_app() -> Starlette:
    ticker = Ticker()

    async def chat(request: Request) -> Response:
        body = json.loads(await request.body())
        text = body["messages"][-1]["content"]
        words = dict(w.split("=", 1) for w in text.split() if "=" in w)
        st = ticker.add(words)
        return StreamingResponse(st.body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def pushes(request: Request) -> Response:
        return JSONResponse(ticker.pushes)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": []})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/pushes", pushes), Route("/v1/models", models)])


def main(argv: list[str]) -> None:
    import uvicorn

    uvicorn.run(create_app(), host="127.0.0.1", port=int(argv[0]), log_level="warning")


if __name__ == "__main__":
    main(sys.argv[1:])
