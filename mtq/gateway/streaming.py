"""A task's events as OpenAI's streamed chunks (``data: {...}`` lines, then
``data: [DONE]``), over :class:`mtq.contrib.sse.EventStream`: the same shared reply
subscription, keep-alives, time limit and cancel-on-disconnect as mtq's own event
streams, with OpenAI's framing (no ``event:`` or ``id:`` lines: the SDKs read every
``data:`` line as a chunk)."""

from __future__ import annotations

import asyncio
from json.encoder import encode_basestring
from typing import Any

from mtq.client import Task
from mtq.contrib.sse import EventStream, comment, to_json
from mtq.errors import MtqError, ResultTimeout
from mtq.gateway.mapping import Generation, chunk, finish_reason, usage
from mtq.replies import Event

__all__ = ["CompletionStream"]

DONE = b"data: [DONE]\n\n"


#: a text no token holds (NUL is escaped in JSON): where a chunk's text goes
_HOLE = "\x00mtq-token\x00"


def data(body: Any) -> bytes:
    return f"data: {to_json(body)}\n\n".encode()


def template(gen: Generation, task_id: str) -> tuple[bytes, bytes]:
    """The bytes of a text chunk before and after its text's JSON string: a token's
    chunk is ``head + json(text) + tail``, the same bytes as :func:`data` of
    :func:`chunk` (built once per stream, not a dict and a JSON encoding per token)."""
    whole = data(chunk(gen, task_id, text=_HOLE))
    head, hole, tail = whole.partition(encode_basestring(_HOLE).encode())
    assert hole and _HOLE.encode() not in tail, "the chunk template lost its hole"
    return head, tail


def error_data(message: str, kind: str, code: str) -> bytes:
    """The error chunk that ends a stream whose task did not succeed (the SDKs raise
    ``openai.APIError`` on it)."""
    return data({"error": {"message": message, "type": kind, "param": None, "code": code}})


class CompletionStream(EventStream):
    """The chunks of one chat or text completion task (the client going away cancels
    the task)."""

    def __init__(self, task: Task, gen: Generation, *, keepalive_s: float,
                 timeout: float | None) -> None:
        super().__init__(task, keepalive_s=keepalive_s, timeout=timeout,
                         cancel_on_disconnect=True)
        self.gen = gen
        #: the token events read (the completion's tokens when the result has no usage)
        self.tokens = 0
        self._head, self._tail = template(gen, task.id)

    def _preamble(self) -> bytes:
        if self.gen.kind == "chat":  # OpenAI's first chat chunk: the role, no text yet
            return data(chunk(self.gen, self.task.id, text="", role=True))
        return comment("mtq")

    def _chunk(self, ev: Event) -> bytes | None:
        if ev.kind == "token":
            self.tokens += 1
            piece = ev.data if isinstance(ev.data, str) else str(ev.data)
            if not piece:  # an end-of-text token, or half a character
                return None
            return self._head + encode_basestring(piece).encode() + self._tail
        if ev.kind == "idle":
            return comment("keep-alive")
        if not ev.terminal:
            return None
        self.finished = True
        if ev.kind != "succeeded":
            text = ev.data if isinstance(ev.data, str) and ev.data else ev.kind
            bad = text.startswith(("BadRequest", "PermanentError"))
            return error_data(f"the task {ev.kind}: {text}",
                              "invalid_request_error" if bad else "server_error",
                              "model_refused" if bad else f"task_{ev.kind}") + DONE
        out = data(chunk(self.gen, self.task.id, finish=finish_reason(ev.data)))
        if self.gen.include_usage:
            out += data(chunk(self.gen, self.task.id, usage_of=usage(ev.data, self.tokens)))
        return out + DONE

    def _failure(self, exc: MtqError) -> bytes:  # type: ignore[override]
        if isinstance(exc, ResultTimeout):  # the task is cancelled: nobody will read it
            try:  # (off the event loop: the cancel is a Redis round trip)
                asyncio.get_running_loop().run_in_executor(None, self.disconnected)
            except RuntimeError:  # no loop runs here
                self.disconnected()
            return error_data("no answer within the gateway's time limit; the request was "
                              "cancelled", "server_error", "timeout") + DONE
        return error_data(str(exc), "server_error", "unavailable") + DONE
