"""Live updates: a page's sections, rendered on the server by the same templates as
the page, sent as server-sent events each refresh; ``static/dashboard.js`` swaps
them in by id. The stream::

    retry: 2000

    event: fragment                              a section whose HTML changed
    data: {"id": "queues", "html": "<section id=\\"queues\\">...</section>"}

    : keep-alive                                 every KEEPALIVE_S without a change

    event: end                                   nothing more will change (a task
    data: {}                                     that ended; the dashboard stopping)

A section is sent when its HTML differs from what this stream sent last, so an idle
dashboard sends keep-alives only. The stream ends when the client goes away
(``http.disconnect``, noticed at once) and when the dashboard stops (server
shutdown: :meth:`mtq.dashboard.web.sampler.Sampler.stop_soon`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mtq.contrib.asgi import send_event_stream
from mtq.contrib.sse import comment, event_bytes
from mtq.dashboard.web.sampler import Sampler

#: seconds without a change after which a ``: keep-alive`` comment is sent
KEEPALIVE_S = 15.0
#: the reconnect delay asked of the browser (ms)
RETRY_MS = 2000

#: a page's sections now: (id -> HTML, whether nothing will change any more)
Render = Callable[[], Awaitable[tuple[dict[str, str], bool]]]


async def fragments(sampler: Sampler, render: Render, keepalive_s: float = KEEPALIVE_S
                    ) -> AsyncIterator[bytes]:
    """The stream's bytes: the sections at once, then those that changed at each refresh."""
    yield f"retry: {RETRY_MS}\n\n".encode()
    sent: dict[str, str] = {}
    version = sampler.version
    while True:
        parts, done = await render()
        for key, html in parts.items():
            if sent.get(key) != html:
                sent[key] = html
                yield event_bytes("fragment", json.dumps({"id": key, "html": html}))
        if done or sampler.stopping:
            yield event_bytes("end", "{}")
            return
        while True:
            now = await sampler.wait(version, keepalive_s)
            if now != version or sampler.stopping:
                version = now
                break
            yield comment("keep-alive")


class FragmentStream:
    """An ASGI response that sends :func:`fragments` until the client goes away or
    the dashboard stops."""

    def __init__(self, sampler: Sampler, render: Render,
                 keepalive_s: float = KEEPALIVE_S) -> None:
        self.sampler = sampler
        self.body = fragments(sampler, render, keepalive_s)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.sampler.viewers += 1
        try:
            _, failure = await send_event_stream(self.body, scope, receive, send)
        finally:  # also when this request itself is cancelled (server shutdown)
            await self.body.aclose()  # type: ignore[attr-defined]
            self.sampler.viewers -= 1
        if failure is not None:
            raise failure


def until_stopped(app: ASGIApp, sampler: Sampler) -> ASGIApp:
    """``app`` (a streaming answer: a task's own event stream) told that its client
    left when the dashboard stops, so that it ends then rather than hold the server's
    shutdown until its graceful timeout."""
    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        async def receive_or_stop() -> Message:
            got = asyncio.ensure_future(receive())
            stop = asyncio.ensure_future(sampler.stopped())
            try:
                await asyncio.wait({got, stop}, return_when=asyncio.FIRST_COMPLETED)
            finally:  # also when this wait is cancelled (the stream ended): no task left
                for t in (got, stop):
                    if not t.done():
                        t.cancel()
            return got.result() if got.done() and not got.cancelled() else \
                {"type": "http.disconnect"}

        started = ended = False

        async def sending(message: Message) -> None:
            nonlocal started, ended
            started = started or message["type"] == "http.response.start"
            ended = ended or (message["type"] == "http.response.body"
                              and not message.get("more_body", False))
            await send(message)

        await app(scope, receive_or_stop, sending)
        if started and not ended and sampler.stopping:  # end the body: the client is there
            with contextlib.suppress(OSError):
                await send({"type": "http.response.body", "body": b"", "more_body": False})

    return wrapped
