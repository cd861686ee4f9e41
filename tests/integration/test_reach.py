"""A worker or supervisor that cannot reach Redis at start says so in one line per
try and gives up after a bounded time (exit 5), or waits without a limit with
``--wait-for-redis`` and then serves normally."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import mtq
from mtq.broker.connection import connect, reach
from tests.support.processes import free_port
from tests.support.servers import RedisServer
from tests.support.waits import wait_for

PY = sys.executable


def test_reach_gives_up_after_its_limit_with_one_line_per_try() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    lines: list[str] = []
    start = time.monotonic()
    with pytest.raises(mtq.RedisUnavailable, match=r"gave up after .* --wait-for-redis"):
        reach(connect(url), url, lines.append, timeout_s=1.5)
    took = time.monotonic() - start
    assert 1.4 < took < 4, took
    assert 3 <= len(lines) <= 8, lines                   # 0.25 s doubling, not a busy loop
    assert all(line.startswith(f"cannot reach Redis at {url}") and "\n" not in line
               for line in lines), lines


def test_a_password_in_the_url_is_not_printed() -> None:
    url = f"redis://me:hunter2@127.0.0.1:{free_port()}/0"
    lines: list[str] = []
    with pytest.raises(mtq.RedisUnavailable) as info:
        reach(connect(url), url, lines.append, timeout_s=0.3)
    assert "hunter2" not in str(info.value) and not any("hunter2" in x for x in lines)


def test_a_supervisor_waits_for_redis_then_serves(tmp_path: Path, qname: str,
                                                  subprocess_env: dict[str, str]) -> None:
    server = RedisServer(tmp_path)
    url = server.url
    env = dict(subprocess_env, MTQ_REDIS_URL=url)
    log = tmp_path / "sup.log"
    with open(log, "wb") as out:
        sup = subprocess.Popen(
            [PY, "-m", "mtq", "workers", "start", "tests.handlers:double", "--queue", qname,
             "--standby", "0", "--wait-for-redis"], env=env, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: "waiting for Redis" in log.read_text(), 30, "no waiting line")
        server.start()                                   # Redis comes up later
        assert mtq.Queue(qname, url).submit({"x": 4}).result(timeout=60) == 8, \
            log.read_text()
        text = log.read_text()
        assert text.count("waiting for Redis") == 1, text  # quiet while it waits
        assert "answered after" in text and "Traceback" not in text, text
        sup.terminate()
        assert sup.wait(30) == 0, log.read_text()
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait(10)
        server.stop()


def test_a_worker_without_redis_exits_5_after_its_limit(qname: str) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    env = dict(os.environ, MTQ_REDIS_WAIT_S="1.5")   # 30 s unless set
    for argv in (["worker", "run"], ["workers", "start"]):
        start = time.monotonic()
        done = subprocess.run([PY, "-m", "mtq", *argv, "tests.handlers:double", "--queue",
                               qname, "--redis", url], capture_output=True, text=True,
                              env=env, timeout=60)
        took = time.monotonic() - start
        lines = done.stderr.splitlines()
        assert done.returncode == 5 and took < 15, (argv, took, done)
        assert lines[-1].startswith("error: gave up after"), lines
        tries = lines[:-1]
        assert 3 <= len(tries) <= 8 and all(
            line.startswith(f"[mtq] cannot reach Redis at {url}") for line in tries), lines
        assert "Traceback" not in done.stderr
