"""Generation against a real redis-server: the continuous-batching engine serving
``tests.models:Counter`` (and subclasses) in in-process workers, streaming
predict for batch models and plain functions, a worker killed mid-generation
under a real supervisor, and seed determinism of the reference TinyGPT.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

import mtq
from mtq.broker.protocol import TERMINAL
from mtq.settings import QueueSettings
from mtq.workers import control
from mtq.workers.model import FunctionModel
from mtq.workers.registry import list_workers
from mtq.workers.worker import Worker
from tests.models import Counter
from tests.support.waits import Reader, wait_for
from tests.support.workers import serving

pytestmark = pytest.mark.timeout(60)

#: a lease short enough for the heartbeat (every lease/3) to beat twice a second
FAST = QueueSettings(lease_ms=1500, retry_backoff_ms=0)


# -- helpers ---------------------------------------------------------------------------------

def make_worker(model: Any, qname: str, url: str, settings: QueueSettings | None = None,
                **kw: Any) -> Worker:
    return Worker(model, qname, url=url, settings=settings or FAST, **kw)


def all_done(tasks: list[mtq.Task]) -> Callable[[], bool]:
    return lambda: all(t.status() in TERMINAL for t in tasks)


def until(predicate: Callable[[], Any], timeout: float, message: str,
          state: Callable[[], Any]) -> Any:
    """:func:`wait_for`, with ``state()`` at the time of the failure in its message."""
    try:
        return wait_for(predicate, timeout, message)
    except pytest.fail.Exception:
        pytest.fail(f"timed out after {timeout}s: {message}; now: {state()!r:.1500}")


def name_of(client: redis.Redis) -> str:
    return str(client.connection_pool.connection_kwargs["client_name"])



def snapshot_read(q: mtq.Queue, task_id: str) -> bool:
    """True once a reader on ``q`` has read the task's stored state: watch.lua then added
    the reply channel of ``q``'s client to the task (that client did not submit it)."""
    reply = q.redis.hget(q.broker.keys.task(task_id), "reply") or b""
    return q.reply_channel().encode() in reply.split()


def readers(watcher: mtq.Queue, tasks: list[mtq.Task], **kw: Any) -> list[Reader]:
    """A live events() reader per task, on the client of ``watcher`` (not the one that
    submitted them), each past its read of the stored state when this returns: every
    event published from then on reaches it live."""
    handles = [watcher.task(t.id) for t in tasks]
    out = [Reader(lambda t=t: t.events(**kw)) for t in handles]  # type: ignore[misc]
    wait_for(lambda: all(snapshot_read(watcher, t.id) for t in tasks), 10,
             "the readers did not read the tasks' stored state")
    return out


def tokens_of(events: list[mtq.Event]) -> list[Any]:
    toks = [e for e in events if e.kind == "token"]
    assert [e.index for e in toks] == list(range(len(toks))), [e.index for e in toks]
    return [e.data for e in toks]


# -- generators for these tests ------------------------------------------------------
class Budgeted(Counter):
    """A Counter whose admission is limited by its token budgets; records the load of
    every prefill (prompt tokens) and decode step (prompt + max tokens in flight)."""

    max_running = 8
    max_prefill_tokens = 10
    max_total_tokens = 40

    def setup(self, device: Any) -> None:
        super().setup(device)
        self.prefills: list[list[int]] = []
        self.loads: list[int] = []

    def prefill(self, requests: list[mtq.Generation]) -> list[Any]:
        self.prefills.append([r.prompt_tokens for r in requests])
        return super().prefill(requests)

    def decode(self, requests: list[mtq.Generation]) -> list[Any]:
        self.loads.append(sum(r.prompt_tokens + r.max_tokens for r in requests))
        return super().decode(requests)


class Single(Counter):
    """One request at a time."""

    max_running = 1


