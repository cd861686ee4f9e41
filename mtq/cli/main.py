"""The ``mtq`` command: a thin click layer over library calls, with rich output."""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
import time
from typing import Any

import click

from mtq.broker.connection import REACH_TIMEOUT_S
from mtq.cli import common
from mtq.cli.common import (
    EXIT_CODES,
    FAILED,
    USAGE,
    FloatRange,
    code_for,
    fail,
    redis_option,
    running_server,
    say,
)
from mtq.errors import MtqError


def _fail(exc: Exception, code: int | None = None) -> None:
    fail(exc, code_for(exc) if code is None else code)


#: the commands defined in other modules, imported when one of them is run or listed,
#: so that ``mtq worker run`` starts without the rest of the CLI (rich's tables, the rq
#: bridge, the exporter): about 0.1 s less before a worker claims its first task
LAZY = {
    **{name: f"mtq.cli.tasks:{name}"
       for name in ("submit", "status", "task", "cancel", "dlq", "purge")},
    "queue": "mtq.cli.queues:queue_group",
    "metrics": "mtq.cli.metrics:metrics_group",
    "trace": "mtq.cli.trace:trace_command",
    "rq": "mtq.cli.rq:rq_group",
    "models": "mtq.cli.models:models",
}


class _LazyGroup(click.Group):
    """click's Group, with the commands of :data:`LAZY` imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *LAZY})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in LAZY and cmd_name not in self.commands:
            module, attr = LAZY[cmd_name].split(":")
            self.add_command(getattr(importlib.import_module(module), attr), cmd_name)
        return super().get_command(ctx, cmd_name)


@click.group(cls=_LazyGroup, epilog=EXIT_CODES)
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
@click.version_option(package_name="mtq")
def cli(verbose: int) -> None:
    """mtq, a Redis-backed task queue for AI inference.

    Redis is MTQ_REDIS_URL (or --redis); without one, mtq uses its embedded
    redis-server (see 'mtq server'). Shell completion: 'mtq completion --help'.

    \b
    Start here:
      mtq demo                                   the whole product in half a minute
      mtq workers start my_app.models:Chat -q chat
      mtq submit chat '{"prompt": "hi"}' --follow
      mtq status / mtq dashboard                 what is going on
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
    common.console.print(f"embedded redis-server running at [bold]{url}[/]")


@server.command("stop")
def server_stop() -> None:
    """Stop the embedded server (its append-only file keeps the data)."""
    from mtq.broker.embedded import EmbeddedServer

    try:
        stopped = EmbeddedServer.from_env().stop()
    except MtqError as exc:
        _fail(exc)
    common.console.print("stopped" if stopped else "not running")


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
        common.console.print(f"running: pid {st.pid}, redis {st.version}, {st.url}, "
                      f"{(st.used_memory or 0) / 1e6:.1f} MB used, state in {st.state_dir}")
    else:
        common.console.print(f"not running (state in {st.state_dir})")
    sys.exit(0 if st.running else 3)


# -- worker ----------------------------------------------------------------------
_redis_opt = redis_option
_queue_opt = click.option("--queue", "-q", required=True, help="Queue to serve.")
_app_dir_opt = click.option(
    "--app-dir", default=".", show_default=True, type=click.Path(file_okay=False),
    help="Where the target's code is: put first on the import path of this process "
         "and of the processes it starts.")
_wait_opt = click.option(
    "--wait-for-redis", is_flag=True,
    help="At start, wait for an unreachable Redis without a limit (default: give up "
         f"after MTQ_REDIS_WAIT_S, {REACH_TIMEOUT_S:.0f} s unless set, and exit 5).")


def _overrides(**given: Any) -> dict[str, Any] | None:
    """The queue settings given on the command line, over the queue's stored ones."""
    return {k: v for k, v in given.items() if v is not None} or None


def _import_from(app_dir: str) -> None:
    from mtq.workers.target import add_app_dir

    try:
        add_app_dir(app_dir)
    except MtqError as exc:
        _fail(exc, USAGE)


