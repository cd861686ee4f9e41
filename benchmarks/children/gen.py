"""Generator targets and the raw decode-rate process for benchmarks/streaming.py.

* :class:`BenchTinyGPT`: the reference TinyGPT at the shape these benchmarks are
  measured with (:data:`BENCH`: d_model 128, 4 layers, 4 heads, 512 positions; random
  weights, which cost what trained ones do), not the smaller shape of its shipped
  trained weights;
* :class:`StaticTinyGPT`: the reference TinyGPT with ``continuous = False`` (static
  batching: a new batch starts only once the whole previous one finished) and
  ``max_running = 16``; the baseline of the continuous-batching comparison;
* :class:`ContinuousTinyGPT`: the same with continuous batching;
* ``python -m benchmarks.children.gen``: loads BenchTinyGPT once, then for each JSON line
  ``{"b": B, "steps": n, "prompt": str}`` on stdin prints ``{"rate": tokens/s}`` of
  :func:`mtq.reference.gpt.decode_rate` (:class:`RawDecoder` drives it, in a process
  with the worker's thread settings); a line ``{"mixed": [payload, ...], "continuous":
  bool}`` runs those payloads through :func:`schedule_rate` instead (the mixed
  workload's ceiling, without a queue);
* ``python -m benchmarks.children.gen target SPEC OPTIONS EXTRA``: the same for
  another generator (benchmarks/causal.py's ``hf:CausalLM``): the target ``SPEC`` with
  the ``--set`` options of the JSON object ``OPTIONS``, serving both kinds of ask, its
  requests given the payload fields of the JSON object ``EXTRA`` (those that keep
  them from stopping early);
* ``python -m benchmarks.children.gen publish PORT N SIZE GAP``: the token latency
  baseline's other process: raw PUBLISH of N messages of SIZE bytes carrying the
  publish time, one every GAP s (:func:`publish`).
"""

from __future__ import annotations

import collections
import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from mtq.reference.gpt import GPTConfig, TinyGPT, _append, decode_rate
from mtq.workers.generator import Generation, Generator

#: the shape the streaming benchmarks run (and docs/benchmarks.md's figures were measured with)
BENCH = GPTConfig(d_model=128, n_layer=4, n_head=4, max_seq=512)


class BenchTinyGPT(TinyGPT):
    """TinyGPT at the :data:`BENCH` shape (random weights: ``$MTQ_REFERENCE_WEIGHTS``,
    made by the benchmark, else cached under the state dir)."""

    default_config: ClassVar[GPTConfig] = BENCH


class ContinuousTinyGPT(BenchTinyGPT):
    """TinyGPT with continuous batching, 16 requests at most.

    Both sides of the comparison compute in float32: the default float64 buys
    batch-invariant sampling, but on this CPU it makes a step's cost grow almost
    linearly with its size (16 requests decode only 1.7x faster per token than 4),
    which hides what batching does on an accelerator; in float32 it is 2.25x.
    """

    dtype = "float32"
    max_running = 16
    max_total_tokens = 16 * 512
    name = "tinygpt-continuous"


class StaticTinyGPT(BenchTinyGPT):
    """TinyGPT with static batching (the baseline), 16 requests at most, float32."""

    dtype = "float32"
    max_running = 16
    max_total_tokens = 16 * 512
    continuous = False
    name = "tinygpt-static"


def schedule_rate(model: Generator, payloads: list[Any], continuous: bool) -> float:
    """Generated tokens/s of ``payloads`` run to completion in this thread, scheduled
    as the engine schedules them but with nothing between the steps: no queue, no
    Redis, no outlet, every request claimed before the first step. Each turn admits
    waiting requests in order up to ``max_running`` (``continuous``: whenever there is
    room; static: only once the running batch has finished), prefills them and runs
    one decode step of all running requests: the ceiling of the served figure."""
    requests = [Generation(f"mix-{i}", p, i) for i, p in enumerate(payloads)]
    for r in requests:
        model.admit(r)
    waiting = collections.deque(requests)
    running: list[Generation] = []
    t0 = time.perf_counter()
    try:
        while waiting or running:
            if continuous or not running:
                new = [waiting.popleft() for _ in range(min(len(waiting),
                                                            model.max_running - len(running)))]
                if new:
                    running += new
                    _append(model, new, model.prefill(new))
            live = [r for r in running if not r.finished]
            if live:
                _append(model, live, model.decode(live))
            done = [r for r in running if r.finished]
            if done:
                model.release(done)
                running = [r for r in running if not r.finished]
        seconds = time.perf_counter() - t0
    finally:
        model.release(running)
    return sum(len(r.tokens) for r in requests) / seconds