class Recording(Counter):
    """Records the ids of every prefill call."""

    def setup(self, device: Any) -> None:
        super().setup(device)
        self.prefills: list[list[str]] = []

    def prefill(self, requests: list[mtq.Generation]) -> list[Any]:
        self.prefills.append([r.id for r in requests])
        return super().prefill(requests)


# -- 1. continuous batching ------------------------------------------------------------
@pytest.mark.gpu_smoke
def test_streams_are_decoded_together_and_join_the_running_batch(
        qname: str, redis_url: str, client: redis.Redis) -> None:
    q = mtq.Queue(qname, client=client, settings=FAST)
    streams = range(6)

    def payload(s: int, i: int) -> dict[str, Any]:
        return {"n": 4 + (s * 7 + i * 5) % 13, "start": 1000 * s + 100 * i, "step_ms": 3,
                "s": s, "i": i}

    by_stream = {s: q.submit_many([payload(s, i) for i in range(5)], stream=f"s{s}")
                 for s in streams}
    stream_of = {t.id: s for s, ts in by_stream.items() for t in ts}
    model = Counter()
    w = make_worker(model, qname, redis_url)
    with serving(w) as run:
        until(all_done([t for ts in by_stream.values() for t in ts]), 30,
              "the 30 generations did not finish", q.stats)
        totals = run.stop()
    for s, ts in by_stream.items():
        for i, t in enumerate(ts):
            p = payload(s, i)
            expected = list(range(p["start"], p["start"] + p["n"]))
            assert t.result(timeout=1) == {"tokens": expected, "s": s, "i": i}
            assert list(t.tokens(timeout=5)) == expected
        infos = [t.info() for t in ts]
        for a, b in itertools.pairwise(infos):  # one at a time per stream, in submit order
            assert a.finished is not None and b.started is not None
            assert a.finished <= b.started, (s, a, b)
        # and in the decode steps: a stream's next task starts after the previous one ended
        spans = []
        for t in ts:
            at = [k for k, step in enumerate(model.steps) if t.id in step]
            spans.append((min(at), max(at)) if at else None)
        present = [sp for sp in spans if sp is not None]
        assert all(a[1] < b[0] for a, b in itertools.pairwise(present)), (s, spans)
    assert totals["succeeded"] == 30
    steps = [set(step) for step in model.steps]
    assert max(len(st) for st in steps) <= Counter.max_running
    widest = max(len({stream_of[i] for i in st}) for st in steps)
    assert widest >= 3, f"requests of at most {widest} streams were decoded together"
    joins = [k for k in range(1, len(steps))
             if steps[k] - steps[k - 1] and steps[k] & steps[k - 1]]
    assert joins, "no request joined while others were being decoded"
    assert model.released and set(model.released) == set(stream_of)


def test_max_running_bounds_every_decode_step(qname: str, redis_url: str) -> None:
    q = mtq.Queue(qname, redis_url, settings=FAST)
    tasks = q.submit_many([{"n": 5 + i % 7, "start": i * 100, "step_ms": 2} for i in range(24)])
    model = Counter()
    w = make_worker(model, qname, redis_url)
    with serving(w) as run:
        until(all_done(tasks), 30, "tasks did not finish", q.stats)
        run.stop()
    sizes = [len(step) for step in model.steps]
    assert max(sizes) == Counter.max_running, sizes
    for i, t in enumerate(tasks):
        assert t.result(timeout=1)["tokens"] == list(range(i * 100, i * 100 + 5 + i % 7))


def test_token_budgets_limit_admission(qname: str, redis_url: str) -> None:
    q = mtq.Queue(qname, redis_url, settings=FAST)
    payloads = [{"prompt": 2 + i % 4, "n": 6 + i % 5, "start": 10 * i, "step_ms": 2}
                for i in range(16)]
    tasks = q.submit_many(payloads)
    model = Budgeted()
    w = make_worker(model, qname, redis_url)
    with serving(w) as run:
        until(all_done(tasks), 30, "tasks did not finish", q.stats)
        run.stop()
    for p, t in zip(payloads, tasks):
        assert t.result(timeout=1)["tokens"] == list(range(p["start"], p["start"] + p["n"]))
    assert max(sum(p) for p in model.prefills) <= Budgeted.max_prefill_tokens, model.prefills
    assert max(model.loads) <= Budgeted.max_total_tokens, model.loads
    sizes = [len(step) for step in model.steps]
    # the budgets, not max_running, limited the batch; yet requests did run together
    assert 2 <= max(sizes) < Budgeted.max_running, sizes
    assert max(len(p) for p in model.prefills) >= 2, model.prefills


