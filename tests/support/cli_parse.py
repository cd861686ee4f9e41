"""Resolving an ``mtq`` command line with click, without running it (shared by the
tests of docker-compose.yml and of the README's commands)."""

from __future__ import annotations

import click
import pytest
from click.core import ParameterSource

from mtq.cli.main import cli


class Parsed:
    def __init__(self, path: tuple[str, ...], ctx: click.Context) -> None:
        self.path, self.ctx, self.params = path, ctx, ctx.params

    def given(self, param: str) -> bool:
        return self.ctx.get_parameter_source(param) == ParameterSource.COMMANDLINE


def parse_mtq(argv: list[str], where: str) -> Parsed:
    """Resolve ``argv`` (``mtq`` first) through the groups of ``mtq.cli.main:cli`` to its
    command and parse that command's arguments as click would, without running it.
    An unknown command or option, a missing argument or a bad value fails the test."""
    assert argv[:1] == ["mtq"], f"{where}: the command must start with 'mtq', got {argv!r}"
    cmd: click.Command = cli
    path = ["mtq"]
    args = list(argv[1:])
    parent: click.Context | None = None
    try:
        while isinstance(cmd, click.Group):
            ctx = cmd.make_context(path[-1], list(args), parent=parent)
            # a group parses its own options up to its first other word: the subcommand;
            # ctx.args holds what follows that word
            at = len(args) - len(ctx.args) - 1
            if at < 0 or args[at].startswith("-"):
                pytest.fail(f"{where}: '{' '.join(path)}' needs a subcommand "
                            f"({', '.join(cmd.list_commands(ctx))}); got {argv!r}")
            sub = cmd.get_command(ctx, args[at])
            if sub is None:
                pytest.fail(f"{where}: '{' '.join(path)}' has no command {args[at]!r} "
                            f"(it has {', '.join(cmd.list_commands(ctx))}); fix {argv!r}")
            path.append(args[at])
            cmd, args, parent = sub, list(ctx.args), ctx
        ctx = cmd.make_context(path[-1], list(args), parent=parent)
    except click.exceptions.Exit:
        problem = "only prints help or the version; give the real command"
    except click.ClickException as exc:
        problem = (f"is rejected by click: {exc.format_message()} "
                   f"(see 'mtq {' '.join(path[1:])} --help')")
    else:
        return Parsed(tuple(path), ctx)
    pytest.fail(f"{where}: {argv!r} {problem}")


