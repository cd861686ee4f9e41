"""Load, unload, reload and reset on every engine serving a queue, waiting for their
answers: the control messages (``mtq.broker.commands``), the answers
(``mtq.broker.answers``), ``mtq.admin.load/unload/reload/reset`` and ``mtq workers
load|unload|reload|reset`` (exit codes: 0 ok, 1 one failed, 2 bad input, 4 no engine,
6 an engine did not answer, 130 Ctrl-C). Against the session's redis-server; the
end-to-end tests run ``mtq workers start`` (real worker processes) of
``tests.models:Optioned``, whose results say which options its setup saw."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner

import mtq
import mtq.admin
from mtq.broker import answers, catalogue, commands, registry
from mtq.cli.main import cli
from mtq.client import engines
from mtq.errors import ConfigError, EngineTimeout, NoEngine, ResultTimeout
from mtq.workers import control
from tests.support.paths import PY
from tests.support.processes import ctrl_c_default
from tests.support.supervisors import StartFn, wait_workers, workers_of
from tests.support.waits import wait_for
from tests.support.workers import registered_worker

pytestmark = pytest.mark.timeout(180)

TARGET = "tests.models:Optioned"


def flat(text: str) -> str:
    """rich wraps long lines: join the words again."""
    return " ".join(text.split())


def mtq_cli(env: dict[str, str], *args: str, timeout: float = 120
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "mtq", *args], env={**env, "COLUMNS": "250"},
                          capture_output=True, text=True, timeout=timeout)


# -- the messages ---------------------------------------------------------------------------
def test_engine_messages_carry_reply_options_and_now() -> None:
    assert control.message("reload") == {"cmd": "reload"}  # as before: fire and forget
    assert control.message("reload", reply="ab12", options={"pooling": "cls"},
                           worker="w1") == {"cmd": "reload", "reply": "ab12",
                                            "options": {"pooling": "cls"}, "worker": "w1"}
    assert control.message("load", reply="x", options={}) == {"cmd": "load", "reply": "x"}
    assert control.message("unload", reply="x", now=True) == {"cmd": "unload", "reply": "x",
                                                              "now": True}
    assert control.message("reset", reply=answers.new_id())["cmd"] == "reset"
    assert control.message is commands.message
    assert set(control.ENGINE_COMMANDS) == {"load", "unload", "reload", "reset"}
    assert set(control.ENGINE_COMMANDS) < set(control.COMMANDS)


@pytest.mark.parametrize(("cmd", "fields", "says"), [
    ("pause", {"reply": "x"}, "pause is not answered"),
    ("reload", {"reply": "a b"}, "reply id 'a b'"),
    ("reload", {"reply": ""}, "reply id ''"),
    ("unload", {"options": {"a": "1"}}, "unload takes no model options"),
    ("reset", {"options": {"a": "1"}}, "reset takes no model options"),
    ("reload", {"options": {"layers": 3}}, "option 'layers' must be given as text"),
    ("reload", {"options": {"": "1"}}, "is not a name"),
    ("reload", {"options": ["a=1"]}, "options must be a dict"),
    ("reload", {"now": True}, "reload takes no --now"),
    ("load", {"now": True}, "load takes no --now"),
])
def test_bad_engine_messages_are_refused(cmd: str, fields: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError, match=says.replace("(", r"\(")):
        control.message(cmd, **fields)


# -- the answers --------------------------------------------------------------------------------
def test_answers_come_in_order_and_a_timeout_returns_fewer(r: redis.Redis, qname: str) -> None:
    rid = answers.new_id()
    assert rid != answers.new_id()
    for i in range(3):
        answers.post(r, qname, rid, {"i": i})
    assert 0 < r.ttl(answers.key(qname, rid)) <= answers.ANSWER_TTL_S
    seen: list[int] = []
    got = answers.collect(r, qname, rid, 3, 5, on_answer=lambda a: seen.append(a["i"]))
    assert [a["i"] for a in got] == [0, 1, 2] == seen

    # expect 3, 1 comes: back after the timeout with it
    answers.post(r, qname, rid, {"i": 9})
    t0 = time.monotonic()
    got = answers.collect(r, qname, rid, 3, 0.5)
    waited = time.monotonic() - t0
    assert got == [{"i": 9}]
    assert 0.4 < waited < 3, waited


def test_an_answer_posted_while_waiting_wakes_the_wait(r: redis.Redis, qname: str) -> None:
    rid = answers.new_id()
    timer = threading.Timer(0.3, answers.post, (r, qname, rid, {"ok": True}))
    timer.start()
    try:
        t0 = time.monotonic()
        assert answers.collect(r, qname, rid, 1, 20) == [{"ok": True}]
        assert time.monotonic() - t0 < 10, "the wait did not wake on the answer"
    finally:
        timer.cancel()
        timer.join(10)  # its round trip may still be reading the reply: before r closes


# -- mtq.admin, against engines played by this test ------------------------------------------
@contextmanager
def fake_engines(r: redis.Redis, qname: str, ids: list[str], answering: set[str]
                 ) -> Iterator[list[dict[str, Any]]]:
    """Registry entries of serving engines ``ids`` of ``qname`` and one listener on the
    queue's control channel answering, for those in ``answering``, each engine command
    as an engine would (the real ones: the end-to-end tests below)."""
    got: list[dict[str, Any]] = []

    def answer(msg: dict[str, Any]) -> None:
        got.append(msg)
        for wid in ids:
            if wid in answering and msg.get("reply") and msg.get("worker") in (None, wid):
                answers.post(r, qname, msg["reply"], {
                    "op": msg["cmd"], "ok": True, "queue": qname, "worker": wid,
                    "host": "h", "pid": 1, "state": "loaded", "took_s": 0.01,
                    "detail": f"options {msg.get('options')}", "error": ""})

    for wid in ids:
        registry.beat(r, wid, {"queue": qname, "role": "serving", "host": "h", "pid": 1},
                      ttl_s=60)
    listener = control.Listener(r, qname, answer)
    listener.start()
    try:
        yield got
    finally:
        listener.close()
        for wid in ids:
            registry.remove(r, wid)


def test_admin_calls_wait_for_every_engine(r: redis.Redis, qname: str) -> None:
    ids = [f"{qname}-w1", f"{qname}-w2"]
    with fake_engines(r, qname, ids, set(ids)) as got:
        out = mtq.admin.reload(r, qname, options={"pooling": "cls"}, timeout=10)
        assert sorted(a["worker"] for a in out) == ids
        assert got[-1]["options"] == {"pooling": "cls"} and got[-1]["cmd"] == "reload"
        assert len(mtq.admin.unload(mtq.Queue(qname, client=r), now=True, timeout=10)) == 2
        assert got[-1]["now"] is True
        one = mtq.admin.reset(r, qname, worker=ids[1], timeout=10)
        assert [a["worker"] for a in one] == [ids[1]]
        assert [a["op"] for a in mtq.admin.load(r, qname, timeout=10)] == ["load"] * 2


def test_admin_calls_name_what_went_wrong(r: redis.Redis, qname: str) -> None:
    with pytest.raises(NoEngine, match="mtq workers start TARGET -q"):
        mtq.admin.load(r, qname)
    with pytest.raises(ConfigError, match="timeout"):
        mtq.admin.reset(r, qname, timeout=0)
    with pytest.raises(ConfigError, match="takes no model options"):
        engines.command(r, qname, "reset", options={"a": "b"})
    ids = [f"{qname}-w1", f"{qname}-w2"]
    with fake_engines(r, qname, ids, {ids[0]}):
        with pytest.raises(NoEngine, match="has worker id 'nope'"):
            mtq.admin.reset(r, qname, worker="nope")
        t0 = time.monotonic()
        with pytest.raises(EngineTimeout) as info:
            mtq.admin.reset(r, qname, timeout=0.5)
        assert time.monotonic() - t0 < 5
        exc = info.value
        assert isinstance(exc, ResultTimeout) and isinstance(exc, TimeoutError)
        assert [a["worker"] for a in exc.answers] == [ids[0]]
        assert [w["id"] for w in exc.missing] == [ids[1]]
        assert ids[1] in str(exc)
    # the registry lists one, nobody listens
    registry.beat(r, f"{qname}-ghost", {"queue": qname, "role": "serving"}, ttl_s=60)
    try:
        with pytest.raises(NoEngine, match="no process listens"):
            mtq.admin.reset(r, qname, timeout=1)
    finally:
        registry.remove(r, f"{qname}-ghost")


# -- the CLI, without engines that answer -------------------------------------------------------
def test_no_engine_exits_4_saying_how_to_start_one(qname: str,
                                                    subprocess_env: dict[str, str]) -> None:
    out = mtq_cli(subprocess_env, "workers", "unload", "-q", qname)
    assert out.returncode == 4, (out.stdout, out.stderr)
    assert f"mtq workers start TARGET -q {qname}" in flat(out.stderr), out.stderr


@pytest.mark.parametrize(("sets", "says"), [
    (["--set", "model"], "--set takes KEY=VALUE, got 'model'"),
    (["--set", "model=/a", "--set", "model=/b"], "--set model is given twice"),
    (["--set", "model=/a", "--set", "poolng=cls"],
     "'tests.models:Configured' has no option 'poolng' (did you mean 'pooling'?)"),
    (["--set", "model=/a", "--set", "layers=9"], "option 'layers' must be >= 1 and <= 8"),
    # the options named change, the served ones stay (model=/srv/a): checked together
    (["--set", "pooling=bogus"], "option 'pooling' must be one of mean, cls; got 'bogus'"),
], ids=["malformed", "twice", "unknown", "range", "choices"])
def test_a_bad_set_exits_2(sets: list[str], says: str, qname: str, r: redis.Redis,
                           subprocess_env: dict[str, str]) -> None:
    # the queue's model record names the target
    catalogue.record(r, qname, {"event": "loaded"}, {
        "target": "tests.models:Configured", "options": json.dumps({"model": "/srv/a"})})
    out = mtq_cli(subprocess_env, "workers", "reload", "-q", qname, *sets)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert says in flat(out.stderr), out.stderr


def test_a_good_set_passes_and_an_unknown_target_is_left_to_the_engines(
        qname: str, r: redis.Redis, subprocess_env: dict[str, str]) -> None:
    catalogue.record(r, qname, {"event": "loaded"}, {"target": "tests.models:Configured"})
    out = mtq_cli(subprocess_env, "workers", "load", "-q", qname, "--set", "model=/b",
                  "--set", "pooling=cls")
    assert out.returncode == 4, (out.stdout, out.stderr)  # checked; then no engine
    # a target this process cannot import: left to the engines, with a note
    catalogue.record(r, qname, {"event": "loaded"}, {"target": "elsewhere.models:Gone"})
    out = mtq_cli(subprocess_env, "workers", "reload", "-q", qname, "--set", "x=1")
    assert out.returncode == 4, (out.stdout, out.stderr)
    assert "cannot check the options here" in flat(out.stderr), out.stderr


def test_redis_unreachable_exits_5(qname: str, subprocess_env: dict[str, str],
                                   unreachable_url: str) -> None:
    out = mtq_cli({**subprocess_env, "MTQ_REDIS_RETRIES": "0"}, "workers", "reset", "-q",
                  qname, "--redis", unreachable_url)
    assert out.returncode == 5, (out.stdout, out.stderr)
    assert "cannot reach Redis" in flat(out.stderr), out.stderr


def test_a_worker_without_a_supervisor_answers_too(
        qname: str, redis_url: str, r: redis.Redis, subprocess_env: dict[str, str],
        tmp_path: Path) -> None:
    with registered_worker(TARGET, qname, subprocess_env, tmp_path / "calls.log",
                           "--set", "model=solo") as proc:
        out = mtq_cli(subprocess_env, "workers", "reset", "-q", qname, "--json")
        assert out.returncode == 0, (out.stdout, out.stderr)
        (answer,) = json.loads(out.stdout)["answers"]
        assert answer["pid"] == proc.pid and answer["ok"] and answer["state"] == "loaded"
        assert mtq.Queue(qname, redis_url).submit({}).result(timeout=30)["options"] == \
            {"model": "solo", "pooling": "mean"}


def test_an_engine_that_does_not_answer_exits_6_naming_it(
        qname: str, redis_url: str, r: redis.Redis, subprocess_env: dict[str, str],
        tmp_path: Path) -> None:
    with registered_worker(TARGET, qname, subprocess_env, tmp_path / "calls.log") as proc:
        (entry,) = [w for w in registry.list_workers(r, qname) if w["pid"] == proc.pid]
        os.kill(proc.pid, signal.SIGSTOP)  # alive, subscribed, registered a few s more
        try:
            res = CliRunner().invoke(cli, ["workers", "reset", "-q", qname, "--timeout", "1",
                                           "--redis", redis_url])
        finally:
            os.kill(proc.pid, signal.SIGCONT)
    assert res.exit_code == 6, res.output
    out = flat(res.output)
    assert f"1 engine(s) did not answer within 1 s: {entry['id']}" in out, out
    assert "reset: 0 of 1 engine(s) ok, 1 did not answer" in out, out


def test_ctrl_c_while_waiting_exits_130_and_says_the_command_goes_on(
        qname: str, redis_url: str, r: redis.Redis, subprocess_env: dict[str, str],
        tmp_path: Path) -> None:
    with registered_worker(TARGET, qname, subprocess_env, tmp_path / "calls.log") as proc:
        # its engine is in a long batch: a command waits for the batch's end
        mtq.Queue(qname, redis_url).submit({"sleep": 120})
        wait_for(lambda: [w for w in registry.list_workers(r, qname)
                          if w["pid"] == proc.pid and w.get("state") == "running"],
                 30, "the worker never ran the long batch")
        err = tmp_path / "cli.err"
        with open(err, "wb") as f:
            cmd = subprocess.Popen([PY, "-m", "mtq", "workers", "reset", "-q", qname],
                                   env=subprocess_env, stdout=subprocess.PIPE, stderr=f,
                                   preexec_fn=ctrl_c_default)
        try:
            wait_for(lambda: "waiting up to 600 s" in flat(err.read_text()), 30,
                     "the command never started waiting")
            cmd.send_signal(signal.SIGINT)
            assert cmd.wait(30) == 130, err.read_text()
        finally:
            if cmd.poll() is None:
                cmd.kill()
                cmd.wait(10)
            proc.kill()  # its batch runs for minutes: no graceful stop
            proc.wait(10)
    text = flat(err.read_text())
    assert "stopped waiting: the reset goes on in the engines" in text, text
    assert "Traceback" not in text, text


# -- end to end: mtq workers start, and the four commands ------------------------------------------
def engine_states(r: redis.Redis, qname: str) -> list[str]:
    return sorted(str(w.get("engine")) for w in workers_of(r, qname, live_only=True))


def results(q: mtq.Queue, n: int, timeout: float = 60) -> list[dict[str, Any]]:
    tasks = [q.submit({"i": i}) for i in range(n)]
    return [t.result(timeout=timeout) for t in tasks]


def test_unload_load_reload_reset_on_every_process(
        supervise: StartFn, qname: str, redis_url: str, r: redis.Redis,
        subprocess_env: dict[str, str]) -> None:
    sup = supervise(TARGET, qname, "--replicas", "2", "--standby", "0", "--set", "model=m1")
    ws = wait_workers(r, qname, 2, sup)
    pids = {w["pid"] for w in ws}
    q = mtq.Queue(qname, redis_url)
    assert {res["options"]["model"] for res in results(q, 4)} == {"m1"}

    # unload: both answer; the registry shows it; tasks wait
    out = mtq_cli(subprocess_env, "workers", "unload", "-q", qname, "--json")
    assert out.returncode == 0, (out.stdout, out.stderr)
    data = json.loads(out.stdout)
    assert data["ok"] and data["missing"] == [] and len(data["answers"]) == 2, data
    assert {a["pid"] for a in data["answers"]} == pids
    assert {a["state"] for a in data["answers"]} == {"unloaded"}
    wait_for(lambda: engine_states(r, qname) == ["unloaded", "unloaded"], 10,
             f"the registry does not show them unloaded: {workers_of(r, qname)}")
    waiting = [q.submit({"w": i}) for i in range(3)]
    submitted = time.time()
    # two beats of both engines after the submit: they had the time to take them
    wait_for(lambda: all(w["beat"] > submitted + 2 for w in workers_of(r, qname)), 15,
             "no heartbeat after the submit")
    assert [t.status() for t in waiting] == ["queued"] * 3, "an unloaded engine ran tasks"
    listed = mtq_cli(subprocess_env, "workers", "list", "-q", qname)
    table = flat(listed.stdout)
    assert listed.returncode == 0 and "┃ engine ┃ memory ┃ last use ┃" in table, listed.stdout
    assert table.count("│ unloaded │ - │") == 2, listed.stdout  # engine, memory

    # load: served
    out = mtq_cli(subprocess_env, "workers", "load", "-q", qname)
    assert out.returncode == 0, (out.stdout, out.stderr)
    lines = [ln for ln in out.stdout.splitlines() if ": load ok in " in ln]
    assert len(lines) == 2, out.stdout
    assert {int(ln.split()[0].rsplit(":", 1)[1]) for ln in lines} == pids, out.stdout
    assert all("engine loaded" in ln for ln in lines), out.stdout
    assert "load: 2 of 2 engine(s) ok" in out.stdout
    assert [t.result(timeout=30)["options"]["model"] for t in waiting] == ["m1"] * 3
    wait_for(lambda: engine_states(r, qname) == ["loaded", "loaded"], 10, "not loaded")

    # reload with new options: served with them, and a process started after too
    out = mtq_cli(subprocess_env, "workers", "reload", "-q", qname, "--set", "model=m2",
                  "--set", "pooling=cls")
    assert out.returncode == 0, (out.stdout, out.stderr)
    assert "reload: 2 of 2 engine(s) ok" in out.stdout, out.stdout
    assert {(x["options"]["model"], x["options"]["pooling"]) for x in results(q, 4)} == \
        {("m2", "cls")}
    wait_for(lambda: "processes start with" in sup.output(), 10,
             f"the supervisor did not adopt the options\n{sup.output()}")
    victim = sorted(pids)[0]
    os.kill(victim, signal.SIGKILL)
    fresh = wait_workers(r, qname, 2, sup, timeout=60,
                         check=lambda w: w["pid"] != victim and w.get("engine") == "loaded")
    new_pid = ({w["pid"] for w in fresh} - pids).pop()

    def from_new() -> dict[str, Any] | None:
        return next((x for x in results(q, 4) if x["pid"] == new_pid), None)

    res = wait_for(from_new, 60, "the new process served nothing")
    assert res["options"] == {"model": "m2", "pooling": "cls"}, res

    # a reload to options whose setup fails: exit 1, the old model serves on
    out = mtq_cli(subprocess_env, "workers", "reload", "-q", qname, "--set", "model=fail")
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert out.stdout.count("reload FAILED") == 2 and "no checkpoint at 'fail'" in out.stdout
    assert {(x["options"]["model"], x["options"]["pooling"]) for x in results(q, 4)} == \
        {("m2", "cls")}

    # reset: ok, still serving
    out = mtq_cli(subprocess_env, "workers", "reset", "-q", qname)
    assert out.returncode == 0 and "reset: 2 of 2 engine(s) ok" in out.stdout, out
    assert len(results(q, 2)) == 2

    models = json.loads(mtq_cli(subprocess_env, "models", "--json", "-q", qname).stdout)
    rows = [e for p in models["processes"] for e in p["engines"]]
    assert len(rows) == 2 and {e["engine"] for e in rows} == {"loaded"}, models
    assert all(p["process"] == f"{p['host']}:{p['pid']}" for p in models["processes"])


def test_a_narrowed_reload_and_the_standby_after_new_options(
        supervise: StartFn, qname: str, redis_url: str, r: redis.Redis,
        subprocess_env: dict[str, str]) -> None:
    sup = supervise(TARGET, qname, "--replicas", "2", "--set", "model=m1")  # a standby too
    ws = wait_workers(r, qname, 2, sup)
    wait_for(lambda: "standby ready" in sup.output(), 60, f"no standby\n{sup.output()}")
    q = mtq.Queue(qname, redis_url)

    # --worker: that engine alone answers, and alone serves the new options
    one, other = ws[0], ws[1]
    out = mtq_cli(subprocess_env, "workers", "reload", "-q", qname, "--worker", one["id"],
                  "--set", "model=m2", "--json")
    assert out.returncode == 0, (out.stdout, out.stderr)
    assert [a["worker"] for a in json.loads(out.stdout)["answers"]] == [one["id"]]
    def both_served() -> dict[int, str] | None:
        # one round of tasks: the answer and the check must come from the same round
        got = {x["pid"]: x["options"]["model"] for x in results(q, 8)}
        return got if len(got) == 2 else None

    served = wait_for(both_served, 60, "both processes never served")
    assert served == {one["pid"]: "m2", other["pid"]: "m1"}, served

    # to every engine: the supervisor starts its later processes with them, the
    # standby too, which takes over when a serving process dies
    out = mtq_cli(subprocess_env, "workers", "reload", "-q", qname, "--set", "model=m3")
    assert out.returncode == 0 and "reload: 2 of 2 engine(s) ok" in out.stdout, out
    wait_for(lambda: "processes start with --set model=m3 from now on" in sup.output(), 15,
             f"the supervisor did not adopt the options\n{sup.output()}")
    os.kill(one["pid"], signal.SIGKILL)
    fresh = wait_workers(r, qname, 2, sup, timeout=60,
                         check=lambda w: w["pid"] != one["pid"])
    new_pid = ({w["pid"] for w in fresh} - {one["pid"], other["pid"]}).pop()
    res = wait_for(lambda: next((x for x in results(q, 4) if x["pid"] == new_pid), None),
                   60, "the new process served nothing")
    assert res["options"]["model"] == "m3", (res, sup.output())