# -- 3. cancel frees the slot ------------------------------------------------------------
def cancel_checks(long: mtq.Task, got: list[int], at_cancel: int | None, heard: list[int],
                  model: Counter) -> None:
    """The cancelled request streamed a gap-free prefix, left the batch within a step or
    two of the worker hearing of the cancel, was released once and ended cancelled."""
    assert got == list(range(len(got))) and len(got) >= 5
    assert at_cancel is not None and heard, "the worker never heard of the cancel"
    after_client = sum(1 for step in model.steps[at_cancel:] if long.id in step)
    after_worker = sum(1 for step in model.steps[heard[0]:] if long.id in step)
    assert after_worker <= 2, f"{after_worker} decode steps after the worker got the cancel"
    assert after_client <= 3, f"{after_client} decode steps after cancel() returned"
    assert model.released.count(long.id) == 1
    info = long.info()
    assert (info.status, info.cancel_requested) == ("cancelled", True)
    with pytest.raises(mtq.TaskCancelled):
        long.result(timeout=1)


def test_cancel_mid_generation_frees_the_slot_within_a_step(
        qname: str, redis_url: str, r: redis.Redis) -> None:
    q = mtq.Queue(qname, redis_url, settings=FAST)
    long, short = q.submit_many([{"n": 10_000, "step_ms": 20}, {"n": 3, "start": 7}])
    model = Single()
    w = make_worker(model, qname, redis_url)
    heard: list[int] = []

    def on_control(msg: dict[str, Any]) -> None:  # the supervisor's job, done here
        if msg.get("cmd") == "cancel":
            heard.append(len(model.steps))
        w.command(msg)

    listener = control.Listener(r, qname, on_control)
    listener.start()
    try:
        with serving(w) as run:
            got: list[int] = []
            at_cancel = None
            end = None
            for ev in long.events(timeout=20):
                if ev.kind == "token":
                    got.append(ev.data)
                    if len(got) == 5:
                        assert long.cancel() is False  # running: its worker is told
                        at_cancel = len(model.steps)
                elif ev.terminal:
                    end = ev
            assert end is not None and end.kind == "cancelled", end
            cancel_checks(long, got, at_cancel, heard, model)
            # the slot it left is taken by the request that waited
            assert short.result(timeout=5) == {"tokens": [7, 8, 9], "s": None, "i": None}
            run.stop()
    finally:
        listener.close()
    assert all(len(step) == 1 for step in model.steps)


def test_a_one_request_generator_serves_queued_requests_in_turn(
        qname: str, redis_url: str) -> None:
    """max_running = 1: when the running request finishes, the next one is claimed."""
    q = mtq.Queue(qname, redis_url, settings=FAST)
    tasks = q.submit_many([{"n": 3, "start": 10 * i} for i in range(3)])
    w = make_worker(Single(), qname, redis_url)
    with serving(w) as run:
        try:
            until(all_done(tasks), 5, "tasks stuck", lambda: [t.status() for t in tasks])
        finally:
            run.stop()
    assert [t.result(timeout=1)["tokens"] for t in tasks] == [[0, 1, 2], [10, 11, 12],
                                                             [20, 21, 22]]


