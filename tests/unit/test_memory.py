"""Running out of memory, without Redis: telling it apart (with the errors torch
really raises), splitting a batch outside the ``except`` block with the failed
call's tensors freed first, the culprit search, and the load limits."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch

import mtq
from mtq.broker.protocol import Claimed
from mtq.errors import DeviceOutOfMemory
from mtq.workers import memory
from mtq.workers.batching import BatchSlot, run_isolated, run_one
from mtq.workers.memory import Limit, is_oom

pytestmark = pytest.mark.timeout(30)


def cuda_oom() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; "
                                  "79.1 GiB total capacity; 1.2 GiB free)")


# -- telling it apart ---------------------------------------------------------------------
def test_out_of_memory_errors_are_told_apart() -> None:
    assert is_oom(cuda_oom())
    assert is_oom(torch.cuda.OutOfMemoryError("CUDA out of memory."))  # the same class
    assert is_oom(MemoryError())
    assert is_oom(DeviceOutOfMemory("CUDA out of memory"))
    assert is_oom(RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. "
                               "DefaultCPUAllocator: can't allocate memory: you tried to "
                               "allocate 1073741824 bytes. Error code 12"))
    assert is_oom(RuntimeError("MPS backend out of memory (MPS allocated: 17 GB)"))
    assert is_oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling "
                               "`cublasCreate(handle)`"))
    assert not is_oom(RuntimeError("size mismatch"))
    assert not is_oom(ValueError("out of memory"))  # not a runtime error of a device
    assert not is_oom(KeyError("x"))


def test_the_error_torch_raises_on_the_cpu_when_an_allocation_fails() -> None:
    """Whatever torch's CPU allocator raises for an allocation it cannot make (here
    one too large for any address space) is taken for running out of memory."""
    with pytest.raises(RuntimeError) as info:
        torch.empty(1 << 62, dtype=torch.uint8)
    assert is_oom(info.value), repr(info.value)


def test_a_task_alone_fails_with_device_out_of_memory_naming_the_original() -> None:
    err = memory.alone(cuda_oom())
    assert isinstance(err, DeviceOutOfMemory) and isinstance(err, mtq.MtqError)
    assert mtq.DeviceOutOfMemory is DeviceOutOfMemory
    text = f"{type(err).__name__}: {err}"
    assert text.startswith("DeviceOutOfMemory: the task ran out of memory on its own")
    assert "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB" in text
    assert "larger device" in text or "more memory" in text
    assert isinstance(err.__cause__, torch.OutOfMemoryError)
    assert memory.alone(err) is err


# -- splitting ----------------------------------------------------------------------------
class Tensor:
    """Stands for the device tensors a failed call held (weak-referenceable)."""


class Allocating:
    """predict that 'allocates' a Tensor per call and runs out of memory past ``limit``
    items, or whenever an item of ``poison`` is in the call. Before each call it
    records whether the previous failed call's Tensor is still alive."""

    def __init__(self, limit: int = 1 << 30, poison: frozenset[int] = frozenset()) -> None:
        self.limit = limit
        self.poison = poison
        self.calls: list[list[int]] = []
        self.last: weakref.ref[Tensor] | None = None
        self.held_at_next_call: list[bool] = []

    def __call__(self, items: list[int]) -> list[Any]:
        if self.last is not None:
            self.held_at_next_call.append(self.last() is not None)
            self.last = None
        self.calls.append(list(items))
        activations = Tensor()
        if len(items) > self.limit or self.poison & set(items):
            self.last = weakref.ref(activations)
            raise cuda_oom()
        return [i * 10 for i in items]


def test_a_batch_that_runs_out_of_memory_is_split_and_its_tensors_freed_first() -> None:
    gc.disable()  # nothing but reference counts may free them: no collection hides a leak
    try:
        model = Allocating(limit=4)
        calls: list[tuple[list[int], str]] = []
        out = run_isolated(model, 16, calls=calls)
    finally:
        gc.enable()
    assert [r.value for r in out] == [i * 10 for i in range(16)] and all(r.ok for r in out)
    assert model.held_at_next_call and not any(model.held_at_next_call), \
        "a part ran while the failed call's tensors were still held"
    # halves, then quarters: 16 -> 8 (out of memory) -> 4, 4; the other 8 likewise
    assert [len(c) for c in model.calls] == [16, 8, 4, 4, 8, 4, 4]
    assert [k for _, k in calls] == ["oom", "oom", "ok", "ok", "oom", "ok", "ok"]
    load, ran = memory.load_failures(calls, lambda j: out[j].ok)
    assert sorted(len(c) for c in load) == [8, 8, 16] and {len(c) for c in ran} == {4}


