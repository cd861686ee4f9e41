"""The generator contract: token generation served by continuous batching.

A :class:`Generator` keeps a *running batch* of requests. The engine
(:mod:`mtq.workers.engine`) calls, between steps:

* :meth:`Generator.admit` once per request when it is claimed: check the payload
  and say how many tokens it will take (``prompt_tokens``, ``max_tokens``), so the
  engine can keep the step within the token budgets;
* :meth:`Generator.prefill` for the requests admitted since the last step;
* :meth:`Generator.decode` for every running request: one step, the next token of
  each;
* :meth:`Generator.release` when requests leave the batch (finished, cancelled,
  failed), to free their KV cache.

A request ends when the handler calls :meth:`Generation.finish`. Its tokens are
streamed to the client as they are produced, each with its index; the task's
result is :meth:`Generator.result` (by default the list of tokens).

This module does not import torch.
"""

from __future__ import annotations

import hashlib
from typing import Any, ClassVar

from mtq.workers.options import Configurable

_UNSET: Any = object()


def default_seed(task_id: str) -> int:
    """A request's seed when its payload gives none: derived from the task id, so a
    redelivered request samples exactly the tokens its first delivery streamed."""
    return int.from_bytes(hashlib.sha256(task_id.encode()).digest()[:8], "big") >> 1


class Generation:
    """One request in the running batch (what prefill and decode receive).

    ``payload`` is the decoded request; ``seed`` its sampling seed (the payload's
    ``"seed"`` if it is a dict with an integer one, else derived from the task id);
    ``tokens`` what was generated so far (appended by the engine); ``state`` is the
    handler's own per-request slot (a KV cache handle, say).
    """

    __slots__ = ("_result", "finished", "id", "max_tokens", "payload", "prompt_tokens", "seed",
                 "state", "tokens")

    def __init__(self, task_id: str, payload: Any, seed: int | None = None) -> None:
        self.id = task_id
        self.payload = payload
        if seed is None:
            given = payload.get("seed") if isinstance(payload, dict) else None
            seed = given if isinstance(given, int) and not isinstance(given, bool) else \
                default_seed(task_id)
        self.seed: int = seed
        self.tokens: list[Any] = []
        self.state: Any = None
        #: tokens its prefill processes (the prompt), for max_prefill_tokens
        self.prompt_tokens = 0
        #: most tokens it will generate, for max_total_tokens (prompt + max_tokens in flight)
        self.max_tokens = 0
        self.finished = False
        self._result: Any = _UNSET

    def finish(self, result: Any = _UNSET) -> None:
        """End this request after the current step. ``result`` is the task's result
        (default: :meth:`Generator.result` of the request)."""
        self.finished = True
        self._result = result

    @property
    def has_result(self) -> bool:
        """:meth:`finish` was given the task's result (:attr:`given_result`)."""
        return self._result is not _UNSET

    @property
    def given_result(self) -> Any:
        """The result given to :meth:`finish` (see :attr:`has_result`)."""
        return self._result

    def __repr__(self) -> str:
        return f"<Generation {self.id} tokens={len(self.tokens)}{' finished' if self.finished else ''}>"


