"""``mtq submit``, ``status``, ``task``, ``cancel``, ``dlq`` and ``purge``: thin over
:class:`mtq.Queue`, :class:`mtq.Task` and :mod:`mtq.admin`."""

from __future__ import annotations

import json
import math
import sys
import time
from typing import IO, Any

import click
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from mtq.cli.common import (
    FAILED,
    INTERRUPTED,
    MAX_WAIT_S,
    NOT_FOUND,
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
    parse_json,
    printable,
    redis_option,
    running_server,
    shown,
    when,
)
from mtq.client import MAX_TTL_S
from mtq.errors import MtqError, ResultTimeout, TaskCancelled, TaskFailed

#: requests sent per round trip by ``mtq submit --file``
FILE_CHUNK = 500


def _queue(name: str, url: str | None) -> Any:
    from mtq.client import Queue

    try:
        return Queue(name, url)
    except MtqError as exc:
        fail_on(exc)


def _known(client: Any, name: str) -> None:
    """Exit 3 if no task was ever submitted to queue ``name``."""
    from mtq.admin import queue_names

    names = queue_names(client)
    if name not in names:
        known = ", ".join(names[:10]) + (" ..." if len(names) > 10 else "")
        fail(f"unknown queue {name!r}: nothing was ever submitted to it"
             + (f" (known: {known})" if names else " (no queues yet)"), NOT_FOUND)


# -- submit ----------------------------------------------------------------------------
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
@redis_option
@json_option
def submit(queue: str, payload: str | None, stream: str | None, file: IO[str] | None,
           stream_from: str | None, key: str | None, ttl: float | None, wait: bool,
           follow: bool, timeout: float | None, raw: bool, no_cache: bool, url: str | None,
           as_json: bool) -> None:
    """Submit a task to QUEUE. PAYLOAD is JSON ('-' reads it from stdin).

    Prints the task id; with --wait, the result; with --follow, the tokens as
    they stream, then the result. --file submits many (one JSON payload per
    line) with a progress bar and prints a summary.

    \b
    mtq submit chat '{"prompt": "hello"}' --stream user-42 --follow
    mtq submit embed --file requests.jsonl --stream-from user --wait --timeout 60
    """
    wait = wait or follow or timeout is not None
    if file is not None:
        if payload is not None:
            fail("give PAYLOAD or --file, not both", USAGE)
        if follow or key:
            fail("--follow and --key take one task; drop them with --file", USAGE)
        _submit_file(queue, file, stream, stream_from, ttl,
                     (math.inf if timeout is None else timeout) if wait else None, url,
                     as_json, not no_cache)
        return
    if stream_from:
        fail("--stream-from goes with --file", USAGE)
    if raw and not follow:
        fail("--raw goes with --follow", USAGE)
    if payload is None:
        fail("give a PAYLOAD (JSON), '-' to read it from stdin, or --file FILE", USAGE)
    try:
        text = sys.stdin.read() if payload == "-" else payload
    except UnicodeDecodeError as exc:
        fail(f"<stdin> is not UTF-8 text ({exc}); nothing was submitted", USAGE)
    value = parse_json(text, "PAYLOAD")
    q = _queue(queue, url)
    try:
        task = q.submit(value, stream=stream, key=key, ttl=ttl, cache=not no_cache)
    except MtqError as exc:
        fail_on(exc)
    if not wait:
        click.echo(json.dumps({"id": task.id, "queue": queue}) if as_json else task.id)
        return
    try:
        # the id first, so that a user who stops waiting can find or cancel the task
        err_console.print(f"task {task.id} queued on {queue!r}", markup=False,
                          highlight=False)
        _hint_if_unserved(q)
        if follow:
            sys.exit(_follow(task, timeout, as_json, raw))
        result = task.result(timeout=timeout)
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
    from mtq.workers.registry import list_workers

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


