"""``mtq submit``: one task from an argument or stdin (printing its id, waiting for
its result or following its tokens), or many from a JSON Lines file."""

from __future__ import annotations

import json
import math
import sys
import time
from datetime import datetime
from typing import IO, Any

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from mtq.cli.common import (
    FAILED,
    INTERRUPTED,
    MAX_WAIT_S,
    OK,
    TIMEOUT,
    USAGE,
    FloatRange,
    console,
    echo_json,
    err_console,
    fail,
    fail_on,
    json_option,
    millis,
    open_queue,
    parse_json,
    printable,
    redis_option,
    shown,
)
from mtq.client import MAX_TTL_S
from mtq.errors import MtqError, ResultTimeout, TaskCancelled, TaskFailed
from mtq.validation import BANDS

#: requests sent per round trip by ``mtq submit --file``
FILE_CHUNK = 500


def _steps(then: tuple[str, ...]) -> list[Any]:
    """``--then`` values: a queue name, or a JSON object of :class:`mtq.Step` fields
    (its ``deadline`` in seconds). A bad one exits 2 before anything is written."""
    from dataclasses import fields

    from mtq.client.chains import Step

    names = {f.name for f in fields(Step)}
    out: list[Any] = []
    for i, text in enumerate(then, 1):
        if not text.lstrip().startswith("{"):
            out.append(text)  # a queue name (checked with the rest of the chain)
            continue
        spec = parse_json(text, f"--then #{i}")
        unknown = sorted(set(spec) - names) if isinstance(spec, dict) else []
        if not isinstance(spec, dict) or "queue" not in spec or unknown:
            fail(f"--then #{i}: a step is a queue name or a JSON object with \"queue\" "
                 f"and any of {', '.join(sorted(names - {'queue'}))}"
                 + (f" (unknown: {', '.join(unknown)})" if unknown else ""), USAGE)
        out.append(Step(**spec))
    return out


@click.command()
@click.argument("queue")
@click.argument("payload", required=False)
@click.option("--stream", "-s", default=None,
              help="Ordering key (a user, a session): its tasks run one at a time, in order.")
@click.option("--file", "file", type=click.File("r"), default=None,
              help="Submit every line of a JSON Lines file (- for stdin) as one task.")
@click.option("--stream-from", default=None, metavar="FIELD",
              help="With --file: each task's stream is this field of its payload.")
@click.option("--key", default=None, help="Idempotency key (one task per key per hour).")
@click.option("--ttl", type=FloatRange(min=0.001, max=MAX_TTL_S), default=None,
              help="Seconds after which the task, if not started, expires unrun.")
@click.option("--run-timeout", "run_timeout", type=FloatRange(min=0.001, max=MAX_TTL_S),
              default=None, metavar="SECONDS",
              help="Longest a run of the task may take once started: past it, it is "
                   "stopped and fails with TaskTimeout (retried under its retry policy). "
                   "Default: the queue's task_timeout_s.")
@click.option("--delay", type=FloatRange(min=0, max=MAX_TTL_S), default=None,
              metavar="SECONDS",
              help="Queue the task SECONDS from now: until then it waits in Redis "
                   "(delayed), then joins the tail of its stream.")
@click.option("--at", "at_text", default=None, metavar="DATETIME",
              help="Queue the task at this ISO 8601 time, with its time zone "
                   "(2030-01-01T09:00:00+01:00, or ...Z); a past time is due now.")
@click.option("--then", "then", multiple=True, metavar="QUEUE|STEP",
              help="A chain: when the task succeeds, submit its result to QUEUE "
                   "(repeat for more steps; mtq task ID shows every step). STEP is a "
                   "JSON object of a step's fields: '{\"queue\": \"tts\", \"pick\": "
                   "\"text\", \"field\": \"text\", \"payload\": {\"voice\": \"en\"}}'.")
@click.option("--wait", "wait", is_flag=True,
              help="Wait for the result(s) and print them (the task id goes to stderr "
                   "first).")
@click.option("--follow", "-f", is_flag=True,
              help="Print tokens live as they arrive, then the end (implies waiting).")
@click.option("--timeout", type=FloatRange(min=0, max=MAX_WAIT_S), default=None,
              metavar="SECONDS",
              help="Stop waiting after SECONDS (exit 6; the task goes on). Implies "
                   "--wait. Default: no limit (Ctrl-C stops waiting, exit 130).")
@click.option("--raw", is_flag=True,
              help="With --follow: write the tokens exactly as they come, control "
                   "characters included (default: escaped, e.g. \\x1b, on a terminal; "
                   "as they come into a pipe or a file).")
@click.option("--no-cache", "no_cache", is_flag=True,
              help="Bypass the queue's result cache: run it even if an identical request "
                   "was answered or is running.")
