"""The sans-IO waiter behind Task.events / aevents (mtq.client.waiting.Waiter), driven
by hand: no Redis, no threads, no event loop."""

from __future__ import annotations

import time

import pytest

from mtq import serialization
from mtq.broker.protocol import Snapshot
from mtq.client.replies.events import FETCH, LOST, RESYNC, Event
from mtq.client.waiting import Need, Waiter, own_outcome, own_wait


def snap(status: str = "running", tokens: tuple[str, ...] = (), result: object = None,
         ts: float = 100.0) -> Snapshot:
    return Snapshot(status, serialization.dumps(result) if status == "succeeded" else None,
                    None, 1, [serialization.dumps(t) for t in tokens], ts)


def token(i: int, text: str) -> Event:
    return Event("token", "t1", text, index=i, ts=101.0)


def read(w: Waiter, s: Snapshot) -> list[Event]:
    assert w.need() is Need.READ
    return w.read(w.state.from_snapshot(s))


def test_it_reads_the_stored_state_first_then_takes_live_tokens_once_in_order() -> None:
    w = Waiter("t1", tokens=True, start=0, timeout=None, idle=None)
    assert [e.data for e in read(w, snap(tokens=("a", "b")))] == ["a", "b"]
    assert isinstance(w.need(), float), "then it waits for the feed"
    assert w.fed(token(1, "b")) == [], "a token it has is dropped"
    assert [e.data for e in w.fed(token(2, "c"))] == ["c"]
    assert w.fed(token(4, "e")) == [] and w.need() is Need.READ, "a gap: read the log"
    assert [e.data for e in read(w, snap(tokens=("d", "e")))] == ["d", "e"]
    done = w.fed(Event("succeeded", "t1", "ok", ts=102.0))
    assert [e.kind for e in done] == ["succeeded"] and w.need() is Need.DONE


def test_a_hub_marker_or_a_result_too_large_for_its_message_asks_for_a_read() -> None:
    for item in (RESYNC, LOST, Event("succeeded", "t1", FETCH, ts=101.0)):
        w = Waiter("t1", tokens=False, start=0, timeout=None, idle=None)
        read(w, snap())
        assert w.fed(item) == [] and w.need() is Need.READ
        assert [e.data for e in read(w, snap("succeeded", result=7))] == [7]
        assert w.need() is Need.DONE


def test_an_ended_task_is_done_after_the_first_read() -> None:
    w = Waiter("t1", tokens=False, start=0, timeout=0.0, idle=None)
    assert [e.kind for e in read(w, snap("failed"))] == ["failed"]
    assert w.need() is Need.DONE, "done wins over a timeout that passed"


def test_timeout_and_idle_ticks() -> None:
    w = Waiter("t1", tokens=False, start=0, timeout=0.05, idle=0.01)
    read(w, snap())
    wait = w.need()
    assert isinstance(wait, float) and wait <= 0.01
    time.sleep(0.015)
    assert [e.kind for e in w.fed(None)] == ["idle"]
    time.sleep(0.05)
    assert w.need() is Need.TIMEOUT


def test_stale_live_events_older_than_the_read_are_dropped() -> None:
    w = Waiter("t1", tokens=False, start=0, timeout=None, idle=None)
    read(w, snap(ts=100.0))
    assert w.fed(Event("started", "t1", delivery=1, ts=99.0)) == []
    assert [e.kind for e in w.fed(Event("started", "t1", delivery=2, ts=100.5))] == ["started"]


@pytest.mark.parametrize(("timeout", "expected"), [(None, 10.0), (3.0, 3.0), (60.0, 10.0),
                                                    (-1.0, 0.0)])
def test_the_short_way_waits_at_most_resync_s(timeout: float | None, expected: float) -> None:
    assert own_wait(timeout) == expected


def test_the_short_way_ends_with_a_usable_terminal_event_or_the_time_left() -> None:
    start = time.monotonic()
    ok = Event("succeeded", "t1", 1)
    assert own_outcome(ok, 5.0, start) == (ok, None)
    for item in (None, RESYNC, Event("succeeded", "t1", FETCH), Event("started", "t1")):
        ev, left = own_outcome(item, 5.0, start)
        assert ev is None and left is not None and 4.0 < left <= 5.0
    assert own_outcome(None, None, start) == (None, None)