def _submit_file(queue: str, file: IO[str], stream: str | None, stream_from: str | None,
                 ttl: float | None, wait: float | None, url: str | None, as_json: bool,
                 cache: bool = True) -> None:
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
        items.append(Request(value, stream=s, ttl=ttl))
    if errors:  # nothing is sent when any line is bad
        shown = "\n  ".join(errors[:10])
        more = f"\n  ... and {len(errors) - 10} more" if len(errors) > 10 else ""
        fail(f"{len(errors)} bad line(s) in {file.name}; nothing was submitted:\n  "
             f"{shown}{more}", USAGE)
    if not items:
        fail(f"{file.name} has no requests (one JSON payload per line)", USAGE)
    q = _queue(queue, url)
    try:
        tasks = q.prepare(items, cache=cache)  # validates and encodes every request first
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


# -- status ----------------------------------------------------------------------------
@click.command()
@click.argument("queue", required=False)
@redis_option
@json_option
def status(queue: str | None, url: str | None, as_json: bool) -> None:
    """The queues, from one cheap snapshot (its cost does not grow with the number
    of tasks).

    \b
    Columns (short, so that the table fits 80 columns):
      wait      tasks waiting
      strm      streams with waiting work
      run       tasks running
      retry     tasks waiting to be retried (after a failure, for their delay)
      dead      dead letters ('mtq dlq list')
      ok, fail  tasks succeeded, failed: totals since the queue began
      p50, p99  submit-to-finish latency in ms, of the last 1000 tasks
      wkrs      live worker processes
    Counts from 10,000 up are rounded: 12.3k, 4.6M; --json gives exact figures.
    """
    from dataclasses import asdict

    from mtq.admin import snapshot
    from mtq.broker.connection import connect

    url = running_server(url)
    try:
        client = connect(url)
        if queue is not None:
            _queue(queue, url)  # checks the name
            _known(client, queue)
        snap = snapshot(client, [queue] if queue else None)
    except MtqError as exc:
        fail_on(exc)
    if as_json:
        echo_json({"ts": snap.ts, "queues": [asdict(q) for q in snap.queues]})
        return
    if not snap.queues:
        console.print("no queues yet: submit a task ('mtq submit QUEUE PAYLOAD')")
        return
    console.print(status_table(snap.queues))
    console.print(STATUS_LEGEND, style="dim", highlight=False)


#: ``mtq status``'s columns after the queue's name, four or five letters each so that a
#: queue name of up to about 24 characters fits 80 columns (explained in its help and
#: in the legend printed under the table)
STATUS_COLUMNS = ("wait", "strm", "run", "retry", "dead", "ok", "fail", "p50", "p99", "wkrs")
STATUS_LEGEND = ("wait, run: tasks waiting, running · strm: streams with work · retry: to be "
                 "retried · ok, fail: totals · p50, p99: latency in ms · wkrs: workers")


def compact_count(n: int) -> str:
    """A count in at most 5 characters: 9,999, then 12.3k, 456k, 1.2M ..."""
    if n < 10_000:
        return f"{n:,}"
    for scale, unit in ((1e3, "k"), (1e6, "M"), (1e9, "G"), (1e12, "T")):
        v = n / scale
        if v < 99.95:
            return f"{v:.1f}{unit}"
        if v < 999.5:
            return f"{v:.0f}{unit}"
    return f"{n / 1e15:.0f}P"


def status_table(queues: list[Any]) -> Table:
    """The queues as a borderless table that fits 80 columns: short headers, two
    spaces between columns, counts of at most 5 characters; a queue name too long
    for what is left wraps onto a second line rather than being cut."""
    from rich import box

    table = Table(title=f"{len(queues)} queue{'s' if len(queues) != 1 else ''}",
                  title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
                  pad_edge=False, padding=(0, 0, 0, 1))
    table.add_column("queue", overflow="fold")
    for col in STATUS_COLUMNS:
        table.add_column(col, justify="right", no_wrap=True)
    for v in queues:
        n = compact_count
        table.add_row(escape(v.name), n(v.waiting), n(v.streams), n(v.running), n(v.delayed),
                      n(v.dead), n(v.succeeded), n(v.failed), millis(v.p50_ms),
                      millis(v.p99_ms), n(v.workers))
    return table


