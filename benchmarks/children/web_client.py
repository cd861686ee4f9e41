"""The worker target and the client processes of benchmarks/web.py.

* :class:`Paced`: a generator that needs no model: every running request gets one
  token per decode step, steps at a fixed pace (``step_ms``, on a fixed schedule,
  not a sleep after the work), up to 1 024 requests decoded together. A token is
  ``[index, stamp]``, ``stamp`` the worker's ``time.time()`` when the step's tokens
  are handed to the engine (the outlet process publishes them right after). While
  the payload's ``gate`` file does not exist a request gets no token (its step
  returns None), so a benchmark opens every reader first and then lets the tokens go.
* ``python -m benchmarks.children.web_client sse BASE QUEUE IDS OUT STAGES``: reads the tasks
  in the file IDS (one id a line) as server-sent events from BASE
  (``http://127.0.0.1:PORT``, the app of benchmarks/children/web_app.py), one raw asyncio
  socket each (HTTP/1.1, chunked), and stamps every event with ``time.time()`` as it
  arrives. STAGES (``1,100,500``): it opens that many streams, waits until each has
  its first keep-alive comment (sent after 0.5 s without an event: the server
  is past its read of the task and the stream waits on the server's reply hub), prints ``opened K`` and waits for a line on stdin before
  the next stage; after the last one it reads every stream to ``done`` and writes
  what it got as JSON to OUT.
* ``python -m benchmarks.children.web_client inproc URL QUEUE IDS OUT STAGES``: the same
  tasks read in this process with ``Task.aevents()`` (mtq's own reader, the one the
  SSE response wraps), with the same stages and output, plus each token's ``ts``
  (Redis TIME when it was published).
* ``python -m benchmarks.children.web_client bare HOST PORT N STEP K OUT``: K streams of
  the app's ``/bare/N/STEP`` (pre-made events, no Redis), stamped the same way.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import mtq


class Paced(mtq.Generator):
    """Tokens at a fixed pace for up to 1 024 requests at once; no model."""

    max_running = 1024
    name = "paced"

    def setup(self, device: Any) -> None:
        self.next_step = 0.0
        self.open_gates: set[str] = set()

    def admit(self, r: mtq.Generation) -> None:
        p = r.payload
        if not isinstance(p, dict) or int(p.get("n", 0)) < 1:
            raise mtq.PermanentError("send {'n': tokens, 'step_ms': pace, 'gate': path}")
        r.prompt_tokens = 1
        r.max_tokens = int(p["n"])

    def _gate(self, r: mtq.Generation) -> bool:
        gate = r.payload.get("gate")
        if not gate or gate in self.open_gates:
            return True
        if os.path.exists(gate):
            self.open_gates.add(gate)
            return True
        return False

    def decode(self, requests: list[mtq.Generation]) -> list[Any]:
        step = float(requests[0].payload.get("step_ms", 50)) / 1000
        now = time.monotonic()
        self.next_step = max(self.next_step + step, now)
        time.sleep(self.next_step - now)  # a fixed schedule: the step's own work is inside it
        stamp = time.time()
        out: list[Any] = []
        for r in requests:
            if not self._gate(r):
                out.append(None)
                continue
            out.append([len(r.tokens), stamp])
            if len(r.tokens) + 1 >= r.max_tokens:
                r.finish()
        return out


# -- the client processes ---------------------------------------------------------
#: the keep-alive interval of the streams (web_app.py's too): the first keep-alive
#: tells a reader that its stream is past its read of the task, waiting on the hub
KEEPALIVE_S = 0.5
Record = dict[str, Any]   # {"id", "tokens": [[index, arrival, data], ...], "done": data}


def _new(task_id: str) -> Record:
    return {"id": task_id, "tokens": [], "done": None, "error": None}


async def _sse(host: str, port: int, path: str, rec: Record, opened: asyncio.Event) -> None:
    """One stream over a raw socket: HTTP/1.1 GET, chunked body, SSE blocks. Data is
    kept as text and decoded after the run, so the reader does little per event."""
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                     "Accept: text/event-stream\r\n\r\n".encode())
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if status != 200:
            rec["error"] = f"HTTP {status}: {head!r}"
            opened.set()
            return
        if b"transfer-encoding: chunked" not in head.lower():
            raise RuntimeError(f"expected a chunked body: {head!r}")
        buf = b""
        tokens = rec["tokens"]
        while True:
            size = int((await reader.readline()).strip(), 16)
            if size == 0:
                return
            buf += (await reader.readexactly(size + 2))[:-2]
            now = time.time()
            while b"\n\n" in buf:
                block, buf = buf.split(b"\n\n", 1)
                name, ident, data = b"", b"", b""
                for line in block.split(b"\n"):
                    if line.startswith(b"event: "):
                        name = line[7:]
                    elif line.startswith(b"id: "):
                        ident = line[4:]
                    elif line.startswith(b"data: "):
                        data = line[6:]
                if name == b"token":
                    tokens.append([int(ident), now, data.decode()])
                elif block.startswith(b": keep-alive"):  # past its read of the task
                    opened.set()
                elif name == b"done":
                    rec["done"] = data.decode()
                    opened.set()
                elif name == b"error":
                    rec["error"] = data.decode()
                    opened.set()
    finally:
        writer.close()


async def _inproc(q: mtq.Queue, rec: Record, opened: asyncio.Event) -> None:
    tokens = rec["tokens"]
    async for ev in q.task(rec["id"]).aevents(600, idle=KEEPALIVE_S):
        now = time.time()
        if ev.kind == "token":
            tokens.append([ev.index, now, json.dumps(ev.data), ev.ts])
        elif ev.kind == "idle":  # past its read of the task
            opened.set()
        elif ev.terminal:
            rec["done"] = json.dumps({"status": ev.kind, "result": ev.data})
            opened.set()


async def _stages(ids: list[str], stages: list[int],
                  one: Callable[[Record, asyncio.Event], Awaitable[None]]) -> list[Record]:
    loop = asyncio.get_running_loop()
    recs = [_new(i) for i in ids]
    running: list[asyncio.Task[None]] = []
    flags: list[asyncio.Event] = []
    for k, n in enumerate(stages):
        for rec in recs[len(running):n]:
            flags.append(asyncio.Event())
            running.append(asyncio.ensure_future(one(rec, flags[-1])))
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in flags)), 120)
        print(f"opened {len(running)}", flush=True)
        if k < len(stages) - 1:
            await loop.run_in_executor(None, sys.stdin.readline)
    results = await asyncio.wait_for(asyncio.gather(*running, return_exceptions=True), 300)
    for rec, res in zip(recs, results):
        if isinstance(res, BaseException):
            rec["error"] = repr(res)
    return recs


async def _bare(host: str, port: int, n: str, step: str, k: int) -> list[Record]:
    recs = [_new(str(i)) for i in range(k)]
    await asyncio.gather(*(_sse(host, port, f"/bare/{n}/{step}", rec, asyncio.Event())
                           for rec in recs))
    return recs


def main(argv: list[str]) -> None:
    if argv[0] == "bare":  # bare HOST PORT N STEP K OUT: the floor, pre-made events
        host, port, n, step, k, out = argv[1:]
        with open(out, "w") as f:
            json.dump(asyncio.run(_bare(host, int(port), n, step, int(k))), f)
        return
    mode, where, queue, ids_file, out, stages_s = argv
    with open(ids_file) as f:
        ids = f.read().split()
    stages = [min(int(s), len(ids)) for s in stages_s.split(",")]
    if mode == "sse":
        host, port = where.removeprefix("http://").rsplit(":", 1)

        def one(rec: Record, opened: asyncio.Event) -> Awaitable[None]:
            return _sse(host, int(port), f"/events/{queue}/{rec['id']}", rec, opened)
    else:
        q = mtq.Queue(queue, where)

        def one(rec: Record, opened: asyncio.Event) -> Awaitable[None]:
            return _inproc(q, rec, opened)
    recs = asyncio.run(_stages(ids, stages, one))
    with open(out, "w") as f:
        json.dump(recs, f)


if __name__ == "__main__":
    main(sys.argv[1:])