# -- 4. bad input ------------------------------------------------------------------------
def test_bad_requests_fail_alone(qname: str, redis_url: str) -> None:
    settings = FAST.replace(max_retries=1)
    q = mtq.Queue(qname, redis_url, settings=settings)
    payloads: list[dict[str, Any]] = [{"n": 3, "start": 10 * i} for i in range(8)]
    payloads[2] = {"bad": True}
    payloads[5] = {"n": 3, "boom": True}
    tasks = q.submit_many(payloads)
    model = Recording()
    w = make_worker(model, qname, redis_url, settings=settings)
    with serving(w) as run:
        until(all_done(tasks), 20, "tasks did not settle", lambda: [t.status() for t in tasks])
        totals = run.stop()
    bad, boom = tasks[2].info(), tasks[5].info()
    assert (bad.status, bad.attempts) == ("failed", 1), bad  # PermanentError: no retry
    assert "PermanentError" in (bad.error or "")
    assert (boom.status, boom.attempts) == ("dead", 2), boom  # retried once, then dead
    assert "ValueError: boom in prefill" in (boom.error or "")
    for i, t in enumerate(tasks):
        if i not in (2, 5):
            assert t.result(timeout=1)["tokens"] == [10 * i, 10 * i + 1, 10 * i + 2]
    # boom was prefilled with others; the prefill was bisected down to it alone
    first = next(p for p in model.prefills if tasks[5].id in p)
    assert len(first) > 1, model.prefills
    assert [tasks[5].id] in model.prefills
    assert tasks[2].id not in {i for p in model.prefills for i in p}  # never admitted
    assert (totals["succeeded"], totals["failed"], totals["dead"]) == (6, 1, 1)


# -- 5. streaming predict -----------------------------------------------------------------
class Speaker(mtq.Model):
    """A batched streaming model (text-to-speech, say): three chunks per item,
    interleaved across the batch, with progress reports."""

    max_batch_size = 8
    max_wait_ms = 0

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def predict(self, batch: list[Any]) -> Any:
        self.calls.append([p["i"] for p in batch])
        for step in range(3):
            for i, p in enumerate(batch):
                if p.get("bad") and step == 1:
                    yield "not an (index, chunk) pair"
                yield i, f"{p['i']}-{step}"
                yield i, mtq.Progress(step + 1)
        return [{"i": p["i"], "chunks": 3} for p in batch]


def test_streaming_predict_sends_chunks_progress_and_results(
        qname: str, redis_url: str, client: redis.Redis) -> None:
    q = mtq.Queue(qname, redis_url, settings=FAST)
    watcher = mtq.Queue(qname, client=client, settings=FAST)
    tasks = q.submit_many([{"i": i} for i in range(5)])
    rs = readers(watcher, tasks, timeout=20)
    model = Speaker()
    w = make_worker(model, qname, redis_url)
    with serving(w) as run:
        evs = [rd.join(20) for rd in rs]
        run.stop()
    assert model.calls == [[0, 1, 2, 3, 4]]
    for i, (t, ev) in enumerate(zip(tasks, evs)):
        assert tokens_of(ev) == [f"{i}-0", f"{i}-1", f"{i}-2"]
        assert [e.data for e in ev if e.kind == "progress"] == [1, 2, 3]
        assert ev[-1].kind == "succeeded" and ev[-1].data == {"i": i, "chunks": 3}
        assert list(t.tokens(timeout=5)) == [f"{i}-0", f"{i}-1", f"{i}-2"]  # stored too


