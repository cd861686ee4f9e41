"""``mtq trace``: a queue's recent batches and tasks as a Chrome trace / Perfetto file."""

from __future__ import annotations

import json
import sys

import click

from mtq.cli.common import NOT_FOUND, USAGE, code_for, fail, redis_option, running_server, say
from mtq.errors import MtqError


@click.command("trace")
@click.argument("queue")
@click.option("--since", default="60s", show_default=True,
              help="How far back: 500ms, 90s, 5m, 2h, or a number of seconds.")
@click.option("-o", "--output", default="trace.json", show_default=True,
              help="File to write ('-': standard output).")
@click.option("--limit", default=10_000, show_default=True, type=click.IntRange(1, 1_000_000),
              help="Most waiting, delayed and running tasks read.")
@redis_option
def trace_command(queue: str, since: str, output: str, limit: int, url: str | None) -> None:
    """Write QUEUE's last --since of batches and tasks as a Chrome trace file.

    Open it in https://ui.perfetto.dev or chrome://tracing: one track per
    worker process (its batches, its tasks' deliveries, restarts and failures)
    and a 'queue QUEUE' track with each task's wait from submit to start.
    Reads the workers' batch records (the newest the queue keeps: its
    batch_log_max and batch_log_bytes settings) and the tasks' timelines,
    never a scan. A malformed --since exits 2 and writes
    nothing; a queue Redis does not know exits 3."""
    from mtq.broker.connection import connect, redis_errors, safe_url
    from mtq.observe.perfetto import collect, parse_since, queue_exists
    from mtq.validation import check_queue_name

    try:
        window = parse_since(since)
    except ValueError as exc:
        fail(exc, USAGE)
    try:
        check_queue_name(queue)
        resolved = running_server(url)
        client = connect(resolved)
        with redis_errors("while reading the trace"):
            if not queue_exists(client, queue):
                fail(f"no queue named {queue!r} in Redis at {safe_url(resolved)}; check the "
                     "name (mtq status lists the queues)", NOT_FOUND)
            doc = collect(client, queue, window, limit)
    except MtqError as exc:
        fail(exc, code_for(exc))
    text = json.dumps(doc, separators=(",", ":"))
    events = doc["traceEvents"]
    tasks = len({e["args"]["id"] for e in events if e.get("cat") in ("task", "queue")})
    batches = sum(1 for e in events if e.get("cat") == "batch")
    if output == "-":
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    else:
        try:
            with open(output, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as exc:
            fail(f"cannot write {output!r} ({exc.strerror or exc}); choose another -o", USAGE)
    where = "standard output" if output == "-" else output
    say(f"wrote {len(events)} events ({tasks} tasks, {batches} batches, last {since}) to "
        f"{where}; open it in https://ui.perfetto.dev or chrome://tracing")
