"""What every ``mtq`` command shares: consoles, exit codes, options, error output."""

from __future__ import annotations

import copy
import json
import math
import re
import sys
from collections.abc import Callable
from datetime import datetime
from typing import Any, NoReturn, TypeVar

import click

from mtq.errors import (
    BrokerError,
    ConfigError,
    InvalidName,
    MtqError,
    PayloadError,
    RedisAuthError,
    RedisUnavailable,
    ResultTimeout,
    TaskFailed,
    TaskNotFound,
)

#: the rich Consoles ``console`` and ``err_console``, made on first use (PEP 562, see
#: __getattr__): rich's imports are loaded only by a command that prints through them,
#: not by ``mtq worker run`` starting up
_consoles: dict[str, Any] = {}


def _console(name: str) -> Any:
    made = _consoles.get(name)
    if made is None:
        from rich.console import Console

        made = _consoles[name] = Console(stderr=name == "err_console")
    return made


def __getattr__(name: str) -> Any:
    if name in ("console", "err_console"):
        return _console(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

#: exit codes (listed in ``mtq --help`` and the README)
OK, FAILED, USAGE, NOT_FOUND, NO_LISTENER, UNREACHABLE, TIMEOUT = 0, 1, 2, 3, 4, 5, 6
#: Ctrl-C while waiting (128 + SIGINT, as shells report it)
INTERRUPTED = 130
#: the longest --timeout accepted (a year): longer is "no limit", the default
MAX_WAIT_S = 365 * 24 * 3600.0

EXIT_CODES = (
    "Exit codes: 0 ok; 1 the task or the work failed (a model's setup too); 2 bad "
    "input (JSON, names, options, a target that cannot be loaded); 3 not found "
    "(queue, task, server); 4 no supervisor listening, or no engine serving the queue; "
    "5 Redis unreachable, or it refused mtq's credentials or TLS; 6 timed out waiting (an "
    "engine's answer too); "
    "130 stopped with Ctrl-C while waiting or submitting a file (what was submitted goes on)."
)

F = TypeVar("F", bound=Callable[..., Any])


class FloatRange(click.FloatRange):
    """click's FloatRange, which lets ``nan`` through (every comparison with it is
    false): refused here, as bad input (exit 2)."""

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if isinstance(number, float) and math.isnan(number):
            self.fail("nan is not a number of seconds", param, ctx)
        return number


def fail(message: object, code: int = FAILED) -> NoReturn:
    """One line on stderr (not wrapped: a log keeps it whole), then exit ``code``."""
    _console("err_console").print(f"[bold red]error:[/] {shown(message)}", highlight=False,
                      soft_wrap=True)
    sys.exit(code)


#: what must not reach a terminal as it is: C0 controls but newline and tab (ESC, CR,
#: BEL, form feed ...), DEL, C1 controls, the line and paragraph separators, lone
#: surrogates, and the bidirectional controls that reorder the text after them
_UNPRINTABLE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e"
                          r"\u2066-\u2069\ud800-\udfff]")


def printable(text: str, *, json_string: bool = False) -> str:
    """``text`` made safe to show on a terminal: each character that could move the
    cursor, clear or recolour the screen, or reorder what follows is written as a
    Python escape (``\\x1b``, ``\\r``, ``\\u202e``); newlines, tabs and every
    printable character (any script, emoji) stay. ``json_string``: ``\\u00XX``
    escapes instead, for text inside a JSON string, so that it stays valid JSON.
    A backslash is not escaped: the output is for reading, ``--raw`` gives the text."""
    if json_string:
        return _UNPRINTABLE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
    return _UNPRINTABLE.sub(lambda m: repr(m.group())[1:-1], text)


def shown(value: object) -> str:
    """``str(value)`` for a rich markup string: :func:`printable`, and markup escaped,
    so that task data (an error, progress, a payload) is printed as it is written,
    never read as markup (``[bold]``, ``[/]``) or terminal control."""
    from rich.markup import escape

    return escape(printable(str(value)))


def say(line: str) -> None:
    """A line of a long-running command's own (a supervisor's events), on stderr."""
    _console("err_console").print(f"[mtq] {line}", markup=False, highlight=False, soft_wrap=True)


def code_for(exc: BaseException) -> int:
    """The exit code an exception means."""
    if isinstance(exc, (RedisUnavailable, RedisAuthError)) or (
            isinstance(exc, BrokerError) and "cannot reach Redis" in str(exc)):
        return UNREACHABLE
    if isinstance(exc, (InvalidName, PayloadError, ConfigError, ValueError)):
        return USAGE
    if isinstance(exc, TaskNotFound):
        return NOT_FOUND
    if isinstance(exc, ResultTimeout):
        return TIMEOUT
    if isinstance(exc, TaskFailed):
        return FAILED
    return FAILED


def fail_on(exc: MtqError) -> NoReturn:
    fail(exc, code_for(exc))


def redis_option(fn: F) -> F:
    return click.option(
        "--redis", "url", default=None, envvar="MTQ_REDIS_URL", show_envvar=True,
        help="Redis URL (default: MTQ_REDIS_URL, else the embedded server).")(fn)


