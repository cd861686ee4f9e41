"""The web dashboard's pure parts: charts and the timeline as numbers, capped
previews, and the live stream's protocol (sections sent when they change,
keep-alives, the end) over a sampler that never touches Redis."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgpack
import redis

from mtq import serialization
from mtq.dashboard.web.charts import _nice, chart, timeline
from mtq.dashboard.web.live import FragmentStream, fragments, until_stopped
from mtq.dashboard.web.reads import cap, preview
from mtq.dashboard.web.sampler import Sampler


def test_charts_scale_to_a_round_top_break_at_gaps_and_span_the_history_there_is() -> None:
    assert [_nice(v) for v in (0, 0.3, 1, 7, 12, 20, 4500)] == [1, 0.5, 1, 10, 20, 20, 5000]
    pts = [(100.0, 1.0), (101.0, None), (102.0, 3.0), (103.0, 4.0)]
    c = chart([("rate", "tasks/s", pts)], width=100, height=20, window_s=300)
    (line,) = c.lines
    assert line.d.count("M") == 2 and line.d.count("L") == 1  # the gap breaks the line
    assert c.top == "5" and line.last == 4.0
    assert c.since == "-3 s"  # three seconds of history span the whole width
    assert line.d.startswith("M2.0 ") and "L98.0 " in line.d
    empty = chart([("rate", "tasks/s", [])], window_s=300)
    assert empty.empty and empty.lines[0].d == "" and empty.since == "-5 min"


def test_the_timeline_spans_waiting_and_running_and_a_live_task_runs_to_now() -> None:
    done = timeline([(10.0, "queued", ""), (10.5, "started", "delivery 1"),
                     (12.0, "succeeded", "")], now=99.0)
    assert [(s.css, s.label) for s in done.spans] == [("wait", "waiting 500 ms"),
                                                      ("run", "running 1.5 s")]
    assert [m.kind for m in done.marks] == ["queued", "started", "succeeded"]
    assert done.total == "2.0 s"
    live = timeline([(10.0, "queued", ""), (11.0, "started", "")], now=14.0)
    assert live.spans[-1].css == "run" and live.total == "4.0 s"
    assert timeline([], now=1.0).marks == []


def test_previews_are_capped_in_characters_and_count_the_rest_in_bytes() -> None:
    p = cap("é" * 10, limit=4)
    assert p.text == "éééé" and p.more_bytes == 12
    assert cap("short", 10).more_bytes == 0
    shown = preview(serialization.dumps({"a": [1, 2]}))
    assert shown is not None and json.loads(shown.text) == {"a": [1, 2]}
    ext = msgpack.packb(["float32", [2, 3], b"\0" * 24])
    got = preview(msgpack.packb(msgpack.ExtType(2, ext)))
    assert got is not None and got.text == f'"<array float32 [2, 3], {len(ext)} bytes>"'
    garbage = preview(b"\xc1" * 50, limit=10)
    assert garbage is not None and garbage.more_bytes > 0 and len(garbage.text) == 10
    assert preview(None) is None


def test_the_live_stream_sends_changes_only_keeps_alive_and_ends() -> None:
    # nothing listens on port 1: each refresh fails at once (and bumps the version)
    sampler = Sampler(redis.Redis(port=1, retry=None), refresh_s=60)
    shown = {"a": "<p>1</p>", "b": "<p>x</p>"}

    async def render() -> tuple[dict[str, str], bool]:
        return dict(shown), False

    async def run() -> list[bytes]:
        sampler.start()
        out: list[bytes] = []
        stream = fragments(sampler, render, keepalive_s=0.05)
        out.append(await stream.__anext__())  # retry
        out.append(await stream.__anext__())  # a
        out.append(await stream.__anext__())  # b
        out.append(await stream.__anext__())  # nothing changed: a keep-alive
        shown["a"] = "<p>2</p>"
        await sampler.refresh()
        out.append(await stream.__anext__())  # only a
        sampler.stop_soon()
        async for chunk in stream:
            out.append(chunk)
        await sampler.stop()
        assert sampler.error is not None  # what the banner shows
        return out

    out = asyncio.run(run())
    assert out[0] == b"retry: 2000\n\n"
    assert [json.loads(c.split(b"data: ")[1])["id"] for c in out[1:3]] == ["a", "b"]
    assert out[3] == b": keep-alive\n\n"
    assert json.loads(out[4].split(b"data: ")[1]) == {"id": "a", "html": "<p>2</p>"}
    assert out[-1] == b"event: end\ndata: {}\n\n"
    assert not any(b'"id": "b"' in c for c in out[4:])


def test_waiting_on_a_sampler_never_started_yields_to_the_loop() -> None:
    # mounted in an app whose lifespan does not reach it, a stream may wait on a sampler
    # no request started: the wait must sleep, not return at once (stopped() spun)
    sampler = Sampler(redis.Redis(port=1, retry=None), refresh_s=0.05)

    async def run() -> bool:
        waiter = asyncio.ensure_future(sampler.stopped())
        await asyncio.sleep(0.2)   # runs only if the waiter yields to the loop
        sampler.stopping = True
        await asyncio.wait_for(waiter, 2)
        return waiter.done()

    assert asyncio.run(asyncio.wait_for(run(), 5))


def test_a_live_stream_whose_render_fails_counts_its_viewer_out() -> None:
    sampler = Sampler(redis.Redis(port=1, retry=None), refresh_s=60)

    async def render() -> tuple[dict[str, str], bool]:
        raise RuntimeError("a template broke")

    async def run() -> str:
        sent: list[Any] = []
        never = asyncio.get_running_loop().create_future()

        async def receive() -> dict[str, object]:
            return await never  # the client stays

        async def send(message: Any) -> None:
            sent.append(message)

        try:
            await FragmentStream(sampler, render)({"type": "http"}, receive, send)
        except RuntimeError as exc:
            return str(exc)
        return "nothing raised"

    assert asyncio.run(run()) == "a template broke"
    assert sampler.viewers == 0


def test_a_stream_cancelled_as_the_refresh_comes_ends() -> None:
    # a client leaving at a refresh: its stream is cancelled in the same turn of the
    # loop as the tick wakes it. The cancel must win (asyncio.wait_for before 3.12
    # returned the tick instead, and the stream went on sending to nobody)
    sampler = Sampler(redis.Redis(port=1, retry=None), refresh_s=60)

    async def run() -> bool:
        sampler.start()
        await asyncio.sleep(0)  # the sampler's first (failing) refresh
        waiter = asyncio.ensure_future(sampler.wait(sampler.version, 30))
        await asyncio.sleep(0)  # the waiter waits on the tick
        sampler._wake()
        waiter.cancel()
        try:
            await asyncio.wait_for(asyncio.shield(waiter), 5)
        except asyncio.CancelledError:
            pass
        cancelled = waiter.cancelled()
        await sampler.stop()
        return cancelled

    assert asyncio.run(run()), "the cancel was lost: the wait returned the refresh"


def test_a_task_stream_that_ends_leaves_no_wait_behind() -> None:
    # a task's stream waits for its client to leave or the dashboard to stop; when
    # the stream ends (its wait cancelled), neither wait may live on, waking at every
    # refresh until the dashboard stops
    sampler = Sampler(redis.Redis(port=1, retry=None), refresh_s=60)

    async def run() -> int:
        never = asyncio.get_running_loop().create_future()

        async def receive() -> Any:
            return await never  # the client stays

        async def send(message: Any) -> None:
            pass

        async def app(scope: Any, receive: Any, send: Any) -> None:
            await receive()

        served = asyncio.ensure_future(until_stopped(app, sampler)({"type": "http"},
                                                                     receive, send))
        for _ in range(5):
            await asyncio.sleep(0)  # it waits
        served.cancel()
        try:
            await served
        except asyncio.CancelledError:
            pass
        for _ in range(5):
            await asyncio.sleep(0)  # cancelled tasks end
        return len(asyncio.all_tasks() - {asyncio.current_task()})

    assert asyncio.run(run()) == 0, "waits left running after their stream ended"
