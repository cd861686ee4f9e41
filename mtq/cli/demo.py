"""``mtq demo``: the whole product for about half a minute, then a summary of what was
checked."""

from __future__ import annotations

import sys
from typing import Any

import click

from mtq.cli import common
from mtq.cli.common import FloatRange, fail, fail_on, redis_option
from mtq.errors import MtqError


@click.command()
@redis_option
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
        fail_on(exc)
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
        fail_on(exc)
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
