"""The ``mtq`` command: a thin click layer over library calls, with rich output.

This module holds the root group, ``mtq server``, ``mtq dashboard`` and ``mtq
completion``; every other command family lives in a module of its own (see
:data:`LAZY`), loaded when it is run or listed."""

from __future__ import annotations

import importlib
import json
import logging
import sys

import click

from mtq.cli import common
from mtq.cli.common import EXIT_CODES, FloatRange, fail_on, redis_option, running_server
from mtq.errors import MtqError

#: the commands defined in other modules (one per command family), imported when one
#: of them is run or listed, so that ``mtq worker run`` starts without the rest of the
#: CLI (rich's tables, the rq bridge, the exporter)
LAZY = {
    "worker": "mtq.cli.workers:worker",
    "workers": "mtq.cli.workers:workers",
    "submit": "mtq.cli.submit:submit",
    "status": "mtq.cli.status:status",
    "task": "mtq.cli.status:task",
    "cancel": "mtq.cli.cancel:cancel",
    "purge": "mtq.cli.cancel:purge",
    "dlq": "mtq.cli.dlq:dlq",
    "queue": "mtq.cli.queues:queue_group",
    "metrics": "mtq.cli.metrics:metrics_group",
    "trace": "mtq.cli.trace:trace_command",
    "rq": "mtq.cli.rq:rq_group",
    "models": "mtq.cli.models:models",
    "keys": "mtq.cli.keys:keys",
    "schedule": "mtq.cli.schedule:schedule",
    "demo": "mtq.cli.demo:demo",
    "serve": "mtq.cli.serve:serve",
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
      mtq dashboard --web                        the same in the browser
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
        fail_on(exc)
    common.console.print(f"embedded redis-server running at [bold]{url}[/]")


@server.command("stop")
def server_stop() -> None:
    """Stop the embedded server (its append-only file keeps the data)."""
    from mtq.broker.embedded import EmbeddedServer

    try:
        stopped = EmbeddedServer.from_env().stop()
    except MtqError as exc:
        fail_on(exc)
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


# -- dashboard -------------------------------------------------------------------
@cli.command()
@click.option("--queue", "-q", "queues", multiple=True,
              help="Only this queue (repeatable; default: every queue). Terminal only.")
@click.option("--refresh", default=1.0, show_default=True, type=FloatRange(0.2, 60),
              help="Seconds between refreshes.")
@click.option("--once", is_flag=True, help="Print one frame and exit. Terminal only.")
@click.option("--web", is_flag=True,
              help="Serve the web dashboard instead (needs the web extra; docs/dashboard.md).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="With --web: address to listen on. Beyond loopback, payloads, results "
                   "and tokens are shown to signed-in admins only.")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535),
              help="With --web: port to listen on.")
@click.option("--origin", default=None, metavar="URL",
              help="With --web: the dashboard's public origin (https://host[:port]) behind "
                   "a proxy that changes the Host header, for the actions' cross-site check.")
@redis_option
def dashboard(queues: tuple[str, ...], refresh: float, once: bool, web: bool, host: str,
              port: int, origin: str | None, url: str | None) -> None:
    """Live view of queues, workers, failures and throughput (q or Ctrl-C quits).
    Reads one cheap snapshot per refresh, whatever the number of tasks.

    With --web, the same in the browser at http://HOST:PORT/ (charts, tenants,
    workers, a page per queue and per task, dead letters), live over server-sent
    events; one snapshot per refresh whatever the number of viewers."""
    if not web and origin is not None:
        common.fail("--origin is for the web dashboard (--web)", common.USAGE)
    if web:
        if queues or once:
            common.fail("--queue and --once are for the terminal dashboard; the web one "
                        "shows every queue, a page each", common.USAGE)
        from mtq.cli.webdash import run_web

        sys.exit(run_web(running_server(url), host, port, refresh, origin=origin))
    from mtq.dashboard.app import run

    url = running_server(url)
    try:
        sys.exit(run(url, list(queues) or None, refresh_s=refresh, once=once))
    except MtqError as exc:
        fail_on(exc)


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




def main() -> None:
    """Console-script entry point."""
    cli(prog_name="mtq")


if __name__ == "__main__":
    main()