def test_an_item_that_runs_out_of_memory_alone_fails_alone() -> None:
    model = Allocating(poison=frozenset({5}))
    out = run_isolated(model, 8)
    assert [r.ok for r in out] == [i != 5 for i in range(8)]
    err = out[5].error
    assert isinstance(err, DeviceOutOfMemory) and isinstance(err.__cause__, torch.OutOfMemoryError)
    assert [5] in model.calls
    assert not any(model.held_at_next_call)


@pytest.mark.parametrize("fitted_s", [0.0, 1.0])
def test_a_culprit_in_a_batch_size_that_fits_is_found_with_few_calls(fitted_s: float) -> None:
    """A batch of a size that ran before runs out of memory: probes run most items
    together, so they finish in fewer calls than halves, quarters, eighths ... would
    take; the culprit ends alone, failed. When a failed call costs little next to one
    that runs (``fitted_s``: a call that runs takes a second here), probes are larger:
    more of them fail, and fewer run."""
    ran_calls, halving_calls = [], []
    for culprit in range(32):
        model = Allocating(poison=frozenset({culprit}))
        out = run_isolated(model, 32, fits=32, fitted_s=fitted_s)
        assert [r.ok for r in out] == [i != culprit for i in range(32)], culprit
        assert [r.value for r in out if r.ok] == [i * 10 for i in range(32) if i != culprit]
        assert [culprit] in model.calls and isinstance(out[culprit].error, DeviceOutOfMemory)
        ran_calls.append(len([c for c in model.calls if culprit not in c]))
        halving = Allocating(poison=frozenset({culprit}))
        run_isolated(halving, 32)
        halving_calls.append(len([c for c in halving.calls if culprit not in c]))
        assert len(model.calls) <= 16, (culprit, model.calls)
    assert all(a <= b for a, b in zip(ran_calls, halving_calls)), (ran_calls, halving_calls)
    assert sum(ran_calls) < sum(halving_calls) * (0.7 if fitted_s == 0 else 0.4)


def test_probing_gives_way_to_halves_when_the_load_not_an_item_was_the_cause() -> None:
    model = Allocating(limit=5)
    calls: list[tuple[list[int], str]] = []
    out = run_isolated(model, 16, fits=16, calls=calls)  # 16 ran before; now 6 do not fit
    assert all(r.ok for r in out) and [r.value for r in out] == [i * 10 for i in range(16)]
    # the search's last suspect ran alone, and fitted: the rest went in halves
    lone = next(n for n, c in enumerate(model.calls) if len(c) == 1)
    assert all(len(c) > 1 for c in model.calls[lone + 1:])
    assert len(model.calls) <= 2 * 7 + 1, model.calls  # twice halving's, at most
    load, _ = memory.load_failures(calls, lambda j: out[j].ok)
    assert load and all(len(c) > 5 for c in load)  # every call over the limit, no other


def test_another_failure_in_a_probe_is_split_as_any() -> None:
    bad = 3

    def predict(items: list[int]) -> list[Any]:
        if 9 in items:
            raise cuda_oom()
        if bad in items and len(items) < 16:
            raise ValueError("bad item")
        return list(items)

    out = run_isolated(predict, 16, fits=16)
    assert [r.ok for r in out] == [i not in (bad, 9) for i in range(16)]
    assert isinstance(out[bad].error, ValueError)
    assert isinstance(out[9].error, DeviceOutOfMemory)


def test_a_per_item_call_that_runs_out_of_memory_ran_out_alone() -> None:
    def predict(items: list[int]) -> list[Any]:
        raise MemoryError()

    r = run_one(predict, 0)
    assert not r.ok and isinstance(r.error, DeviceOutOfMemory)
    assert "MemoryError" in str(r.error)


