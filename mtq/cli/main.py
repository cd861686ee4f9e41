"""The ``mtq`` command: a thin click layer over library calls, with rich output."""

from __future__ import annotations

import json
import logging
import signal
import sys
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from mtq.errors import MtqError

console = Console()
err_console = Console(stderr=True)


def _fail(exc: Exception, code: int = 1) -> None:
    err_console.print(f"[bold red]error:[/] {exc}")
    sys.exit(code)


@click.group()
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
@click.version_option(package_name="mtq")
def cli(verbose: int) -> None:
    """mtq, a Redis-backed task queue for AI inference.

    Redis is MTQ_REDIS_URL (or --redis); without one, mtq uses its embedded
    redis-server (see 'mtq server').
    """
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# -- server ----------------------------------------------------------------------
@cli.group()
def server() -> None:
    """Manage the embedded redis-server (used when no Redis URL is configured)."""


@server.command("start")
def server_start() -> None:
    """Start the embedded server (no-op if it runs)."""
    from mtq.broker.embedded import EmbeddedServer

    try:
        url = EmbeddedServer.from_env().start()
    except MtqError as exc:
        _fail(exc)
    console.print(f"embedded redis-server running at [bold]{url}[/]")


@server.command("stop")
def server_stop() -> None:
    """Stop the embedded server (its append-only file keeps the data)."""
    from mtq.broker.embedded import EmbeddedServer

    try:
        stopped = EmbeddedServer.from_env().stop()
    except MtqError as exc:
        _fail(exc)
    console.print("stopped" if stopped else "not running")


@server.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def server_status(as_json: bool) -> None:
    """Show whether the embedded server runs. Exit code 3 if it does not."""
    from dataclasses import asdict

    from mtq.broker.embedded import EmbeddedServer

    st = EmbeddedServer.from_env().status()
    if as_json:
        click.echo(json.dumps(asdict(st)))
    elif st.running:
        console.print(f"running: pid {st.pid}, redis {st.version}, {st.url}, "
                      f"{(st.used_memory or 0) / 1e6:.1f} MB used, state in {st.state_dir}")
    else:
        console.print(f"not running (state in {st.state_dir})")
    sys.exit(0 if st.running else 3)


# -- worker ----------------------------------------------------------------------
@cli.group()
def worker() -> None:
    """Run a worker process."""


@worker.command("run")
@click.argument("target")
@click.option("--queue", "-q", required=True, help="Queue to serve.")
@click.option("--redis", "url", default=None, help="Redis URL (default: MTQ_REDIS_URL / embedded).")
@click.option("--batch-size", default=64, show_default=True, type=click.IntRange(1, 10_000))
@click.option("--lease-ms", default=30_000, show_default=True, type=click.IntRange(1))
@click.option("--burst", is_flag=True, help="Exit when the queue has nothing left to do.")
def worker_run(target: str, queue: str, url: str | None, batch_size: int, lease_ms: int,
               burst: bool) -> None:
    """Serve QUEUE with TARGET, a plain function 'package.module:function'
    called once per task payload. SIGTERM/SIGINT stop it after the current batch."""
    from mtq.settings import QueueSettings, RedisSettings
    from mtq.workers.simple import SimpleWorker, WorkerInterrupted
    from mtq.workers.target import load_target

    try:
        func = load_target(target)
        w = SimpleWorker(queue, func, url=url or RedisSettings.from_env().url,
                         settings=QueueSettings(lease_ms=lease_ms), batch_size=batch_size)
    except MtqError as exc:
        _fail(exc, 2)

    def on_signal(signum: int, _frame: Any) -> None:
        w.stop()
        if w.waiting:
            raise WorkerInterrupted()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        stats = w.run(burst=burst)
    except WorkerInterrupted:  # a signal that landed just as the idle wait returned
        stats = w.stats
    except MtqError as exc:
        _fail(exc)
    err_console.print(f"worker stopped: {stats}")


# -- submit ----------------------------------------------------------------------
@cli.command()
@click.argument("queue")
@click.argument("payload")
@click.option("--stream", "-s", default=None, help="Ordering key (user, session).")
@click.option("--redis", "url", default=None, help="Redis URL (default: MTQ_REDIS_URL / embedded).")
@click.option("--wait", "wait", type=float, default=None, metavar="SECONDS",
              help="Wait up to SECONDS for the result and print it.")
def submit(queue: str, payload: str, stream: str | None, url: str | None,
           wait: float | None) -> None:
    """Submit one task: PAYLOAD is JSON. Prints the task id (or the result with --wait)."""
    from mtq.client import Queue
    from mtq.settings import RedisSettings

    try:
        value = json.loads(payload)
    except json.JSONDecodeError as exc:
        _fail(ValueError(f"PAYLOAD is not valid JSON ({exc}); quote it, e.g. '{{\"x\": 1}}'"), 2)
    try:
        q = Queue(queue, url or RedisSettings.from_env().url)
        task = q.submit(value, stream=stream)
        if wait is None:
            click.echo(task.id)
        else:
            click.echo(json.dumps(task.result(timeout=wait), default=repr))
    except MtqError as exc:
        _fail(exc)


# -- demo ------------------------------------------------------------------------
@cli.command()
@click.option("--redis", "url", default=None, help="Redis URL (default: MTQ_REDIS_URL / embedded).")
@click.option("--tasks", default=400, show_default=True, type=click.IntRange(1))
@click.option("--streams", default=20, show_default=True, type=click.IntRange(1))
@click.option("--workers", default=2, show_default=True, type=click.IntRange(1, 32))
@click.option("--no-kill", is_flag=True, help="Do not kill a worker mid-run.")
def demo(url: str | None, tasks: int, streams: int, workers: int, no_kill: bool) -> None:
    """Run worker processes, submit tasks over many streams, kill a worker mid-batch,
    and check that nothing was lost and every stream kept its order."""
    from mtq.broker.connection import resolve_url
    from mtq.demo import run_demo
    from mtq.settings import RedisSettings

    try:
        resolved = resolve_url(url or RedisSettings.from_env().url)
        console.print(f"[bold]mtq demo[/] on {resolved}")
        report = run_demo(resolved, tasks=tasks, streams=streams, workers=workers,
                          kill_one=not no_kill,
                          progress=lambda msg: console.print(f"  • {msg}"))
    except MtqError as exc:
        _fail(exc)
    table = Table(title="what happened", show_header=False)
    table.add_row("tasks", f"{report.tasks} over {report.streams} streams")
    table.add_row("succeeded", f"{report.succeeded}" + (f"  other: {report.other}" if report.other else ""))
    note = (f"; includes waiting out the killed worker's {report.lease_ms / 1000:g} s lease"
            if report.killed_pid else "")
    table.add_row("time", f"{report.seconds:.2f} s ({report.tasks / report.seconds:.0f} tasks/s{note})")
    table.add_row("latency p50 / p99", f"{report.latency_ms_p50:.0f} / {report.latency_ms_p99:.0f} ms (submit to finish)")
    if report.killed_pid:
        table.add_row("worker killed", f"pid {report.killed_pid} (SIGKILL); tasks redelivered: {report.redelivered}")
    table.add_row("tasks per worker pid", ", ".join(f"{k}: {v}" for k, v in sorted(report.by_worker.items())))
    table.add_row("order per stream", "[green]kept[/]" if report.order_ok else f"[red]BROKEN[/] {report.order_errors}")
    table.add_row("nothing lost", "[green]yes[/]" if report.succeeded == report.tasks else "[red]NO[/]")
    console.print(table)
    sys.exit(0 if report.ok else 1)


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="mtq")


if __name__ == "__main__":
    main()
