"""``@mtq.rq.batched``: an RQ job function that takes the list of many jobs' payloads.

::

    @mtq.rq.batched(max_batch_size=32, max_wait_ms=5)
    def embed(texts: list[str]) -> list[list[float]]:
        return model.encode(texts)

    q.enqueue(embed, "hello")          # one job: one payload, one positional argument

``mtq rq worker`` groups the queued jobs of ``embed`` into one call (as many as
``max_batch_size``, waiting at most ``max_wait_ms`` for the batch to fill) and stores
result ``i`` as the return value of job ``i``. An exception instance in a slot fails
that job alone; a call that raises is bisected so one bad payload fails alone.
Called with one argument (what a plain ``rq worker`` does), the decorated function
runs a batch of one and returns its single result, so the same code works under
both workers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# BatchArityError is defined in mtq.errors and imported from here too
from mtq.errors import BatchArityError, BatchShapeError, ConfigError


@dataclass(frozen=True)
class Batched:
    """How a batched function is served: read from the function's ``__mtq_batched__``."""

    func: Callable[[list[Any]], Any]
    max_batch_size: int
    max_wait_ms: float

    def call_batch(self, payloads: list[Any]) -> list[Any]:
        """Run the function on ``payloads``; one result per payload, in order.
        Raises BatchShapeError (also a TypeError) when the function returns anything else."""
        results = self.func(list(payloads))
        if not isinstance(results, (list, tuple)) or len(results) != len(payloads):
            got = (f"{len(results)} results" if isinstance(results, (list, tuple))
                   else f"a {type(results).__name__}")
            name = getattr(self.func, "__qualname__", "?")
            raise BatchShapeError(f"batched function {name} returned {got} for "
                            f"{len(payloads)} payloads; it must return a list with one "
                            "result per payload, in order")
        return list(results)


def batched_spec(obj: object) -> Batched | None:
    """The :class:`Batched` of a function decorated with :func:`batched`, else None."""
    spec = getattr(obj, "__mtq_batched__", None)
    return spec if isinstance(spec, Batched) else None


def check_arity(target: object, args: tuple[Any, ...] | list[Any], kwargs: dict[str, Any]
                ) -> Any:
    """The one payload of a job of a batched function; BatchArityError otherwise."""
    if len(args) != 1 or kwargs:
        name = getattr(target, "__qualname__", None) or getattr(target, "__name__", "?")
        raise BatchArityError(
            f"{name} is batched: each job takes exactly one positional argument (its "
            f"payload), got {len(args)} positional and {len(kwargs)} keyword argument(s); "
            f"enqueue one job per payload, e.g. q.enqueue({name}, payload), and pack "
            "several values into one dict or list")
    return args[0]


def _wrap(func: Callable[[list[Any]], Any], max_batch_size: int, max_wait_ms: float
          ) -> Callable[..., Any]:
    if not callable(func):
        raise ConfigError(f"@batched needs a function, got {type(func).__name__}")
    if int(max_batch_size) < 1:
        raise ConfigError(f"max_batch_size must be >= 1, got {max_batch_size}")
    if not 0 <= float(max_wait_ms) <= 60_000:
        raise ConfigError(f"max_wait_ms must be between 0 and 60000, got {max_wait_ms}")
    spec = Batched(func, int(max_batch_size), float(max_wait_ms))

    # a plain function, not a callable object: RQ enqueues a function by its import
    # path ("module.name"), which a JSON job can carry; a callable object it would pickle
    @functools.wraps(func)
    def one(*args: Any, **kwargs: Any) -> Any:
        (result,) = spec.call_batch([check_arity(one, args, kwargs)])
        if isinstance(result, BaseException):
            raise result
        return result

    one.__mtq_batched__ = spec  # type: ignore[attr-defined]
    return one


def batched(func: Callable[..., Any] | None = None, *, max_batch_size: int = 32,
            max_wait_ms: float = 5.0) -> Any:
    """Mark an RQ job function as batched: it receives a list of payloads and returns
    one result per payload. Usable bare (``@batched``) or with arguments. Raises
    ValueError for a bad max_batch_size or max_wait_ms."""
    if func is not None:
        return _wrap(func, max_batch_size, max_wait_ms)
    return lambda f: _wrap(f, max_batch_size, max_wait_ms)
