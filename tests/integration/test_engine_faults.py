"""An engine command cut short: the worker process is SIGKILLed while it loads or
unloads its model. Nothing is lost and nothing runs twice to completion: the
supervisor gives back what the process held, a new process serves the queue, and
every task ends succeeded, its payload run once. Real supervisors, real processes,
a real redis-server."""

from __future__ import annotations

import os
import signal
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import redis

import mtq
from mtq.broker import answers
from mtq.workers import control
from tests.support.paths import PY
from tests.support.supervisors import StartFn, wait_workers, workers_of
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(180)

TARGET = "tests.engine_models:Stalls"


def ran(d: Path) -> Counter[str]:
    path = d / "ran"
    lines = path.read_text().splitlines() if path.exists() else []
    return Counter(line.split()[1] for line in lines)


def stalled(d: Path, what: str) -> int | None:
    """The pid of the process stalled in its ``what`` (setup, teardown), if one is."""
    for f in d.glob(f"{what}-stalled.*"):
        return int(f.name.rsplit(".", 1)[1])
    return None


def command(r: redis.Redis, queue: str, cmd: str) -> str:
    """Publish an engine command with a reply id (nobody waits for the answer)."""
    rid = answers.new_id()
    assert control.send(r, queue, cmd, reply=rid) >= 1, "no supervisor listened"
    return rid


def all_succeeded(tasks: list[mtq.Task]) -> bool:
    return all(t.status() == "succeeded" for t in tasks)


@pytest.mark.parametrize("cut", ["unload", "load"])
def test_a_process_killed_mid_command_loses_nothing_and_runs_nothing_twice(
        cut: str, qname: str, r: redis.Redis, redis_url: str, supervise: StartFn,
        tmp_path: Path) -> None:
    d = tmp_path / "markers"
    d.mkdir()
    sup = supervise(TARGET, qname, "--set", f"dir={d}", "--standby", "0")
    (w,) = wait_workers(r, qname, 1, sup, check=lambda w: w.get("engine") == "loaded")
    q = mtq.Queue(qname, redis_url)
    streams = [f"s{i}" for i in range(4)]
    first = [q.submit(f"a{i}", stream=streams[i % 4]) for i in range(40)]
    if cut == "unload":  # the unload stalls in the model's teardown, tasks still coming
        (d / "teardown-stall").touch()
        wait_for(lambda: sum(t.status() == "succeeded" for t in first) >= 4, 30,
                 "the first tasks did not run")
        command(r, qname, "unload")
        pid = wait_for(lambda: stalled(d, "teardown"), 30, "the unload never began")
        (d / "teardown-stall").unlink()
    else:  # unloaded; the load stalls in setup, tasks waiting in the queue meanwhile
        wait_for(lambda: all_succeeded(first), 30, "the first tasks did not finish")
        command(r, qname, "unload")
        wait_workers(r, qname, 1, sup, check=lambda w: w.get("engine") == "unloaded")
        (d / "setup-stall").touch()
        command(r, qname, "load")
        pid = wait_for(lambda: stalled(d, "setup"), 30, "the load never began")
        (d / "setup-stall").unlink()
    assert pid == w["pid"]
    later = [q.submit(f"b{i}", stream=streams[i % 4]) for i in range(20)]
    os.kill(pid, signal.SIGKILL)  # mid-command
    wait_for(lambda: all_succeeded(first + later), 60,
             f"tasks were lost: {[t.status() for t in first + later]}\n{sup.output()}")
    counts = ran(d)
    assert set(counts) == {f"a{i}" for i in range(40)} | {f"b{i}" for i in range(20)}
    assert max(counts.values()) == 1, {k: v for k, v in counts.items() if v > 1}
    # the order of each stream held across the kill
    infos = [t.info() for t in first + later]
    for s in streams:
        ends = [i.finished for i in infos if i.stream == s]
        assert ends == sorted(ends), f"stream {s} ran out of order"
    sup.proc.send_signal(signal.SIGTERM)
    assert sup.wait_exit(30, "after SIGTERM") == 0


def test_a_process_killed_while_it_loads_on_demand_gives_its_tasks_back(
        qname: str, r: redis.Redis, redis_url: str, subprocess_env: dict[str, str],
        tmp_path: Path) -> None:
    """An on-demand engine claims, then loads for what it claimed: those tasks are
    held (their leases extended) while the load runs. Killed then, the supervisor
    gives them back uncounted, and the new process loads and runs each once."""
    d = tmp_path / "markers"
    d.mkdir()
    host = tmp_path / "host.toml"
    host.write_text(f'[host]\nstandby = 0\n\n[[engine]]\nqueue = "{qname}"\n'
                    f'target = "{TARGET}"\non_demand = true\n'
                    f'options = {{ dir = "{d}" }}\n')
    (d / "setup-stall").touch()
    log = (tmp_path / "sup.log").open("wb")
    proc = subprocess.Popen([PY, "-m", "mtq", "workers", "start", "--config", str(host),
                             "--redis", redis_url], env=subprocess_env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        q = mtq.Queue(qname, redis_url)
        tasks = [q.submit(f"c{i}", stream=f"s{i % 3}") for i in range(12)]
        pid = wait_for(lambda: stalled(d, "setup"), 30, "the load on demand never began")
        # (an entry written between the claim and the load's start says "unloaded")
        wait_for(lambda: [w for w in workers_of(r, qname)
                          if w.get("held") and w.get("engine") == "loading"], 10,
                 f"no loading engine holds a task: {workers_of(r, qname)}")
        (d / "setup-stall").unlink()
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: all_succeeded(tasks), 60,
                 f"tasks were lost: {[t.status() for t in tasks]}")
        assert max(ran(d).values()) == 1 and len(ran(d)) == 12
        assert all(t.info().deliveries == 1 for t in tasks)  # the load's claim: uncounted
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        log.close()


def test_a_failed_engine_of_a_host_process_is_made_again_in_that_process(
        qname: str, r: redis.Redis, redis_url: str, subprocess_env: dict[str, str],
        tmp_path: Path) -> None:
    qa, qb = qname, qname + "-b"
    host = tmp_path / "host.toml"
    host.write_text("".join(
        f'[[engine]]\nqueue = "{q}"\ntarget = "tests.engine_models:Sized"\n'
        f'options = {{ tag = "{tag}" }}\n\n' for q, tag in ((qa, "a"), (qb, "b"))))
    log = (tmp_path / "sup.log").open("wb")
    proc = subprocess.Popen([PY, "-m", "mtq", "workers", "start", "--config", str(host),
                             "--redis", redis_url], env=subprocess_env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        before = wait_for(lambda: [w for w in workers_of(r, qa) if w.get("engine") == "loaded"],
                          30, "the host did not start")[0]
        t = mtq.Queue(qa, redis_url).submit("crash-once")  # escapes the engine's loop
        assert t.result(timeout=30)["x"] == "crash-once"
        assert t.info().deliveries == 2  # the failed engine's delivery counted
        after = wait_for(lambda: [w for w in workers_of(r, qa, live_only=True)
                                  if w.get("restarts") == 1], 10,
                         "the new engine does not count its restart")[0]
        assert after["pid"] == before["pid"] and after["id"] != before["id"]
        assert "loop broke once" in after["last_error"]
        assert mtq.Queue(qb, redis_url).submit(1).result(timeout=10)["tag"] == "b"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        log.close()