@click.option("--priority", "-p", type=click.Choice(list(BANDS)), default=None,
              help="Its band: claims serve interactive first, then standard (the "
                   "default), then batch.")
@click.option("--tenant", default=None,
              help="Whose fair share of the workers it counts against (a customer, a "
                   "team).")
@click.option("--cost", type=float, default=None,
              help="What it costs the workers (tokens, say); default: the payload's "
                   "prompt plus max_tokens, else the queue's default_cost.")
@redis_option
@json_option
def submit(queue: str, payload: str | None, stream: str | None, file: IO[str] | None,
           stream_from: str | None, key: str | None, ttl: float | None, wait: bool,
           follow: bool, timeout: float | None, raw: bool, no_cache: bool,
           priority: str | None, tenant: str | None, cost: float | None, url: str | None,
           as_json: bool, run_timeout: float | None = None, delay: float | None = None,
           at_text: str | None = None, then: tuple[str, ...] = ()) -> None:
    """Submit a task to QUEUE. PAYLOAD is JSON ('-' reads it from stdin).

    Prints the task id; with --wait, the result; with --follow, the tokens as
    they stream, then the result. --file submits many (one JSON payload per
    line) with a progress bar and prints a summary.

    \b
    mtq submit chat '{"prompt": "hello"}' --stream user-42 --follow
    mtq submit embed --file requests.jsonl --stream-from user --wait --timeout 60
    """
    wait = wait or follow or timeout is not None
    at = _parse_at(at_text, delay)
    if file is not None:
        if payload is not None:
            fail("give PAYLOAD or --file, not both", USAGE)
        if follow or key or then:
            fail("--follow, --key and --then take one task; drop them with --file", USAGE)
        _submit_file(queue, file, stream, stream_from, ttl,
                     (math.inf if timeout is None else timeout) if wait else None, url,
                     as_json, not no_cache, priority=priority, tenant=tenant, cost=cost,
                     run_timeout=run_timeout, delay=delay, at=at)
        return
    if stream_from:
        fail("--stream-from goes with --file", USAGE)
    if raw and not follow:
        fail("--raw goes with --follow", USAGE)
    if then and follow:
        fail("--follow takes one task; with --then, use --wait (the last step's result)",
             USAGE)
    if payload is None:
        fail("give a PAYLOAD (JSON), '-' to read it from stdin, or --file FILE", USAGE)
    try:
        text = sys.stdin.read() if payload == "-" else payload
    except UnicodeDecodeError as exc:
        fail(f"<stdin> is not UTF-8 text ({exc}); nothing was submitted", USAGE)
    value = parse_json(text, "PAYLOAD")
    q = open_queue(queue, url)
    try:
        task = q.submit(value, stream=stream, key=key, ttl=ttl, cache=not no_cache,
                        priority=priority, tenant=tenant, cost=cost, timeout=run_timeout,
                        delay=delay, at=at, then=_steps(then) or None)
    except MtqError as exc:
        fail_on(exc)
    if not wait:
        click.echo(json.dumps({"id": task.id, "queue": queue}) if as_json else task.id)
        return
    try:
        # the id first, so that a user who stops waiting can find or cancel the task
        how = "delayed" if delay or at is not None else "queued"
        err_console.print(f"task {task.id} {how} on {queue!r}", markup=False,
                          highlight=False)
        _hint_if_unserved(q)
        if follow:
            sys.exit(_follow(task, timeout, as_json, raw))
        result = task.chain().result(timeout=timeout) if then else task.result(timeout=timeout)
    except KeyboardInterrupt:
        err_console.print(f"\nstopped waiting; task {task.id} goes on (mtq task {task.id}, "
                          f"mtq cancel {task.id})", markup=False, highlight=False)
        sys.exit(INTERRUPTED)
    except (TaskFailed, TaskCancelled, ResultTimeout) as exc:
        if as_json:
            echo_json({"id": task.id, "status": getattr(exc, "status", "waiting"),
                       "error": str(exc)})
        fail_on(exc)
    except MtqError as exc:
        fail_on(exc)
    click.echo(json.dumps({"id": task.id, "status": "succeeded", "result": result},
                          default=repr, ensure_ascii=False) if as_json
               else json.dumps(result, default=repr, ensure_ascii=False))


def _hint_if_unserved(q: Any) -> None:
    """Say so when no worker serves the queue: waiting would wait for nothing."""
    from mtq.broker.registry import list_workers

    try:
        if not list_workers(q.redis, q.name):
            err_console.print(f"[yellow]no worker serves {q.name!r} yet[/]: the task waits "
                              f"until one does ('mtq workers start TARGET --queue {q.name}')")
    except MtqError:
        pass  # the wait itself reports an unreachable Redis