def _reach(url: str | None, wait: bool) -> str:
    """Wait for Redis before anything starts (see mtq.broker.connection.reach): a wrong
    address, password or certificate is one line and exit 5. Returns the URL."""
    from mtq.broker.connection import connect, reach, resolve_url, safe_url
    from mtq.errors import RedisUnavailable

    limit: float | None = None
    try:
        if not wait:
            limit = float(os.environ.get("MTQ_REDIS_WAIT_S") or REACH_TIMEOUT_S)
            if not 0 <= limit < float("inf"):
                raise ValueError(limit)
    except ValueError:
        fail("MTQ_REDIS_WAIT_S must be a number of seconds (0 or more)", USAGE)
    try:
        resolved = resolve_url(url)
        deadline = None if limit is None else time.monotonic() + limit
        while True:  # a cluster's client reads the slot map when it is made: wait for it
            try:
                client = connect(resolved)
                break
            except RedisUnavailable as exc:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                say(f"cannot reach {safe_url(resolved)} ({exc.__cause__ or exc}); "
                    "retrying in 1 s")
                time.sleep(1.0)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        reach(client, resolved, say, timeout_s=left)
    except MtqError as exc:
        _fail(exc)
    return resolved


@cli.group()
def worker() -> None:
    """Run one worker in this process (no supervisor; see 'mtq workers start')."""


@worker.command("run")
@click.argument("target")
@_queue_opt
@_redis_opt
@click.option("--batch-size", default=None, type=click.IntRange(1, 100_000),
              help="Most tasks per batch (default: the model's max_batch_size).")
@click.option("--max-wait-ms", default=None, type=FloatRange(0, 60_000),
              help="Longest wait for a batch to fill (default: the model's max_wait_ms).")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda:N or mps.")
@click.option("--lease-ms", default=None, type=click.IntRange(1),
              help="Lease of a claimed task, extended every second (default: the queue's "
                   "lease_ms, see 'mtq queue config').")
@click.option("--burst", is_flag=True, help="Exit when the queue has nothing left to do.")
@_app_dir_opt
@_wait_opt
def worker_run(target: str, queue: str, url: str | None, batch_size: int | None,
               max_wait_ms: float | None, device: str, lease_ms: int | None, burst: bool,
               app_dir: str, wait_for_redis: bool) -> None:
    """Serve QUEUE with TARGET ('package.module:attr': an mtq.Model subclass or a
    plain function). SIGTERM/SIGINT stop it after the running batch; a second
    signal exits at once (its tasks return when their leases expire)."""
    from mtq.workers.control import Listener
    from mtq.workers.signals import on_stop_signals
    from mtq.workers.target import load_model
    from mtq.workers.worker import Worker

    _import_from(app_dir)
    try:  # a target that cannot be loaded is bad input, whatever Redis does
        load_model(target)
    except MtqError as exc:
        _fail(exc, USAGE)
    url = _reach(url, wait_for_redis)
    try:
        w = Worker(target, queue, url=url, settings=_overrides(lease_ms=lease_ms),
                   device=device, max_batch_size=batch_size, max_wait_ms=max_wait_ms)
    except MtqError as exc:
        _fail(exc, USAGE)  # the target cannot be loaded, or an option is out of range
    try:
        w.setup()
    except Exception as exc:  # the model's own setup(): the work failed
        logging.getLogger("mtq.cli").info("setup failed", exc_info=True)
        fail(f"setup of {target} failed: {type(exc).__name__}: {exc} (-v shows the "
             "traceback)", FAILED)
    on_stop_signals(w.stop)  # the first stops the worker, a second exits (130)
    listener = Listener(w.consumer.redis, w.queue, w.command)
    listener.start()
    if burst:
        w.command({"cmd": "drain"})
    w.freeze_startup()
    try:
        totals = w.run()
    except MtqError as exc:
        _fail(exc)
    finally:
        listener.close()
    common.err_console.print(f"worker stopped: {totals}")


@cli.group()
def workers() -> None:
    """Start, list and control supervised worker processes."""


@workers.command("start")
@click.argument("target")
@_queue_opt
@_redis_opt
@click.option("--devices", "devices_spec", default="cpu", show_default=True,
              help="cpu | cuda:0,cuda:1 | all (every GPU, or cpu without one).")
