"""``mtq workers start --config host.toml``: one supervisor, processes that host an
engine per queue. Real processes and the session's Redis, as in test_supervisor.py:
the supervisor runs in a session of its own (the teardown SIGKILLs its group), and
the models (tests/models.py) log every predict call, with their pid, to a file.
Tasks of queue A have streams a0, a1 ... and of queue B b0, b1 ..., so the log
tells the engines apart."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

import mtq
from mtq.workers.registry import list_workers
from tests.support.paths import PY
from tests.support.supervisors import Call, Sup, pid_exists, read_log, wait_workers
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(150)

HostFn = Callable[..., Sup]


@pytest.fixture
def host(redis_url: str, subprocess_env: dict[str, str], tmp_path: Path) -> Iterator[HostFn]:
    """``host(toml_text, *cli options, env=...)``: write the host file, start
    ``mtq workers start --config`` on it, and kill its process group at teardown."""
    started: list[Sup] = []

    def start(text: str, *args: str, env: dict[str, str] | None = None) -> Sup:
        path = tmp_path / f"host-{len(started)}.toml"
        path.write_text(text)
        log = tmp_path / f"supervisor-{len(started)}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [PY, "-m", "mtq", "workers", "start", "--config", str(path),
                 "--redis", redis_url, *args],
                env={**subprocess_env, **(env or {})}, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)
        sup = Sup(proc, log)
        started.append(sup)
        return sup

    yield start
    for sup in started:
        sup.kill()


def two_probes(qa: str, qb: str, host_keys: str = "", a_keys: str = "",
               b_keys: str = "") -> str:
    return (f"[host]\nstandby = 0\n{host_keys}\n"
            f"[[engine]]\nqueue = \"{qa}\"\ntarget = \"tests.models:Probe\"\n{a_keys}\n"
            f"[[engine]]\nqueue = \"{qb}\"\ntarget = \"tests.models:Probe\"\n{b_keys}\n")


def submit(q: mtq.Queue, label: str, streams: int, per_stream: int,
           **fields: Any) -> dict[str, mtq.Task]:
    """``per_stream`` tasks on each of ``streams`` streams ``<label><n>``, interleaved;
    returns key ("a0:1") -> task."""
    reqs = [mtq.Request({"s": f"{label}{s}", "i": i, **fields}, stream=f"{label}{s}")
            for i in range(per_stream) for s in range(streams)]
    return {f"{r.payload['s']}:{r.payload['i']}": t
            for r, t in zip(reqs, q.submit_many(reqs))}


def open_calls(calls: list[Call]) -> dict[tuple[int, str], Call]:
    """(pid, queue label) -> that engine's predict call in progress (a B line with no
    D line after it)."""
    last: dict[tuple[int, str], Call] = {}
    for c in calls:
        if c.tag in "BD" and c.keys:
            last[(c.pid, c.keys[0][0])] = c
    return {k: c for k, c in last.items() if c.tag == "B"}


def host_pid(r: redis.Redis, qa: str, qb: str, sup: Sup) -> int:
    """The pid of the one process serving both queues (after checking it is one)."""
    (wa,) = wait_workers(r, qa, 1, sup)
    (wb,) = wait_workers(r, qb, 1, sup)
    assert wa["pid"] == wb["pid"], (wa, wb)
    return int(wa["pid"])


def assert_all_succeeded_once(q: mtq.Queue, tasks: dict[str, mtq.Task]) -> None:
    for key, task in tasks.items():
        res = task.result(timeout=5)
        assert f"{res['s']}:{res['i']}" == key, (key, res)
    stats = q.stats()
    assert stats["succeeded"] == len(tasks), stats
    assert (stats["waiting"], stats["running"], stats["dead"]) == (0, 0, 0), stats


# -- one process, two queues ------------------------------------------------------------
def test_a_host_file_serves_two_queues_from_one_process(
        host: HostFn, qname: str, redis_url: str, r: redis.Redis) -> None:
    qa, qb = f"{qname}-a", f"{qname}-b"
    sup = host(f"""\
[host]
replicas = 1
standby = 0

