"""The model contract: what a worker process runs.

A target is either a :class:`Model` subclass (weights loaded once per process in
:meth:`Model.setup`, payloads run in dynamic batches through :meth:`Model.predict`)
or a plain function ``handle(payload) -> result``, which runs one payload per call.

This module does not import torch: ``setup`` receives a ``torch.device`` built by
the worker process only when torch is installed (see :mod:`mtq.workers.devices`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, ClassVar

from mtq.workers.options import Configurable


@dataclass(frozen=True, slots=True)
class Progress:
    """Yield ``(i, mtq.Progress(value))`` from a streaming ``predict`` to report the
    progress of item ``i`` (a progress event; nothing is stored)."""

    value: Any


class Model(Configurable):
    """Base class of a batched model served by mtq workers.

    Override :meth:`setup` and :meth:`predict`; tune the class attributes::

        class Embedder(mtq.Model):
            max_batch_size = 32   # run as soon as 32 requests are claimable ...
            max_wait_ms = 5       # ... or when the oldest has waited 5 ms
            def setup(self, device): self.net = load(device)
            def predict(self, batch): return self.net(batch)

    ``predict`` returns one result per payload, in order. It may instead be a
    generator that streams chunks as they are made (text-to-speech audio, say):
    ``yield i, chunk`` sends a chunk of item ``i`` (its index in the batch) to that
    task's client as a token event, in order; ``yield i, mtq.Progress(x)`` reports
    progress; ``return results`` gives the results (by default each item's result is
    the list of its chunks). To fail a single item
    without failing the batch, put an exception instance in its place. If
    ``predict`` raises, the worker splits the batch to find the failing items,
    so one bad request does not fail the others. A failed item is retried with
    backoff, unless its exception is an :class:`mtq.PermanentError` (a malformed
    request, say): then it fails at once.

    Settings of the model itself (which weights, a pooling) are declared as
    :class:`mtq.Option` class attributes (``model = mtq.Option(str)``): given with
    ``--set KEY=VALUE`` on the worker commands (checked before anything starts) or
    :meth:`set_options` in Python, they are set on the instance before ``setup``,
    recorded in the model catalogue and part of the version (see
    :mod:`mtq.workers.options`, docs/workers.md "Model options").

    Running out of memory (``torch.OutOfMemoryError``, MPS's, a ``MemoryError``)
    charges no task that did not cause it: the batch is split and its parts run in
    the same delivery, after what the failed call held is freed; the worker then
    takes smaller batches until a run of batches fits. A payload that runs out of
    memory alone fails with :class:`mtq.DeviceOutOfMemory` and is retried alone.
    See docs/workers.md, "Out of memory".
    """

    #: most payloads per predict call
    max_batch_size: ClassVar[int] = 32
    #: longest a request waits for the batch to fill, from its arrival (ms)
    max_wait_ms: ClassVar[float] = 5.0
    #: longest one predict call may run (s); past it the supervisor kills the process
    #: (a hung kernel cannot be interrupted from a thread). None: no limit.
    timeout_s: ClassVar[float | None] = 300.0
    #: reported in the worker registry; ``name`` defaults to the class name
    name: ClassVar[str] = ""
    #: the served model's version, which keys the result cache: set it when you version
    #: your weights; left "0", the worker computes one after setup from the target's
    #: source file and its torch tensors (see mtq.workers.catalogue)
    version: ClassVar[str] = "0"
    #: the result is a function of the payload (the default assumption for a Model,
    #: which the result cache relies on; informative here, decisive for a Generator)
    deterministic: ClassVar[bool] = False
    #: False: never answer requests from the result cache (the model reads state
    #: outside its payload, samples without a seed, or has side effects)
    cacheable: ClassVar[bool] = True

    def setup(self, device: Any) -> None:
        """Load weights once per process onto ``device`` (a ``torch.device`` when
        torch is installed, else the device string)."""

    def predict(self, batch: list[Any]) -> list[Any]:
        """Run a batch of decoded payloads; return one result per payload, in order."""
        raise NotImplementedError(f"{type(self).__name__}.predict is not implemented")

    def describe(self) -> tuple[str, str]:
        """(name, version) for the registry."""
        return (self.name or type(self).__name__, str(self.version))


class FunctionModel(Model):
    """Adapts ``handle(payload) -> result`` to the model contract: one payload per
    call, so failures are per item and no bisection is needed."""

    max_batch_size = 64
    max_wait_ms = 0.0
    #: the worker calls predict with one payload at a time (the timeout is per call)
    per_item: ClassVar[bool] = True

    def __init__(self, func: Callable[[Any], Any]) -> None:
        self.func = func
        if inspect.isgeneratorfunction(func):  # a streaming handler: chunks, then a result
            self.predict = self._stream  # type: ignore[method-assign,assignment]

    def predict(self, batch: list[Any]) -> list[Any]:
        return [self.func(p) for p in batch]

    def _stream(self, batch: list[Any]) -> Generator[tuple[int, Any], None, list[Any]]:
        results: list[Any] = []
        for i, p in enumerate(batch):
            chunks: list[Any] = []
            gen = self.func(p)
            try:
                while True:
                    try:
                        chunk = next(gen)
                    except StopIteration as stop:
                        results.append(chunks if stop.value is None else stop.value)
                        break
                    if not isinstance(chunk, Progress):
                        chunks.append(chunk)
                    yield i, chunk
            finally:
                gen.close()  # (stopped between two steps: a cancel, a run timeout)
        return results

    def describe(self) -> tuple[str, str]:
        name = getattr(self.func, "__qualname__", None) or type(self.func).__name__
        return (f"{getattr(self.func, '__module__', '?')}.{name}", str(self.version))


def is_per_item(model: object) -> bool:
    """True if the worker should call ``predict`` one payload at a time."""
    return bool(getattr(model, "per_item", False))