@click.option("--replicas", default=1, show_default=True, type=click.IntRange(0, 256),
              help="Worker processes per device.")
@click.option("--max-batch-size", default=None, type=click.IntRange(1, 100_000),
              help="Override the model's max_batch_size.")
@click.option("--max-wait-ms", default=None, type=FloatRange(0, 60_000),
              help="Override the model's max_wait_ms.")
@click.option("--timeout", "timeout_s", default=None, type=FloatRange(min=0.001),
              help="Override the model's timeout_s: longest one predict call may run.")
@click.option("--lease-ms", default=None, type=click.IntRange(100),
              help="Lease of a claimed task, extended every second (default: the queue's "
                   "lease_ms, see 'mtq queue config').")
@click.option("--standby", default=None, type=click.IntRange(0, 1),
              help="A warm spare process per device that takes over at once when a worker "
                   "process dies (default: 1 on the CPU, 0 on a GPU, where it holds a "
                   "second copy of the model in device memory).")
@_app_dir_opt
@_wait_opt
def workers_start(target: str, queue: str, url: str | None, devices_spec: str, replicas: int,
                  max_batch_size: int | None, max_wait_ms: float | None,
                  timeout_s: float | None, lease_ms: int | None, standby: int | None,
                  app_dir: str, wait_for_redis: bool) -> None:
    """Serve QUEUE with TARGET ('package.module:attr') in REPLICAS processes per
    device, restarted when they die. SIGTERM/SIGINT drain gracefully; a second
    signal forces."""
    from mtq.workers.supervisor import Supervisor
    from mtq.workers.target import find_target_module

    _import_from(app_dir)
    try:  # (the module is imported in the worker processes, not here)
        find_target_module(target)
    except MtqError as exc:
        _fail(exc, USAGE)
    url = _reach(url, wait_for_redis)
    try:
        sup = Supervisor(target, queue, url=url, devices_spec=devices_spec, replicas=replicas,
                         settings=_overrides(lease_ms=lease_ms),
                         max_batch_size=max_batch_size, max_wait_ms=max_wait_ms,
                         timeout_s=timeout_s, standby=standby,
                         on_event=say)
    except MtqError as exc:
        _fail(exc, 2)
    say(f"supervisor {sup.id} serving {queue!r} with {target} on "
        f"{', '.join(sup.devices)} x {replicas}")
    sys.exit(sup.run())


@workers.command("list")
@click.option("--queue", "-q", default=None, help="Only workers of this queue.")
@_redis_opt
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def workers_list(queue: str | None, url: str | None, as_json: bool) -> None:
    """Live workers from the registry (host, device, model, state, batch sizes, rate)."""
    from mtq.broker.connection import connect
    from mtq.workers.registry import list_workers

    url = running_server(url)
    try:
        rows = list_workers(connect(url), queue)
    except MtqError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    from rich.table import Table

    table = Table(title=f"{len(rows)} worker(s)")
    for col in ("id", "queue", "device", "model", "state", "batch", "typical", "tasks/s",
                "done", "beat age"):
        table.add_column(col)
    for w in rows:
        table.add_row(w["id"], str(w.get("queue")), str(w.get("device")),
                      f"{w.get('model')}/{w.get('version')}", str(w.get("state")),
                      str(w.get("batch")), str(w.get("typical_batch")),
                      str(w.get("tasks_per_s")), str(w.get("succeeded")),
                      f"{w['heartbeat_age_s']:.1f}s")
    common.console.print(table)


def _control(cmd: str, queue: str, url: str | None, worker_id: str | None = None,
             replicas: int | None = None) -> None:
    from mtq.broker.connection import connect
    from mtq.workers import control

    url = running_server(url)
    try:
        n = control.send(connect(url), queue, cmd, worker=worker_id, replicas=replicas)
    except MtqError as exc:
        _fail(exc)
    if n == 0:
        common.err_console.print(f"[yellow]no supervisor of queue {queue!r} is listening[/]")
        sys.exit(4)
    common.console.print(f"{cmd}: sent to {n} supervisor(s) of {queue!r}")


