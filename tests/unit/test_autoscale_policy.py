"""The autoscaler's arithmetic (mtq.workers.autoscale): the formula, the clamp, up at
once, down only after the cool-down and to the highest target seen in it."""

from __future__ import annotations

import pytest

from mtq.errors import ConfigError
from mtq.workers.autoscale import Decider, Policy, parse_range


def test_target_is_backlog_over_rate_times_drain_clamped() -> None:
    p = Policy(0, 8, drain_s=10)
    assert p.target(0, 2.0, 3) == 0
    assert p.target(1, 2.0, 0) == 1            # a backlog always gets one
    assert p.target(41, 2.0, 1) == 3           # ceil(41 / 20)
    assert p.target(10_000, 2.0, 1) == 8       # MAX
    assert Policy(2, 8).target(0, 2.0, 5) == 2  # MIN
    assert p.target(50, None, 3) == 3          # not measured: keep what runs
    assert p.target(50, None, 0) == 1


def test_up_at_once_down_after_the_cooldown_to_the_peak() -> None:
    d = Decider(Policy(0, 10, drain_s=1, cooldown_s=5))
    assert d.decide(0.0, 40, 10.0, 1) == 4     # up at once
    # a load that wobbles around 2-3 processes' worth never scales down early
    for t, backlog in ((1, 20), (2, 30), (3, 15), (4.9, 25)):
        assert d.decide(t, backlog, 10.0, 4) is None
    assert d.decide(6.0, 20, 10.0, 4) == 3     # after 5 s below: the peak of the window
    assert d.decide(6.5, 0, 10.0, 3) is None   # empty: wait the cool-down again
    assert d.decide(11.4, 0, 10.0, 3) is None
    assert d.decide(11.6, 0, 10.0, 3) == 0
    assert d.decide(12.0, 5, 10.0, 0) == 1     # a task at zero: up at once


def test_steady_load_does_not_flap() -> None:
    d = Decider(Policy(0, 10, drain_s=2, cooldown_s=3))
    current, changes = 1, []
    for i in range(200):  # backlog oscillating 30..50 at 10 tasks/s: 2..3 processes
        n = d.decide(i * 0.1, 30 + (i % 3) * 10, 10.0, current)
        if n is not None:
            current = n
            changes.append((i, n))
    assert changes == [(0, 2), (2, 3)]  # up within the first ticks, never down after


def test_parse_range() -> None:
    p = parse_range("0:4,drain=2.5,cooldown=7")
    assert (p.low, p.high, p.drain_s, p.cooldown_s) == (0, 4, 2.5, 7.0)
    for bad in ("4", "a:b", "3:2", "0:0", "0:4,drain=0", "0:4,speed=3"):
        with pytest.raises(ConfigError):
            parse_range(bad)