def _follow(task: Any, timeout: float | None, as_json: bool, raw: bool = False) -> int:
    """Print a task's events live; returns the exit code.

    The tokens go to stdout: on a terminal, with :func:`printable` escapes for what
    would move the cursor or recolour the screen (a model's output is arbitrary text);
    with ``raw``, or into a pipe or a file, exactly as they came (like ``ls``). Every
    other line goes to stderr, task data in it shown as text, never as markup."""
    out = sys.stdout
    escaped = not raw and out.isatty()

    def write(text: str) -> None:  # not click.echo: it drops ANSI codes from a pipe
        out.write(printable(text) if escaped else text)
        out.flush()

    last = None
    printed = False
    try:
        for ev in task.events(timeout=timeout):
            last = ev
            if as_json:
                click.echo(json.dumps({"event": ev.kind, "id": ev.task_id, "data": ev.data,
                                       "index": ev.index, "delivery": ev.delivery,
                                       "ts": ev.ts}, default=repr, ensure_ascii=False))
                continue
            if ev.kind == "token":
                text = ev.data if isinstance(ev.data, str) else json.dumps(ev.data, default=repr)
                sep = "" if isinstance(ev.data, str) else " "
                write(text + sep)
                printed = True
            elif ev.kind == "progress":
                err_console.print(f"[dim]progress: {shown(ev.data)}[/]", highlight=False)
            elif ev.kind == "restarted":
                err_console.print(f"\n[yellow]restarted[/] (delivery {ev.delivery}: "
                                  f"{shown(ev.data)}); the stream goes on where it stopped",
                                  highlight=False)
            elif ev.kind in ("queued", "started"):
                err_console.print(f"[dim]{ev.kind}[/]")
    except ResultTimeout as exc:
        if printed:
            write("\n")
        fail(exc, TIMEOUT)
    except MtqError as exc:
        fail_on(exc)
    if printed and not as_json:
        write("\n")
    if last is None:
        return FAILED
    if as_json:
        return OK if last.kind == "succeeded" else FAILED
    if last.kind == "succeeded":
        if not printed:  # no tokens: the result is the output
            text = json.dumps(last.data, default=repr, ensure_ascii=False)
            out.write((printable(text, json_string=True) if escaped else text) + "\n")
            out.flush()
        err_console.print(f"[green]succeeded[/] {task.id}")
        return OK
    err_console.print(f"[red]{last.kind}[/] {task.id}: {shown(last.data)}", highlight=False)
    return FAILED


def _parse_at(text: str | None, delay: float | None) -> datetime | None:
    """``--at``'s datetime (aware); exits 2 for both --delay and --at, a text that is
    no ISO 8601 time, or one without its time zone."""
    if text is None:
        return None
    if delay is not None:
        fail("give --delay or --at, not both; nothing was submitted", USAGE)
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        fail(f"--at {text!r} is not an ISO 8601 time (2030-01-01T09:00:00+01:00); nothing "
             "was submitted", USAGE)
    if at.tzinfo is None:
        fail(f"--at {text!r} has no time zone: add one (+01:00, or Z for UTC); nothing "
             "was submitted", USAGE)
    return at


