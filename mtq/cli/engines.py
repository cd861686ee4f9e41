"""``mtq workers load|unload|reload|reset``: an engine command to every process that
serves a queue, waiting until each engine has answered. Thin over
:mod:`mtq.client.engines`; ``mtq.cli.workers`` adds these commands to ``mtq workers``."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import click

from mtq.cli import common
from mtq.cli.common import (
    FAILED,
    INTERRUPTED,
    NO_LISTENER,
    TIMEOUT,
    USAGE,
    FloatRange,
    echo_json,
    fail,
    fail_on,
    printable,
    redis_option,
    running_server,
)
from mtq.errors import EngineTimeout, MtqError, NoEngine, OptionError, TargetError

#: the default --timeout (s): a model load can take minutes
DEFAULT_TIMEOUT_S = 600.0

_HELP = {
    "load": "Load the model of every engine serving QUEUE (one that is unloaded), and wait "
            "until each has answered.",
    "unload": "Unload the model of every engine serving QUEUE: it finishes its running work "
              "(--now: gives it back to the queue) and frees the model's memory; tasks wait "
              "for a load, or go to other processes. Waits until each engine has answered.",
    "reload": "Reload every engine serving QUEUE: re-import the target and set it up again "
              "(--set: with these options), losing no task; an engine whose reload fails "
              "keeps its old model (exit 1). Waits until each engine has answered.",
    "reset": "Drop the caches and state of every engine serving QUEUE, keeping its weights; "
             "waits until each engine has answered.",
}

_EPILOG = ("Exit codes: 0 every engine answered ok; 1 one failed (a reload that kept the old "
           "model too); 2 bad input (a --set that is malformed or that the target does not "
           "take); 4 no engine serves the queue; 5 Redis unreachable; 6 an engine did not "
           "answer within --timeout (it may still be at it); 130 Ctrl-C while waiting (the "
           "command goes on in the engines).")


def _text(value: Any) -> str:
    """An option's served value as --set writes it."""
    return value if isinstance(value, str) else "none" if value is None else json.dumps(value)


def check_sets(client: Any, queue: str, options: dict[str, str]) -> None:
    """Check ``options`` (those it names change; the others keep the values the
    queue's model record shows) against the target that record names; exit 2 if the
    target does not take them. A target that cannot be imported here (its code is on
    the workers' machines only) is left to the engines, with a note."""
    from mtq.broker import catalogue
    from mtq.workers.target import check_options

    record = catalogue.models(client, [queue]).get(queue, {})
    target = record.get("target")
    if not target:
        return
    try:
        served = json.loads(record.get("options") or "{}")
    except ValueError:
        served = {}
    if not isinstance(served, dict):
        served = {}
    options = {**{str(k): _text(v) for k, v in served.items()}, **options}
    cwd = os.getcwd()
    if cwd not in sys.path:  # the target's code, as 'mtq workers start' finds it
        sys.path.insert(0, cwd)
    try:
        check_options(target, options)
    except OptionError as exc:
        fail(exc, USAGE)
    except TargetError as exc:
        common.err_console.print(
            f"note: cannot check the options here ({printable(str(exc))}); the engines "
            "check them", markup=False, highlight=False, soft_wrap=True)


def _line(a: dict[str, Any]) -> str:
    """One engine's answer, for people: where, what happened, how long, its state now."""
    took = a.get("took_s")
    took_text = f"{float(took):.2f} s" if isinstance(took, (int, float)) else "-"
    what = "ok" if a.get("ok") else "FAILED"
    tail = str(a.get("detail") or "") if a.get("ok") else str(a.get("error") or "")
    return printable(f"{a.get('host')}:{a.get('pid')} ({a.get('worker')}): {a.get('op')} "
                     f"{what} in {took_text}, engine {a.get('state')}"
                     + (f": {tail}" if tail else ""))