# -- limits -------------------------------------------------------------------------------
def test_a_limit_goes_down_to_what_ran_and_back_up_after_a_run_of_successes() -> None:
    lim = Limit("batch size", 32, recover_after=3)
    assert lim.ran(32) is False and not lim.lowered and lim.good == 32
    assert lim.out_of_memory(32, ran=8)  # 32 failed now; 8 ran in the same batch
    assert lim.value == 8 and lim.lowered
    assert lim.out_of_memory(8, ran=4) and lim.value == 4
    assert not lim.out_of_memory(16, ran=4) and lim.value == 4  # already below
    lim = Limit("batch size", 32, recover_after=3)
    lim.ran(12)
    assert lim.out_of_memory(32)  # 12 ran before, less than what failed: it fits
    assert lim.value == 12
    for _ in range(2):
        assert lim.ran(12) is False and lim.value == 12
    assert lim.ran(12) and lim.value == 15  # a quarter up
    steps = [lim.value]
    while lim.lowered:
        for _ in range(3):
            lim.ran(lim.value or 0)
        steps.append(lim.value)
    assert steps == [15, 18, 22, 27, 32], steps


def test_a_limit_with_nothing_known_halves_and_never_goes_below_one() -> None:
    lim = Limit("running requests", 16, recover_after=5)
    assert lim.out_of_memory(16) and lim.value == 8
    assert lim.out_of_memory(8) and lim.value == 4
    assert lim.out_of_memory(2) and lim.value == 1
    assert not lim.out_of_memory(2) and lim.value == 1


def test_an_unlimited_budget_gets_a_value_and_goes_back_to_none() -> None:
    lim = Limit("tokens in flight", None, recover_after=1)
    assert lim.out_of_memory(1000) and lim.value == 500
    while lim.value is not None:
        lim.ran(lim.value)
    assert not lim.lowered and lim.failed is None


def test_a_task_that_ran_out_of_memory_alone_runs_alone_when_it_comes_back() -> None:
    def claimed(i: int) -> Claimed:
        return Claimed(id=f"t{i}", token="1", payload=b"", stream=None, attempts=1,
                       deliveries=2, retries=None)

    slot = BatchSlot(8, 0)
    assert slot.alone_in([claimed(i) for i in range(4)]) == []
    slot.run_alone(["t3"])
    slot.put([claimed(i) for i in range(6)], 0.0)
    batch = slot.take() or []
    assert [t.id for t in batch] == [f"t{i}" for i in range(6)]  # in the batch ...
    assert slot.alone_in(batch) == [3]  # ... called on its own
    assert slot.solo(claimed(3)) and not slot.solo(claimed(4))
    model = Allocating(poison=frozenset({3}))
    out = run_isolated(model, 6, alone=[3])
    assert model.calls == [[3], [0, 1, 2, 4, 5]]
    assert [r.ok for r in out] == [True, True, True, False, True, True]


def test_a_search_carries_the_last_suspects_into_the_next_batch_instead_of_small_calls(
        ) -> None:
    """A stream of batches of 32 with one task in 50 that does not fit: suspects left
    once all else ran, and innocents left over, wait for the next batch (filled up with
    other tasks) instead of running in calls of a few items; every task ends once."""
    tasks = [f"p{i}" if i % 50 == 49 else f"g{i}" for i in range(2000)]
    waiting = list(tasks)
    suspected: set[str] = set()
    ends: dict[str, list[bool]] = {t: [] for t in tasks}
    sizes: list[int] = []
    while waiting:
        batch, waiting = waiting[:32], waiting[32:]

        def predict(items: list[int]) -> list[Any]:
            if any(batch[j].startswith("p") for j in items):  # noqa: B023
                raise cuda_oom()
            sizes.append(len(items))
            return [batch[j] for j in items]  # noqa: B023

        carry: list[tuple[int, bool]] = []
        known = [j for j, t in enumerate(batch) if t in suspected]
        suspected -= set(batch)
        out = run_isolated(predict, len(batch), fits=32, fitted_s=1.0, suspects=known,
                           carry=carry)
        for t, r in zip(batch, out):
            if not r.later:
                ends[t].append(r.ok)
                assert r.ok or isinstance(r.error, DeviceOutOfMemory), r
        waiting = [batch[j] for j, _ in carry] + waiting
        suspected |= {batch[j] for j, s in carry if s}
    assert all(ends[t] == [not t.startswith("p")] for t in tasks), \
        [(t, e) for t, e in ends.items() if e != [not t.startswith("p")]][:5]
    small = [s for s in sizes if s <= 8]
    assert len(small) <= 3, small  # the last batches only (nothing left to fill them)
    assert len(sizes) <= 1.15 * len(tasks) / 32, len(sizes)