# -- task ------------------------------------------------------------------------------
@click.command()
@click.argument("task_id")
@click.option("--queue", "-q", default=None, help="Its queue (default: look in every queue).")
@redis_option
@json_option
def task(task_id: str, queue: str | None, url: str | None, as_json: bool) -> None:
    """Details of a task and the timeline of its life."""
    from dataclasses import asdict

    from mtq.admin import find_task
    from mtq.broker.connection import connect

    url = running_server(url)
    try:
        t = find_task(connect(url), task_id, queue)
        info = t.info()
        trace = t.trace()
        result = t.result(timeout=0) if info.status == "succeeded" else None
    except MtqError as exc:
        fail_on(exc)
    if as_json:
        echo_json({**asdict(info), "queue": t.queue.name, "result": result,
                   "timeline": [asdict(e) for e in trace]})
        return
    table = Table(title=f"task {t.id}", show_header=False)
    table.add_row("queue", t.queue.name)
    style = {"succeeded": "green", "failed": "red", "dead": "red", "running": "yellow"}
    table.add_row("status", f"[{style.get(info.status, 'white')}]{info.status}[/]")
    table.add_row("stream", info.stream or "-")
    table.add_row("attempts / deliveries", f"{info.attempts} / {info.deliveries}")
    table.add_row("created / started / finished",
                  f"{when(info.created)} / {when(info.started)} / {when(info.finished)}")
    if info.worker:
        table.add_row("worker", shown(info.worker))
    if info.error:
        table.add_row("error", shown(info.error))
    if info.cancel_requested:
        table.add_row("cancel", "requested")
    if result is not None:
        text = json.dumps(result, default=repr, ensure_ascii=False)
        table.add_row("result", shown(text if len(text) <= 300 else text[:300] + " ..."))
    console.print(table)
    timeline = Table(title="timeline")
    for col in ("time", "+ms", "event", "detail"):
        timeline.add_column(col)
    first = trace[0].ts if trace else 0.0
    for e in trace:
        timeline.add_row(when(e.ts * 1000), f"{(e.ts - first) * 1000:.0f}", e.kind,
                         shown(e.detail))
    console.print(timeline)
    if info.traceback:
        console.print("traceback (the last exception its handler raised):")
        console.print(printable(info.traceback), markup=False, highlight=False,
                      soft_wrap=True)


# -- cancel ----------------------------------------------------------------------------
@click.command()
@click.argument("task_id")
@click.option("--queue", "-q", default=None, help="Its queue (default: look in every queue).")
@redis_option
@json_option
def cancel(task_id: str, queue: str | None, url: str | None, as_json: bool) -> None:
    """Cancel a task: a waiting one at once; a running one is stopped by its worker
    (a generator at its next step). Exit 1 if it had already finished."""
    from mtq.admin import find_task
    from mtq.broker.codes import Code
    from mtq.broker.connection import connect

    url = running_server(url)
    try:
        t = find_task(connect(url), task_id, queue)
        code, before = t.queue.broker.cancel(t.id)
    except MtqError as exc:
        fail_on(exc)
    outcome = {1: "cancelled", 2: "cancel requested"}.get(code, "finished")
    if as_json:
        echo_json({"id": t.id, "queue": t.queue.name, "outcome": outcome, "was": before})
    elif code == 1:
        console.print(f"cancelled {t.id} (it was {before})")
    elif code == 2:
        console.print(f"cancel requested: {t.id} is running; its worker stops it")
    if code == Code.FINISHED:
        if not as_json:
            err_console.print(f"[yellow]{t.id} already {before}; nothing to cancel[/]")
        sys.exit(FAILED)
    if code == Code.NOT_FOUND:
        fail(f"no task {t.id!r}", NOT_FOUND)


# -- dead letters, purge ----------------------------------------------------------------
@click.group()
def dlq() -> None:
    """Dead letters: tasks that failed on every retry or killed their workers."""


@dlq.command("list")
@click.argument("queue")
@click.option("--count", "-n", default=20, show_default=True, type=click.IntRange(1, 10_000))
@click.option("--verbose", "-v", is_flag=True,
              help="Each dead letter's whole error and traceback, after the table.")