def _submit_file(queue: str, file: IO[str], stream: str | None, stream_from: str | None,
                 ttl: float | None, wait: float | None, url: str | None, as_json: bool,
                 cache: bool = True, *, priority: str | None = None,
                 tenant: str | None = None, cost: float | None = None,
                 run_timeout: float | None = None, delay: float | None = None,
                 at: datetime | None = None) -> None:
    from mtq.client import Request

    items: list[Request] = []
    errors: list[str] = []
    try:
        lines = list(enumerate(file, 1))
    except UnicodeDecodeError as exc:
        fail(f"{file.name} is not UTF-8 text ({exc}); nothing was submitted", USAGE)
    for n, line in lines:
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            errors.append(f"line {n}: not valid JSON ({exc})")
            continue
        except RecursionError:
            errors.append(f"line {n}: nested too deeply for JSON")
            continue
        except ValueError as exc:  # e.g. an integer of more than 4 300 digits
            errors.append(f"line {n}: cannot be read as JSON ({exc})")
            continue
        s = stream
        if stream_from is not None:
            if not isinstance(value, dict) or value.get(stream_from) is None:
                errors.append(f"line {n}: no field {stream_from!r} to take the stream from")
                continue
            s = str(value[stream_from])
        items.append(Request(value, stream=s, ttl=ttl, timeout=run_timeout))
    if errors:  # nothing is sent when any line is bad
        shown = "\n  ".join(errors[:10])
        more = f"\n  ... and {len(errors) - 10} more" if len(errors) > 10 else ""
        fail(f"{len(errors)} bad line(s) in {file.name}; nothing was submitted:\n  "
             f"{shown}{more}", USAGE)
    if not items:
        fail(f"{file.name} has no requests (one JSON payload per line)", USAGE)
    q = open_queue(queue, url)
    try:
        # validates and encodes every request first
        tasks = q.prepare(items, cache=cache, priority=priority, tenant=tenant, cost=cost,
                          delay=delay, at=at)
    except MtqError as exc:
        fail_on(exc)
    sent: list[Any] = []
    summary: dict[str, Any] = {"queue": queue, "submitted": 0}
    t0 = time.perf_counter()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    code = OK
    try:  # a Ctrl-C from the first chunk sent on (see the handler)
        with Progress(*columns, console=err_console, disable=as_json) as bar:
            job = bar.add_task("submitting", total=len(tasks))
            for k in range(0, len(tasks), FILE_CHUNK):
                try:
                    sent += q.send(tasks[k:k + FILE_CHUNK])
                except MtqError as exc:
                    bar.stop()
                    err_console.print(f"{len(sent)} of {len(tasks)} submitted before the "
                                      "error")
                    fail_on(exc)
                bar.advance(job, min(FILE_CHUNK, len(tasks) - k))
        seconds = time.perf_counter() - t0
        summary.update(submitted=len(sent), seconds=round(seconds, 3),
                       per_s=round(len(sent) / max(seconds, 1e-9)))
        if wait is not None:
            summary.update(_wait_all(sent, wait, as_json))
            if summary["timed_out"]:
                code = TIMEOUT
            elif summary["failed"]:
                code = FAILED
    except KeyboardInterrupt:
        # whether it came while the tasks were sent, between the last one and the wait,
        # or in the wait: what was submitted goes on, and the user is told so (exit 130,
        # never click's "Aborted!")
        if len(sent) < len(tasks):
            said = (f"stopped submitting; {len(sent)} of {len(tasks)} task(s) were "
                    "submitted and go on (--json lists their ids), and the chunk being "
                    "sent then may have been too")
        else:
            said = f"stopped waiting; the {len(sent)} task(s) go on (--json lists their ids)"
        err_console.print(f"\n{said}", markup=False, highlight=False)
        if as_json:
            echo_json({**summary, "submitted": len(sent), "interrupted": True,
                       "ids": [t.id for t in sent]})
        sys.exit(INTERRUPTED)
    if as_json:
        summary["ids"] = [t.id for t in sent]
        echo_json(summary)
    else:
        table = Table(title="submitted", show_header=False)
        table.add_row("queue", queue)
        table.add_row("tasks", f"{len(sent)} in {seconds:.2f} s ({summary['per_s']}/s)")
        if wait is not None:
            table.add_row("succeeded", str(summary["succeeded"]))
            table.add_row("failed", str(summary["failed"]))
            if summary["timed_out"]:
                table.add_row("still running", f"{summary['timed_out']} after {wait:g} s")
            table.add_row("latency p50 / p99", f"{millis(summary['p50_ms'])} / "
                                               f"{millis(summary['p99_ms'])} ms")
        console.print(table)
    sys.exit(code)


def _wait_all(tasks: list[Any], wait: float, quiet: bool) -> dict[str, Any]:
    """Wait for every task (a group's callbacks, no polling)."""
    import threading

    if not tasks:
        return {"succeeded": 0, "failed": 0, "timed_out": 0, "p50_ms": None, "p99_ms": None}
    lock = threading.Lock()
    done = {"succeeded": 0, "failed": 0}
    finished = threading.Event()
    t0 = time.time()
    lat: list[float] = []

    def on_done(task: Any, ev: Any) -> None:
        with lock:
            done["succeeded" if ev.kind == "succeeded" else "failed"] += 1
            lat.append((time.time() - t0) * 1000)
            if done["succeeded"] + done["failed"] == len(tasks):
                finished.set()

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err_console, disable=quiet) as bar:
        job = bar.add_task("waiting", total=len(tasks))
        for t in tasks:
            t.add_done_callback(on_done)
        deadline = time.monotonic() + wait
        while not finished.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
            with lock:
                bar.update(job, completed=done["succeeded"] + done["failed"])
            if time.monotonic() >= deadline:
                break
        with lock:
            bar.update(job, completed=done["succeeded"] + done["failed"])
    with lock:
        lat.sort()
        n = len(lat)
        return {**done, "timed_out": len(tasks) - done["succeeded"] - done["failed"],
                "p50_ms": lat[n // 2] if n else None,
                "p99_ms": lat[min(n - 1, int(n * 0.99))] if n else None}
