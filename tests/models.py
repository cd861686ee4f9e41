"""Worker targets for the supervisor fault tests (``tests.models:<Name>``).

They run in processes the supervisor spawns, so this module must import without
pytest and without the test package's conftest. torch is imported only in
``setup`` (the worker imports it anyway to build the device).

Payloads are dicts; these fields steer :class:`Probe` inside ``predict``:

* ``"sleep": s``  sleep s seconds for this item
* ``"spin": s``  busy-loop s seconds in Python for this item (CPU-bound)
* ``"exit": true``  ``os._exit(1)`` (a crash the worker cannot catch)
* ``"hang": true``  sleep forever (only the supervisor's timeout ends it)
* ``"hang_here": true``  sleep forever in a process whose ``MTQ_TEST_HANG`` is set
  (the victim of a kill test); run normally elsewhere
* ``"s"``, ``"i"``  stream label and index, echoed in the result and the log

When ``MTQ_TEST_LOG`` names a file, every predict call appends a line as it starts,
``B <time> <pid> <key> <key>...``, and another after its last item,
``D <time> <pid> <key>...``, where a key is ``s:i`` (one atomic O_APPEND write
per line, so several processes can share the file); ``setup`` appends
``S <time> <pid>`` as it starts, then sleeps ``MTQ_TEST_SETUP_DELAY`` seconds if set.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import mtq

LOG_ENV = "MTQ_TEST_LOG"
VERSION_ENV = "MTQ_TEST_VERSION_FILE"
SETUP_DELAY_ENV = "MTQ_TEST_SETUP_DELAY"
HANG_ENV = "MTQ_TEST_HANG"


def _log(tag: str, batch: list[Any]) -> None:
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    keys = " ".join(f"{p.get('s', '-')}:{p.get('i', '-')}" if isinstance(p, dict) else "-:-"
                    for p in batch)
    line = f"{tag} {time.time():.6f} {os.getpid()} {keys}\n".encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


class Probe(mtq.Model):
    """A batched model whose payloads say how to behave (see the module docstring)."""

    max_batch_size = 4
    max_wait_ms = 20
    name = "probe"
    version = "0"
    #: extra sleep per predict call, whatever the batch (see :class:`Slow`)
    call_sleep_s = 0.0

    def setup(self, device: Any) -> None:
        import torch

        _log("S", [])
        time.sleep(float(os.environ.get(SETUP_DELAY_ENV) or 0))
        self.device = device
        # touch the device, so a wrong pinning fails here rather than silently
        self.bias = torch.zeros(1, device=device)

    def predict(self, batch: list[Any]) -> list[Any]:
        _log("B", batch)
        if self.call_sleep_s:
            time.sleep(self.call_sleep_s)
        out = []
        for p in batch:
            p = p if isinstance(p, dict) else {}
            if p.get("exit"):
                os._exit(1)
            if p.get("hang") or (p.get("hang_here") and os.environ.get(HANG_ENV)):
                while True:
                    time.sleep(3600)
            if p.get("sleep"):
                time.sleep(float(p["sleep"]))
            if p.get("spin"):  # CPU-bound Python, holding the interpreter but for its switches
                until = time.monotonic() + float(p["spin"])
                while time.monotonic() < until:
                    pass
            out.append({"pid": os.getpid(), "s": p.get("s"), "i": p.get("i"),
                        "version": self.version, "t": time.time(),
                        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                        "device": str(self.device),
                        "tensor_device": str(self.bias.device)})
        _log("D", batch)
        return out


class Slow(Probe):
    """Every predict call takes at least 2 s (a big model busy with a batch)."""

    name = "slow"
    call_sleep_s = 2.0


def _version() -> str:
    path = os.environ.get(VERSION_ENV)
    return Path(path).read_text().strip() if path else "0"


class Versioned(Probe):
    """Its version is read from the file named by ``MTQ_TEST_VERSION_FILE`` when this
    module is (re)imported, so the reload command picks up a change of the file."""

    name = "versioned"
    version = _version()


def _tuning() -> tuple[str, float | None]:
    path = os.environ.get(VERSION_ENV)
    if not path:
        return "0", None
    version, _, timeout = Path(path).read_text().strip().partition(" ")
    return version, float(timeout) if timeout else None


class Retimed(Probe):
    """Like :class:`Versioned`, but the file holds ``<version> <timeout_s>``, so a
    reload can change the predict timeout too."""

    name = "retimed"
    version, timeout_s = _tuning()


class SetupFails(mtq.Model):
    """Its setup always raises (missing weights, say)."""

    name = "setup-fails"

    def setup(self, device: Any) -> None:
        raise RuntimeError("setup exploded: no weights at /nonexistent/weights.pt")

    def predict(self, batch: list[Any]) -> list[Any]:
        return batch


class Counter(mtq.Generator):
    """A toy generator: payload ``{"n": N, "start": k}`` streams k, k+1, ... (N tokens).

    ``"step_ms"`` sleeps that long in every decode step (for the whole batch),
    ``"bad": true`` raises PermanentError in admit, ``"boom": true`` raises in prefill,
    ``"exit_at": i`` calls ``os._exit(1)`` while decoding token i (a crash mid-generation).
    It records the ids of every decode step in ``self.steps`` (for batching tests).
    """

    max_running = 8
    name = "counter"

    def setup(self, device: Any) -> None:
        self.steps: list[list[str]] = []
        self.released: list[str] = []

    def admit(self, r: mtq.Generation) -> None:
        p = r.payload
        if not isinstance(p, dict) or p.get("bad"):
            raise mtq.PermanentError("send {'n': tokens}")
        r.prompt_tokens = int(p.get("prompt", 1))
        r.max_tokens = int(p.get("n", 3))

    def prefill(self, requests: list[mtq.Generation]) -> list[Any]:
        for r in requests:
            if r.payload.get("boom"):
                raise ValueError("boom in prefill")
            r.state = int(r.payload.get("start", 0))
        return [self._next(r) for r in requests]

    def _next(self, r: mtq.Generation) -> int:
        tok = r.state + len(r.tokens)
        if r.payload.get("exit_at") == len(r.tokens) and not os.environ.get("MTQ_TEST_NO_EXIT"):
            _log("X", [r.payload])
            os._exit(1)
        if len(r.tokens) + 1 >= r.max_tokens:
            r.finish()
        return tok

    def decode(self, requests: list[mtq.Generation]) -> list[Any]:
        self.steps.append([r.id for r in requests])
        delay = max((r.payload.get("step_ms", 0) for r in requests), default=0)
        if delay:
            time.sleep(delay / 1000)
        return [self._next(r) for r in requests]

    def release(self, requests: list[mtq.Generation]) -> None:
        self.released.extend(r.id for r in requests)

    def result(self, r: mtq.Generation) -> Any:
        return {"tokens": list(r.tokens), "s": r.payload.get("s"), "i": r.payload.get("i")}


class SingleCounter(Counter):
    """A :class:`Counter` with one slot: one request generates at a time, the next
    waits for it (a generator whose slot a cancel must free)."""

    max_running = 1
    name = "single-counter"


class Batch8(Probe):
    """Batches of up to 8; each predict call takes 30 ms whatever its size."""

    name = "batch8"
    max_batch_size = 8
    max_wait_ms = 5
    call_sleep_s = 0.03


class Bisecting(Batch8):
    """Every call on more than one payload raises at once, so each batch is bisected
    down to single items (each of which then takes 30 ms)."""

    name = "bisecting"

    def predict(self, batch: list[Any]) -> list[Any]:
        if len(batch) > 1:
            _log("B", batch)
            raise ValueError(f"a batch of {len(batch)}: bisect it")
        return super().predict(batch)


class LoggedCounter(Counter):
    """A :class:`Counter` that logs a ``B`` line for each call on its requests (the
    prefill that admits them, then every decode step) and ``D`` when one ends."""

    name = "logged-counter"

    def prefill(self, requests: list[mtq.Generation]) -> list[Any]:
        _log("B", [r.payload for r in requests])
        return super().prefill(requests)

    def decode(self, requests: list[mtq.Generation]) -> list[Any]:
        _log("B", [r.payload for r in requests])
        return super().decode(requests)

    def result(self, r: mtq.Generation) -> Any:
        _log("D", [r.payload])
        return super().result(r)


class Orphaner(Probe):
    """On a payload ``{"orphan": n, "queue": q, "flag": path}`` seen for the first time
    (``path`` does not exist yet): writes ``path``, waits (at most 10 s) for
    ``path + ".go"``, then claims ``n`` tasks of ``q`` under this process's own worker
    id and exits at once: a claim answered just before a crash, which the supervisor
    never heard of. Seen again, it is an ordinary payload."""

    name = "orphaner"

    def predict(self, batch: list[Any]) -> list[Any]:
        for p in batch:
            if isinstance(p, dict) and p.get("orphan") and not os.path.exists(p["flag"]):
                from mtq.broker.consumer import Consumer

                Path(p["flag"]).write_text("started")
                go = Path(p["flag"] + ".go")
                deadline = time.monotonic() + 10
                while not go.exists() and time.monotonic() < deadline:
                    time.sleep(0.005)
                Consumer(p["queue"], worker_id=os.environ["MTQ_WORKER_ID"]).claim(p["orphan"])
                os._exit(1)
        return super().predict(batch)


class DeviceTensors(mtq.Model):
    """Holds ``$MTQ_TEST_HOLD_MB`` MiB (default 64) of its device's memory from
    ``setup`` on, and answers ``{"n": N}`` with ``{"values": arange(N) * 2, "device":
    str}``, the tensor computed on its device in bfloat16 (a CUDA tensor on a GPU,
    which the worker must bring to the host to encode). ``setup`` logs an ``S`` line
    (see the module docstring), so a test can tell when a reload set it up again."""

    max_batch_size = 8
    max_wait_ms = 5
    name = "device-tensors"
    version = "0"

    def setup(self, device: Any) -> None:
        import torch

        _log("S", [])
        self.device = device
        mb = int(os.environ.get("MTQ_TEST_HOLD_MB") or 64)
        self.block = torch.ones(mb * 2**20, dtype=torch.uint8, device=device)

    def predict(self, batch: list[Any]) -> list[Any]:
        import torch

        return [{"values": torch.arange(int(p["n"]), device=self.device,
                                        dtype=torch.bfloat16) * 2,
                 "device": str(self.block.device)} for p in batch]


class SignalBlocker(Probe):
    """A :class:`Probe` whose ``setup`` blocks SIGTERM and SIGINT in the thread that
    runs it (the worker's main thread), as a native library loaded there can: the
    kernel then gives the stop signals to another thread of the process."""

    def setup(self, device: Any) -> None:
        import signal

        super().setup(device)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})


class Configured(mtq.Model):
    """Declares an option of each kind (``model`` required); each result says which
    values its ``setup`` saw, when that setup ran, and in which process."""

    max_batch_size = 4
    max_wait_ms = 5
    name = "configured"
    model = mtq.Option(str, help="a path (any text)")
    pooling = mtq.Option(str, "mean", choices=("mean", "cls"))
    normalize = mtq.Option(bool, True)
    layers = mtq.Option(int, 2, min=1, max=8)
    scale = mtq.Option(float, 1.0, min=0)
    revision = mtq.Option(str, None)

    def setup(self, device: Any) -> None:
        self.seen = {k: getattr(self, k) for k in
                     ("model", "pooling", "normalize", "layers", "scale", "revision")}
        self.setup_at = time.time()

    def predict(self, batch: list[Any]) -> list[Any]:
        return [{"options": self.seen, "setup_at": self.setup_at, "pid": os.getpid()}
                for _ in batch]


class ConfiguredVersioned(Configured):
    """:class:`Configured` with a declared version."""

    name = "configured-versioned"
    version = "3"


class Optioned(mtq.Model):
    """Options its ``setup`` reads (for the engine commands' tests): ``model`` (any text;
    ``fail`` makes ``setup`` raise, as a checkpoint that is not there would) and
    ``pooling``. Each result says which values its setup saw, when, in which process;
    ``{"sleep": s}`` sleeps s seconds first."""

    max_batch_size = 4
    max_wait_ms = 5
    name = "optioned"
    model = mtq.Option(str, "a", help="any text; 'fail' fails setup")
    pooling = mtq.Option(str, "mean", choices=("mean", "cls"))

    def setup(self, device: Any) -> None:
        if self.model == "fail":
            raise RuntimeError("no checkpoint at 'fail'")
        self.seen = {"model": self.model, "pooling": self.pooling}
        self.setup_at = time.time()

    def predict(self, batch: list[Any]) -> list[Any]:
        for p in batch:
            if isinstance(p, dict) and p.get("sleep"):
                time.sleep(float(p["sleep"]))
        return [{"options": self.seen, "setup_at": self.setup_at, "pid": os.getpid()}
                for _ in batch]


class EchoChat(mtq.Generator):
    """A generator that takes ``hf:CausalLM``'s payload (checked by
    :func:`mtq.backends.hf.payload.parse`) and streams back the words of the prompt
    (or of the last message), one word a token, ``STEP_S`` apart, cycling until
    ``max_tokens`` (default 8) or a ``stop`` string; result as ``hf:CausalLM``'s:
    ``{"text", "finish_reason", "usage"}``. The gateway's tests serve it as an
    ``hf``-dialect model without downloading one."""

    max_running = 8
    name = "echo-chat"
    STEP_S = 0.05

    def setup(self, device: Any) -> None:
        pass

    def admit(self, r: mtq.Generation) -> None:
        from mtq.backends.hf.payload import parse

        params = parse(r.payload)
        text = params.prompt if params.prompt is not None else \
            (params.messages or [{}])[-1].get("content", "")
        words = text.split() or ["..."]
        r.state = {"words": words, "stop": params.stop, "text": "", "reason": "length"}
        r.prompt_tokens = len(text.split()) + 1
        r.max_tokens = params.max_tokens or 8

    def _next(self, r: mtq.Generation) -> str:
        s = r.state
        piece = ("" if not len(r.tokens) else " ") + s["words"][len(r.tokens) % len(s["words"])]
        s["text"] += piece
        if any(stop in s["text"] for stop in s["stop"]):
            s["text"] = s["text"][:min(s["text"].index(x) for x in s["stop"] if x in s["text"])]
            s["reason"] = "stop"
            r.finish()
        elif len(r.tokens) + 1 >= r.max_tokens:
            r.finish()
        return piece

    def prefill(self, requests: list[mtq.Generation]) -> list[Any]:
        return [self._next(r) for r in requests]

    def decode(self, requests: list[mtq.Generation]) -> list[Any]:
        time.sleep(self.STEP_S)
        return [self._next(r) for r in requests]

    def result(self, r: mtq.Generation) -> Any:
        return {"text": r.state["text"], "finish_reason": r.state["reason"],
                "usage": {"prompt_tokens": r.prompt_tokens,
                          "completion_tokens": len(r.tokens)}}