def _control_command(cmd: str, help_text: str) -> None:
    @workers.command(cmd, help=help_text)
    @_queue_opt
    @_redis_opt
    @click.option("--worker", "worker_id", default=None, help="Only this worker id.")
    def _cmd(queue: str, url: str | None, worker_id: str | None) -> None:
        _control(cmd, queue, url, worker_id)


_control_command("pause", "Stop claiming; claimed-ahead tasks go back to the queue.")
_control_command("resume", "Claim again after a pause.")
_control_command("reload", "Re-import the target and run setup again, losing no task.")
_control_command("drain", "Work until the queue is empty, then exit.")
_control_command("stop", "Finish running batches, give the rest back, exit.")


@workers.command("scale")
@click.argument("replicas", type=click.IntRange(0, 256))
@_queue_opt
@_redis_opt
def workers_scale(replicas: int, queue: str, url: str | None) -> None:
    """Set the number of worker processes per device of the running supervisors."""
    _control("scale", queue, url, replicas=replicas)


# -- dashboard -------------------------------------------------------------------
@cli.command()
@click.option("--queue", "-q", "queues", multiple=True,
              help="Only this queue (repeatable; default: every queue).")
@click.option("--refresh", default=1.0, show_default=True, type=FloatRange(0.2, 60),
              help="Seconds between refreshes.")
@click.option("--once", is_flag=True, help="Print one frame and exit.")
@_redis_opt
def dashboard(queues: tuple[str, ...], refresh: float, once: bool, url: str | None) -> None:
    """Live view of queues, workers, failures and throughput (q or Ctrl-C quits).
    Reads one cheap snapshot per refresh, whatever the number of tasks."""
    from mtq.dashboard.app import run

    url = running_server(url)
    try:
        sys.exit(run(url, list(queues) or None, refresh_s=refresh, once=once))
    except MtqError as exc:
        _fail(exc)


# -- completion ------------------------------------------------------------------
@cli.command()
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
def completion(shell: str) -> None:
    """Print the shell completion script for SHELL.

    \b
    bash:  eval "$(mtq completion bash)"     (add it to ~/.bashrc)
    zsh:   eval "$(mtq completion zsh)"      (add it to ~/.zshrc)
    fish:  mtq completion fish > ~/.config/fish/completions/mtq.fish
    """
    from click.shell_completion import get_completion_class

    cls = get_completion_class(shell)
    assert cls is not None  # the three choices are click's own
    click.echo(cls(cli, {}, "mtq", "_MTQ_COMPLETE").source())


# -- demo ------------------------------------------------------------------------
@cli.command()
@_redis_opt
@click.option("--users", default=24, show_default=True, type=click.IntRange(1, 500),
              help="Simulated users, each chatting in a stream of their own.")
@click.option("--duration", default=20.0, show_default=True, type=FloatRange(1, 600),
              help="Seconds over which the users arrive.")
@click.option("--no-kill", is_flag=True, help="Do not kill a worker mid-run.")
@click.option("--no-dashboard", is_flag=True,
              help="Print progress lines instead of the live dashboard.")
def demo(url: str | None, users: int, duration: float, no_kill: bool,
         no_dashboard: bool) -> None:
    """Run the whole product for about half a minute (the users arrive over
    --duration seconds, then the checks): a generator and an embedding model
    served by supervised worker processes, a crowd of users chatting in their
    own FIFO streams, a worker killed mid-run, the dashboard live; then a
    summary of what was checked. Leaves no process behind."""
    from mtq.broker.connection import resolve_url
    from mtq.demo import Tick, run

    try:
        resolved = resolve_url(url)
    except MtqError as exc:
        _fail(exc)
    common.console.print(f"[bold]mtq demo[/] on {resolved}")
    live_view = common.console.is_terminal and not no_dashboard
    last_line = [0.0]

    def plain_tick(t: Tick) -> None:
        if t.elapsed_s - last_line[0] >= 5 or t.finished == t.total:
            last_line[0] = t.elapsed_s
            common.console.print(f"  {t.elapsed_s:5.1f} s  submitted {t.submitted}/{t.total}, "
                          f"finished {t.finished}/{t.total}", highlight=False)

    try:
        if live_view:
            from mtq.dashboard.demo_view import DemoScreen

            with DemoScreen(common.console, resolved) as screen:
                report = run(resolved, users=users, duration_s=duration, kill_one=not no_kill,
                             on_tick=screen.tick)
        else:
            report = run(resolved, users=users, duration_s=duration, kill_one=not no_kill,
                         on_tick=plain_tick,
                         progress=lambda msg: common.console.print(f"  • {msg}", highlight=False))
    except MtqError as exc:
        _fail(exc)
    if report.skipped:
        fail(f"the demo needs torch: {report.skipped}", 2)
    _demo_summary(report)
    sys.exit(0 if report.ok else 1)


