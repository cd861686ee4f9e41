"""The worker engine's pure parts, without Redis: the batch slot, bisection,
target loading and batch policy, device specs and control messages."""

from __future__ import annotations

import math
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import mtq
from mtq.broker.protocol import Claimed
from mtq.errors import ConfigError, TargetError
from mtq.workers import control, devices
from mtq.workers.batching import NOT_TAKEN, OFFERED, BatchShapeError, BatchSlot, run_isolated
from mtq.workers.model import FunctionModel, Model, is_per_item
from mtq.workers.target import BatchPolicy, load_model, load_target

pytestmark = pytest.mark.timeout(30)


def claimed(i: int | str, *, age_ms: int = 0, attempts: int = 0, deliveries: int = 1,
            stream: str | None = None) -> Claimed:
    return Claimed(id=f"t{i}", token=str(i), payload=b"\x80", stream=stream,
                   attempts=attempts, deliveries=deliveries, retries=None, age_ms=age_ms)


def ids(tasks: list[Claimed] | None) -> list[str]:
    assert tasks is not None
    return [t.id for t in tasks]


class Background:
    """Run ``fn`` in a thread; ``.done`` is set when it returns."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()

        def body() -> None:
            try:
                self.result = fn()
            except BaseException as exc:  # surfaced by join()
                self.error = exc
            finally:
                self.done.set()

        self.thread = threading.Thread(target=body, daemon=True)
        self.thread.start()

    def join(self, timeout: float = 5.0) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "background call did not return"
        if self.error is not None:
            raise self.error
        return self.result


def wait_until(predicate: Callable[[], Any], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.001)


# -- BatchSlot -----------------------------------------------------------------------
def test_full_batch_is_taken_at_once() -> None:
    slot = BatchSlot(max_batch_size=4, max_wait_ms=10_000)
    assert slot.put([claimed(i) for i in range(6)], time.monotonic()) == []
    start = time.monotonic()
    assert ids(slot.take()) == ["t0", "t1", "t2", "t3"]
    assert time.monotonic() - start < 0.5
    assert len(slot) == 2 and [t.id for t in slot.ids()] == ["t4", "t5"]


def test_partial_batch_waits_for_the_oldest_deadline() -> None:
    wait = 0.2
    slot = BatchSlot(max_batch_size=8, max_wait_ms=wait * 1000)
    start = time.monotonic()
    slot.put([claimed(0)], start)
    slot.put([claimed(1), claimed(2)], start + 0.05)  # later arrivals ride along
    batch = slot.take()
    elapsed = time.monotonic() - start
    assert ids(batch) == ["t0", "t1", "t2"]
    assert wait * 0.9 <= elapsed < wait + 0.5, elapsed


def test_deadline_counts_from_submission_not_claim() -> None:
    # submitted 400 ms before the claim with a 500 ms window: due 100 ms after the claim
    slot = BatchSlot(max_batch_size=8, max_wait_ms=500)
    start = time.monotonic()
    slot.put([claimed(0, age_ms=400)], start)
    assert ids(slot.take()) == ["t0"]
    elapsed = time.monotonic() - start
    assert 0.09 <= elapsed < 0.4, elapsed


def test_task_older_than_the_window_is_due_at_once() -> None:
    slot = BatchSlot(max_batch_size=8, max_wait_ms=5_000)
    start = time.monotonic()
    slot.put([claimed(0, age_ms=6_000), claimed(1)], start)
    assert ids(slot.take()) == ["t0", "t1"]
    assert time.monotonic() - start < 0.5


def test_put_that_fills_the_batch_wakes_a_waiting_take() -> None:
    slot = BatchSlot(max_batch_size=3, max_wait_ms=30_000)
    slot.put([claimed(0)], time.monotonic())
    taker = Background(slot.take)
    assert not taker.done.wait(0.1)  # one task, 30 s window: still waiting
    slot.put([claimed(1), claimed(2)], time.monotonic())
    assert taker.done.wait(2), "a full batch did not wake take()"
    assert ids(taker.join()) == ["t0", "t1", "t2"]


def test_wait_space_claims_a_batch_at_most_into_ahead_batches() -> None:
    slot = BatchSlot(max_batch_size=4, max_wait_ms=10_000)
    slot.put([claimed(i) for i in range(3)], time.monotonic())
    assert slot.wait_space() == 1  # one batch: the room left in it
    slot.ahead = 2
    assert slot.wait_space() == 4  # two: at most a batch a claim
    slot.put([claimed(i) for i in range(3, 7)], time.monotonic())
    assert slot.wait_space() == 1
    slot.put([claimed(7)], time.monotonic())
    fetcher = Background(slot.wait_space)
    assert not fetcher.done.wait(0.05), "wait_space returned with two batches held"
    assert ids(slot.take()) == ["t0", "t1", "t2", "t3"]
    assert fetcher.join() == 4


def test_a_refill_claims_all_the_room_once_half_of_many_small_batches_are_taken() -> None:
    """claim_ahead(ahead, refill): with many batches ahead, the fetcher waits until the
    slot has room for ``refill`` tasks, then claims all of it in one claim; back to
    claim_ahead(1), it claims as soon as there is room, a batch at most."""
    slot = BatchSlot(max_batch_size=1, max_wait_ms=0)
    slot.claim_ahead(8, 4)
    assert slot.wait_space() == 8  # empty: all the room, eight batches of one
    slot.put([claimed(i) for i in range(8)], time.monotonic())
    fetcher = Background(slot.wait_space)
    for i in range(3):
        assert ids(slot.take()) == [f"t{i}"]
        assert not fetcher.done.wait(0.05), f"wait_space returned with room for {i + 1}"
    assert ids(slot.take()) == ["t3"]
    assert fetcher.join() == 4  # room for four: the refill, claimed at once
    assert slot.full() is False
    slot.put([claimed(i) for i in range(8, 12)], time.monotonic())
    assert slot.full()
    slot.claim_ahead(1)  # a claim came back short: one batch, claimed into any room
    assert slot.full()
    for i in range(4, 11):
        assert ids(slot.take()) == [f"t{i}"]
    fetcher = Background(slot.wait_space)
    assert not fetcher.done.wait(0.05), "wait_space returned with the batch held"
    assert ids(slot.take()) == ["t11"]
    assert fetcher.join() == 1


def test_raising_the_refill_wakes_no_fetcher_until_there_is_that_room() -> None:
    slot = BatchSlot(max_batch_size=2, max_wait_ms=0)
    slot.put([claimed(0), claimed(1)], time.monotonic())
    fetcher = Background(slot.wait_space)
    assert not fetcher.done.wait(0.05)
    slot.claim_ahead(4, 4)  # holds eight now: room for six, more than the refill
    assert fetcher.join() == 6


def test_suspect_task_runs_alone_and_first() -> None:
    slot = BatchSlot(max_batch_size=8, max_wait_ms=10_000)
    normal = [claimed(0), claimed(1)]
    # deliveries - attempts > 1: an earlier delivery ended without an outcome
    suspect = claimed("s", attempts=1, deliveries=3)
    not_suspect = claimed("r", attempts=1, deliveries=2)  # an ordinary retry
    assert suspect.suspect and not not_suspect.suspect and not normal[0].suspect
    slot.put([*normal, suspect, not_suspect], time.monotonic())
    start = time.monotonic()
    assert ids(slot.take()) == ["ts"]  # not due yet, but a suspect goes at once
    assert time.monotonic() - start < 0.5
    assert [t.id for t in slot.ids()] == ["t0", "t1", "tr"]


def test_a_suspect_put_after_the_slot_was_scanned_still_runs_alone_and_first() -> None:
    """The slot looks for suspects only while one may be in it (set as one comes in,
    cleared by a scan that finds none): one that comes in later, behind others, is
    still taken first, alone; and each of several in turn."""
    slot = BatchSlot(max_batch_size=2, max_wait_ms=0)
    slot.put([claimed(i) for i in range(4)], time.monotonic())
    assert ids(slot.take()) == ["t0", "t1"]  # no suspect: the scan found none
    slot.put([claimed("s1", attempts=1, deliveries=3), claimed(4)], time.monotonic())
    assert ids(slot.take()) == ["ts1"]
    assert ids(slot.take()) == ["t2", "t3"]
    slot.put([claimed("s2", attempts=0, deliveries=2)], time.monotonic())
    slot.put([claimed("s3", attempts=2, deliveries=4)], time.monotonic())
    assert [ids(slot.take()) for _ in range(3)] == [["ts2"], ["ts3"], ["t4"]]
    assert len(slot) == 0


def test_kick_makes_take_return_empty_once() -> None:
    slot = BatchSlot(max_batch_size=8, max_wait_ms=10_000)
    taker = Background(slot.take)
    assert not taker.done.wait(0.05)
    slot.kick()
    assert taker.join() == []
    slot.kick()
    slot.put([claimed(i) for i in range(8)], time.monotonic())
    assert slot.take() == []  # the kick wins once, even over a full batch
    assert ids(slot.take()) == [f"t{i}" for i in range(8)]


def test_an_offered_wait_is_taken_by_an_idle_take_and_comes_back_with_its_result() -> None:
    """offer_wait / take / return_wait: the model thread's take() returns OFFERED once
    the fetcher offers its wait and the slot is empty; the fetcher blocks until the
    wait comes back, with what it returned. While the model thread keeps the wait,
    take() returns OFFERED again whenever the slot is empty."""
    slot = BatchSlot(max_batch_size=8, max_wait_ms=0)
    taker = Background(slot.take)
    assert not taker.done.wait(0.05)
    fetcher = Background(slot.offer_wait)
    assert taker.join() is OFFERED
    slot.put([claimed(0)], time.monotonic())  # what its wait was handed: runs next
    assert ids(slot.take()) == ["t0"]
    assert not fetcher.done.wait(0.05), "the fetcher came back while the wait was kept"
    assert slot.take() is OFFERED  # kept: empty again, so the model thread waits again
    slot.return_wait(True)
    assert fetcher.join() is True
    taker = Background(slot.take)
    assert not taker.done.wait(0.05), "take() returned OFFERED with nothing offered"
    slot.kick()
    assert taker.join() == []


@pytest.mark.parametrize("event", ["pause", "kick", "close"])
def test_an_offered_wait_comes_back_when_the_slot_is_paused_kicked_or_closed(
        event: str) -> None:
    """Offered and not taken yet, the offer is withdrawn (NOT_TAKEN: the fetcher waits
    itself); taken, the model thread's next take() hands it back (True: woken), so a
    paused or stopping worker's fetcher always gets its wait back."""
    act = {"pause": lambda s: s.set_paused(True), "kick": BatchSlot.kick,
           "close": BatchSlot.close}[event]
    slot = BatchSlot(max_batch_size=8, max_wait_ms=0)
    fetcher = Background(slot.offer_wait)
    assert not fetcher.done.wait(0.05)
    act(slot)
    assert fetcher.join() is NOT_TAKEN
    slot = BatchSlot(max_batch_size=8, max_wait_ms=0)
    fetcher = Background(slot.offer_wait)
    wait_until(lambda: slot._waiter == "offered")
    assert slot.take() is OFFERED
    act(slot)  # the model thread is not waiting on Redis here (between two takes)
    assert not fetcher.done.wait(0.05), "handed back before the model thread saw it"
    taker = Background(slot.take)
    assert fetcher.join() is True
    if event == "pause":  # paused: nothing to take, and no wait offered
        assert not taker.done.wait(0.05)
        slot.close()
    assert taker.join() == ([] if event == "kick" else None)