def test_streaming_function_target(qname: str, redis_url: str, client: redis.Redis) -> None:
    def speak(p: dict[str, Any]) -> Any:
        for k in range(p["n"]):
            yield f"w{k}"
            yield mtq.Progress(k / p["n"])
        if p.get("ret"):
            return {"words": p["n"]}
        return None

    q = mtq.Queue(qname, redis_url, settings=FAST)
    watcher = mtq.Queue(qname, client=client, settings=FAST)
    tasks = q.submit_many([{"n": 3}, {"n": 4, "ret": True}, {"n": 0}])
    rs = readers(watcher, tasks, timeout=20)
    w = make_worker(FunctionModel(speak), qname, redis_url)
    with serving(w) as run:
        evs = [rd.join(20) for rd in rs]
        run.stop()
    assert tokens_of(evs[0]) == ["w0", "w1", "w2"]
    assert [e.data for e in evs[0] if e.kind == "progress"] == [0, 1 / 3, 2 / 3]
    assert evs[0][-1].data == ["w0", "w1", "w2"]  # no return value: the list of chunks
    assert tokens_of(evs[1]) == ["w0", "w1", "w2", "w3"]
    assert evs[1][-1].data == {"words": 4}  # the return value
    assert tokens_of(evs[2]) == [] and evs[2][-1].data == []
    assert [e[-1].kind for e in evs] == ["succeeded"] * 3


def test_streaming_predict_with_a_bad_yield_fails_only_that_item(
        qname: str, redis_url: str, client: redis.Redis) -> None:
    settings = FAST.replace(max_retries=0)
    q = mtq.Queue(qname, redis_url, settings=settings)
    watcher = mtq.Queue(qname, client=client, settings=settings)
    tasks = q.submit_many([{"i": i, "bad": i == 3} for i in range(6)])
    rs = readers(watcher, tasks, timeout=20)
    model = Speaker()
    w = make_worker(model, qname, redis_url, settings=settings)
    with serving(w) as run:
        evs = [rd.join(20) for rd in rs]
        run.stop()
    assert model.calls[0] == list(range(6)) and [3] in model.calls  # bisected down to it
    for i, ev in enumerate(evs):
        if i == 3:
            assert ev[-1].kind == "dead" and "BatchShapeError" in ev[-1].data, ev[-1]
        else:
            # re-runs after the bisection stream the same chunks again: each arrives once
            assert tokens_of(ev) == [f"{i}-0", f"{i}-1", f"{i}-2"]
            assert ev[-1].kind == "succeeded" and ev[-1].data == {"i": i, "chunks": 3}
    with pytest.raises(mtq.TaskFailed):
        list(tasks[3].tokens(timeout=5))


