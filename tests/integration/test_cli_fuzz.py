"""Fuzzing the CLI's input (hypothesis): whatever the arguments and payloads, an
``mtq`` command ends with a documented exit code and no traceback, and the queue
stays healthy: a task exists for each submit that said so, and for nothing else
(no partial write), against a real Redis."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import redis
from click.testing import CliRunner
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import mtq
from mtq.cli.main import cli

#: the exit codes ``mtq --help`` documents
DOCUMENTED = {0, 1, 2, 3, 4, 5, 6, 130}
QUEUE = "fuzz-q"

# any text, lone surrogates (bytes of argv that were not UTF-8) included
anything = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | anything,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(anything, inner, max_size=4),
    max_leaves=20)


@st.composite
def payloads(draw: Any) -> str:
    kind = draw(st.sampled_from(["json", "json", "json", "deep", "text", "big-number",
                                 "big-number"]))
    if kind == "json":
        return json.dumps(draw(json_values), ensure_ascii=draw(st.booleans()))
    if kind == "deep":
        depth = draw(st.sampled_from([10, 400, 999, 5000, 100_000]))
        return "[" * depth + "]" * depth
    if kind == "big-number":
        return "1" + "0" * draw(st.integers(20, 5000))
    return draw(anything)


numbers = st.sampled_from(["1", "0", "-1", "1e12", "1e308", "inf", "-inf", "nan", "0.0001",
                           "abc", "", "1_000", "3600"]) | anything
# mostly the queues under test, so that submits go through as often as they fail
names = st.one_of(st.just(QUEUE), st.just(QUEUE), st.just("fuzz-q2"),
                  st.sampled_from(["bad name", "", "a" * 101, "x{y}", "q:1"]), anything)


@st.composite
def submit_args(draw: Any) -> list[str]:
    args = ["submit", draw(names), draw(payloads())]
    for option, values in (("--stream", anything), ("--key", anything), ("--ttl", numbers),
                           ("--timeout", st.sampled_from(["0.01", "0.01", "0.01", "-1", "nan", "x"]))):
        if draw(st.booleans()):
            args += [option, draw(values)]
    if draw(st.integers(0, 9)) == 0:
        args += ["--redis", draw(st.sampled_from(["notaurl", "redis://", "redis://:x@",
                                                  "rediss://h?ssl_ca_certs=/nope",
                                                  "redis://h?ssl_ca_certs=/x"]))]
    if draw(st.booleans()):
        args.append("--json")
    return args


@st.composite
def other_args(draw: Any) -> list[str]:
    return draw(st.sampled_from([
        ["status", draw(names)], ["task", draw(anything)], ["cancel", draw(anything)],
        ["dlq", "list", draw(names), "-n", draw(numbers)], ["purge", draw(names), "--yes"],
        ["dlq", "retry", draw(names), draw(anything)], ["queue", "delete", draw(names)],
        ["submit", QUEUE, "--file", "-", "--stream-from", draw(anything)],
    ]))


def task_keys(r: redis.Redis) -> set[bytes]:
    return {k for q in (QUEUE, "fuzz-q2")
            for k in r.scan_iter(match=f"mtq:{{{q}}}:task:*", count=10_000)}


@pytest.fixture(scope="module")
def fuzz_redis(redis_url: str) -> Any:
    r = redis.Redis.from_url(redis_url)
    for q in (QUEUE, "fuzz-q2"):
        try:
            mtq.Queue(q, redis_url).delete(force=True)
        except mtq.MtqError:
            pass
    return r


ID = re.compile(r"\b[A-Za-z0-9_-]{16}\b")


@settings(max_examples=300, deadline=None,
          phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(argv=submit_args() | other_args(), stdin=payloads())
def test_no_input_gets_a_traceback_or_a_partial_write(argv: list[str], stdin: str,
                                                      fuzz_redis: redis.Redis,
                                                      redis_url: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MTQ_REDIS_URL", redis_url)
    # a --redis nothing serves ("redis://": localhost:6379) is refused at once, not
    # after a dropped connection's retries (about 4 s an example)
    monkeypatch.setenv("MTQ_REDIS_RETRIES", "0")
    if argv[0] == "queue" or argv[0] == "purge":
        argv = [*argv, "--yes"] if "--yes" not in argv else argv
    before = task_keys(fuzz_redis)
    if argv[2:3] == ["-"] or "--file" in argv:
        stdin_text = stdin if "--file" not in argv else stdin + "\n" + stdin
    else:
        stdin_text = ""
    # stdin is bytes: a lone surrogate of the text stands for bytes that are not UTF-8
    res = CliRunner().invoke(cli, argv, input=stdin_text.encode("utf-8", "surrogatepass"))
    out = res.output
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise AssertionError(f"{argv!r} raised {res.exception!r}") from res.exception
    assert res.exit_code in DOCUMENTED, (argv, res.exit_code, out)
    assert "Traceback" not in out, (argv, out)
    added = task_keys(fuzz_redis) - before
    if argv[0] == "submit" and res.exit_code in (0, 6, 1) and "--file" not in argv:
        # a submit that went in wrote one task (exit 6 or 1: it went in, then the wait
        # ended); one that did not wrote nothing
        assert len(added) <= 1, (argv, out, added)
    elif argv[0] != "submit" or res.exit_code != 0:
        assert not added, f"{argv!r} failed (exit {res.exit_code}) but wrote {added}: {out}"
    for q in (QUEUE, "fuzz-q2"):  # the queues stay consistent
        stats = mtq.Queue(q, redis_url).stats()
        assert stats["waiting"] >= 0 and stats["running"] == 0, stats


@pytest.mark.parametrize("bad", [
    {"idempotency_window_s": 10**20}, {"retention_s": 10**12}, {"lease_ms": -1},
    {"max_payload_bytes": 2**40}, {"max_retries": 10**9},
])
def test_an_out_of_range_setting_writes_nothing(bad: dict[str, int], redis_url: str,
                                                qname: str, r: redis.Redis) -> None:
    with pytest.raises(mtq.ConfigError, match=next(iter(bad))):
        mtq.Queue(qname, redis_url, **bad).submit({"x": 1}, stream="s", key="k")
    assert list(r.scan_iter(match=f"mtq:{{{qname}}}:*", count=10_000)) == []


@pytest.mark.parametrize("kwargs", [{"ttl": 1e12}, {"ttl": float("inf")},
                                    {"ttl": float("nan")}, {"ttl": True}, {"retries": -1},
                                    {"retries": 10**9}, {"stream": "a\udcff"}])
def test_a_bad_argument_to_submit_writes_nothing(kwargs: dict[str, Any], redis_url: str,
                                                 qname: str, r: redis.Redis) -> None:
    with pytest.raises((mtq.ConfigError, mtq.InvalidName)):
        mtq.Queue(qname, redis_url).submit({"x": 1}, **kwargs)
    assert list(r.scan_iter(match=f"mtq:{{{qname}}}:*", count=10_000)) == []


@pytest.mark.parametrize("argv", [["submit", QUEUE, "-"],
                                  ["submit", QUEUE, "--file", "-"]])
def test_stdin_that_is_not_utf8_is_refused_whole(argv: list[str], fuzz_redis: redis.Redis,
                                                 redis_url: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MTQ_REDIS_URL", redis_url)
    before = task_keys(fuzz_redis)
    res = CliRunner().invoke(cli, argv, input=b'{"a": "\xed\xa0\x80"}\n')
    assert res.exit_code == 2, (res.exit_code, res.exception, res.output)
    assert "<stdin> is not UTF-8 text" in res.output and "nothing was submitted" in res.output
    assert task_keys(fuzz_redis) == before