def test_an_offered_wait_is_taken_once_the_tasks_in_the_slot_have_run() -> None:
    slot = BatchSlot(max_batch_size=8, max_wait_ms=0)
    slot.put([claimed(0)], time.monotonic())
    fetcher = Background(slot.offer_wait)
    wait_until(lambda: slot._waiter == "offered")
    assert ids(slot.take()) == ["t0"]  # what is in the slot runs first
    assert slot.take() is OFFERED
    slot.return_wait(False)
    assert fetcher.join() is False


def test_close_returns_pending_and_ends_take_and_put() -> None:
    slot = BatchSlot(max_batch_size=8, max_wait_ms=10_000)
    slot.put([claimed(0), claimed(1)], time.monotonic())
    taker = Background(slot.take)
    assert not taker.done.wait(0.05)
    assert ids(slot.close()) == ["t0", "t1"]
    assert taker.join() is None
    assert slot.take() is None
    assert ids(slot.put([claimed(2)], time.monotonic())) == ["t2"]
    assert slot.wait_space() == 0
    assert len(slot) == 0


def test_pause_empties_refuses_and_resume_accepts() -> None:
    slot = BatchSlot(max_batch_size=8, max_wait_ms=0)
    slot.put([claimed(0), claimed(1)], time.monotonic())
    assert ids(slot.set_paused(True)) == ["t0", "t1"]
    assert len(slot) == 0
    assert ids(slot.put([claimed(2)], time.monotonic())) == ["t2"]
    filler = Background(slot.wait_space)
    assert not filler.done.wait(0.1)  # paused: the fetcher must not claim
    assert slot.set_paused(False) == []
    assert filler.join() == 8
    assert slot.put([claimed(3)], time.monotonic()) == []
    assert ids(slot.take()) == ["t3"]


