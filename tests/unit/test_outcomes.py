"""mtq.broker.outcomes: what a settle sends (retry, dead letter or fail; the backoff;
what cannot be encoded) and how it counts the scripts' answers. No Redis."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from mtq.broker import outcomes
from mtq.broker.codes import Code
from mtq.broker.outcomes import (
    ERROR_MAX,
    TRACEBACK_MAX,
    Chunk,
    Encoded,
    Outcome,
    backoff_ceiling_ms,
    backoff_ms,
    failure_action,
    plan,
)
from mtq.broker.records import CANCEL, DEAD, FAIL, RELEASE, RETRY, Claimed
from mtq.settings import QueueSettings


def task(i: str = "t", attempts: int = 0, retries: int | None = None) -> Claimed:
    return Claimed(i, "tok-" + i, b"", None, attempts, attempts + 1, retries)


def fail(t: Claimed, error: str = "ValueError: x", **kw: object) -> Outcome:
    return Outcome(t, ok=False, error=error, **kw)  # type: ignore[arg-type]


RNG = random.Random(0)
S = QueueSettings(max_retries=2, retry_backoff_ms=100, retry_backoff_max_ms=1000)


# -- retry, dead letter or fail ----------------------------------------------------------
def test_failure_action_table() -> None:
    assert failure_action(True, 0, 2, True) == RETRY
    assert failure_action(True, 1, 2, False) == RETRY
    assert failure_action(True, 2, 2, True) == DEAD
    assert failure_action(True, 2, 2, False) == FAIL
    assert failure_action(False, 0, 5, True) == FAIL  # not retryable: failed, never dead
    assert failure_action(True, 0, 0, True) == DEAD


def test_a_released_outcome_gives_the_task_back_and_ends_nothing() -> None:
    """A generator's request given back after running out of memory: a release,
    whatever its attempts, neither counted nor ending the task."""
    t = task(attempts=5)
    o = Outcome(t, ok=False, released=True)
    assert plan([o], S, RNG) == ([], [(t.id, t.token, RELEASE, "")])
    assert not outcomes.ends(o, S.max_retries)
    report = outcomes.count([], [(t.id, t.token, RELEASE, "")], [], [1])
    assert (report.retried, report.failed, report.dead, report.cancelled) == (0, 0, 0, 0)


def test_a_task_s_own_retries_win_over_the_queue_s() -> None:
    assert outcomes.allowed_retries(None, 3) == 3
    assert outcomes.allowed_retries(0, 3) == 0
    assert outcomes.allowed_retries(7, 3) == 7
    _, nacks = plan([fail(task("a", attempts=2, retries=5))], S, RNG)
    assert nacks[0][2] == RETRY
    _, nacks = plan([fail(task("b", attempts=0, retries=0))], S, RNG)
    assert nacks[0][2] == DEAD


@given(ok=st.booleans(), cancelled=st.booleans(), retryable=st.booleans(),
       attempts=st.integers(0, 10), retries=st.none() | st.integers(0, 10),
       max_retries=st.integers(0, 10), dead_letter=st.booleans())
def test_ends_agrees_with_plan(ok: bool, cancelled: bool, retryable: bool, attempts: int,
                               retries: int | None, max_retries: int, dead_letter: bool
                               ) -> None:
    o = Outcome(task(attempts=attempts, retries=retries), ok=ok, value=1, error="E: x",
                retryable=retryable, cancelled=cancelled)
    s = QueueSettings(max_retries=max_retries, dead_letter=dead_letter)
    acks, nacks = plan([o], s, random.Random(1))
    ended = bool(acks) or nacks[0][2] in (FAIL, DEAD)
    assert outcomes.ends(o, max_retries) == ended


# -- backoff -----------------------------------------------------------------------------
@given(attempts=st.integers(0, 200), base=st.integers(0, 10**7), top=st.integers(0, 10**9),
       draw=st.floats(0, 1, exclude_max=True))
def test_backoff_stays_in_the_upper_half_of_its_ceiling(attempts: int, base: int, top: int,
                                                         draw: float) -> None:
    ceiling = backoff_ceiling_ms(attempts, base, top)
    assert ceiling <= top and ceiling <= base * 2 ** min(attempts, 30)
    delay = backoff_ms(attempts, base, top, draw)
    assert int(ceiling * 0.5) <= delay <= ceiling


@given(attempts=st.integers(0, 100), base=st.integers(0, 10**6), top=st.integers(0, 10**8))
def test_the_ceiling_doubles_until_the_maximum(attempts: int, base: int, top: int) -> None:
    now, after = (backoff_ceiling_ms(a, base, top) for a in (attempts, attempts + 1))
    assert now <= after <= max(top, 0)
    if attempts < 30 and 2 * now <= top:
        assert after == 2 * now


def test_backoff_examples() -> None:
    assert [backoff_ceiling_ms(a, 500, 60_000) for a in range(9)] == \
        [500, 1000, 2000, 4000, 8000, 16_000, 32_000, 60_000, 60_000]
    assert backoff_ms(0, 500, 60_000, 0.0) == 250 and backoff_ms(0, 500, 60_000, 0.999) == 499
    assert backoff_ceiling_ms(10**6, 1, 10**12) == 2 ** 30  # the exponent stops at 30


def test_a_retry_carries_its_delay_then_the_error() -> None:
    _, nacks = plan([fail(task(attempts=1))], S, random.Random(3))
    delay, error = nacks[0][3].split("|", 1)
    assert 100 <= int(delay) <= 200 and error == "ValueError: x"


# -- what goes to Redis ------------------------------------------------------------------
def test_successes_are_encoded_and_an_encoded_value_passes_through() -> None:
    acks, nacks = plan([Outcome(task("a"), ok=True, value={"x": 1}),
                        Outcome(task("b"), ok=True, value=Encoded(b"raw"))], S, RNG)
    assert [a[:2] for a in acks] == [("a", "tok-a"), ("b", "tok-b")] and not nacks
    assert acks[1][2] == b"raw"


def test_a_result_that_cannot_be_encoded_fails_its_task_at_once() -> None:
    acks, nacks = plan([Outcome(task("a"), ok=True, value=object())], S, RNG)
    assert not acks and nacks[0][2] == FAIL and nacks[0][3].startswith("EncodeError")


def test_a_cancelled_task_is_settled_cancelled() -> None:
    _, nacks = plan([Outcome(task("a"), ok=False, cancelled=True)], S, RNG)
    assert nacks == [("a", "tok-a", CANCEL, "")]


def test_errors_are_bounded_and_storable() -> None:
    o = fail(task(attempts=9), error="E: " + "x" * 10_000 + "\0", traceback="tb\0" * 5000)
    _, nacks = plan([o], S, RNG)
    error, tb = nacks[0][3].split("\0")
    assert len(error) == ERROR_MAX and len(tb) <= TRACEBACK_MAX + 4
    _, nacks = plan([fail(task(attempts=9), error="E: \udcff name")], S, RNG)
    assert nacks[0][3] == "E: \\udcff name"
    _, nacks = plan([fail(task(attempts=9), error=None)], S, RNG)  # type: ignore[arg-type]
    assert nacks[0][3] == "error"


def test_an_unencodable_chunk_fails_its_task_and_drops_its_later_chunks() -> None:
    a, b = task("a"), task("b")
    items, failed, bad = outcomes.stream_items(
        [Chunk(a, 0, "x"), Chunk(b, 0, object()), Chunk(b, 1, "y"), Chunk(a, -1, 0.5)])
    assert [i[:3] for i in items] == [("a", "tok-a", 0), ("a", "tok-a", -1)]
    assert bad == {"b"} and failed[0].task is b and not failed[0].retryable
    assert failed[0].error is not None and failed[0].error.startswith("EncodeError: token 0")


def test_count_reports_lost_leases_and_counts_the_rest() -> None:
    acks = [("a", "t", b""), ("b", "t", b"")]
    nacks = [("c", "t", RETRY, ""), ("d", "t", DEAD, ""), ("e", "t", FAIL, ""),
             ("f", "t", CANCEL, ""), ("g", "t", RETRY, "")]
    report = outcomes.count(acks, nacks, [1, Code.LEASE_LOST], [1, 1, 1, 1, Code.LEASE_LOST])
    assert (report.succeeded, report.retried, report.dead, report.failed,
            report.cancelled) == (1, 1, 1, 1, 1)
    assert report.lost == ["b", "g"]
