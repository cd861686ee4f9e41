"""The bytes of mtq.contrib.sse (no Redis): events, ids, keep-alives, Last-Event-ID,
and the HTTP answers of mtq's errors."""

from __future__ import annotations

import json

import pytest

import mtq
from mtq.contrib import sse
from mtq.contrib.web import BadHeader
from mtq.replies import Event


def test_each_event_kind_has_its_sse_form() -> None:
    f = sse.format_event
    assert f(Event("token", "T", "héllo\nworld", index=7)) == \
        'id: 7\nevent: token\ndata: "héllo\\nworld"\n\n'.encode()
    assert f(Event("token", "T", b"\x00\xff", index=0)) == b'id: 0\nevent: token\ndata: "AP8="\n\n'
    assert f(Event("progress", "T", 0.5)) == b"event: progress\ndata: 0.5\n\n"
    assert f(Event("started", "T", delivery=2)) == b'event: started\ndata: {"delivery":2}\n\n'
    assert f(Event("restarted", "T", "worker died", delivery=1)) == \
        b'event: restarted\ndata: {"delivery":1,"reason":"worker died"}\n\n'
    assert f(Event("succeeded", "T", {"text": "hi"})) == \
        b'event: done\ndata: {"status":"succeeded","result":{"text":"hi"}}\n\n'
    for end in ("failed", "dead", "expired", "cancelled"):
        body = f(Event(end, "T", "why"))
        assert body is not None and body.startswith(b"event: done\ndata: ")
        assert json.loads(body.split(b"data: ")[1]) == {"status": end, "error": "why"}
    assert f(Event("idle", "T")) == b": keep-alive\n\n"
    assert f(Event("queued", "T")) is None
    with pytest.raises(TypeError):
        f(Event("token", "T", object(), index=0))


def test_last_event_id_is_the_index_of_the_last_token_received() -> None:
    p = sse.parse_last_event_id
    assert p(None) == 0 and p("") == 0 and p(None, "") == 0
    assert p("0") == 1 and p("41") == 42 and p(" 41 ") == 42
    assert p(None, "9") == 10 and p("3", "9") == 4  # the header wins
    for bad in ("x", "-1", "1.0", "1e3", "٣", "9" * 19):
        with pytest.raises(sse.BadLastEventId):
            p(bad)
    with pytest.raises(sse.BadLastEventId):
        p(None, "abc")


def test_mtq_errors_become_http_answers() -> None:
    def answer(exc: BaseException) -> tuple[int, str, dict[str, str]]:
        err = sse.http_error(exc, retry_after_s=5)
        assert err is not None
        assert json.loads(err.body())["error"] == err.code
        return err.status, err.code, dict(err.headers)

    assert answer(mtq.TaskNotFound("no task")) == (404, "not_found", {})
    assert answer(mtq.InvalidName("invalid task id 'a b'")) == (404, "not_found", {})
    assert answer(mtq.InvalidName("invalid stream ' '")) == (400, "invalid_name", {})
    assert answer(sse.BadLastEventId("x")) == (400, "bad_last_event_id", {})
    assert answer(mtq.PayloadTooLarge("big")) == (413, "payload_too_large", {})
    assert answer(mtq.QueueFull("q", 10, 10)) == (503, "queue_full", {"Retry-After": "5"})
    assert answer(mtq.RedisUnavailable("down")) == (503, "unavailable", {"Retry-After": "5"})
    # refusals that say when to retry: their own Retry-After, whole seconds rounded up
    assert answer(mtq.RateLimited("q", "ann", 59.2)) == (
        429, "rate_limited", {"Retry-After": "60"})
    assert answer(mtq.RateLimited("q", "ann", 0.0)) == (
        429, "rate_limited", {"Retry-After": "1"})
    assert answer(mtq.WouldMissDeadline("q", "T1", 7.0)) == (
        503, "would_miss_deadline", {"Retry-After": "7"})
    assert answer(BadHeader("bad_priority", "no")) == (400, "bad_priority", {})
    assert sse.http_error(ValueError("a bug")) is None


def test_headers_leave_hop_by_hop_out_where_it_is_not_allowed() -> None:
    assert dict(sse.headers()) == {"Content-Type": "text/event-stream; charset=utf-8",
                                   "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                   "Connection": "keep-alive"}
    assert "Connection" not in dict(sse.headers(hop_by_hop=False))