ROOT = Path(__file__).resolve().parent.parent


class RawDecoder:
    """Client of ``python -m benchmarks.children.gen`` (every wait has a timeout)."""

    def __init__(self, env: dict[str, str], args: Sequence[str] = ()) -> None:
        """``args``: the child's arguments (``target SPEC OPTIONS EXTRA``; none: TinyGPT)."""
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.children.gen", *args],
                                     env=env, cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        # a thread reads the answers: select() on a buffered pipe misses lines that
        # readline() already pulled into the buffer (several answers after a few asks)
        self._lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        threading.Thread(target=self._read_lines, daemon=True).start()
        self.read(120)

    def _read_lines(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put("")

    def read(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            line = ""
        if not line:
            self.close()
            raise SystemExit(f"benchmarks.children.gen gave no answer within {timeout:.0f} s")
        return dict(json.loads(line))

    def ask(self, b: int, steps: int, prompt: str) -> None:
        """Start a measurement (answers come back in order, see :meth:`rate`)."""
        assert self.proc.stdin is not None
        ask = {"b": b, "steps": steps, "prompt": prompt}
        self.proc.stdin.write(json.dumps(ask) + "\n")
        self.proc.stdin.flush()

    def ask_mixed(self, payloads: list[Any], continuous: bool) -> None:
        """Start a :func:`schedule_rate` run (its answer comes back as :meth:`rate`'s)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"mixed": payloads, "continuous": continuous}) + "\n")
        self.proc.stdin.flush()

    def rate(self, *args: Any, **kwargs: Any) -> float:
        """With arguments: :meth:`ask`, then wait for its answer; without: the answer
        to the oldest unanswered :meth:`ask`."""
        if args or kwargs:
            self.ask(*args, **kwargs)
        return float(self.read(120)["rate"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def publish(port: int, n: int, size: int, gap: float) -> None:
    import redis

    r = redis.Redis(port=port)
    pad = b"x" * (size - 18)  # 18 bytes: b"%.6f|" % time.time()
    for _ in range(n):
        r.publish("bench:pub", b"%.6f|" % time.time() + pad)
        time.sleep(gap)
    r.publish("bench:pub", b"stop")


def pubsub_latencies(port: int, n: int, size: int, gap: float) -> list[float]:
    """Milliseconds from raw PUBLISH (by :func:`publish` in another process, its
    time.time() in the message) to their receipt by a SUBSCRIBE in this thread."""
    import redis

    sub = redis.Redis(port=port)
    ps = sub.pubsub()
    ps.subscribe("bench:pub")
    ps.get_message(timeout=5)  # the subscribe confirmation
    out: list[float] = []
    pub = subprocess.Popen([sys.executable, "-m", "benchmarks.children.gen", "publish",
                            str(port), str(n), str(size), str(gap)], cwd=ROOT)
    try:
        deadline = time.monotonic() + 30 + n * gap * 3
        while (msg := ps.get_message(timeout=1.0)) is None or msg["data"] != b"stop":
            if msg is not None and msg["type"] == "message":
                out.append((time.time() - float(msg["data"].split(b"|", 1)[0])) * 1000)
            if time.monotonic() > deadline:
                raise SystemExit("the raw PUBLISH baseline did not finish in time")
        pub.wait(10)
    finally:
        if pub.poll() is None:
            pub.kill()
            pub.wait(10)
        ps.close()
        sub.close()
    return out


def main() -> int:
    if sys.argv[1:2] == ["publish"]:
        publish(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
        return 0
    model: Generator
    mixed: Generator | None = None  # TinyGPT: loaded on the first mixed ask
    extra: dict[str, Any] | None = None
    if sys.argv[1:2] == ["target"]:
        from mtq.workers.target import load_model

        options, extra = json.loads(sys.argv[3]), json.loads(sys.argv[4])
        model = mixed = load_model(sys.argv[2], options=options)  # type: ignore[assignment]
    else:
        model = BenchTinyGPT()
    model.setup("cpu")
    decode_rate(model, model.max_running, 20, extra=extra)  # allocate the cache, warm up
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        ask = json.loads(line)
        if "mixed" in ask:
            if mixed is None:
                mixed = ContinuousTinyGPT()
                mixed.setup("cpu")
                decode_rate(mixed, mixed.max_running, 20)
            rate = schedule_rate(mixed, list(ask["mixed"]), bool(ask["continuous"]))
            print(json.dumps({"rate": rate}), flush=True)
            continue
        b, steps, prompt = int(ask["b"]), int(ask["steps"]), str(ask["prompt"])
        rate = decode_rate(model, b, steps, prompt=prompt, extra=extra)
        print(json.dumps({"rate": rate}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