def test_take_waits_while_paused_even_if_kicked_later() -> None:
    slot = BatchSlot(max_batch_size=2, max_wait_ms=0)
    slot.set_paused(True)
    taker = Background(slot.take)
    assert not taker.done.wait(0.05)
    slot.kick()
    assert taker.join() == []


def test_wait_space_blocks_while_full_and_returns_room() -> None:
    slot = BatchSlot(max_batch_size=4, max_wait_ms=10_000)
    assert slot.wait_space() == 4
    slot.put([claimed(0)], time.monotonic())
    assert slot.wait_space() == 3
    slot.put([claimed(i) for i in range(1, 4)], time.monotonic())
    filler = Background(slot.wait_space)
    assert not filler.done.wait(0.1)  # full
    assert ids(slot.take()) == ["t0", "t1", "t2", "t3"]
    assert filler.join() == 4
    # closing releases a blocked fetcher with 0
    slot.put([claimed(i) for i in range(4, 8)], time.monotonic())
    filler = Background(slot.wait_space)
    assert not filler.done.wait(0.05)
    slot.close()
    assert filler.join() == 0


def test_taking_a_suspect_wakes_a_fetcher_waiting_for_room() -> None:
    """Regression (found by the batching benchmark): a slot full of suspects was
    handed out one by one without waking the fetcher, which slept for good."""
    slot = BatchSlot(max_batch_size=2, max_wait_ms=10_000)
    slot.put([claimed(i, deliveries=2) for i in range(2)], time.monotonic())
    filler = Background(slot.wait_space)
    assert not filler.done.wait(0.05)  # full
    assert ids(slot.take()) == ["t0"]
    assert filler.join() == 1, "the fetcher was not woken when a suspect left the slot"