[[engine]]
queue = "{qa}"
target = "tests.models:Configured"
options = {{ model = "/srv/m", layers = 3, normalize = false, scale = 0.5 }}
max_batch_size = 2

[[engine]]
queue = "{qb}"
target = "tests.host_models:shout"
""")
    (wa,) = wait_workers(r, qa, 1, sup)
    (wb,) = wait_workers(r, qb, 1, sup)
    # one process, two engines: each its own worker id and registry entry
    assert wa["pid"] == wb["pid"] and wa["id"] != wb["id"], (wa, wb)
    assert wa["supervisor"] == wb["supervisor"] and wa["supervisor"]
    assert (wa["model"], wb["model"]) == ("configured", "tests.host_models.shout"), (wa, wb)
    assert wa["max_batch_size"] == 2, wa  # the engine's max_batch_size from the file

    a = mtq.Queue(qa, redis_url).submit_many([{"n": i} for i in range(6)])
    b = mtq.Queue(qb, redis_url).submit_many([{"text": f"x{i}"} for i in range(6)])
    ra = [t.result(timeout=30) for t in a]
    rb = [t.result(timeout=30) for t in b]
    assert {x["pid"] for x in ra} == {x["pid"] for x in rb} == {wa["pid"]}
    # the options, typed in TOML, reached the model as --set would give them
    assert all(x["options"] == {"model": "/srv/m", "pooling": "mean", "normalize": False,
                                "layers": 3, "scale": 0.5, "revision": None} for x in ra), ra
    assert [x["text"] for x in rb] == [f"X{i}" for i in range(6)]
    assert {x["worker"] for x in rb} == {wa["id"]}  # MTQ_WORKER_ID: the first engine's
    out = sup.output()
    assert f"{qa!r} with tests.models:Configured, {qb!r} with tests.host_models:shout" in out
    assert f"ready on cpu (pid {wa['pid']}, {qa}: configured/" in out, out


def test_the_files_budget_on_demand_and_idle_unload_reach_the_engines(
        host: HostFn, qname: str, redis_url: str, r: redis.Redis) -> None:
    """max_loaded = 1: B (on demand) loads on its first task, unloading A (the least
    recently used) for room; B unloads after idle_unload_s; A loads again for its task."""
    qa, qb = f"{qname}-a", f"{qname}-b"
    sup = host(two_probes(qa, qb, "max_loaded = 1",
                          b_keys='on_demand = true\nidle_unload_s = 1\nmemory = "1MiB"'))

    def engines() -> tuple[dict[str, Any], dict[str, Any]]:
        (wa,) = wait_workers(r, qa, 1, sup)
        (wb,) = wait_workers(r, qb, 1, sup)
        return wa, wb

    def states(a: str, b: str, what: str) -> None:
        wait_for(lambda: tuple(w["engine"] for w in engines()) == (a, b), 20,
                 f"{what}: A {a}, B {b}: {[(w['engine'], w['state']) for w in engines()]}\n"
                 f"{sup.output()}")

    states("loaded", "unloaded", "at start")
    wa, wb = engines()
    assert wa["process"] == wb["process"] and wa["pid"] == wb["pid"], (wa, wb)
    assert (wb["on_demand"], float(wb["idle_unload_s"]), int(wb["memory_bytes"])) == \
        (True, 1.0, 2**20), wb
    assert not wa["on_demand"], wa
    assert mtq.Queue(qb, redis_url).submit({"s": "b0", "i": 0}).result(timeout=30)["i"] == 0
    states("unloaded", "unloaded", "B ran, A unloaded for room, B idle for 1 s")
    assert mtq.Queue(qa, redis_url).submit({"s": "a0", "i": 1}).result(timeout=30)["i"] == 1
    states("loaded", "unloaded", "A loaded again for its task")


# -- SIGKILL of a host process ------------------------------------------------------------
@pytest.mark.slow
def test_sigkill_of_a_host_process_gives_back_each_engines_tasks(
        host: HostFn, qname: str, redis_url: str, r: redis.Redis, tmp_path: Path) -> None:
    """Both engines are inside predict when their process is killed: each one's
    tasks go back at once with its queue's consumer (a 30 s lease is not waited
    out), the running calls' deliveries counted, the rest not; nothing is lost and
    nothing runs to completion twice; the dead process's registry entries go."""
    lease_ms = 30_000
    log = tmp_path / "calls.log"
    qa, qb = f"{qname}-a", f"{qname}-b"
    sup = host(two_probes(qa, qb, f"lease_ms = {lease_ms}"), env={"MTQ_TEST_LOG": str(log)})
    pid = host_pid(r, qa, qb, sup)
    q_a, q_b = mtq.Queue(qa, redis_url), mtq.Queue(qb, redis_url)
    ta = submit(q_a, "a", streams=4, per_stream=2, sleep=0.5)  # a batch of 4: 2 s
    tb = submit(q_b, "b", streams=4, per_stream=2, sleep=0.5)

    running = wait_for(lambda: (lambda o: o if {(pid, "a"), (pid, "b")} <= set(o) else None)(
        open_calls(read_log(log))), 20, f"both engines inside predict\n{sup.output()}")
    os.kill(pid, signal.SIGKILL)
    killed_at = time.time()
    killed = {k for c in running.values() for k in c.keys}
    assert {k[0] for k in killed} == {"a", "b"}

    wait_for(lambda: q_a.stats()["succeeded"] == 8 and q_b.stats()["succeeded"] == 8, 60,
             f"every task succeeded: {q_a.stats()} {q_b.stats()}\n{sup.output()[-6000:]}")
    assert_all_succeeded_once(q_a, ta)
    assert_all_succeeded_once(q_b, tb)
    calls = read_log(log)
    # nothing ran to completion twice: each task in exactly one returned call
    done = Counter(k for c in calls if c.tag == "D" for k in c.keys)
    assert done == Counter({k: 1 for k in [*ta, *tb]}), done
    # each engine's killed call ran again promptly: given back, not left to its lease
    for label in "ab":
        rerun = [c for c in calls if c.tag == "B" and c.t > killed_at
                 and {k for k in c.keys if k[0] == label} & killed]
        assert rerun and rerun[0].t - killed_at < lease_ms / 3000, (label, rerun, killed_at)
    # both engines' running calls counted (either could have killed it); nothing else
    deliveries = {k: t.info().deliveries for k, t in [*ta.items(), *tb.items()]}
    assert {k for k, d in deliveries.items() if d != 1} == killed, deliveries
    assert all(deliveries[k] == 2 for k in killed), deliveries
    assert "died (exit code -9)" in sup.output()
    # a new process serves both; the dead one's two entries were removed, not aged out
    assert host_pid(r, qa, qb, sup) != pid
    assert pid not in {w["pid"] for q in (qa, qb) for w in list_workers(r, q)}
    assert not pid_exists(pid)