class Generator(Configurable):
    """Base class of a token generator served with continuous batching.

    ::

        class Chat(mtq.Generator):
            max_running = 32                 # requests decoded together
            max_prefill_tokens = 2048        # prompt tokens per prefill step
            def setup(self, device): ...
            def admit(self, r): r.prompt_tokens = len(r.payload["prompt"])
            def prefill(self, requests): ...  # build each request's KV cache
            def decode(self, requests):       # one token per request
                out = [...]
                for r, tok in zip(requests, out):
                    if tok == EOS or len(r.tokens) + 1 >= 64:
                        r.finish()
                return out

    ``prefill`` may return a first token per request (or None); ``decode`` returns
    one token per request (None: no token this step). A token is any
    msgpack-encodable value. Requests join between decode steps and leave as soon
    as they finish, are cancelled or fail; each finished request is acknowledged
    at once, not at the end of a batch.

    Errors: an exception from ``admit`` or ``prefill`` fails only the requests it
    concerns (prefill is split, as a model's batch is); an exception from ``decode``
    cannot be pinned on one request, so every request of that step is failed and
    retried (a redelivered request regenerates its tokens with the same seed, and the
    client's stream carries on where it was). :class:`mtq.PermanentError` fails at
    once, as for models.

    Options (:class:`mtq.Option` class attributes, ``--set KEY=VALUE``,
    :meth:`set_options`) work as for :class:`~mtq.Model`.

    Running out of memory (CUDA, MPS, the host) is not a failure of the requests: a
    decode step that does gives the most recently admitted half of the requests back
    to their streams without counting a delivery (each starts over later, its client's
    stream going on where it was), lowers the limits in force (requests running,
    tokens in flight; a prefill, the prefill token budget) and runs the step again
    with the rest, so ``decode`` must leave the requests it was given as they were
    when it raises out of memory (allocate before you write to a request's state).
    A request that runs out of memory alone fails with
    :class:`mtq.DeviceOutOfMemory` and is retried alone. See docs/workers.md, "Out
    of memory".
    """

    #: most requests in the running batch
    max_running: ClassVar[int] = 16
    #: most prompt tokens prefilled in one step (None: no limit). A request larger
    #: than the budget still runs, alone in its prefill step.
    max_prefill_tokens: ClassVar[int | None] = None
    #: most tokens in flight: the sum of prompt_tokens + max_tokens over running
    #: requests (None: no limit)
    max_total_tokens: ClassVar[int | None] = None
    #: False: static batching (a new batch starts only when the whole previous one
    #: has finished); kept as the baseline the benchmark compares against
    continuous: ClassVar[bool] = True
    #: the publisher sends tokens at most this often (ms): the tokens of the steps
    #: in between go in one Redis trip (fewer trips, fewer wake-ups on a busy host);
    #: a real model's GPU step is usually longer than this anyway. 0: a trip per step.
    stream_interval_ms: ClassVar[float] = 2.0
    #: publish from a process of its own (mtq.workers.outlet), so that Redis trips
    #: never take the GIL from the model thread; False: from a thread of the worker
    outlet: ClassVar[bool] = True
    #: longest one prefill or decode call may run (s); past it the supervisor kills the process
    timeout_s: ClassVar[float | None] = 300.0
    name: ClassVar[str] = ""
    #: the served model's version, which keys the result cache: set it when you version
    #: your weights; left "0", the worker computes one after setup from the target's
    #: source file and its torch tensors (see mtq.workers.catalogue)
    version: ClassVar[str] = "0"
    #: True: the same payload always gives the same tokens, seeded or not (greedy
    #: decoding, say), so unseeded requests may be answered from the result cache too;
    #: False (the default): only requests with an integer ``seed`` are (an unseeded one
    #: samples with a seed derived from its task id: two of them differ)
    deterministic: ClassVar[bool] = False
    #: False: never answer requests from the result cache (the model reads state
    #: outside its payload: the time, a database)
    cacheable: ClassVar[bool] = True

    def setup(self, device: Any) -> None:
        """Load weights once per process onto ``device``."""

    def admit(self, request: Generation) -> None:
        """Check a newly claimed request and set its ``prompt_tokens`` / ``max_tokens``.
        Raise (preferably :class:`mtq.PermanentError`) to fail it alone."""

    def prefill(self, requests: list[Generation]) -> list[Any] | None:
        """Admit these requests into the running batch; optionally return a first
        token per request."""
        return None

    def decode(self, requests: list[Generation]) -> list[Any]:
        """One step for every running request: return its next token (or None)."""
        raise NotImplementedError(f"{type(self).__name__}.decode is not implemented")

    def release(self, requests: list[Generation]) -> None:
        """These requests left the batch (finished, cancelled or failed): free their state."""

    def result(self, request: Generation) -> Any:
        """The task's result when the request finishes without one: its tokens."""
        return list(request.tokens)

    def describe(self) -> tuple[str, str]:
        """(name, version) for the registry."""
        return (self.name or type(self).__name__, str(self.version))
