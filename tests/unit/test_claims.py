"""mtq.workers.claims: the claim size follows the measured time per task."""

from __future__ import annotations

from mtq.workers.batching import BatchSlot
from mtq.workers.claims import CLAIM_AHEAD_S, ClaimSizer
from tests.unit.test_batching import claimed


def test_a_per_item_model_starts_at_one_and_follows_its_time_per_task() -> None:
    slot = BatchSlot(64, 0)
    sizer = ClaimSizer(slot)
    sizer.reset(per_item=True)
    assert slot.unit() == 1  # not measured yet
    sizer.observe(1, 0.5)  # a slow function: one task at a time
    assert slot.unit() == 1
    sizer.observe(1, CLAIM_AHEAD_S / 8)  # faster: halved towards it, so claims grow
    assert sizer.task_s is not None and sizer.task_s < 0.5 and slot.unit() == 1
    for _ in range(20):
        sizer.observe(slot.unit(), slot.unit() * CLAIM_AHEAD_S / 8)
    assert slot.unit() == 8  # 5 ms of its work
    sizer.observe(8, 8 * 0.2)  # one slow batch: small claims at once
    assert slot.unit() == 1
    for _ in range(40):
        sizer.observe(slot.unit(), slot.unit() * 1e-6)
    assert slot.unit() == 64  # capped by max_batch_size
    slot.set_batch_size(16)  # lowered after running out of memory: it caps the claim
    assert slot.unit() == 16


def test_a_batch_model_claims_whole_batches() -> None:
    slot = BatchSlot(32, 5)
    sizer = ClaimSizer(slot)
    sizer.reset(per_item=False)
    sizer.observe(32, 2.0)  # a slow batch: its tasks start together
    assert slot.unit() == 32
    slot.claim_ahead(2)
    assert slot.wait_space() == 32


def test_the_slot_claims_and_holds_claims_of_its_unit() -> None:
    slot = BatchSlot(64, 0)
    slot.set_claim_size(1)
    assert slot.wait_space() == 1
    slot.put([claimed("a")], 0.0)
    assert slot.full()  # one claim ahead of one task
    slot.set_claim_size(4)
    assert slot.wait_space() == 3


def test_a_slow_task_cuts_a_per_item_batch_and_the_slot_trims_to_its_claims() -> None:
    slot = BatchSlot(64, 0)
    sizer = ClaimSizer(slot)
    sizer.reset(per_item=True)
    sizer.observe(64, 64e-6)
    assert slot.unit() == 64
    assert not sizer.slow(CLAIM_AHEAD_S / 2, 10)  # not slow: the batch goes on
    assert sizer.slow(0.5, 10)  # ten more of half a second: cut, claims of one
    assert slot.unit() == 1
    sizer.observe(11, 0.5)  # the batch's end: measured already, skipped
    assert sizer.task_s == 0.5
    assert not sizer.slow(0.5, 1)  # one more: as much as a claim holds, kept
    slot.put([claimed(i) for i in range(5)], 0.0)
    assert [t.id for t in slot.trim()] == ["t1", "t2", "t3", "t4"]  # the tail
    assert [t.id for t in slot.ids()] == ["t0"] and slot.trim() == []
