"""Chains (``submit(..., then=[...])``, docs/streaming.md, "Chains"): each step a task of
its own on its queue and stream, its payload built from the previous result as data
(default, pick, field), the last step's result; a streaming step's tokens reach the
chain's reader; a failure or a cancel stops the chain and names the step; bad steps
are refused before anything is written; the hand-off record is completed exactly once
by racing recoverers. Workers run in this process (threads); the kill between the
ack and the next submit is tests/integration/test_chains_kill.py."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest
import redis
from click.testing import CliRunner

import mtq
from mtq.broker import chains
from mtq.broker.consumer import Consumer
from mtq.broker.keys import QUEUES, QueueKeys
from mtq.cli.main import cli
from mtq.errors import ChainError, ChainFailed, EncodeError, PermanentError
from mtq.workers.model import FunctionModel
from tests.support.commands import commands_per_task
from tests.support.threads import run_together
from tests.support.waits import wait_for
from tests.support.workers import make_worker, serving

pytestmark = pytest.mark.timeout(60)


def names(n: int) -> list[str]:
    tag = uuid.uuid4().hex[:10]
    return [f"c{i}-{tag}" for i in range(n)]


@contextmanager
def workers(url: str, *served: tuple[str, Any]) -> Iterator[None]:
    """A worker in this process per (queue, function or target) pair."""
    with ExitStack() as stack:
        for queue, target in served:
            model = FunctionModel(target) if callable(target) else target
            stack.enter_context(serving(make_worker(model, queue, url)))
        yield


def stt(p: dict[str, Any]) -> dict[str, Any]:
    return {"text": p["audio"].upper(), "lang": "en"}


def llm(p: dict[str, Any]) -> str:
    return f"{p['prompt']}!{p['max']}"


def tts(p: str) -> dict[str, Any]:
    return {"spoken": p}


def test_three_steps_across_three_queues(redis_url: str, client: redis.Redis) -> None:
    a, b, c = names(3)
    q = mtq.Queue(a, client=client)
    task = q.submit({"audio": "hi"}, stream="user-1", tenant="acme", then=[
        mtq.Step(b, payload={"max": 3}, field="prompt", pick="text"),
        c,  # the previous result itself
    ])
    with workers(redis_url, (a, stt), (b, llm), (c, tts)):
        chain = task.chain()
        assert chain.result(timeout=15) == {"spoken": "HI!3"}
    assert [s.status for s in chain.steps()] == ["succeeded"] * 3
    assert [s.queue for s in chain.steps()] == [a, b, c]
    assert chain.status() == "succeeded"
    for i, t in enumerate(chain.tasks):
        assert t.queue.name == [a, b, c][i]
        assert t.info().stream == "user-1"  # each step on the first task's stream
        assert t.chain().id == task.id  # any step leads to the whole chain
    r = client
    assert r.hget(QueueKeys(b).task(chain.tasks[1].id), "tenant") == b"acme"
    assert mtq.Queue(b, client=client).stats()["submitted"] == 1
    assert r.zcard(QueueKeys(a).handoffs) == 0 and r.zcard(QueueKeys(b).handoffs) == 0
    assert mtq.Queue(a, client=client).task(task.id).chain().result(timeout=5) == \
        {"spoken": "HI!3"}  # a reader that comes late reads every step's stored outcome


def test_streaming_step_tokens_reach_the_chain_reader(redis_url: str,
                                                      client: redis.Redis) -> None:
    a, b, c = names(3)
    q = mtq.Queue(a, client=client)
    task = q.submit({"words": ["to", "be", "or"]}, then=[
        mtq.Step(b, field="chunks", pick="words"), mtq.Step(c, stream="out")])
    with workers(redis_url, (a, lambda p: p), (b, "tests.handlers:chunks"),
                 (c, lambda n: n * 10)):
        chain = task.chain()
        assert list(chain.tokens(timeout=15)) == ["to", "be", "or"]
        assert chain.result(timeout=5) == 30
    assert chain.tasks[2].info().stream == "out"


def test_a_failing_middle_step_stops_the_chain(redis_url: str, client: redis.Redis) -> None:
    a, b, c = names(3)

    def bad(p: Any) -> Any:
        raise PermanentError("no GPU today")

    q = mtq.Queue(a, client=client)
    task = q.submit(1, then=[b, c])
    with workers(redis_url, (a, lambda p: p + 1), (b, bad), (c, lambda p: p)):
        chain = task.chain()
        with pytest.raises(ChainFailed) as e:
            chain.result(timeout=15)
    err = e.value
    assert (err.step, err.queue, err.task_id, err.status) == (1, b, chain.tasks[1].id, "failed")
    assert "no GPU today" in str(err) and "no GPU today" in (err.error or "")
    assert isinstance(err.cause, mtq.TaskFailed)
    assert [s.status for s in chain.steps()] == ["succeeded", "failed", "pending"]
    assert chain.status() == "failed"
    assert not client.exists(QueueKeys(c).task(chain.tasks[2].id))
    assert client.zcard(QueueKeys(b).handoffs) == 0


def test_cancel_mid_chain(redis_url: str, client: redis.Redis) -> None:
    a, b, c = names(3)
    started, gate = threading.Event(), threading.Event()

    def held(p: Any) -> Any:
        started.set()
        gate.wait(15)
        return p

    q = mtq.Queue(a, client=client)
    task = q.submit("x", then=[b, c])
    with workers(redis_url, (a, lambda p: p), (b, held), (c, lambda p: p)):
        chain = task.chain()
        assert started.wait(10), "step 1 never started"
        assert chain.cancel() == 1
        gate.set()
        with pytest.raises(ChainFailed) as e:
            chain.result(timeout=15)
    assert e.value.step == 1 and e.value.status == "cancelled"
    assert [s.status for s in chain.steps()] == ["succeeded", "cancelled", "pending"]
    assert not client.exists(QueueKeys(c).task(chain.tasks[2].id))


def test_cancel_while_the_hand_off_is_pending_stops_the_chain(redis_url: str,
                                                              client: redis.Redis) -> None:
    """The first step succeeded and its record waits (no worker submitted the next step):
    a cancel marks it, and the hand-off then submits nothing."""
    a, b = names(2)
    q = mtq.Queue(a, client=client)
    task = q.submit("x", then=[b])
    ack_without_hand_off(redis_url, a)
    chain = task.chain()
    assert chain.cancel() == 1
    assert chains.HandOff(client, a).run([task.id]) == 1
    assert not client.exists(QueueKeys(b).task(chain.tasks[1].id))
    with pytest.raises(ChainFailed) as e:
        chain.result(timeout=5)
    assert e.value.step == 1 and e.value.status == "cancelled"


def ack_without_hand_off(url: str, queue: str, result: Any = "done") -> str:
    """Claim and ack one task of ``queue`` through the script alone, as a worker that
    died right after its ack leaves it: returns its id (its hand-off recorded)."""
    c = Consumer(queue, url)
    got = wait_for(lambda: c.claim(1), 5, "the chain's first task to claim")
    from mtq import serialization

    codes = c.broker.ack([(got[0].id, got[0].token, serialization.dumps(result))])
    assert codes == [chains.CHAINED]
    return got[0].id


def test_racing_recoverers_submit_the_next_step_once(redis_url: str,
                                                     client: redis.Redis) -> None:
    a, b = names(2)
    q = mtq.Queue(a, client=client)
    task = q.submit("x", then=[mtq.Step(b, field="text", payload={"n": 1})])
    tid = ack_without_hand_off(redis_url, a, "hello")
    assert client.zrange(QueueKeys(a).handoffs, 0, -1) == [tid.encode()]
    hand_offs = [chains.HandOff(redis.Redis.from_url(redis_url), a) for _ in range(4)]
    done = run_together(4, lambda: chains.recover(hand_offs.pop(), 0))  # any age is due
    assert sum(done) >= 1
    qb = mtq.Queue(b, client=client)
    assert qb.stats()["submitted"] == 1  # one task, whoever came second found it there
    assert client.zcard(QueueKeys(a).handoffs) == 0
    # and once more, the record put back (a recoverer that read it before it went)
    client.zadd(QueueKeys(a).handoffs, {tid: 0})
    assert chains.recover(chains.HandOff(client, a), 0) == 1
    assert qb.stats()["submitted"] == 1
    with workers(redis_url, (b, lambda p: p)):
        assert task.chain().result(timeout=10) == {"n": 1, "text": "hello"}


def test_a_pick_the_result_lacks_fails_the_chain_at_that_step(redis_url: str,
                                                              client: redis.Redis) -> None:
    a, b = names(2)
    task = mtq.Queue(a, client=client).submit("x", then=[mtq.Step(b, pick="text")])
    with workers(redis_url, (a, lambda p: {"other": 1})):
        with pytest.raises(ChainFailed) as e:
            task.chain().result(timeout=10)
    assert e.value.step == 1 and e.value.queue == b and "text" in str(e.value)
    assert not client.exists(QueueKeys(b).task(chains.step_id(task.id, 1)))


def test_each_step_keeps_its_retries_and_its_ttl(redis_url: str, client: redis.Redis) -> None:
    a, b = names(2)
    tries: list[Any] = []

    def flaky(p: Any) -> Any:
        tries.append(p)
        if len(tries) < 3:
            raise ValueError("not yet")
        return p

    task = mtq.Queue(a, client=client).submit(5, then=[
        mtq.Step(b, retries=2, ttl=30, timeout=20, priority="interactive")])
    with workers(redis_url, (a, lambda p: p), (b, flaky)):
        chain = task.chain()
        assert chain.result(timeout=15) == 5
    info = chain.tasks[1].info()
    assert info.attempts == 2 and info.deliveries == 3 and info.deadline is not None
    fields = client.hmget(QueueKeys(b).task(chain.tasks[1].id), "retries", "timeout", "band")
    assert fields == [b"2", b"20000", b"i"]


def written(client: redis.Redis, queue: str) -> tuple[set[bytes], bool]:
    """What a submit to ``queue`` may write: its own keys (one hash tag) and its name
    in the set of queues (the server is shared: other tests' keys come and go)."""
    return set(client.keys(f"mtq:{{{queue}}}*")), bool(client.sismember(QUEUES, queue))


@pytest.mark.parametrize("then,match", [
    (["bad name!"], "step 1"),
    ([mtq.Step("ok", field=3)], "field"),
    ([mtq.Step("ok", pick="")], "pick"),
    ([mtq.Step("ok", payload=[1], field="x")], "must then be a dict"),
    ([mtq.Step("ok", payload={"a": 1})], "needs field"),
    ([mtq.Step("ok", ttl=-1)], "ttl"),
    ([mtq.Step("ok", retries=1.5)], "retries"),
    ([mtq.Step("ok", tenant="bad tenant")], "step 1"),
    (["ok"] * chains.MAX_STEPS, "at most"),
    ([], "non-empty"),
    ("ok", "non-empty list"),
    ([3], "Step objects"),
])
def test_bad_steps_are_refused_before_anything_is_written(
        client: redis.Redis, qname: str, then: Any, match: str) -> None:
    before = written(client, qname)
    with pytest.raises(ChainError, match=match):
        mtq.Queue(qname, client=client).submit({"x": 1}, then=then)
    assert written(client, qname) == before


def test_bad_step_payloads_and_ids(client: redis.Redis, qname: str) -> None:
    q = mtq.Queue(qname, client=client)
    before = written(client, qname)
    with pytest.raises(EncodeError):
        q.submit(1, then=[mtq.Step("ok", payload={"f": object()}, field="x")])
    with pytest.raises(ChainError, match="at most 61"):
        q.submit(1, id="x" * 62, then=["ok"])
    with pytest.raises(ChainError, match="delayed"):
        q.submit(1, delay=5, then=["ok"])
    assert written(client, qname) == before


def test_cli_submit_then_and_task_show_every_step(redis_url: str, client: redis.Redis,
                                                  qname: str) -> None:
    runner = CliRunner()
    env = {"MTQ_REDIS_URL": redis_url}
    bad = runner.invoke(cli, ["submit", qname, '{"x": 1}', "--then", "no good!"], env=env)
    assert bad.exit_code == 2, bad.output
    assert not client.exists(QueueKeys(qname).stats)
    a, b = names(2)
    out = runner.invoke(cli, ["submit", a, '"hi"', "--then", b], env=env)
    assert out.exit_code == 0, out.output
    tid = out.output.strip().split()[-1]
    shown = runner.invoke(cli, ["task", tid, "-q", a, "--json"], env=env)
    assert shown.exit_code == 0, shown.output
    steps = json.loads(shown.output)["chain"]["steps"]
    assert [(s["queue"], s["status"]) for s in steps] == [(a, "queued"), (b, "pending")]
    with workers(redis_url, (a, str.upper), (b, lambda p: p + "!")):
        assert mtq.Queue(a, client=client).task(tid).chain().result(timeout=10) == "HI!"
    text = runner.invoke(cli, ["task", tid, "-q", b + "x"], env=env)
    assert text.exit_code == 3  # not on that queue
    text = runner.invoke(cli, ["task", chains.step_id(tid, 1), "-q", b], env=env)
    assert text.exit_code == 0, text.output
    assert "chain" in text.output and a in text.output and "succeeded" in text.output


def test_cli_then_takes_a_steps_fields_as_json(redis_url: str, client: redis.Redis) -> None:
    runner = CliRunner()
    env = {"MTQ_REDIS_URL": redis_url}
    a, b = names(2)
    for bad, says in ((json.dumps({"queue": b, "bogus": 1}), "unknown: bogus"),
                      ('{"pick": "text"}', 'with "queue"'),
                      (json.dumps({"queue": b, "pick": 5}), "pick"),
                      ('{"queue": ', "not valid JSON")):
        out = runner.invoke(cli, ["submit", a, '"x"', "--then", bad], env=env)
        assert out.exit_code == 2, (bad, out.output)
        assert says in out.output, (bad, out.output)
        assert not client.exists(QueueKeys(a).stats), bad
    step = json.dumps({"queue": b, "pick": "text", "field": "prompt", "payload": {"n": 1}})
    with workers(redis_url, (a, lambda p: {"text": p.upper()}), (b, lambda p: p)):
        out = runner.invoke(cli, ["submit", a, '"hi"', "--then", step, "--wait",
                                  "--timeout", "20"], env=env)
    assert out.exit_code == 0, out.output
    assert json.loads(out.output.strip().splitlines()[-1]) == {"n": 1, "prompt": "HI"}


def test_plain_tasks_cost_the_same_redis_commands(tmp_path: Any) -> None:
    """A plain task's submit, claim and ack send no command for chains, in a queue that
    served a chain too (the ack's HMGET reads one field more, no command more)."""
    from tests.support.servers import RedisServer

    server = RedisServer(tmp_path)
    server.start()
    try:
        plain = commands_per_task(server.url, "plain", lambda q: None)
        after = commands_per_task(server.url, "after-chain",
                                  lambda q: q.submit("first", then=["after-chain-next"]))
    finally:
        server.stop()
    assert plain == after, (plain, after)


def test_submit_many_takes_chains_in_requests(redis_url: str, client: redis.Redis) -> None:
    a, b = names(2)
    tasks = mtq.Queue(a, client=client).submit_many(
        [mtq.Request(i, then=[b]) for i in range(5)] + [7])
    with workers(redis_url, (a, lambda p: p * 2), (b, lambda p: p + 1)):
        assert [t.chain().result(timeout=10) for t in tasks[:5]] == [1, 3, 5, 7, 9]
        assert tasks[5].result(timeout=10) == 14 and tasks[5].chain() is None


def test_steps_keep_their_stream_order_and_a_passed_deadline_expires_a_step(
        redis_url: str, client: redis.Redis) -> None:
    a, b = names(2)
    order: list[int] = []

    def record(p: int) -> int:
        order.append(p)
        return p

    q = mtq.Queue(a, client=client)
    tasks = [q.submit(i, stream="user-7", then=[b]) for i in range(4)]
    late = q.submit({"slow": 1}, then=[mtq.Step(b, deadline=0.05)])

    def first(p: Any) -> Any:
        if isinstance(p, dict):
            import time

            time.sleep(0.2)  # past the next step's deadline (a function's own work)
        return p

    with workers(redis_url, (a, first), (b, record)):
        assert [t.chain().result(timeout=10) for t in tasks] == [0, 1, 2, 3]
        with pytest.raises(ChainFailed) as e:
            late.chain().result(timeout=10)
    assert order == [0, 1, 2, 3]  # one stream: in submit order on the next queue too
    assert {t.chain().tasks[1].info().stream for t in tasks} == {"user-7"}
    assert e.value.step == 1 and e.value.status == "expired"