# -- control and standby -----------------------------------------------------------------
def _mtq(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "mtq", *args], env=env, capture_output=True, text=True,
                          timeout=30)


@pytest.mark.slow
def test_pause_acts_on_the_whole_host_and_reload_on_its_queues_engine(
        host: HostFn, qname: str, redis_url: str, r: redis.Redis,
        subprocess_env: dict[str, str]) -> None:
    qa, qb = f"{qname}-a", f"{qname}-b"
    sup = host(two_probes(qa, qb))
    pid = host_pid(r, qa, qb, sup)
    # one supervisor listens on each queue's channel
    for q in (qa, qb):
        res = _mtq(subprocess_env, "workers", "pause", "-q", q, "--redis", redis_url)
        assert res.returncode == 0 and "sent to 1 supervisor" in res.stdout, res
        for each in (qa, qb):  # the whole host pauses, whichever queue it came on
            wait_workers(r, each, 1, sup, check=lambda w: w["state"] == "paused")
        res = _mtq(subprocess_env, "workers", "resume", "-q", q, "--redis", redis_url)
        assert res.returncode == 0, res
        for each in (qa, qb):
            wait_workers(r, each, 1, sup, check=lambda w: w["state"] == "idle")
    res = _mtq(subprocess_env, "workers", "reload", "-q", qb, "--redis", redis_url)
    assert res.returncode == 0, res
    wait_for(lambda: f"worker 0 queue {qb!r} reloaded" in sup.output(), 30,
             f"queue B's engine reloaded\n{sup.output()}")
    assert f"queue {qa!r} reloaded" not in sup.output(), sup.output()
    assert mtq.Queue(qa, redis_url).submit({"s": "a0", "i": 0}).result(timeout=30)["pid"] == pid
    assert mtq.Queue(qb, redis_url).submit({"s": "b0", "i": 0}).result(timeout=30)["pid"] == pid