def running_server(url: str | None) -> str:
    """The Redis URL for a command that works on what is already there (it reads,
    or changes existing tasks, queues or workers): ``url`` (``--redis`` or
    ``MTQ_REDIS_URL``), else the embedded server's if it runs. Such a command never
    starts the embedded server: a server started to be looked at would undo
    'mtq server stop' and, in a shell without the MTQ_REDIS_URL meant, answer
    "no queues yet" from the wrong server. Exits 3 (not found) instead, saying how
    to start it. Commands that bring work or serve it (submit, workers start,
    worker run, demo) start it on demand."""
    if url:
        return url
    from mtq.broker.embedded import EmbeddedServer

    server = EmbeddedServer.from_env()
    if not server.status().running:  # status() reads; it creates nothing
        fail(f"the embedded redis-server is not running (state in {server.state_dir}), and "
             "no --redis or MTQ_REDIS_URL names another Redis; start it with 'mtq server "
             "start' ('mtq submit' and 'mtq workers start' start it too), or set "
             "MTQ_REDIS_URL", NOT_FOUND)
    return server.url


def open_queue(name: str, url: str | None) -> Any:
    """:class:`mtq.Queue` ``name`` on ``url``; exits with the error's code if the name
    or the URL is refused."""
    from mtq.client import Queue

    try:
        return Queue(name, url)
    except MtqError as exc:
        fail_on(exc)


def require_known(client: Any, name: str) -> None:
    """Exit 3 if no task was ever submitted to queue ``name``."""
    from mtq.admin import queue_names

    names = queue_names(client)
    if name not in names:
        known = ", ".join(names[:10]) + (" ..." if len(names) > 10 else "")
        fail(f"unknown queue {name!r}: nothing was ever submitted to it"
             + (f" (known: {known})" if names else " (no queues yet)"), NOT_FOUND)


def json_option(fn: F) -> F:
    return click.option("--json", "as_json", is_flag=True,
                        help="Print JSON instead of tables.")(fn)


def echo_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, default=repr, ensure_ascii=False))


def when(ms: float | int | None) -> str:
    """Local time of a server timestamp in ms (or '-')."""
    if not ms:
        return "-"
    return datetime.fromtimestamp(ms / 1000).strftime("%H:%M:%S.%f")[:-3]


def size(n: Any) -> str:
    """A number of bytes for people (``1.5 GiB``), or '-'."""
    if isinstance(n, bool) or not isinstance(n, (int, float)) or n < 0:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def held_memory(entry: dict[str, Any]) -> str:
    """The memory a registry entry's model holds (``memory_bytes``), or '-' when its
    engine is not loaded (the entry keeps the size its next load will take)."""
    if entry.get("engine") not in (None, "loaded", "unloading"):
        return "-"
    return size(entry.get("memory_bytes"))


def ago(ts: Any, now: float | None = None) -> str:
    """How long ago a unix time (s) was (``12 s ago``, ``3 min ago``), or '-'."""
    import time

    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts <= 0:
        return "-"
    d = max(0.0, (time.time() if now is None else now) - ts)
    if d < 120:
        return f"{d:.0f} s ago"
    if d < 7200:
        return f"{d / 60:.0f} min ago"
    return f"{d / 3600:.1f} h ago"


def millis(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if v >= 10 else f"{v:.1f}"


def parse_json(text: str, what: str) -> Any:
    """``text`` as JSON, or exit 2 with how to fix it."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        fail(f"{what} is not valid JSON ({exc}); quote it for the shell, e.g. "
             "'{\"prompt\": \"hi\"}', or pass - to read it from stdin", USAGE)
    except RecursionError:
        fail(f"{what} is nested too deeply to decode (about 1 000 levels at most); flatten it",
             USAGE)
    except ValueError as exc:  # e.g. an integer of more than 4 300 digits
        fail(f"{what} cannot be read as JSON ({exc})", USAGE)


def with_defaults(command: click.Command, name: str, **defaults: Callable[[], Any]
                  ) -> click.Command:
    """A copy of one of mtq's click commands named ``name``, whose parameters named in
    ``defaults`` (options and arguments, by parameter name) take their default from a
    callable (a framework's settings: ``flask mtq``, ``manage.py mtq_status``), after
    the command line and before nothing else (an option's environment variable is
    dropped: the callable reads it if it should). The original command is unchanged."""
    cmd = copy.copy(command)
    cmd.name = name
    params: list[click.Parameter] = []
    for p in command.params:
        if p.name in defaults and isinstance(p, (click.Option, click.Argument)):
            p = copy.copy(p)
            p.default = defaults[p.name]
            p.required = False
            p.envvar = None
            if isinstance(p, click.Option):
                p.show_envvar = False
        params.append(p)
    cmd.params = params
    return cmd


def connect_client(url: str | None, *, start: bool) -> Any:
    """A client of ``url``; ``start``: the embedded server is started if it is the one
    meant and not running (the command brings work), else exit 3 (see
    :func:`running_server`)."""
    from mtq.broker.connection import connect

    try:
        return connect(url if start else running_server(url))
    except MtqError as exc:
        fail_on(exc)
