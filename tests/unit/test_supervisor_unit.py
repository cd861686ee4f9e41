"""The supervisor's book of what each child holds (mtq.workers.supervisor), and its
fence (mtq.workers.fencing)."""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest

from mtq.workers.children import drop as _drop
from mtq.workers.fencing import FENCE_FLOOR_S, Fence, fence_s


def test_a_settle_read_after_the_task_was_held_again_leaves_the_new_lease() -> None:
    held = {"a": "t2", "b": "t1"}  # "a" settled under t1, then claimed again under t2
    _drop(held, [["a", "t1"], ["b", "t1"], ["c", "t9"]])
    assert held == {"a": "t2"}
    _drop(held, [["a", "t2"]])
    assert held == {}


# -- the fence (mtq.workers.fencing) ---------------------------------------------------
def _child(engines: int, leases: list[float], beat: float) -> Any:
    """A Child whose shared array says these leases and this last beat, around a real
    (sleeping) process the fence may kill."""
    import multiprocessing as mp
    import subprocess
    import sys

    from mtq.workers import child
    from mtq.workers.children import Child, Engine

    shared = mp.RawArray("d", child.beat_at(engines) + 1)
    for i, lease in enumerate(leases):
        shared[child.at(i, child.LEASE)] = lease
    shared[child.beat_at(engines)] = beat
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    return Child(0, "cpu", proc, None, shared, time.monotonic(),  # type: ignore[arg-type]
                 engines=[Engine(f"q{i}") for i in range(engines)], ready=True)


def test_the_fence_comes_a_margin_before_the_smallest_lease_could_run_out() -> None:
    # 8 s: leases extended every 1 s, lost 7 s after a freeze at the earliest: 6 s
    assert fence_s(8.0) == 6.0 and fence_s(60.0) == 58.0
    # short leases: never under half a lease, nor under the floor
    assert fence_s(2.0) == 1.0 and fence_s(0.4) == FENCE_FLOOR_S
    f = Fence(8.0, host=True, on_event=lambda m: None)
    c = _child(3, [8.0, 2.0, 0.0], time.monotonic())  # 0: not told yet
    try:
        assert f.child_fence_s(c) == 1.0
        none_told = _child(1, [0.0], time.monotonic())
        try:
            assert f.child_fence_s(none_told) == 6.0  # the supervisor's own reading
        finally:
            none_told.process.kill()
    finally:
        c.process.kill()


def test_a_child_whose_beat_is_older_than_its_fence_is_killed_a_fresh_one_is_not() -> None:
    now = time.monotonic()
    f = Fence(2.0, host=False, on_event=lambda m: None)
    fresh, stale = _child(1, [2.0], now - 0.5), _child(1, [2.0], now - 1.5)
    try:
        assert f.deadline(now, [fresh, stale]) == pytest.approx(-0.5)
        f.check(now, [fresh, stale])
        assert not fresh.killed_for and stale.killed_for.startswith("frozen: no sign of life")
        assert stale.process.wait(5) == -signal.SIGKILL
        # a supervisor that woke up late (a host frozen with it) judges its children
        # from when it resumed: each gets a whole fence to beat again
        late = _child(1, [2.0], now - 5.0)
        try:
            f.deadline(now - 10.0, [late])  # it asked to be woken long ago
            f.check(now, [late])
            assert not late.killed_for
            assert f.deadline(now, [late]) == pytest.approx(FENCE_FLOOR_S)  # (a look)
            f.check(now + 0.9, [late])  # (late for the look, not for the fence)
            assert not late.killed_for
            f.check(now + 1.01, [late])  # a whole fence since, and no beat
            assert late.killed_for
        finally:
            late.process.kill()
    finally:
        fresh.process.kill()
        stale.process.kill()


def test_a_forced_child_with_an_aborted_call_past_its_grace_asks_for_no_timer() -> None:
    """A forced stop killed it (not marked killed_for: its sentinel ends it): its
    aborted call's grace, ended, must not wake the loop at once again and again (a
    busy loop until the process is gone: seconds for one tearing down a device)."""
    from mtq.workers import child
    from mtq.workers.children import Abort

    now = time.monotonic()
    f = Fence(2.0, host=False, on_event=lambda m: None)
    c = _child(1, [2.0], now)
    try:
        c.shared[child.at(0, child.STARTED)] = now - 3.0
        c.engines[0].aborted = Abort([], now - 1.0, 1.0, now - 3.0)
        c.forced = True
        c.process.kill()
        assert f.deadline(now, [c]) is None
        f.check(now, [c])
        assert not c.killed_for and not c.abandoned
    finally:
        c.process.kill()


def test_a_lease_shortened_while_the_supervisor_sleeps_is_fenced_by_the_new_one() -> None:
    """``mtq queue config Q lease_ms`` lowered under a running process: its beat tells
    the new lease at once, but a supervisor asleep on the old fence (30 s for a 60 s
    lease) would only look again then, long after Redis gave a process frozen
    meanwhile's tasks to another worker."""
    from mtq.workers import child

    now = time.monotonic()
    f = Fence(60.0, host=False, on_event=lambda m: None)
    c = _child(1, [60.0], now)
    try:
        timer = f.deadline(now, [c])
        assert timer is not None and timer <= FENCE_FLOOR_S, timer
        # the lease is now 1 s (fence 0.5 s), and the process froze just after: the
        # supervisor, awake again within its timer, kills it by the new fence
        c.shared[child.at(0, child.LEASE)] = 1.0
        f.check(now + timer, [c])
        assert not c.killed_for
        assert f.deadline(now + timer, [c]) == pytest.approx(0.5 - timer)
        f.check(now + 0.51, [c])
        assert c.killed_for.startswith("frozen: no sign of life")
    finally:
        c.process.kill()