@pytest.mark.slow
def test_a_hosts_standby_takes_over_both_engines(host: HostFn, qname: str, redis_url: str,
                                                 r: redis.Redis) -> None:
    qa, qb = f"{qname}-a", f"{qname}-b"
    sup = host(two_probes(qa, qb).replace("standby = 0", "standby = 1"))
    pid = host_pid(r, qa, qb, sup)
    wait_for(lambda: "standby ready on cpu" in sup.output(), 30,
             f"the standby set up\n{sup.output()}")
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: "its standby" in sup.output() and "took over" in sup.output(), 20,
             f"the standby took over\n{sup.output()}")
    spare = host_pid(r, qa, qb, sup)
    assert spare != pid
    assert f"(pid {spare}) took over" in sup.output(), sup.output()
    assert mtq.Queue(qa, redis_url).submit({"s": "a0", "i": 0}).result(timeout=30)["pid"] == spare
    assert mtq.Queue(qb, redis_url).submit({"s": "b0", "i": 0}).result(timeout=30)["pid"] == spare


@pytest.mark.slow
def test_engine_commands_reach_their_queues_engine_and_later_processes_keep_its_options(
        host: HostFn, qname: str, redis_url: str, r: redis.Redis,
        subprocess_env: dict[str, str]) -> None:
    qa, qb = f"{qname}-a", f"{qname}-b"
    sup = host(f"[host]\nstandby = 0\n"
               f"[[engine]]\nqueue = \"{qa}\"\ntarget = \"tests.models:Optioned\"\n"
               f"options = {{ model = \"a1\" }}\n"
               f"[[engine]]\nqueue = \"{qb}\"\ntarget = \"tests.models:Optioned\"\n"
               f"options = {{ model = \"b1\", pooling = \"cls\" }}\n")
    pid = host_pid(r, qa, qb, sup)
    (wa,) = wait_workers(r, qa, 1, sup)
    q_a, q_b = mtq.Queue(qa, redis_url), mtq.Queue(qb, redis_url)

    def served(q: mtq.Queue) -> set[tuple[int, str, str]]:
        return {(x["pid"], x["options"]["model"], x["options"]["pooling"])
                for x in (t.result(timeout=60) for t in q.submit_many([{"i": 0}] * 2))}

    assert (served(q_a), served(q_b)) == ({(pid, "a1", "mean")}, {(pid, "b1", "cls")})
    # unload A: A's engine alone answers; B's stays loaded
    res = _mtq(subprocess_env, "workers", "unload", "-q", qa, "--redis", redis_url, "--json")
    assert res.returncode == 0, res
    answers = json.loads(res.stdout)["answers"]
    assert [(a["worker"], a["state"]) for a in answers] == [(wa["id"], "unloaded")], answers
    wait_for(lambda: [w["engine"] for q in (qa, qb) for w in wait_workers(r, q, 1, sup)]
             == ["unloaded", "loaded"], 10, "A unloaded, B loaded")
    res = _mtq(subprocess_env, "workers", "load", "-q", qa, "--redis", redis_url)
    assert res.returncode == 0 and "load: 1 of 1 engine(s) ok" in res.stdout, res
    # reload A with new options: A serves them, B keeps its own; a process started
    # later starts A's engine with them, and B's with the file's
    res = _mtq(subprocess_env, "workers", "reload", "-q", qa, "--set", "model=a2",
               "--redis", redis_url)
    assert res.returncode == 0 and "reload: 1 of 1 engine(s) ok" in res.stdout, res
    assert (served(q_a), served(q_b)) == ({(pid, "a2", "mean")}, {(pid, "b1", "cls")})
    wait_for(lambda: f"processes start queue {qa!r}'s engine with --set model=a2" in
             sup.output(), 15, f"the supervisor adopted A's options\n{sup.output()}")
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: host_pid(r, qa, qb, sup) != pid, 60, f"a new process\n{sup.output()}")
    new = host_pid(r, qa, qb, sup)
    assert (served(q_a), served(q_b)) == ({(new, "a2", "mean")}, {(new, "b1", "cls")})