def run(op: str, queue: str, url: str | None, sets: tuple[str, ...], now: bool,
        worker_id: str | None, timeout_s: float, as_json: bool) -> None:
    from mtq.broker.connection import connect
    from mtq.client import engines
    from mtq.validation import check_queue_name
    from mtq.workers.options import parse_pairs

    try:
        check_queue_name(queue)
        options = parse_pairs(sets)
    except MtqError as exc:
        fail(exc, USAGE)
    url = running_server(url)
    started = time.monotonic()
    asked: list[dict[str, Any]] = []

    def sent(who: list[dict[str, Any]]) -> None:
        asked.extend(who)
        common.err_console.print(
            f"{op}: asked {len(who)} engine(s) of {printable(queue)!r}; waiting up to "
            f"{timeout_s:g} s for their answers (Ctrl-C stops waiting, not the {op})",
            markup=False, highlight=False, soft_wrap=True)

    def answered(a: dict[str, Any]) -> None:
        if not as_json:
            click.echo(_line(a))

    got: list[dict[str, Any]] = []
    missing: list[dict[str, Any]] = []
    try:
        client = connect(url)
        if options:
            check_sets(client, queue, options)
        got = engines.command(client, queue, op, options=options or None, now=now,
                              worker=worker_id, timeout=timeout_s, on_answer=answered,
                              on_sent=sent)
    except NoEngine as exc:
        fail(exc, NO_LISTENER)
    except EngineTimeout as exc:
        got, missing = exc.answers, exc.missing
    except KeyboardInterrupt:
        common.err_console.print(
            f"stopped waiting: the {op} goes on in the engines that were asked; see mtq "
            f"workers list -q {printable(queue)}", markup=False, highlight=False,
            soft_wrap=True)
        sys.exit(INTERRUPTED)
    except MtqError as exc:
        fail_on(exc)
    failed = [a for a in got if not a.get("ok")]
    took = time.monotonic() - started
    if as_json:
        echo_json({"op": op, "queue": queue, "ok": not failed and not missing,
                   "answers": got, "missing": [str(w.get("id")) for w in missing]})
    else:
        ok = len(got) - len(failed)
        click.echo(printable(f"{op}: {ok} of {len(asked)} engine(s) ok"
                             + (f", {len(failed)} failed" if failed else "")
                             + (f", {len(missing)} did not answer" if missing else "")
                             + f" in {took:.1f} s"))
    if missing:
        names = ", ".join(f"{w.get('id')} ({w.get('host')}:{w.get('pid')})" for w in missing)
        fail(f"{len(missing)} engine(s) did not answer within {timeout_s:g} s: {names}; they "
             "may still be at it (a longer --timeout waits longer), or be stuck (mtq workers "
             f"list -q {queue})", TIMEOUT)
    if failed:
        sys.exit(FAILED)


def _command(op: str) -> click.Command:
    options = [
        click.option("--queue", "-q", required=True, help="The queue whose engines to ask."),
        redis_option,
        click.option("--worker", "worker_id", default=None,
                     help="Only the engine with this worker id (mtq workers list)."),
        click.option("--timeout", "timeout_s", default=DEFAULT_TIMEOUT_S, show_default=True,
                     type=FloatRange(min=0.001, max=common.MAX_WAIT_S),
                     help="Seconds to wait for every engine's answer (a model load can take "
                          "minutes); past it: exit 6, naming those that did not answer."),
        click.option("--json", "as_json", is_flag=True,
                     help="Print the answers as JSON (one object: op, queue, ok, answers, "
                          "missing)."),
    ]
    if op in ("load", "reload"):
        options.append(click.option(
            "--set", "sets", multiple=True, metavar="KEY=VALUE",
            help="A model option to change (repeat it for each); the others keep the values "
                 "the engines serve with. Checked against the target first when it can be "
                 "imported here (exit 2)."))
    if op == "unload":
        options.append(click.option(
            "--now", is_flag=True,
            help="Give the running requests back to the queue (uncounted) instead of "
                 "finishing them (a generator's; a batch model's running call finishes)."))

    def body(queue: str, url: str | None, worker_id: str | None, timeout_s: float,
             as_json: bool, sets: tuple[str, ...] = (), now: bool = False) -> None:
        run(op, queue, url, sets, now, worker_id, timeout_s, as_json)

    cmd: Any = body
    for opt in reversed(options):
        cmd = opt(cmd)
    return click.command(op, help=_HELP[op], epilog=_EPILOG)(cmd)


#: the four commands, added to ``mtq workers`` by mtq.cli.workers
COMMANDS = [_command(op) for op in ("load", "unload", "reload", "reset")]