def test_remove_takes_tasks_out_by_id() -> None:
    slot = BatchSlot(max_batch_size=8, max_wait_ms=10_000)
    slot.put([claimed(i) for i in range(4)], time.monotonic())
    assert ids(slot.remove({"t1", "t3", "nope"})) == ["t1", "t3"]
    assert slot.remove({"nope"}) == []
    assert [t.id for t in slot.ids()] == ["t0", "t2"]


def test_configure_applies_new_limits_to_a_waiting_take() -> None:
    slot = BatchSlot(max_batch_size=8, max_wait_ms=30_000)
    slot.put([claimed(0), claimed(1)], time.monotonic())
    taker = Background(slot.take)
    assert not taker.done.wait(0.05)
    slot.configure(max_batch_size=2, max_wait_ms=30_000)
    assert ids(taker.join()) == ["t0", "t1"]
    assert slot.max_wait_s == 30.0


# -- run_isolated --------------------------------------------------------------------
class Predict:
    """predict over items 0..n-1 that raises if any item in the call is bad; records
    each call as (lo, hi) (the calls here are on runs of items)."""

    def __init__(self, bad: set[int]) -> None:
        self.bad = bad
        self.calls: list[tuple[int, int]] = []

    def __call__(self, items: list[int]) -> list[Any]:
        lo, hi = items[0], items[-1] + 1
        assert items == list(range(lo, hi)), items
        self.calls.append((lo, hi))
        if any(i in self.bad for i in items):
            raise ValueError(f"bad item in {lo}..{hi - 1}")
        return [i * 10 for i in items]


