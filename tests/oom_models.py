"""A worker target that runs out of memory for real (``tests.oom_models:Hungry``), for
tests/integration/test_oom.py: it runs in a ``mtq worker run`` process, so this module
imports without pytest. torch is imported in ``predict`` only.

On its first call, :class:`Hungry` limits its process's address space
(``RLIMIT_AS``) to what the process maps now plus room for :data:`ROOM_ITEMS` items'
tensors; each call then allocates :data:`ITEM_MB` MiB per item, so a batch of more
than about ROOM_ITEMS items fails the way the host fails an allocation (whatever
torch raises for it), and smaller ones run. When ``MTQ_TEST_LOG`` names a file, each
call appends ``B <size>`` when its allocation succeeded, or ``F <size> <error>``.

:class:`DeviceHungry` does the same on a CUDA device, where an item takes a sixth of the
memory free at setup (on a CPU it is :class:`Hungry`); each call first holds a small
tensor, and logs ``S <size> <allocated bytes> <reserved bytes>`` as it starts, so a test
can see that a failed call's tensors were freed before the next call began.
"""

from __future__ import annotations

import os
import resource
from typing import Any

import mtq

#: MiB allocated per item of a batch
ITEM_MB = 64
#: the address space left for tensors, in items (a batch of 4 fits with room to spare,
#: one of 8 does not)
ROOM_ITEMS = 6


def vm_size() -> int:
    """The bytes this process maps now (what RLIMIT_AS counts)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def _log(line: str) -> None:
    path = os.environ.get("MTQ_TEST_LOG")
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line.replace("\n", " ") + "\n").encode())
    finally:
        os.close(fd)


class Hungry(mtq.Model):
    """Allocates ITEM_MB MiB per item under a limit on its address space."""

    max_batch_size = 32
    max_wait_ms = 0
    name = "hungry"

    def setup(self, device: Any) -> None:
        self.limited = False

    def predict(self, batch: list[Any]) -> list[Any]:
        import torch

        if not self.limited:  # the worker's threads are up by now, their stacks mapped
            _, hard = resource.getrlimit(resource.RLIMIT_AS)
            resource.setrlimit(resource.RLIMIT_AS,
                               (vm_size() + ROOM_ITEMS * ITEM_MB * 2**20, hard))
            self.limited = True
        try:
            activations = torch.ones(len(batch) * ITEM_MB * 2**20 // 4)
        except BaseException as exc:
            _log(f"F {len(batch)} {type(exc).__name__}: {str(exc)[:300]}")
            raise
        _log(f"B {len(batch)}")
        total = float(activations[:len(batch)].sum())
        return [{"i": p["i"], "n": len(batch), "sum": total} for p in batch]


class DeviceHungry(Hungry):
    """:class:`Hungry` on a CUDA device: an item takes a sixth of the memory that was
    free at setup, so a batch of 6 or more cannot be allocated and one of 4 can."""

    name = "device-hungry"

    def setup(self, device: Any) -> None:
        import torch

        super().setup(device)
        self.device = device
        self.cuda = getattr(device, "type", str(device)) == "cuda"
        if self.cuda:
            free, _ = torch.cuda.mem_get_info(device)
            self.item = free // 6

    def predict(self, batch: list[Any]) -> list[Any]:
        if not self.cuda:
            return super().predict(batch)
        import torch

        cuda = torch.cuda
        _log(f"S {len(batch)} {cuda.memory_allocated(self.device)} "
             f"{cuda.memory_reserved(self.device)}")
        held = torch.ones(1024, device=self.device)  # a failed call's frame holds it
        try:
            activations = torch.empty(len(batch) * self.item, dtype=torch.uint8,
                                      device=self.device)
        except BaseException as exc:
            _log(f"F {len(batch)} {type(exc).__name__}: {str(exc)[:300]}")
            raise
        _log(f"B {len(batch)}")
        total = float(held.sum()) + activations.numel()
        return [{"i": p["i"], "n": len(batch), "sum": total} for p in batch]