def _demo_summary(report: Any) -> None:
    """The demo's report: what ran, then one row per check saying what was found
    (each reads true whether it passed or not), then one line: did every check pass."""
    def found(ok: bool, text: str) -> str:
        return f"[green]{text}[/]" if ok else f"[bold red]{text}[/]"

    from rich.markup import escape
    from rich.table import Table

    table = Table(title="mtq demo: what happened", show_header=False)
    table.add_row("users", f"{report.users}, each in a FIFO stream of their own per queue")
    for name, part in (("chats (TinyGPT)", report.chat), ("embeddings (TinyEmbedder)",
                                                          report.embed)):
        other = f", other: {part.other}" if part.other else ""
        table.add_row(name, f"{part.succeeded}/{part.tasks} succeeded{other}; latency p50 "
                            f"{part.p50_ms:.0f} ms, p99 {part.p99_ms:.0f} ms")
    rate = report.tasks / report.seconds if report.seconds else 0.0
    table.add_row("throughput", f"{report.tasks} tasks in {report.seconds:.1f} s ({rate:.0f}/s "
                                f"while users arrived); {report.tokens:,} tokens streamed")
    if report.killed_pid:
        held, done = report.killed_held, report.killed_held_done
        if not held:
            what = "it held no task at that moment (its batch had just finished)"
        elif done == held:
            what = (f"it held {held} task{'s' if held != 1 else ''}: given back, run again, "
                    + found(True, f"all {held} completed"))
        else:
            what = f"it held {held} tasks: " + found(False, f"{held - done} did not complete")
        table.add_row("worker killed", f"pid {report.killed_pid} (SIGKILL); {what}")
    checks = report.checks()
    lost = report.tasks - report.succeeded
    table.add_row("tasks lost", found(
        checks["nothing lost"], f"none ({report.succeeded} of {report.tasks} succeeded)"
        if not lost else f"{lost} of {report.tasks} did not succeed"))
    table.add_row("tasks finished twice", found(
        checks["nothing finished twice"], "none" if not report.finished_twice
        else str(report.finished_twice)))
    table.add_row("order per user stream", found(
        checks["order per user stream"],
        "kept: each stream's tasks ran one at a time, in submit order" if report.order_ok
        else "broken: " + escape("; ".join(report.order_errors))))
    chats = report.chat.tasks
    table.add_row("streamed tokens", found(
        checks["streamed tokens = results"], f"spell the result of each of the {chats} chats"
        if not report.streamed_differ
        else f"differ from the result in {report.streamed_differ} of {chats} chats"))
    left = report.processes_left
    table.add_row("processes left behind", found(
        checks["no process left behind"], f"none (0 of {report.processes} started)" if not left
        else f"{len(left)} of {report.processes} started: pids "
             + ", ".join(map(str, left))))
    common.console.print(table)
    failed = [name for name, ok in checks.items() if not ok]
    if not failed:
        common.console.print(f"[bold green]All {len(checks)} checks passed.[/]")
    else:
        common.console.print(f"[bold red]{len(failed)} of {len(checks)} checks failed:[/] "
                      + ", ".join(failed) + ".")
    if not report.ok and report.log:
        common.err_console.print("[dim]supervisors' output (last lines):[/]")
        common.err_console.print(report.log, markup=False, highlight=False)


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="mtq")


if __name__ == "__main__":
    main()