def test_bisection_isolates_one_bad_item_in_logarithmic_calls() -> None:
    n, bad = 32, 13
    predict = Predict({bad})
    out = run_isolated(predict, n)
    assert len(out) == n
    for i, r in enumerate(out):
        if i == bad:
            assert not r.ok and isinstance(r.error, ValueError)
        else:
            assert r.ok and r.value == i * 10 and r.error is None
    assert predict.calls[0] == (0, n)
    assert len(predict.calls) <= 2 * math.log2(n) + 2, predict.calls


def test_bisection_with_several_bad_items_and_all_bad() -> None:
    predict = Predict({0, 31})
    out = run_isolated(predict, 32)
    assert [r.ok for r in out] == [False] + [True] * 30 + [False]
    assert [r.value for r in out[1:31]] == [i * 10 for i in range(1, 31)]
    all_bad = Predict(set(range(8)))
    out = run_isolated(all_bad, 8)
    assert not any(r.ok for r in out) and len(out) == 8
    assert len(all_bad.calls) == 2 * 8 - 1  # every node of the bisection tree


def test_good_batch_is_one_call() -> None:
    predict = Predict(set())
    out = run_isolated(predict, 5)
    assert [r.value for r in out] == [0, 10, 20, 30, 40] and predict.calls == [(0, 5)]
    assert run_isolated(predict, 0) == []
    assert predict.calls == [(0, 5)]  # an empty batch calls nothing


def test_wrong_length_everywhere_fails_every_item_with_shape_error() -> None:
    calls = []

    def predict(items: list[int]) -> list[Any]:
        calls.append(items)
        return []

    out = run_isolated(predict, 4)
    assert len(out) == 4 and not any(r.ok for r in out)
    assert all(isinstance(r.error, BatchShapeError) for r in out)
    assert "0 results for 1 payloads" in str(out[0].error)
    assert len(calls) == 7


def test_wrong_length_only_for_big_batches_is_isolated() -> None:
    def predict(items: list[int]) -> list[Any]:
        values = [f"v{i}" for i in items]
        return values[:-1] if len(items) > 2 else values  # drops one result of big batches

    out = run_isolated(predict, 8)
    assert all(r.ok for r in out)
    assert [r.value for r in out] == [f"v{i}" for i in range(8)]


def test_exception_instance_in_results_fails_only_that_item() -> None:
    calls = []
    err = KeyError("missing")

    def predict(items: list[int]) -> list[Any]:
        calls.append(items)
        return ["a", err, "c"]

    out = run_isolated(predict, 3)
    assert [r.ok for r in out] == [True, False, True]
    assert out[1].error is err and [out[0].value, out[2].value] == ["a", "c"]
    assert calls == [[0, 1, 2]]  # no bisection


@pytest.mark.parametrize("value", [None, 3, "ab", b"ab", {"a": 1, "b": 2}, iter([1, 2])])
def test_non_list_return_is_a_shape_error(value: Any) -> None:
    out = run_isolated(lambda items: value, 2)
    assert len(out) == 2 and not any(r.ok for r in out)
    assert all(isinstance(r.error, BatchShapeError) for r in out)
    assert "must return a list" in str(out[0].error)


def test_tuple_return_is_accepted() -> None:
    out = run_isolated(lambda items: tuple(items), 3)
    assert [r.value for r in out] == [0, 1, 2]