# -- an engine's timeout ------------------------------------------------------------------
@pytest.mark.slow
def test_an_engine_that_overruns_its_timeout_kills_the_process_and_only_its_call_counts(
        host: HostFn, qname: str, redis_url: str, r: redis.Redis, tmp_path: Path) -> None:
    log = tmp_path / "calls.log"
    qa, qb = f"{qname}-a", f"{qname}-b"
    q_a, q_b = mtq.Queue(qa, redis_url), mtq.Queue(qb, redis_url)
    q_a.configure(max_deliveries=2)
    sup = host(two_probes(qa, qb, a_keys="timeout = 1.5"), env={"MTQ_TEST_LOG": str(log)})
    pid = host_pid(r, qa, qb, sup)
    tb = submit(q_b, "b", streams=4, per_stream=2, sleep=1.0)  # a batch of 4: 4 s
    wait_for(lambda: (pid, "b") in open_calls(read_log(log)), 20,
             f"queue B's engine inside predict\n{sup.output()}")
    hung = q_a.submit({"s": "a0", "i": 0, "hang": True})  # A's engine is idle: runs at once

    wait_for(lambda: q_a.stats()["dead"] == 1 and q_b.stats()["succeeded"] == 8, 90,
             f"the hung task dead, B's done: {q_a.stats()} {q_b.stats()}\n"
             f"{sup.output()[-6000:]}")
    info = hung.info()
    assert (info.status, info.deliveries) == ("dead", 2), info
    out = sup.output()
    assert out.count(f"predict of queue {qa!r} ran past its 1.5 s timeout; killing it") == 2, out
    # B's calls cut by the kills went back uncounted: every B task ran on its first
    # counted delivery, and some of them were running when the process was killed
    assert_all_succeeded_once(q_b, tb)
    assert {k: t.info().deliveries for k, t in tb.items()} == {k: 1 for k in tb}
    calls = read_log(log)
    started_b = Counter(k for c in calls if c.tag == "B" for k in c.keys if k[0] == "b")
    assert max(started_b.values()) >= 2, started_b  # cut once at least, then run again


# -- SIGTERM ------------------------------------------------------------------------------
@pytest.mark.slow
def test_sigterm_drains_both_engines(host: HostFn, qname: str, redis_url: str,
                                     r: redis.Redis, tmp_path: Path) -> None:
    log = tmp_path / "calls.log"
    qa, qb = f"{qname}-a", f"{qname}-b"
    sup = host(two_probes(qa, qb, "lease_ms = 30000"), env={"MTQ_TEST_LOG": str(log)})
    pid = host_pid(r, qa, qb, sup)
    q_a, q_b = mtq.Queue(qa, redis_url), mtq.Queue(qb, redis_url)
    ta = submit(q_a, "a", streams=6, per_stream=2, sleep=0.5)
    tb = submit(q_b, "b", streams=6, per_stream=2, sleep=0.5)
    wait_for(lambda: {(pid, "a"), (pid, "b")} <= set(open_calls(read_log(log))), 20,
             f"both engines inside predict\n{sup.output()}")
    sup.proc.send_signal(signal.SIGTERM)
    assert sup.wait_exit(30, "after SIGTERM") == 0, sup.output()
    assert "stopping: finishing running batches" in sup.output()
    wait_for(lambda: not sup.group_alive(), 10, "worker processes left after the supervisor")

    calls = read_log(log)
    assert not open_calls(calls), open_calls(calls)  # every running call finished
    ran = {k for c in calls if c.tag == "D" for k in c.keys}
    for label, q, tasks in (("a", q_a, ta), ("b", q_b, tb)):
        assert any(k in ran for k in tasks), f"queue {label} ran nothing"
        back = [k for k in tasks if k not in ran]
        assert back, f"queue {label}: nothing was left to give back"
        for k, t in tasks.items():
            info = t.info()
            want = ("succeeded", 1) if k in ran else ("queued", 0)
            assert (info.status, info.deliveries) == want, (k, info)
        stats = q.stats()
        assert (stats["running"], stats["waiting"]) == (0, len(back)), stats
    # the host's registry entries left with it
    assert not [w for q in (qa, qb) for w in list_workers(r, q)]


