"""Local mode's processes: the runner that holds the supervisor (``python -c ...
serve(config)``), and how :mod:`mtq.workers.local` stops it and everything under it."""

from __future__ import annotations

import json
import multiprocessing
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

from mtq.broker.embedded import EmbeddedServer
from mtq.errors import MtqError

__all__ = ["alive", "forward_stdout", "group_members", "serve", "stop_group", "wait_exit"]


# -- processes -------------------------------------------------------------------------
def group_members(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes of process group ``pgid``."""
    out: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:  # no /proc: the caller's killpg is all there is
        return out
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(entry))
    return out


def alive(pid: int) -> bool:
    """Process ``pid`` exists and has not ended (a zombie has)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def wait_exit(pids: list[int], timeout: float) -> None:
    """Block until each of ``pids`` (processes that need not be this one's children)
    has exited, or ``timeout`` seconds: a wait on their pidfds, readable once the
    process ends (a zombie counts as ended). Where pidfds are missing (not Linux 5.3+)
    it looks every 20 ms instead."""
    deadline = time.monotonic() + timeout
    fds: list[int] = []
    try:
        for pid in pids:
            try:
                fds.append(os.pidfd_open(pid))
            except ProcessLookupError:
                continue  # gone already
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        left = len(fds)
        while left and (ms := int((deadline - time.monotonic()) * 1000)) > 0:
            for fd, _event in poller.poll(ms):
                poller.unregister(fd)
                left -= 1
    except (AttributeError, OSError):  # no pidfd_open here: look at /proc
        while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        for fd in fds:
            os.close(fd)


def wait_group(pgid: int, timeout: float) -> list[int]:
    """Wait (at most ``timeout`` s) until process group ``pgid`` has no live member,
    blocking on its members' exits (:func:`wait_exit`); returns those left."""
    deadline = time.monotonic() + timeout
    while (members := group_members(pgid)) and (left := deadline - time.monotonic()) > 0:
        wait_exit(members, left)
    return group_members(pgid)


def stop_group(p: subprocess.Popen[bytes], force: bool, timeout: float,
                took: threading.Event) -> None:
    """SIGTERM the runner (its supervisor drains), then a second SIGTERM (it kills the
    workers) at once when ``force``, else after ``timeout``; then SIGKILL whatever is
    left of its process group. ``took``: set once the supervisor took the first (two
    signals sent together would arrive as one)."""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        if force:
            took.wait(2.0)
        try:
            p.wait(0 if force else timeout)
        except subprocess.TimeoutExpired:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
    if p.poll() is None:
        _killpg(p.pid)
        p.wait(5)
    if wait_group(p.pid, 5):  # outlets and the fork server follow their parents
        _killpg(p.pid)
        wait_group(p.pid, 2)


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def forward_stdout(pipe: IO[bytes]) -> None:
    """The worker processes' prints, to this process's stdout as they come."""
    for raw in iter(pipe.readline, b""):
        try:
            sys.stdout.write(raw.decode(errors="replace"))
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
    pipe.close()


# -- the runner (python -c ... serve(config)) ------------------------------------------
def serve(config_json: str) -> int:
    """The runner process: a supervisor of the target in its main thread, stopped by
    SIGTERM (a second forces); and should its stdin close first (the process that
    started it died), a forced stop, then the server shut down and its directory removed."""
    from mtq.workers.supervisor import Supervisor
    from mtq.workers.target import check_options

    cfg = json.loads(config_json)
    orphaned = threading.Event()

    def ignore(_signum: int, _frame: object) -> None:
        pass

    def watch() -> None:
        while os.read(0, 4096):  # b"" at EOF: the parent closed it or died (the raw fd:
            pass                 # a daemon thread in a buffered read aborts at exit)
        orphaned.set()
        devnull = os.open(os.devnull, os.O_WRONLY)  # nobody reads our pipes any more
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        # a forced stop: two SIGTERMs, to the main thread (one this thread took would
        # not wake the supervisor's wait), the second once the first was taken (two
        # at once run its handler once: a graceful stop, waiting for running tasks)
        main = threading.main_thread().ident
        assert main is not None
        deadline = time.monotonic() + 10  # (the parent died at once: the supervisor's
        while signal.getsignal(signal.SIGTERM) is ignore and \
                time.monotonic() < deadline:  # handler first, or nothing would stop)
            time.sleep(0.01)
        signal.pthread_kill(main, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not sup.stopping and time.monotonic() < deadline:
            time.sleep(0.01)
        signal.pthread_kill(main, signal.SIGTERM)

    def say(line: str) -> None:
        try:
            print(line, file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass

    try:
        if cfg["options"]:
            check_options(cfg["target"], cfg["options"])
        sup = Supervisor(cfg["target"], cfg["queue"], url=cfg["url"],
                         devices_spec=cfg["devices"], replicas=cfg["replicas"],
                         settings={"lease_ms": cfg["lease_ms"]} if cfg["lease_ms"] else None,
                         max_batch_size=cfg["max_batch_size"], max_wait_ms=cfg["max_wait_ms"],
                         timeout_s=cfg["timeout_s"], standby=cfg["standby"],
                         options=cfg["options"], on_event=say)
    except MtqError as exc:
        say(f"error: {type(exc).__name__}: {exc}")
        return 2
    if "forkserver" in multiprocessing.get_all_start_methods():
        # the supervisor asked for torch besides its child module (children.context());
        # the fork server starts with the first process, so this list is the one it uses
        multiprocessing.get_context("forkserver").set_forkserver_preload(
            ["mtq.workers.child", *cfg["preload"]])
    # a SIGTERM outside the supervisor's run (its handler, in place meanwhile, is set
    # back to this one after it) does not kill the runner before it shuts the server
    # down: the watch's second one may come after a stop that had nothing to wait for
    signal.signal(signal.SIGTERM, ignore)
    threading.Thread(target=watch, name="mtq-local-watch", daemon=True).start()
    code = sup.run()
    if orphaned.is_set() and cfg.get("state_dir"):
        try:
            EmbeddedServer(cfg["state_dir"]).stop()
        finally:
            shutil.rmtree(cfg["state_dir"], ignore_errors=True)
    return code