# -- targets and batch policy ----------------------------------------------------------
MODULE = '''
import mtq

class Good(mtq.Model):
    max_batch_size = 8
    max_wait_ms = 2
    timeout_s = 10
    name = "good"
    version = "3"
    def predict(self, batch):
        return batch

instance = Good()

def handle(payload):
    return payload

class Lookalike:
    def predict(self, batch):
        return batch

class Plain:
    pass

class NeedsArgs(mtq.Model):
    def __init__(self, path):
        self.path = path

class BadBatch(mtq.Model):
    max_batch_size = 0

NUMBER = 42
'''


@pytest.fixture
def target_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name = "mtq_test_targets_" + uuid.uuid4().hex[:8]
    (tmp_path / f"{name}.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_load_model_subclass_instance_and_function(target_module: str) -> None:
    m = load_model(f"{target_module}:Good")
    assert type(m).__name__ == "Good" and isinstance(m, Model)
    assert m.describe() == ("good", "3") and not is_per_item(m)
    inst = load_model(f"{target_module}:instance")
    assert inst is sys.modules[target_module].instance
    fn = load_model(f"{target_module}:handle")
    assert isinstance(fn, FunctionModel) and is_per_item(fn)
    assert fn.predict([1, "x"]) == [1, "x"]
    assert fn.describe() == (f"{target_module}.handle", "0")
    assert load_target(f"{target_module}:handle") is sys.modules[target_module].handle


def test_class_with_predict_that_is_not_a_model_gets_a_hint(target_module: str) -> None:
    with pytest.raises(TargetError, match=r"does not subclass mtq\.Model.*class Lookalike\(mtq\.Model\)"):
        load_model(f"{target_module}:Lookalike")
    with pytest.raises(TargetError, match=r"is a class that is not an mtq\.Model"):
        load_model(f"{target_module}:Plain")


def test_bad_targets_raise_target_error(target_module: str) -> None:
    with pytest.raises(TargetError, match=r"is a int, not an mtq\.Model or a function"):
        load_model(f"{target_module}:NUMBER")
    with pytest.raises(TargetError, match="not a callable"):
        load_target(f"{target_module}:NUMBER")
    with pytest.raises(TargetError, match=r"package\.module:attr"):
        load_model(target_module)
    with pytest.raises(TargetError, match=r"package\.module:attr"):
        load_model(f"{target_module}:")
    with pytest.raises(TargetError, match="has no attribute 'Missing'"):
        load_model(f"{target_module}:Missing")
    with pytest.raises(TargetError, match=r"cannot import .*PYTHONPATH"):
        load_model("mtq_no_such_module_xyz:Model")
    with pytest.raises(TargetError, match=r"NeedsArgs\(\) failed.*no required arguments"):
        load_model(f"{target_module}:NeedsArgs")


def test_batch_policy_reads_class_attributes_and_applies_overrides(target_module: str) -> None:
    m = load_model(f"{target_module}:Good")
    p = BatchPolicy.of(m)
    assert (p.max_batch_size, p.max_wait_ms, p.timeout_s) == (8, 2.0, 10.0)
    assert isinstance(p.max_wait_ms, float)
    p = BatchPolicy.of(m, max_batch_size=64, max_wait_ms=0, timeout_s=1.5)
    assert (p.max_batch_size, p.max_wait_ms, p.timeout_s) == (64, 0.0, 1.5)
    assert BatchPolicy.of(m, max_wait_ms=7).max_batch_size == 8  # the rest unchanged
    fn = FunctionModel(len)
    p = BatchPolicy.of(fn)
    assert (p.max_batch_size, p.max_wait_ms, p.timeout_s) == (64, 0.0, 300.0)

    class NoLimit(Model):
        timeout_s = None

    assert BatchPolicy.of(NoLimit()).timeout_s is None


@pytest.mark.parametrize(("field", "value"), [
    ("max_batch_size", 0), ("max_batch_size", -1), ("max_batch_size", 100_001),
    ("max_batch_size", 2.0), ("max_batch_size", True), ("max_batch_size", "8"),
    ("max_wait_ms", -1), ("max_wait_ms", 60_001), ("max_wait_ms", "5"), ("max_wait_ms", True),
    ("timeout_s", 0), ("timeout_s", -1.0), ("timeout_s", "10"), ("timeout_s", False),
])
def test_batch_policy_rejects_bad_values_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(TargetError, match=f"{field} must be"):
        BatchPolicy.of(Model(), **{field: value})


def test_bad_class_attribute_names_the_model(target_module: str) -> None:
    m = load_model(f"{target_module}:BadBatch")
    with pytest.raises(TargetError, match=r"BadBatch: max_batch_size must be .* got 0"):
        BatchPolicy.of(m)
    assert BatchPolicy.of(m, max_batch_size=4).max_batch_size == 4


def test_base_model_predict_is_not_implemented() -> None:
    with pytest.raises(NotImplementedError, match=r"Model\.predict"):
        Model().predict([1])
    assert issubclass(mtq.Model, Model) and Model().describe() == ("Model", "0")


# -- devices ---------------------------------------------------------------------------
@pytest.mark.parametrize(("spec", "expected"), [
    ("cpu", ["cpu"]),
    ("cuda:0,cuda:1", ["cuda:0", "cuda:1"]),
    (" cuda:0 , cuda:3 ", ["cuda:0", "cuda:3"]),
    ("cuda", ["cuda:0"]),
    ("cpu,cuda:1", ["cpu", "cuda:1"]),
])
def test_parse_devices(spec: str, expected: list[str]) -> None:
    assert devices.parse_devices(spec) == expected


@pytest.mark.parametrize("spec", ["", "gpu", "cuda:", "cuda:x", "cuda:-1", "cuda:0,,cuda:1",
                                  "CPU", "mps:0", "cuda0"])
def test_parse_devices_rejects_bad_specs(spec: str) -> None:
    with pytest.raises(ConfigError, match="cuda:N"):
        devices.parse_devices(spec)


@pytest.mark.gpu_smoke
def test_parse_devices_all(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)
    assert devices.parse_devices("all") == ["cpu"]
    monkeypatch.setattr(devices, "cuda_count", lambda: 3)
    assert devices.parse_devices(" all ") == ["cuda:0", "cuda:1", "cuda:2"]


def test_child_env_pins_one_gpu_or_hides_them() -> None:
    assert devices.child_env("cuda:1") == ({"CUDA_VISIBLE_DEVICES": "1"}, "cuda:0")
    assert devices.child_env("cuda:0") == ({"CUDA_VISIBLE_DEVICES": "0"}, "cuda:0")
    assert devices.child_env("cpu") == ({"CUDA_VISIBLE_DEVICES": ""}, "cpu")


@pytest.mark.gpu_smoke
def test_torch_device_and_memory_on_cpu() -> None:
    dev = devices.torch_device("cpu")
    assert str(dev) == "cpu"
    assert devices.memory(dev) is None
    assert devices.memory("cpu") is None


def test_visible_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert devices.visible() is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    assert devices.visible() == "2"


# -- control messages -------------------------------------------------------------------
def test_control_message_builds_valid_commands() -> None:
    assert control.message("pause") == {"cmd": "pause"}
    assert control.message("reload", worker="w1") == {"cmd": "reload", "worker": "w1"}
    assert control.message("drain", supervisor="s1") == {"cmd": "drain", "supervisor": "s1"}
    assert control.message("scale", replicas=0) == {"cmd": "scale", "replicas": 0}
    assert control.message("scale", replicas=3, supervisor="s") == {
        "cmd": "scale", "replicas": 3, "supervisor": "s"}
    assert set(control.COMMANDS) == {"pause", "resume", "load", "unload", "reload", "reset",
                                     "drain", "stop", "scale"}


@pytest.mark.parametrize(("cmd", "fields", "match"), [
    ("restart", {}, "unknown control command 'restart'"),
    ("", {}, "unknown control command"),
    ("scale", {}, "replicas"),
    ("scale", {"replicas": -1}, "replicas"),
])
def test_control_message_rejects_bad_commands(cmd: str, fields: dict[str, Any],
                                              match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        control.message(cmd, **fields)
