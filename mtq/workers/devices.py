"""Device slots: parsing ``--devices``, pinning a child process, building its device.

A worker process pinned to ``cuda:N`` is started with ``CUDA_VISIBLE_DEVICES=N``
(set in its environment before it exists, so before torch is imported in it) and
sees that GPU as ``cuda:0``. A CPU worker gets ``CUDA_VISIBLE_DEVICES=""`` so it
cannot touch a GPU by accident. torch is imported here only inside functions that
need it.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

from mtq.errors import ConfigError

_CUDA = re.compile(r"^cuda:(\d+)$")


def cuda_count() -> int:
    """How many CUDA devices this machine has (0 without torch or without a GPU)."""
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def parse_devices(spec: str) -> list[str]:
    """``cpu`` | ``cuda:0,cuda:1`` | ``all`` (every GPU, or cpu when there is none).

    Raises ConfigError for anything else, naming the accepted forms."""
    spec = spec.strip()
    if spec == "all":
        n = cuda_count()
        return [f"cuda:{i}" for i in range(n)] if n else ["cpu"]
    out: list[str] = []
    for part in (p.strip() for p in spec.split(",")):
        if part == "cpu" or _CUDA.match(part):
            out.append(part)
        elif part == "cuda":
            out.append("cuda:0")
        else:
            raise ConfigError(f"bad device {part!r} in --devices {spec!r}: use cpu, "
                              "cuda:N[,cuda:M...] or all")
    if not out:
        raise ConfigError("--devices is empty: use cpu, cuda:N[,cuda:M...] or all")
    return out


def check_device(name: str) -> str:
    """One device name: ``cpu``, ``cuda:N`` (``cuda`` means ``cuda:0``) or ``mps``.

    Raises ConfigError naming the accepted forms."""
    name = name.strip()
    if name == "cuda":
        return "cuda:0"
    if name in ("cpu", "mps") or _CUDA.match(name):
        return name
    raise ConfigError(f"bad device {name!r}: use cpu, cuda:N or mps")


def child_env(device: str) -> tuple[dict[str, str], str]:
    """(environment entries for a child pinned to ``device``, the device it should use)."""
    m = _CUDA.match(device)
    if m:
        return {"CUDA_VISIBLE_DEVICES": m.group(1)}, "cuda:0"
    return {"CUDA_VISIBLE_DEVICES": ""}, device


def torch_device(name: str, needed: bool = True) -> Any:
    """A ``torch.device`` for ``name`` when torch is installed, else the string
    (a plain function worker on a machine without torch). ``needed=False`` (a target
    that never looks at its device: a plain function): the string ``"cpu"`` for the
    CPU unless torch is already imported, so that such a worker does not spend
    seconds importing torch at start-up."""
    if not needed and name == "cpu" and "torch" not in sys.modules:
        return name
    try:
        import torch
    except ImportError:
        if name != "cpu":
            raise ConfigError(f"device {name!r} needs torch: pip install 'mtq[workers]'") from None
        return name
    return torch.device(name)


def memory(device: Any) -> dict[str, int] | None:
    """Allocated / reserved / total bytes of a CUDA device; None for other devices."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch  # already imported: the device is a torch.device

    props = torch.cuda.get_device_properties(device)
    return {"allocated": int(torch.cuda.memory_allocated(device)),
            "reserved": int(torch.cuda.memory_reserved(device)),
            "total": int(props.total_memory)}


def visible() -> str | None:
    """CUDA_VISIBLE_DEVICES as this process sees it (None if unset)."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def engine_stream(device: Any) -> Any:
    """A context manager under which an engine's model thread runs: on CUDA, a stream
    of its own (torch's current stream is per thread), so that engines in one process
    neither serialise their kernels behind one stream nor wait on each other's
    synchronisations; elsewhere, nothing."""
    import contextlib

    if getattr(device, "type", None) != "cuda":
        return contextlib.nullcontext()
    import torch  # already imported: the device is a torch.device

    return torch.cuda.stream(torch.cuda.Stream(device))


def settle(device: Any) -> None:
    """Wait for the work this thread queued on its current CUDA stream (after a model's
    setup: the engine that serves the model runs on a stream of its own, which does
    not wait for the kernels another stream still runs); elsewhere, nothing."""
    if getattr(device, "type", None) != "cuda":
        return
    import torch

    torch.cuda.current_stream(device).synchronize()


def model_bytes(model: Any) -> int:
    """Bytes of the torch tensors a model object holds: the parameters and buffers of
    every ``torch.nn.Module`` among its attributes (and in their lists, tuples and
    dicts, one level down), and plain tensors there, each storage counted once. 0
    without torch or without tensors."""
    torch = sys.modules.get("torch")
    if torch is None:
        return 0
    seen: set[tuple[int, str]] = set()
    total = 0

    def tensor(t: Any) -> None:
        nonlocal total
        try:
            storage = t.untyped_storage()
            ptr = (storage.data_ptr(), str(t.device))
        except (RuntimeError, AttributeError):  # a meta or sparse tensor
            return
        if ptr in seen:
            return
        seen.add(ptr)
        total += int(storage.nbytes())

    def visit(value: Any) -> None:
        if isinstance(value, torch.nn.Module):
            for p in value.parameters():
                tensor(p)
            for b in value.buffers():
                tensor(b)
        elif isinstance(value, torch.Tensor):
            tensor(value)

    for value in list(vars(model).values()) if hasattr(model, "__dict__") else []:
        if isinstance(value, (list, tuple)):
            for v in value:
                visit(v)
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)
        else:
            visit(value)
    return total


def allocated(device: Any) -> int:
    """Bytes the CUDA caching allocator has handed out on ``device`` (0 elsewhere)."""
    if getattr(device, "type", None) != "cuda":
        return 0
    import torch

    return int(torch.cuda.memory_allocated(device))


def free_bytes(device: Any) -> int | None:
    """Free memory of a CUDA device as the driver sees it; None for other devices
    (their memory is the host's, which the budget alone guards)."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def empty_cache(device: Any) -> None:
    """Give the CUDA caching allocator's unused blocks back to the device (after an
    unload: the memory the model held becomes free for other processes too)."""
    if getattr(device, "type", None) != "cuda":
        return
    import torch

    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
