"""A handler that raises: the task keeps a bounded traceback (and so does its dead
letter), ``mtq task ID`` and ``mtq dlq list --verbose`` show it, and the worker logs
it once per failure. Real worker processes, a real generator (whose outcomes cross
its outlet process) and real Redis."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import mtq
from mtq.broker.consumer import TRACEBACK_MAX
from mtq.settings import QueueSettings
from mtq.workers.model import FunctionModel
from mtq.workers.worker import Worker
from tests.models import Counter
from tests.support.waits import wait_for
from tests.support.workers import serving

PY = sys.executable


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "mtq", *args], capture_output=True, text=True,
                          timeout=60)


def test_a_failed_task_keeps_its_traceback(redis_url: str, qname: str, tmp_path: Path,
                                           subprocess_env: dict[str, str]) -> None:
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        worker = subprocess.Popen([PY, "-m", "mtq", "worker", "run", "tests.handlers:boom",
                                   "--queue", qname], env=subprocess_env, stdout=out,
                                  stderr=subprocess.STDOUT)
    try:
        q = mtq.Queue(qname, redis_url)
        tasks = [q.submit({"n": i}, retries=0) for i in range(3)]
        for t in tasks:
            with pytest.raises(mtq.TaskFailed):
                t.result(timeout=30)
        # the worker logs each failure's traceback, once
        wait_for(lambda: log.read_text().count("Traceback (most recent call last)") >= 3, 10,
                 "the worker did not log the tracebacks")
    finally:
        worker.terminate()
        worker.wait(30)
    assert log.read_text().count("Traceback (most recent call last)") == 3, log.read_text()
    info = tasks[0].info()
    assert info.status == "dead" and info.error == "ValueError: boom on {'n': 0}", info
    assert info.traceback is not None
    assert info.traceback.startswith("Traceback (most recent call last)"), info.traceback
    assert 'tests/handlers.py", line' in info.traceback and "in boom" in info.traceback
    assert info.traceback.endswith("ValueError: boom on {'n': 0}"), info.traceback

    shown = cli("task", tasks[0].id, "--redis", redis_url)
    assert shown.returncode == 0 and "in boom" in shown.stdout, shown
    as_json = json.loads(cli("task", tasks[0].id, "--redis", redis_url, "--json").stdout)
    assert as_json["traceback"] == info.traceback
    dlq = cli("dlq", "list", qname, "--verbose", "--redis", redis_url)
    assert dlq.returncode == 0, dlq
    assert dlq.stdout.count("Traceback (most recent call last)") == 3, dlq.stdout
    rows = json.loads(cli("dlq", "list", qname, "--redis", redis_url, "--json").stdout)
    assert all("in boom" in row["traceback"] for row in rows["tasks"]), rows
    # retried from the dead letters, the old traceback goes with the old error
    q.retry_dead([tasks[0].id])
    assert tasks[0].info().traceback is None


def test_a_long_traceback_is_cut_to_its_end(redis_url: str, qname: str) -> None:
    from tests.handlers import deep

    q = mtq.Queue(qname, redis_url)
    t = q.submit({"depth": 400}, retries=0)
    with serving(Worker(FunctionModel(deep), qname, url=redis_url)):
        with pytest.raises(mtq.TaskFailed):
            t.result(timeout=30)
    tb = t.info().traceback
    assert tb is not None and len(tb) <= TRACEBACK_MAX + 4, len(tb or "")
    assert tb.startswith("...\n") and tb.endswith("ValueError: bad input to model, deep down")


def test_a_generator_failure_keeps_its_traceback(redis_url: str, qname: str) -> None:
    q = mtq.Queue(qname, redis_url)
    t = q.submit({"n": 3, "boom": True}, retries=0)
    with serving(Worker(Counter(), qname, url=redis_url)):  # its outlet is a process
        with pytest.raises(mtq.TaskFailed, match="boom in prefill"):
            t.result(timeout=30)
    tb = t.info().traceback
    assert tb is not None and "in prefill" in tb and tb.endswith("ValueError: boom in prefill")


def test_a_poison_death_does_not_keep_an_older_traceback(redis_url: str, qname: str) -> None:
    """Attempt 1 raises (its traceback is kept while it waits to retry); attempt 2's
    process dies (its lease runs out): the task is dead as poison, and the traceback
    of attempt 1 is not shown under that error."""
    from mtq.broker.consumer import Consumer, Outcome

    fixed = QueueSettings(max_deliveries=2, retry_backoff_ms=0, retry_backoff_max_ms=0)
    t = mtq.Queue(qname, redis_url, settings=fixed).submit({"x": 1})
    c = Consumer(qname, redis_url, settings=fixed)
    (first,) = c.claim(1)
    c.settle([Outcome(first, ok=False, error="ValueError: first", traceback="TB of 1")])
    assert t.info().traceback == "TB of 1"
    second = wait_for(lambda: c.claim(1, lease_ms=30), 10, "the retry was not claimed")
    assert second[0].id == t.id
    wait_for(lambda: c.reap() or t.status() == "dead", 10, "the lease did not run out")
    info = t.info()
    assert info.status == "dead" and info.error.startswith("PoisonTask"), info
    assert info.traceback is None, info.traceback


def test_an_error_that_is_not_utf8_still_settles(redis_url: str, qname: str) -> None:
    def bad_name(p: dict[str, int]) -> int:
        raise ValueError("cannot open file \udcff.bin")  # a file name's stray byte

    t = mtq.Queue(qname, redis_url).submit({"x": 1}, retries=0)
    with serving(Worker(FunctionModel(bad_name), qname, url=redis_url)):
        with pytest.raises(mtq.TaskFailed):
            t.result(timeout=30)
    info = t.info()
    assert info.status == "dead" and "\\udcff" in (info.error or ""), info
    assert info.traceback is not None and "\\udcff" in info.traceback
