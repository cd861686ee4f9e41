"""Local mode (``mtq.local``): a private redis-server and a supervisor of real worker
processes for one target, inside a script or a test; on leaving the block (normally,
by an exception, by KeyboardInterrupt, or the script killed) nothing is left: no
process, no socket, no directory. The docs' example runs as a script."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

import mtq
from mtq.workers import local as localmode
from tests.support.paths import ROOT
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(120)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _holding(text: str) -> list[str]:
    """Live processes whose command line mentions ``text`` (a temporary directory: the
    runner's config, redis-server's config file, the fork server's sys.path)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid() and _alive(int(entry)):
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if text.encode() in cmd:
                out.append(f"{entry}: {cmd.decode(errors='replace')[:200]}")
    return out


def _left_by(lm: localmode.Local, pids: list[int], sock: Path, state_dir: Path) -> None:
    """Nothing of ``lm`` is left: its processes, the redis-server, the socket, the dir."""
    assert lm.process is None and lm.server is None
    alive = [p for p in pids if _alive(p)]
    assert not alive, f"processes left running after mtq.local: {alive}"
    assert not _holding(str(state_dir)), _holding(str(state_dir))
    assert not sock.exists(), f"the unix socket {sock} is still there"
    with pytest.raises(redis.exceptions.ConnectionError):  # (no retries: it is gone)
        redis.Redis(unix_socket_path=str(sock), socket_connect_timeout=1,
                    retry=Retry(NoBackoff(), 0)).ping()
    assert not state_dir.exists(), f"{state_dir} was not removed"


def test_a_block_serves_streams_and_leaves_nothing() -> None:
    """A module's function by name and a class object: results, tokens, then a normal
    exit stops every process and the server."""
    lm = mtq.local("tests.handlers:chunks", replicas=2, max_batch_size=4)
    with lm as q:
        assert isinstance(q, mtq.Queue) and q.name == "chunks"
        pids = lm.processes()
        assert lm.process is not None and lm.process.pid in pids
        assert len(pids) >= 4, pids  # runner, fork server, two workers
        sock, state_dir = Path(lm.server.socket), Path(lm.state_dir)
        assert sock.exists() and str(sock).startswith(str(state_dir))
        task = q.submit({"chunks": ["a", "b", "c"]})
        assert list(task.tokens(timeout=30)) == ["a", "b", "c"]
        assert task.result(timeout=30) == 3
        tasks = q.submit_many([{"chunks": [i]} for i in range(6)])
        assert [t.result(timeout=30) for t in tasks] == [1] * 6
        workers = {t.info().worker for t in tasks}
        assert all(w for w in workers)
    _left_by(lm, pids, sock, state_dir)


@pytest.mark.parametrize("error", [pytest.param(RuntimeError, marks=pytest.mark.slow),
                                   KeyboardInterrupt])  # (one path: a forced stop)
def test_an_exception_or_ctrl_c_in_the_block_stops_everything(error: type) -> None:
    from tests import handlers

    lm = mtq.local(handlers.logged, replicas=1)  # the function object, by its name
    with pytest.raises(error):
        with lm as q:
            assert lm.target == "tests.handlers:logged" and q.name == "logged"
            pids, sock, state_dir = lm.processes(), Path(lm.server.socket), Path(lm.state_dir)
            assert q.submit({"i": 1}).result(timeout=30)["i"] == 1
            q.submit({"sleep": 30})  # running when the block is left: killed, not awaited
            wait_for(lambda: q.stats().get("running"), 10, "the long task to start")
            raise error("leaving")
    _left_by(lm, pids, sock, state_dir)


def test_async_with_gives_the_same_queue() -> None:
    async def main() -> tuple[Any, list[Any]]:
        async with mtq.local("tests.handlers:chunks") as q:
            task = q.submit({"chunks": ["x", "y"]})
            tokens = [t async for t in task.atokens(timeout=30)]
            return await task.aresult(timeout=30), tokens

    assert asyncio.run(main()) == (2, ["x", "y"])
    assert not localmode._live


@pytest.mark.slow
def test_an_async_start_cancelled_midway_leaves_nothing(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    localmode.tempfile.tempdir = None
    lm = mtq.local("tests.handlers:record", replicas=2)

    async def main() -> None:
        async def enter() -> None:
            async with lm:
                pytest.fail("the block ran")

        task = asyncio.ensure_future(enter())
        deadline = time.monotonic() + 10
        while lm.process is None:  # the start is under way in its thread
            assert time.monotonic() < deadline, "the runner process never started"
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(main())
    finally:
        localmode.tempfile.tempdir = None
    wait_for(lambda: not list(tmp_path.glob("mtq-local-*")) and not _holding(str(tmp_path))
             and not localmode._live, 30, "the cancelled start to be stopped")
    assert lm.process is None


def test_a_bad_target_fails_at_enter_and_leaves_nothing(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    localmode.tempfile.tempdir = None  # (read TMPDIR again)
    try:
        with pytest.raises(mtq.TargetError, match="has no attribute 'nope'"):
            with mtq.local("tests.handlers:nope"):
                pytest.fail("the block ran")
        with pytest.raises(mtq.OptionError, match="declares no options"):
            mtq.local("tests.handlers:record", options={"model": "x"}).start()
    finally:
        localmode.tempfile.tempdir = None
    assert not list(tmp_path.glob("mtq-local-*")), "a temporary directory was left"
    assert not _holding(str(tmp_path))


def test_targets_no_process_can_import_are_named_at_once() -> None:
    def nested(payload: Any) -> Any:
        return payload

    for target, message in [(nested, "inside a function"), (lambda p: p, "lambda"),
                            ("nosuch_module_xyz:f", "cannot import 'nosuch_module_xyz'"),
                            ("no-colon", "package.module:attr"), (42, r"got 42 \(int\)")]:
        with pytest.raises(mtq.TargetError, match=message):
            mtq.local(target)
    notebook = types.ModuleType("__main__")  # a notebook's or a REPL's: no file
    with pytest.raises(mtq.TargetError, match=r"interactive session.*mymodels\.handle"):
        localmode._main_spec(notebook, "handle")
    with pytest.raises(mtq.ConfigError, match="replicas"):
        mtq.local("tests.handlers:record", replicas=0)
    with pytest.raises(mtq.ConfigError, match="bad device"):
        mtq.local("tests.handlers:record", devices="gpu")
    for bad in ({"max_batch_size": 0}, {"max_wait_ms": -1}, {"lease_ms": 50},
                {"timeout_s": 0}, {"ready_timeout": "60"}):
        with pytest.raises(mtq.ConfigError, match=next(iter(bad))):
            mtq.local("tests.handlers:record", **bad)


def test_a_script_target_is_imported_from_its_file(tmp_path: Path) -> None:
    script = tmp_path / "myscript.py"
    script.write_text("import mtq\n\ndef handle(p):\n    return p\n")
    mod = types.ModuleType("__main__")
    mod.__file__ = str(script)
    assert localmode._main_spec(mod, "handle") == ("myscript:handle", str(tmp_path))
    clash = tmp_path / "json.py"
    mod.__file__ = str(clash)
    with pytest.raises(mtq.TargetError, match="rename the script"):
        localmode._main_spec(mod, "handle")


def test_a_model_class_or_instance_of_a_script_is_named_by_the_script(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "served.py"
    script.write_text("")
    main = types.ModuleType("__main__")
    main.__file__ = str(script)

    class Echo(mtq.Model):
        def predict(self, batch: list[Any]) -> list[Any]:
            return batch

    Echo.__module__, Echo.__qualname__ = "__main__", "Echo"  # as if the script defined it
    main.Echo, main.echo = Echo, Echo()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert localmode.target_spec(Echo) == ("served:Echo", str(tmp_path))
    assert localmode.target_spec(main.echo) == ("served:echo", str(tmp_path))  # type: ignore[attr-defined]
    with pytest.raises(mtq.TargetError, match="has no name in module '__main__'"):
        localmode.target_spec(Echo())


def _doc_example() -> str:
    text = (ROOT / "docs" / "workers.md").read_text()
    section = text[text.index("## Local mode"):]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code, "docs/workers.md, Local mode: no python block"
    return code.group(1)


def test_the_docs_example_runs_as_a_script(tmp_path: Path) -> None:
    code = _doc_example()
    assert len(code.strip().splitlines()) <= 15, "the seed's example in at most 15 lines"
    script = tmp_path / "seed_example.py"
    script.write_text(code)
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    # (print writes its text and its newline apart: the workers' lines, forwarded by a
    # thread, may fall between the two, so the text is looked for, not whole lines)
    for i in range(20):
        assert re.search(rf"DONE -> Sentence {i}(?!\d)", out.stdout), out.stdout
        assert re.search(rf"STARTED: Sentence {i}(?!\d)", out.stdout), out.stdout
    assert "ALL DONE " + str([f"Sentence {i}" for i in range(20)]) in out.stdout
    assert not list(tmp_path.glob("mtq-local-*")), "the temporary directory was left"
    assert not _holding(str(tmp_path)), _holding(str(tmp_path))


def test_without_the_main_guard_the_start_fails_and_says_why(tmp_path: Path) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text("import mtq\n\ndef handle(p):\n    return p\n\n"
                      "with mtq.local(handle) as q:\n    print(q.submit(1).result(timeout=10))\n")
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 1
    assert "mtq.errors.TargetError" in out.stderr and "__name__ == \"__main__\"" in out.stderr
    assert not list(tmp_path.glob("mtq-local-*"))
    assert not _holding(str(tmp_path)), _holding(str(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "kill-9"])
def test_a_script_interrupted_or_killed_leaves_nothing(tmp_path: Path, sig: int) -> None:
    """Ctrl-C (SIGINT: KeyboardInterrupt leaves the block), or SIGKILL (the runner sees
    its stdin close and stops everything itself)."""
    script = tmp_path / "killed.py"
    script.write_text("import sys, time\nimport mtq\n\ndef handle(p):\n    return p\n\n"
                      "if __name__ == '__main__':\n"
                      "    with mtq.local(handle, replicas=2) as q:\n"
                      "        print(q.submit(7).result(timeout=30), flush=True)\n"
                      "        time.sleep(120)\n")
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "7"
    assert len(_holding(str(tmp_path))) >= 4  # runner, fork server, 2 workers, redis
    proc.send_signal(sig)
    code = proc.wait(30)
    if sig == signal.SIGINT:
        assert proc.stderr is not None and "KeyboardInterrupt" in proc.stderr.read()
        assert code == -signal.SIGINT  # (python exits "by" the signal after a KeyboardInterrupt)
        assert not _holding(str(tmp_path)), "left behind by the block's exit"
    wait_for(lambda: not _holding(str(tmp_path)), 30,
             "the runner to stop every process and the server after the script died")
    wait_for(lambda: not list(tmp_path.glob("mtq-local-*")), 10,
             "the temporary directory to be removed")


@pytest.mark.slow
def test_a_started_one_is_held_until_stopped() -> None:
    """``q = mtq.local(...).start()`` keeps no reference to the Local: it lives on (until
    stop(), or the interpreter's exit) rather than being collected with its runner."""
    import gc

    q = mtq.local("tests.handlers:record").start()
    gc.collect()
    assert q.submit(5).result(timeout=30)["payload"] == 5
    (lm,) = [x for x in localmode._live if x.queue is q]
    lm.stop()
    assert not localmode._live


@pytest.mark.slow
def test_not_ready_in_time_or_setup_failing_is_a_local_error() -> None:
    with pytest.raises(mtq.LocalError, match="setup exploded") as failed:
        mtq.local("tests.models:SetupFails").start()
    assert not failed.value.timed_out
    with pytest.raises(mtq.LocalError, match=r"0 of 1 worker process\(es\) ready") as late:
        mtq.local("tests.handlers:record", ready_timeout=0.2).start()
    assert late.value.timed_out
    assert not localmode._live


def test_a_script_killed_while_a_task_runs_leaves_nothing_at_once(tmp_path: Path) -> None:
    """The runner's stop after the script died is a forced one: a running task is not
    waited for (two SIGTERMs sent together counted as one: a graceful stop that waited
    for the task, however long)."""
    script = tmp_path / "killed_busy.py"
    script.write_text("import time\nimport mtq\n\ndef handle(p):\n    time.sleep(p)\n"
                      "    return p\n\n"
                      "if __name__ == '__main__':\n"
                      "    with mtq.local(handle) as q:\n"
                      "        t = q.submit(120)\n"
                      "        while t.status() != 'running':\n"
                      "            time.sleep(0.02)\n"
                      "        print('running', flush=True)\n"
                      "        time.sleep(120)\n")
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "running"
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    wait_for(lambda: not _holding(str(tmp_path)), 15,
             f"the runner to stop every process and the server: {_holding(str(tmp_path))}")
    wait_for(lambda: not list(tmp_path.glob("mtq-local-*")), 10,
             "the temporary directory to be removed")


def test_a_runner_whose_parent_died_during_the_start_still_shuts_the_server_down(
        tmp_path: Path) -> None:
    """The parent gone before the supervisor runs (its stdin at EOF from the start): the
    runner's stop must not be a SIGTERM that kills it before it shuts the server down
    (it did, 3 runs in 5), nor one its supervisor's stop outlived."""
    from mtq.broker.embedded import EmbeddedServer

    code = "import sys; from mtq.workers.localproc import serve; sys.exit(serve(sys.argv[1]))"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for n in range(3):
        state = tmp_path / f"mtq-local-{n}"
        state.mkdir()
        server = EmbeddedServer(state)
        url = server.start()
        cfg = {"target": "tests.handlers:gated", "queue": "orphan", "devices": "cpu",
               "replicas": 1, "standby": 0, "max_batch_size": None, "max_wait_ms": None,
               "timeout_s": None, "lease_ms": None, "options": {}, "url": url,
               "preload": [], "state_dir": str(state)}
        try:
            out = subprocess.run([sys.executable, "-c", code, json.dumps(cfg)], env=env,
                                 stdin=subprocess.DEVNULL, capture_output=True, timeout=60,
                                 start_new_session=True)
            assert out.returncode == 0, (n, out.returncode, out.stderr[-2000:])
            assert not state.exists(), f"run {n}: {state} was left"
            assert not _holding(str(state)), _holding(str(state))
        finally:
            if state.exists():
                server.stop()
