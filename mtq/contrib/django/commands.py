"""``manage.py mtq_status`` and ``manage.py mtq_workers``: mtq's own click commands
(``mtq status``, ``mtq workers start``), every option of theirs, with the project's
settings as defaults.

``--redis`` defaults to ``MTQ["REDIS_URL"]`` (else ``MTQ_REDIS_URL``, else the
embedded server, as for ``mtq``), ``--queue`` to ``MTQ["QUEUE"]`` and the target of
``mtq_workers`` to ``MTQ["WORKERS"]``; the command line wins. Exit codes are mtq's
(5: Redis unreachable, 2: usage). Django's own ``--settings`` and ``--pythonpath``
are taken by ``manage.py`` before the command runs; other Django options
(``--verbosity``) are not these commands'.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from mtq.contrib.django.conf import get_settings, redis_url

#: options manage.py reads itself before any command runs
DJANGO_OPTIONS = ("--settings", "--pythonpath")


def _strip_django_options(args: list[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg in DJANGO_OPTIONS:
            skip = True
            continue
        if arg.startswith(tuple(o + "=" for o in DJANGO_OPTIONS)):
            continue
        out.append(arg)
    return out


class ClickCommand(BaseCommand):
    """A management command that runs one of mtq's click commands."""

    #: the command reports Redis problems itself (exit 5), and must run while Redis
    #: is down (mtq_workers waits for it with --wait), so no system checks first
    requires_system_checks: list[str] = []

    def click_command(self) -> Any:
        raise NotImplementedError

    def run_from_argv(self, argv: list[str]) -> None:
        """``manage.py <name> ARGS``: click parses ARGS and exits with mtq's exit code."""
        prog = f"{argv[0].rsplit('/', 1)[-1]} {argv[1]}"
        self.click_command().main(args=_strip_django_options(argv[2:]), prog_name=prog,
                                  standalone_mode=True)

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        """``call_command`` parses with it: every argument is the click command's, as
        given (argparse would reorder options and positionals)."""
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        self._prog = f"{prog_name} {subcommand}"
        base = parser.parse_args

        def parse_args(args: Any = None, namespace: Any = None) -> Any:
            ns = base([], namespace)
            ns.args = list(args or ())
            return ns

        parser.parse_args = parse_args
        return parser

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("args", nargs="*", help="the arguments of the mtq command")

    def print_help(self, prog_name: str, subcommand: str) -> None:
        """``manage.py help <name>``: the click command's help."""
        self.click_command().main(args=["--help"], prog_name=f"{prog_name} {subcommand}",
                                  standalone_mode=False)

    def handle(self, *args: str, **options: Any) -> None:
        """``call_command(name, *args)``: the arguments go to the click command; a
        non-zero exit is a CommandError with that returncode."""
        try:
            self.click_command().main(args=list(args), prog_name=getattr(self, "_prog", ""),
                                      standalone_mode=False)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if code:
                raise CommandError(f"exited {code}", returncode=code) from None
        except Exception as exc:
            from click import ClickException

            if isinstance(exc, ClickException):
                raise CommandError(exc.format_message(), returncode=exc.exit_code) from None
            raise


def queue_default() -> str:
    return get_settings().queue


def status_command() -> Any:
    """``mtq status`` with the project's Redis."""
    from mtq.cli.common import with_defaults
    from mtq.cli.status import status

    return with_defaults(status, "mtq_status", url=redis_url)


def workers_command() -> Any:
    """``mtq workers start`` with the project's Redis, queue and (if set) target."""
    from mtq.cli.common import with_defaults
    from mtq.cli.workers import workers_start

    defaults: dict[str, Callable[[], Any]] = {"url": redis_url, "queue": queue_default}
    target = get_settings().workers
    if target is not None:
        defaults["target"] = lambda: target
    return with_defaults(workers_start, "mtq_workers", **defaults)

