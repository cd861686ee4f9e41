"""Local mode: a private Redis and a supervisor for one target, inside a script,
a notebook or a test.

::

    with mtq.local("myapp.models:Embedder", replicas=2) as q:   # or a function, a class
        print(q.submit({"text": "hi"}).result(timeout=30))

:func:`local` starts a ``redis-server`` of its own in a temporary directory (the
embedded server of :mod:`mtq.broker.embedded`, listening on a unix socket only) and a
runner process that holds a :class:`~mtq.workers.supervisor.Supervisor` of the target
(its worker processes forked from the supervisor's fork server, as with ``mtq workers
start``), waits until every worker process is set up, and hands back a
:class:`~mtq.client.queue.Queue` bound to that server. Leaving the block (normally,
by an exception, by Ctrl-C) stops the supervisor and its processes, shuts the server
down and removes the directory. Should this process die without leaving the block
(SIGKILL), the runner sees its stdin close and does the same.

Worker processes are new interpreters: they import the target by name. A function,
a class or a ``Model`` instance of an importable module is named by its module and
qualified name; one defined in the script being run is imported from the script's
file (so the script's ``with mtq.local(...)`` must sit under ``if __name__ ==
"__main__":``, as for :mod:`multiprocessing`); one defined in a notebook cell, a REPL,
inside a function or as a lambda has no name a process can import: a TargetError says
so at once.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any

from mtq.broker.embedded import EmbeddedServer
from mtq.errors import ConfigError, LocalError, MtqError, OptionError, TargetError
from mtq.validation import check_queue_name
from mtq.workers.localproc import forward_stdout, group_members, stop_group

if TYPE_CHECKING:
    from mtq.client.queue import Queue

__all__ = ["Local", "target_spec"]

log = logging.getLogger("mtq.local")

#: set in the runner's environment (so in every worker process): mtq.local() there is
#: a script imported for its target without ``if __name__ == "__main__":``
INSIDE_ENV = "MTQ_LOCAL_RUNNER"
#: lines of the runner's stderr kept for error messages
TAIL_LINES = 40

#: the started ones, held until stopped (``q = mtq.local(f).start()`` keeps no reference
#: to its Local, whose collection would close the runner's stdin) and stopped at exit
_live: set[Local] = set()


class Local:
    """A private Redis and a supervisor for ``target``; :meth:`start` and :meth:`stop`,
    or a ``with`` / ``async with`` block.

    ``target``: ``"package.module:attr"`` (as ``mtq workers start`` takes it), or a
    function, an ``mtq.Model`` / ``mtq.Generator`` class or instance that worker
    processes can import by name. ``replicas``: processes per device. ``devices``:
    ``"cpu"``, ``"cuda:0,cuda:1"``, a list, or ``"all"``. ``queue``: its name (default:
    the target's name). ``max_batch_size``, ``max_wait_ms``, ``timeout_s``: override the
    model's. ``lease_ms``: the queue's lease. ``standby``: 0 (default) or 1 warm spare
    process per device. ``options``: the model's options (``--set``). ``ready_timeout``:
    seconds to wait for every process to be set up (LocalError after it).
    ``stop_timeout``: seconds a graceful stop waits for running batches before it
    forces. ``url``: use this Redis instead of starting one (nothing in it is removed).
    ``preload``: modules the fork server imports once for every worker process (default:
    ``torch`` when this process has imported it, else none: a start then skips torch's
    import, and a worker that needs torch imports it itself).
    """

    def __init__(self, target: Any, replicas: int = 1, *, queue: str | None = None,
                 devices: str | Sequence[str] = "cpu", max_batch_size: int | None = None,
                 max_wait_ms: float | None = None, timeout_s: float | None = None,
                 lease_ms: int | None = None, standby: int = 0,
                 options: Mapping[str, Any] | None = None, ready_timeout: float = 60.0,
                 stop_timeout: float = 30.0, url: str | None = None,
                 preload: Sequence[str] | None = None) -> None:
        from mtq.workers.devices import parse_devices

        if isinstance(replicas, bool) or not isinstance(replicas, int) or not \
                1 <= replicas <= 256:
            raise ConfigError(f"replicas must be an int in 1..256, got {replicas!r}")
        if standby not in (0, 1):
            raise ConfigError(f"standby must be 0 or 1, got {standby!r}")
        for name, value in (("ready_timeout", ready_timeout), ("stop_timeout", stop_timeout),
                            ("timeout_s", timeout_s)):
            if name == "timeout_s" and value is None:
                continue
            if not _number(value, 0, float("inf")) or value == 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        for name, value, lo, hi, whole in (("max_batch_size", max_batch_size, 1, 100_000, True),
                                           ("max_wait_ms", max_wait_ms, 0, 60_000, False),
                                           ("lease_ms", lease_ms, 100, 2**31, True)):
            if value is not None and not _number(value, lo, hi, whole):
                raise ConfigError(f"{name} must be {'an int' if whole else 'a number'} in "
                                  f"{lo}..{hi}, got {value!r}")
        spec = devices if isinstance(devices, str) else ",".join(devices)
        self.devices = parse_devices(spec)
        self.target, self._root = target_spec(target)
        self.queue_name = check_queue_name(queue) if queue is not None else \
            _queue_for(self.target)
        self.replicas = replicas
        self.ready_timeout, self.stop_timeout = float(ready_timeout), float(stop_timeout)
        self.url = url
        self._given_url = url is not None
        self._preload = None if preload is None else [str(m) for m in preload]
        self._config: dict[str, Any] = {
            "target": self.target, "queue": self.queue_name, "devices": spec,
            "replicas": replicas, "standby": standby, "max_batch_size": max_batch_size,
            "max_wait_ms": max_wait_ms, "timeout_s": timeout_s, "lease_ms": lease_ms,
            "options": {k: _option_text(v) for k, v in (options or {}).items()},
        }
        self.state_dir: Path | None = None
        self.server: EmbeddedServer | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self._queue: Queue | None = None
        self._client: Any = None
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._readers: list[threading.Thread] = []
        self._stopping = threading.Event()  # the supervisor took the first SIGTERM
        self._abandoned = False  # an async start was cancelled: stop once started
        self._lock = threading.Lock()

    # -- the block ---------------------------------------------------------------------
    def __enter__(self) -> Queue:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop(force=exc_type is not None)

    async def __aenter__(self) -> Queue:
        try:
            return await asyncio.to_thread(self.start)
        except asyncio.CancelledError:
            # the start runs on in its thread: whichever of it and this stop takes the
            # lock second stops what it started
            self._abandoned = True
            threading.Thread(target=self.stop, kwargs={"force": True},
                             name="mtq-local-abandoned", daemon=True).start()
            raise

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await asyncio.to_thread(self.stop, force=exc_type is not None)

    @property
    def queue(self) -> Queue:
        """The :class:`~mtq.client.queue.Queue` bound to the private Redis (once started)."""
        if self._queue is None:
            raise LocalError("mtq.local(...) is not started: use it in a with block, or "
                             "call start()")
        return self._queue

    @property
    def pgid(self) -> int | None:
        """The process group of the runner, its supervisor and every worker process."""
        return self.process.pid if self.process is not None else None

    def processes(self) -> list[int]:
        """The pids alive now in the runner's process group (zombies excluded)."""
        return [] if self.pgid is None else group_members(self.pgid)

    # -- start -------------------------------------------------------------------------
    def start(self) -> Queue:
        """Start the server and the supervisor, wait until every worker process is set
        up, and return the Queue. Raises TargetError (a target that cannot be served),
        LocalError (set-up failed, or not ready within ``ready_timeout``),
        ServerNotFound (no redis-server); nothing is left running then."""
        if os.environ.get(INSIDE_ENV):
            raise LocalError(
                "mtq.local() was called inside one of its own worker processes: the script "
                "that defines the target was imported there to find it, and ran its "
                "mtq.local(...) again. Put that code under 'if __name__ == \"__main__\":' "
                "(as multiprocessing requires), or move the target into a module")
        with self._lock:
            if self.process is not None or self._queue is not None:
                raise LocalError("this mtq.local(...) is already started; make another one")
            try:
                self._start()
                if self._abandoned:
                    raise LocalError("mtq.local(...): its start was cancelled")
            except BaseException:
                self._teardown(force=True)
                raise
            _live.add(self)
            return self.queue

    def _start(self) -> None:
        from mtq.broker.connection import open_client
        from mtq.client.queue import Queue
        from mtq.settings import RedisSettings

        self._stopping.clear()
        self._tail.clear()
        if not self._given_url:
            self.state_dir = Path(tempfile.mkdtemp(prefix="mtq-local-"))
            self.server = EmbeddedServer(self.state_dir)
            self.url = self.server.start()
        assert self.url is not None
        self._client = open_client(self.url, RedisSettings(), None)
        self._spawn()
        self._wait_ready()
        self._queue = Queue(self.queue_name, client=self._client)

    def _spawn(self) -> None:
        preload = self._preload if self._preload is not None else \
            ["torch"] if "torch" in sys.modules else []
        config = dict(self._config, url=self.url, preload=preload,
                      state_dir=None if self._given_url else str(self.state_dir))
        paths = _user_paths(self._root)
        env = dict(os.environ, PYTHONUNBUFFERED="1", MTQ_REDIS_URL=str(self.url))
        env[INSIDE_ENV] = str(os.getpid())
        env["PYTHONPATH"] = os.pathsep.join(
            [*paths, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                       if p and p not in paths]])
        code = "import sys; from mtq.workers.localproc import serve; sys.exit(serve(sys.argv[1]))"
        self.process = subprocess.Popen(
            [sys.executable, "-c", code, json.dumps(config)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
            start_new_session=True)  # Ctrl-C here stops it through stop(), once
        assert self.process.stdout is not None and self.process.stderr is not None
        self._readers = [
            threading.Thread(target=forward_stdout, args=(self.process.stdout,),
                             name="mtq-local-stdout", daemon=True),
            threading.Thread(target=self._read_stderr, args=(self.process.stderr,),
                             name="mtq-local-stderr", daemon=True)]
        for t in self._readers:
            t.start()

    def _read_stderr(self, pipe: IO[bytes]) -> None:
        for raw in iter(pipe.readline, b""):
            line = raw.decode(errors="replace").rstrip()
            self._tail.append(line)
            if line.startswith("stopping: "):
                self._stopping.set()  # a second SIGTERM now counts as the second
            log.info("%s", line)
        pipe.close()

    def _wait_ready(self) -> None:
        from mtq.broker.registry import list_workers

        assert self.process is not None
        want = self.replicas * len(self.devices)
        deadline = time.monotonic() + self.ready_timeout
        delay, ready = 0.01, 0
        while True:
            code = self.process.poll()
            if code is not None:
                raise self._exit_error(code)
            ready = sum(1 for w in list_workers(self._client, self.queue_name)
                        if w.get("role", "serving") == "serving")
            if ready >= want:
                return
            if time.monotonic() > deadline:
                raise LocalError(
                    f"mtq.local({self.target!r}): {ready} of {want} worker process(es) "
                    f"ready after {self.ready_timeout:g} s (ready_timeout); the "
                    f"supervisor's last lines:\n{self._tail_text()}", timed_out=True)
            time.sleep(delay)
            delay = min(delay * 1.5, 0.1)

    def _exit_error(self, code: int) -> MtqError:
        for t in self._readers:  # its last lines (the processes under it have gone too)
            t.join(timeout=5)
        lines = list(self._tail)
        why = next((ln.split(": ", 1)[1] for ln in reversed(lines)
                    if ln.startswith(("stopped: ", "error: ")) and ": " in ln), "")
        where = f"mtq.local({self.target!r})"
        if code == 2:
            cls = {"OptionError": OptionError, "ConfigError": ConfigError}.get(
                why.partition(":")[0], TargetError)
            return cls(f"{where}: {why or 'the target cannot be served'}"
                       + ("" if why else f"; the supervisor's last lines:\n{self._tail_text()}"))
        return LocalError(f"{where}: the supervisor exited with code {code} before its "
                          f"workers were ready: {why or self._tail_text()}")

    def _tail_text(self) -> str:
        return "\n".join(self._tail) or "(nothing)"

    # -- stop --------------------------------------------------------------------------
    def stop(self, force: bool = False) -> None:
        """Stop the supervisor (gracefully: running batches finish, within
        ``stop_timeout``; ``force``: at once) and every process under it, shut the
        server down and remove its directory. Tasks not finished are discarded with the
        server. Safe to call twice."""
        with self._lock:
            try:
                self._teardown(force)
            except BaseException:  # Ctrl-C while it waits: finish the job at once
                self._teardown(force=True)
                raise
            finally:
                _live.discard(self)

    def _teardown(self, force: bool) -> None:
        if self._client is not None:
            from mtq.client.replies.hub import hub_of

            hub_of(self._client).close_all()  # its listener would retry a gone server
        p = self.process
        if p is not None:
            stop_group(p, force, self.stop_timeout, self._stopping)
            for t in self._readers:
                t.join(timeout=5)
            if p.stdin is not None:
                p.stdin.close()  # (only now: its closing tells the runner we are gone)
            self.process = None
        if self._client is not None:
            self._client.close()
            self._client = None
        self._queue = None
        try:
            if self.server is not None:
                self.server.stop()
        finally:
            self.server = None
            if self.state_dir is not None:
                shutil.rmtree(self.state_dir, ignore_errors=True)
                self.state_dir = None


# -- targets ---------------------------------------------------------------------------
def target_spec(target: Any) -> tuple[str, str | None]:
    """``package.module:attr`` for ``target``, and the directory its module is imported
    from when worker processes need it on their path (a script run as ``__main__``).
    Raises TargetError for a target no other process can import by name."""
    from mtq.workers.generator import Generator
    from mtq.workers.model import Model
    from mtq.workers.target import find_target_module

    if isinstance(target, str):
        find_target_module(target)
        return target, None
    if isinstance(target, (Model, Generator)):  # an instance: by a name its module gives it
        module_name = type(target).__module__
        module = sys.modules.get(module_name)
        names = [k for k, v in vars(module).items() if v is target] if module else []
        if not names:
            raise TargetError(
                f"mtq.local: this {type(target).__name__} instance has no name in module "
                f"{module_name!r}, and worker processes import their target by name: give "
                "it one at module level (embedder = Embedder().set_options(...)), or pass "
                "the class and its options (mtq.local(Embedder, options={...}))")
        qualname = names[0]
    elif callable(target):
        module_name = getattr(target, "__module__", None) or ""
        qualname = getattr(target, "__qualname__", "") or ""
        if not module_name or not qualname or "<" in qualname:
            raise TargetError(
                f"mtq.local: {target!r} is defined inside a function or is a lambda, so "
                "worker processes (new interpreters, which import their target by name) "
                "cannot find it: define it at the top level of a module or script")
    else:
        raise TargetError(f"mtq.local: the target must be 'package.module:attr', a "
                          "function or an mtq.Model class or instance; got "
                          f"{target!r:.80} ({type(target).__name__})")
    module = sys.modules.get(module_name)
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if obj is not target:
        raise TargetError(f"mtq.local: {module_name}.{qualname} is not {target!r} (was it "
                          "renamed or replaced?): pass 'package.module:attr'")
    if module_name != "__main__":
        return f"{module_name}:{qualname}", None
    return _main_spec(module, qualname)


def _main_spec(main: Any, qualname: str) -> tuple[str, str | None]:
    """A target defined in ``__main__``: by its module name when run with ``python -m``,
    else by the script's file (its stem, with its directory first on the path)."""
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and not spec.name.endswith("__main__"):
        return f"{spec.name}:{qualname}", None
    file = getattr(main, "__file__", None)
    if not file or not str(file).endswith(".py"):
        raise TargetError(
            f"mtq.local: {qualname} is defined in an interactive session (a notebook or "
            "a REPL), which worker processes cannot import: they are new interpreters "
            "that import their target by name. Put it in a module (mymodels.py beside "
            f"the notebook), import it, and pass it (mtq.local(mymodels.{qualname})) or "
            f"its name ('mymodels:{qualname}')")
    path = Path(file).resolve()
    stem = path.stem
    clash = stem in sys.stdlib_module_names or stem in sys.builtin_module_names or (
        stem in sys.modules and getattr(sys.modules[stem], "__file__", None) and
        Path(str(sys.modules[stem].__file__)).resolve() != path)
    if not stem.isidentifier() or clash:
        raise TargetError(
            f"mtq.local: worker processes import {qualname} from the script {path}, as "
            f"module {stem!r}, which is {'not a module name' if not stem.isidentifier() else 'the name of another module'}: "
            "rename the script, or move the target into a module of its own")
    return f"{stem}:{qualname}", str(path.parent)


def _number(value: Any, lo: float, hi: float, whole: bool = False) -> bool:
    kinds = (int,) if whole else (int, float)
    return isinstance(value, kinds) and not isinstance(value, bool) and lo <= value <= hi


def _queue_for(spec: str) -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", spec.rpartition(":")[2].lower()).strip("-._")
    return check_queue_name(name[:100] or "local")


def _option_text(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _user_paths(root: str | None) -> list[str]:
    """The import path worker processes need beyond their own: the script's directory
    and this process's entries outside the interpreter's installation (the script's
    directory, the current directory, a test runner's root)."""
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    out: list[str] = [root] if root else []
    for entry in sys.path:
        full = os.path.realpath(entry or os.getcwd())
        if os.path.isdir(full) and full not in out and \
                not any(full == p or full.startswith(p + os.sep) for p in prefixes):
            out.append(full)
    return out


@atexit.register
def _stop_all() -> None:
    for lm in list(_live):
        try:
            lm.stop(force=True)
        except Exception:  # at exit: stop the others anyway
            log.warning("mtq.local: could not stop %r", lm.target, exc_info=True)