# -- bad input: exit 2, nothing started ------------------------------------------------------
def _cli(subprocess_env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "mtq", "workers", "start", *args], env=subprocess_env,
                          capture_output=True, text=True, timeout=60)


def test_a_bad_host_file_exits_2_naming_its_line_and_starts_nothing(
        subprocess_env: dict[str, str], qname: str, r: redis.Redis, tmp_path: Path) -> None:
    path = tmp_path / "host.toml"
    path.write_text(f'[host]\nreplicas = 1\n\n[[engine]]\nqueue = "{qname}"\n'
                    'target = "tests.models:Probe"\nmax_batch_sise = 4\n')
    res = _cli(subprocess_env, "--config", str(path))
    assert res.returncode == 2, res
    assert f"{path}:7: unknown key 'max_batch_sise' in [[engine]] 1 (did you mean " \
           "'max_batch_size'?)" in " ".join(res.stderr.split()), res.stderr
    assert not list_workers(r, qname)
    path.write_text(f'[[engine]]\nqueue = "{qname}"\ntarget = "tests.models:NoSuch"\n'
                    'options = { x = 1 }\n')
    res = _cli(subprocess_env, "--config", str(path))
    assert res.returncode == 2, res
    assert f"{path}:3: module 'tests.models' has no attribute 'NoSuch'" in \
        " ".join(res.stderr.split()), res.stderr


@pytest.mark.parametrize("args, says", [
    (("tests.models:Probe", "-q", "x", "--config", "h.toml"), "not both"),
    ((), "give TARGET with --queue, or --config HOST.TOML"),
    (("tests.models:Probe",), "missing option --queue"),
    (("--config", "h.toml", "--replicas", "2"), "--replicas does not go with --config"),
    (("--config", "h.toml", "-q", "x"), "--queue does not go with --config"),
    (("--config", "h.toml", "--set", "a=b"), "--set does not go with --config"),
    (("--config", "no-such-host.toml"), "no-such-host.toml: cannot read the host file"),
])
def test_target_or_config_and_flags_the_file_holds(
        subprocess_env: dict[str, str], tmp_path: Path, args: tuple[str, ...],
        says: str) -> None:
    res = subprocess.run([PY, "-m", "mtq", "workers", "start", *args], env=subprocess_env,
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert res.returncode == 2, res
    assert says in " ".join(res.stderr.split()), res.stderr


def test_start_checks_every_engine_before_any_process_starts(
        subprocess_env: dict[str, str], qname: str, r: redis.Redis, tmp_path: Path) -> None:
    """The first engine is fine; the second's target is missing: nothing starts, not
    even the first's process."""
    path = tmp_path / "host.toml"
    path.write_text(f'[[engine]]\nqueue = "{qname}-a"\ntarget = "tests.models:Probe"\n'
                    f'[[engine]]\nqueue = "{qname}-b"\ntarget = "tests.no_such_module:X"\n')
    started = time.monotonic()
    res = _cli(subprocess_env, "--config", str(path))
    assert res.returncode == 2 and f"{path}:6: cannot import 'tests.no_such_module'" in \
        " ".join(res.stderr.split()), res
    assert "supervisor" not in res.stdout + res.stderr
    assert time.monotonic() - started < 30
    assert not list_workers(r, f"{qname}-a")
