"""The worker target and the streaming client of benchmarks/gateway.py.

* :class:`GwPaced`: a generator that takes ``hf:CausalLM``'s payload (what ``mtq serve``
  sends a model that is not TinyGPT) and needs no model. The last message's content
  says what to do, as ``key=value`` words: ``n`` tokens, one step every ``step_ms``
  (on a fixed schedule, not a sleep after the work), a token every ``every`` steps
  (default 1; requests take turns, in the order they were admitted), and no token while the file
  ``gate`` does not exist (so a benchmark opens every reader first, then lets the
  tokens go). Token ``i`` is the text ``"t{i} "``; the result is ``hf:CausalLM``'s:
  ``{"text", "finish_reason", "usage"}``, its text every token joined.
* ``python -m benchmarks.children.gw_client KIND BASE MODEL PROMPT N OUT STAGES``: N
  streaming ``POST /v1/chat/completions`` (``stream: true``), one connection each, in
  one asyncio process: KIND ``httpx`` (httpx's async client) or ``raw`` (a raw
  socket, HTTP/1.1, chunked: the cheapest reader). STAGES (``50,500``): it opens that many streams,
  waits until each has its first chunk (the role: the task exists and its id is
  known), prints ``opened K`` and waits for a line on stdin before the next stage;
  after the last one it writes the task ids (one a line) to ``OUT.ids``, prints
  ``ids``, reads every stream to ``[DONE]`` and writes what it got as JSON to OUT:
  ``{"cpu_s": its CPU time, "streams": [...]}``, per stream ``{"id": task id, "tokens": [[index, arrival, text], ...], "done":
  finish_reason, "error"}``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

import mtq


def _words(text: str) -> dict[str, str]:
    return dict(w.split("=", 1) for w in text.split() if "=" in w)


class GwPaced(mtq.Generator):
    """Tokens at a fixed pace for up to 1 024 requests at once; no model."""

    max_running = 1024
    name = "gw-paced"

    def setup(self, device: Any) -> None:
        self.next_step = 0.0
        self.steps = 0
        self.admitted = 0

    def admit(self, r: mtq.Generation) -> None:
        from mtq.backends.hf.payload import parse

        params = parse(r.payload)
        text = params.prompt if params.prompt is not None else \
            (params.messages or [{}])[-1].get("content", "")
        w = _words(str(text))
        if "n" not in w:
            raise mtq.PermanentError("say 'n=TOKENS step_ms=PACE gate=PATH'")
        every = int(w.get("every", 1))
        r.state = {"step": float(w.get("step_ms", 50)) / 1000, "gate": w.get("gate", ""),
                   "text": "", "every": every, "phase": self.admitted % every}
        self.admitted += 1
        r.prompt_tokens = 1
        r.max_tokens = int(w["n"])

    def decode(self, requests: list[mtq.Generation]) -> list[Any]:
        step = requests[0].state["step"]
        now = time.monotonic()
        self.next_step = max(self.next_step + step, now)
        time.sleep(self.next_step - now)
        self.steps += 1
        gates: dict[str, bool] = {}
        out: list[Any] = []
        for r in requests:
            gate = r.state["gate"]
            if gate not in gates:
                gates[gate] = not gate or os.path.exists(gate)
            if not gates[gate] or (self.steps + r.state["phase"]) % r.state["every"]:
                out.append(None)
                continue
            piece = f"t{len(r.tokens)} "
            r.state["text"] += piece
            out.append(piece)
            if len(r.tokens) + 1 >= r.max_tokens:
                r.finish()
        return out

    def result(self, r: mtq.Generation) -> Any:
        return {"text": r.state["text"], "finish_reason": "length",
                "usage": {"prompt_tokens": r.prompt_tokens, "completion_tokens": len(r.tokens)}}


# -- the client process --------------------------------------------------------------
Record = dict[str, Any]


async def _stream(client: Any, model: str, prompt: str, rec: Record,
                  opened: asyncio.Event) -> None:
    body = {"model": model, "stream": True, "max_tokens": int(_words(prompt)["n"]),
            "messages": [{"role": "user", "content": prompt}]}
    tokens = rec["tokens"]
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                rec["error"] = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return
            async for line in resp.aiter_lines():
                now = time.time()
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    rec["complete"] = True
                    return
                chunk = json.loads(data)
                if rec["id"] is None:
                    rec["id"] = chunk["id"].split("-", 1)[1]
                    opened.set()
                choice = chunk["choices"][0] if chunk.get("choices") else {}
                text = (choice.get("delta") or {}).get("content")
                if text:
                    tokens.append([int(text.strip()[1:]), now, text])
                if choice.get("finish_reason"):
                    rec["done"] = choice["finish_reason"]
    finally:
        opened.set()


async def _raw(host: str, port: int, model: str, prompt: str, rec: Record,
               opened: asyncio.Event) -> None:
    """The same over a raw socket (HTTP/1.1, chunked body): the cheapest reader, so
    that the client's own cost stays out of the gateway's figure. Chunks are kept as
    text and decoded after the run, but for the first (the task's id)."""
    body = json.dumps({"model": model, "stream": True, "max_tokens": int(_words(prompt)["n"]),
                       "messages": [{"role": "user", "content": prompt}]}).encode()
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
    tokens = rec["tokens"]
    try:
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
                     "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if status != 200:
            rec["error"] = f"HTTP {status}: {head!r}"
            return
        if b"transfer-encoding: chunked" not in head.lower():
            raise RuntimeError(f"expected a chunked body: {head!r}")
        buf = b""
        while True:
            size = int((await reader.readline()).strip(), 16)
            if size == 0:
                return
            buf += (await reader.readexactly(size + 2))[:-2]
            now = time.time()
            while b"\n\n" in buf:
                block, buf = buf.split(b"\n\n", 1)
                if not block.startswith(b"data: "):
                    continue
                data = block[6:]
                if data == b"[DONE]":
                    rec["complete"] = True
                    return
                if rec["id"] is None:
                    rec["id"] = json.loads(data)["id"].split("-", 1)[1]
                    opened.set()
                    continue
                tokens.append([now, data.decode()])
    finally:
        opened.set()
        writer.close()


def _decode_raw(rec: Record) -> None:
    """A raw stream's kept chunks as [index, arrival, text] and its finish_reason."""
    tokens = []
    for now, data in rec["tokens"]:
        chunk = json.loads(data)
        choice = chunk["choices"][0] if chunk.get("choices") else {}
        text = (choice.get("delta") or {}).get("content")
        if text:
            tokens.append([int(text.strip()[1:]), now, text])
        if choice.get("finish_reason"):
            rec["done"] = choice["finish_reason"]
    rec["tokens"] = tokens


async def _run(kind: str, base: str, model: str, prompt: str, n: int, stages: list[int],
               ids_out: str) -> list[Record]:
    import httpx

    loop = asyncio.get_running_loop()
    host, port = base.removeprefix("http://").rsplit(":", 1)
    recs: list[Record] = [{"id": None, "tokens": [], "done": None, "complete": False,
                           "error": None} for _ in range(n)]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=None) as client:
        running: list[asyncio.Task[None]] = []
        flags: list[asyncio.Event] = []
        for k, m in enumerate(stages):
            for rec in recs[len(running):m]:
                flags.append(asyncio.Event())
                running.append(asyncio.ensure_future(
                    _stream(client, model, prompt, rec, flags[-1]) if kind == "httpx" else
                    _raw(host, int(port), model, prompt, rec, flags[-1])))
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in flags)), 120)
            print(f"opened {len(running)}", flush=True)
            if k < len(stages) - 1:
                await loop.run_in_executor(None, sys.stdin.readline)
        with open(ids_out, "w") as f:
            f.write("\n".join(str(rec["id"]) for rec in recs))
        print("ids", flush=True)
        results = await asyncio.wait_for(asyncio.gather(*running, return_exceptions=True),
                                         300)
    for rec, res in zip(recs, results):
        if isinstance(res, BaseException):
            rec["error"] = repr(res)
        if kind == "raw":
            _decode_raw(rec)
    return recs


def main(argv: list[str]) -> None:
    kind, base, model, prompt, n, out, stages_s = argv
    stages = [min(int(s), int(n)) for s in stages_s.split(",")]
    recs = asyncio.run(_run(kind, base, model, prompt, int(n), stages, out + ".ids"))
    with open(out, "w") as f:
        json.dump({"cpu_s": time.process_time(), "streams": recs}, f)


if __name__ == "__main__":
    main(sys.argv[1:])