# -- 6. a worker killed mid-generation ----------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_worker_killed_mid_generation_resumes_the_stream(
        qname: str, redis_url: str, r: redis.Redis, subprocess_env: dict[str, str],
        tmp_path: Path) -> None:
    log = tmp_path / "supervisor.log"
    with open(log, "wb") as out:
        sup = subprocess.Popen(
            [sys.executable, "-m", "mtq", "workers", "start", "tests.models:Counter",
             "--queue", qname, "--redis", redis_url, "--devices", "cpu", "--replicas", "1",
             "--lease-ms", "3000"],
            env=subprocess_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def output() -> str:
            return log.read_text(errors="replace")[-4000:]

        def one_worker() -> list[dict[str, Any]]:
            assert sup.poll() is None, f"supervisor exited:\n{output()}"
            return [w for w in list_workers(r, qname) if Path(f"/proc/{w['pid']}").exists()]

        (first,) = wait_for(one_worker, 60, "the supervisor's worker did not register")
        q = mtq.Queue(qname, redis_url, lease_ms=3000)
        t = q.submit({"n": 40, "step_ms": 20})
        events: list[mtq.Event] = []
        for ev in t.events(timeout=60):
            events.append(ev)
            if ev.kind == "token" and ev.index == 9:
                outlets = outlet_children(first["pid"])
                assert len(outlets) == 1, "the worker has no outlet process"
                os.kill(first["pid"], signal.SIGKILL)
        kinds = [e.kind for e in events]
        assert kinds[-1] == "succeeded", kinds
        tokens = tokens_of(events)  # each index once, in order
        assert tokens == list(range(40))
        assert t.result(timeout=5)["tokens"] == tokens
        restarted = [k for k, e in enumerate(events) if e.kind == "restarted"]
        assert len(restarted) == 1, kinds
        before = [e for e in events[:restarted[0]] if e.kind == "token"]
        assert len(before) >= 10
        assert events[restarted[0]].delivery == 1
        started = [e.delivery for e in events if e.kind == "started"]
        assert started[-1] == 2, kinds
        info = t.info()
        assert (info.deliveries, info.status) == (2, "succeeded")
        assert "died (exit code -9)" in " ".join(output().split())
        # its outlet read end-of-file and left too: no process outlives a worker
        wait_for(lambda: not any(_alive(p) for p in outlets), 10,
                 "the dead worker's outlet process is still running")
    finally:
        try:
            os.killpg(sup.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        sup.wait(10)


# -- the outlet process --------------------------------------------------------------
def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def outlet_children(parent: int) -> list[int]:
    """Live (not zombie) ``mtq.workers.outlet`` processes whose parent is ``parent``."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if b"mtq.workers.outlet" in cmd and fields[0] != "Z" and int(fields[1]) == parent:
            found.append(int(d.name))
    return found


@pytest.mark.gpu_smoke
def test_a_generator_publishes_through_its_outlet_process(
        qname: str, redis_url: str, client: redis.Redis) -> None:
    q = mtq.Queue(qname, client=client, settings=FAST)
    w = make_worker(Counter(), qname, redis_url)
    with serving(w) as run:
        t = q.submit({"n": 30, "start": 5})
        assert list(t.tokens(timeout=10)) == list(range(5, 35))
        outlet = w.outlet
        assert outlet is not None and outlet.proc is not None and not outlet.dead
        assert outlet.proc.poll() is None
        totals = run.stop()
    assert outlet.proc.returncode == 0  # it settled everything and said goodbye
    assert (totals["succeeded"], totals["tokens"]) == (1, 30)
    assert t.info().status == "succeeded"


def test_outlet_killed_mid_generation_the_stream_restarts_and_the_worker_goes_on(
        qname: str, redis_url: str, client: redis.Redis,
        caplog: pytest.LogCaptureFixture) -> None:
    q = mtq.Queue(qname, client=client, settings=FAST)
    w = make_worker(Counter(), qname, redis_url)
    with serving(w) as run:
        t = q.submit({"n": 60, "step_ms": 15})
        events: list[mtq.Event] = []
        killed = None
        for ev in t.events(timeout=30):
            events.append(ev)
            if ev.kind == "token" and ev.index == 9 and killed is None:
                assert w.outlet is not None and w.outlet.proc is not None
                killed = w.outlet.proc.pid
                os.kill(killed, signal.SIGKILL)
        kinds = [e.kind for e in events]
        assert kinds[-1] == "succeeded", kinds
        assert kinds.count("restarted") == 1, kinds
        assert tokens_of(events) == list(range(60))  # each index once, in order
        assert t.result(timeout=5)["tokens"] == list(range(60))
        assert t.info().deliveries == 2
        assert w.outlet.dead
        # the worker settles through its publisher thread from now on
        later = q.submit({"n": 5, "start": 100})
        assert list(later.tokens(timeout=10)) == [100, 101, 102, 103, 104]
        assert later.result(timeout=5)["tokens"] == [100, 101, 102, 103, 104]
        run.stop()
    assert "the outlet process died (exit code -9)" in caplog.text


@pytest.mark.parametrize("poison, match", [
    (object(), "token 3: cannot encode a builtins.object"),  # encoded in the worker
    (2**64, "token 3: .*64-bit range"),  # an int too big to cross the pipe plain
], ids=["object", "int-beyond-64-bit"])
def test_bad_token_through_the_outlet_fails_its_task_alone(
        qname: str, redis_url: str, client: redis.Redis, poison: Any, match: str) -> None:
    class Unencodable(Counter):
        def decode(self, requests: list[mtq.Generation]) -> list[Any]:
            toks = super().decode(requests)
            return [poison if r.payload.get("poison") == len(r.tokens) else tok
                    for r, tok in zip(requests, toks)]

    q = mtq.Queue(qname, client=client, settings=FAST)
    bad, good = q.submit_many([{"n": 20, "poison": 3, "step_ms": 5}, {"n": 20, "step_ms": 5}])
    w = make_worker(Unencodable(), qname, redis_url)
    with serving(w) as run:
        assert good.result(timeout=10)["tokens"] == list(range(20))
        with pytest.raises(mtq.TaskFailed, match=match):
            bad.result(timeout=10)
        assert tokens_of(list(bad.events(timeout=5))) == [0, 1, 2]  # before the bad one
        run.stop()
    assert bad.info().status == "failed"
    assert w.outlet is not None and not w.outlet.dead


def test_token_values_of_every_kind_cross_the_outlet_unchanged(
        qname: str, redis_url: str, client: redis.Redis) -> None:
    """Plain tokens cross the pipe as they are and the outlet encodes them; others are
    encoded in the worker: the client gets the same values either way."""
    import torch

    values: list[Any] = ["text", "", "é🙂", b"\x00\xffbytes", 0, -(2**63), 2**64 - 1, 2**63,
                         1.5, float("-inf"), True, False, [1, "a", None], {"k": [1.0]},
                         torch.arange(3, dtype=torch.int16)]

    class Kinds(Counter):
        def decode(self, requests: list[mtq.Generation]) -> list[Any]:
            super().decode(requests)
            return [values[len(r.tokens)] for r in requests]

    q = mtq.Queue(qname, client=client, settings=FAST)
    t = q.submit({"n": len(values), "start": 0})
    w = make_worker(Kinds(), qname, redis_url)
    with serving(w) as run:
        got = list(t.tokens(timeout=10))
        run.stop()
    assert w.outlet is not None and not w.outlet.dead  # they went through the outlet
    assert got[0] == 0  # prefill's token; the rest come from decode
    for want, have in zip(values[1:], got[1:]):
        if isinstance(want, torch.Tensor):
            assert torch.equal(have, want) and have.dtype == want.dtype
        else:
            assert have == want and type(have) is type(want), (want, have)
    assert len(got) == len(values)


# -- 7. seeds --------------------------------------------------------------------------
@pytest.mark.gpu_smoke
def test_tinygpt_seeded_request_gives_the_same_text_alone_and_in_a_batch(
        qname: str, redis_url: str, client: redis.Redis, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    weights = tmp_path / "tinygpt.pt"
    monkeypatch.setenv("MTQ_REFERENCE_WEIGHTS", str(weights))
    q = mtq.Queue(qname, client=client, settings=FAST)
    probe = {"prompt": "hello", "max_tokens": 24, "seed": 7, "stop_at_eos": False}
    w = make_worker("mtq.reference.gpt:TinyGPT", qname, redis_url)
    with serving(w) as run:
        alone = q.submit(probe)
        first = alone.result(timeout=30)
        assert weights.exists(), "the weights file was not created under tmp_path"
        others = q.submit_many([{"prompt": f"other {k}" * (k + 1), "max_tokens": 30 + 4 * k,
                                 "seed": 100 + k, "stop_at_eos": False} for k in range(7)])
        wait_for(lambda: all(client.llen(q.broker.keys.out(o.id)) > 0 for o in others), 20,
                 "the other requests did not start streaming")
        joined = q.submit(probe)
        reseeded = q.submit({**probe, "seed": 8})
        again = joined.result(timeout=30)
        streamed = list(joined.tokens(timeout=5))
        changed = reseeded.result(timeout=30)
        wait_for(all_done(others), 30, "the other requests did not finish")
        run.stop()
    assert len(first["tokens"]) == 24 and first["finish_reason"] == "length"
    assert again["tokens"] == first["tokens"] and again["text"] == first["text"]
    assert "".join(streamed) == again["text"]
    assert changed["text"] != first["text"]
    # it really joined a running batch: it started while others were generating
    j = joined.info()
    infos = [o.info() for o in others]
    assert any(o.started <= j.started <= o.finished for o in infos), (j, infos)  # type: ignore[operator]