@redis_option
@json_option
def dlq_list(queue: str, count: int, verbose: bool, url: str | None, as_json: bool) -> None:
    """The newest dead letters of QUEUE, with their errors (--json: tracebacks too)."""
    q = _queue(queue, running_server(url))
    try:
        _known(q.redis, queue)
        rows = q.dead_letters(0, count)
        total = q.stats()["dead"]
    except MtqError as exc:
        fail_on(exc)
    if as_json:
        echo_json({"queue": queue, "dead": total, "tasks": rows})
        return
    table = Table(title=f"{total} dead letter(s) in {queue!r}"
                  + (f", newest {len(rows)}" if total > len(rows) else ""))
    for col in ("id", "stream", "attempts", "deliveries", "died", "error"):
        table.add_column(col)
    for row in rows:
        table.add_row(row["id"], row["stream"] or "-", str(row["attempts"]),
                      str(row["deliveries"]), when(row["finished"]),
                      shown((row["error"] or "")[:120]))
    console.print(table)
    if verbose:
        for row in rows:
            console.print(printable(f"\n{row['id']}: {row['error'] or '-'}"), markup=False,
                          highlight=False, soft_wrap=True)
            console.print(printable(row["traceback"] or "(no traceback: the task killed its "
                                    "process or its lease ran out)"), markup=False,
                          highlight=False, soft_wrap=True)


def _dlq_action(action: str, queue: str, ids: tuple[str, ...], all_: bool, url: str | None,
                as_json: bool) -> None:
    if bool(ids) == all_:
        fail(f"name the ids to {action}, or --all", USAGE)
    q = _queue(queue, running_server(url))
    try:
        _known(q.redis, queue)
        n = q.retry_dead(ids or None) if action == "retry" else q.purge_dead(ids or None)
    except MtqError as exc:
        fail_on(exc)
    if as_json:
        echo_json({"queue": queue, action: n})
    else:
        verb = "queued again" if action == "retry" else "deleted"
        console.print(f"{n} dead letter(s) {verb}")
    if ids and n < len(ids):
        err_console.print(f"[yellow]{len(ids) - n} id(s) were not dead letters of {queue!r}[/]")
        sys.exit(NOT_FOUND)


@dlq.command("retry")
@click.argument("queue")
@click.argument("ids", nargs=-1)
@click.option("--all", "all_", is_flag=True, help="Every dead letter of the queue.")
@redis_option
@json_option
def dlq_retry(queue: str, ids: tuple[str, ...], all_: bool, url: str | None,
              as_json: bool) -> None:
    """Queue dead letters again (each at the tail of its stream, attempts reset)."""
    _dlq_action("retry", queue, ids, all_, url, as_json)


@dlq.command("purge")
@click.argument("queue")
@click.argument("ids", nargs=-1)
@click.option("--all", "all_", is_flag=True, help="Every dead letter of the queue.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@redis_option
@json_option
def dlq_purge(queue: str, ids: tuple[str, ...], all_: bool, yes: bool, url: str | None,
              as_json: bool) -> None:
    """Delete dead letters for good."""
    if all_ and not yes:
        click.confirm(f"Delete every dead letter of {queue!r}?", abort=True, err=True)
    _dlq_action("purge", queue, ids, all_, url, as_json)


@click.command()
@click.argument("queue")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@redis_option
@json_option
def purge(queue: str, yes: bool, url: str | None, as_json: bool) -> None:
    """Drop every waiting task of QUEUE (each ends cancelled, 'purged'). Running
    tasks, retries waiting for their delay and dead letters stay."""
    q = _queue(queue, running_server(url))
    try:
        _known(q.redis, queue)
        waiting = q.stats()["waiting"]
        if not yes:
            click.confirm(f"Drop the {waiting:,} waiting task(s) of {queue!r}?", abort=True,
                          err=True)
        n = q.purge()
    except MtqError as exc:
        fail_on(exc)
    if as_json:
        echo_json({"queue": queue, "purged": n})
    else:
        console.print(f"{n:,} waiting task(s) purged from {queue!r}")


COMMANDS = (submit, status, task, cancel, dlq, purge)
