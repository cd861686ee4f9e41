"""Rows of figures, the console table, and the writer of docs/benchmarks.md's blocks.

docs/benchmarks.md is hand-written; a benchmark owns only the block between its
markers, which :func:`write_block` replaces::

    <!-- bench:broker:start -->
    (generated: date, command, machine, then the table)
    <!-- bench:broker:end -->
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness.server import ROOT

DOCS = ROOT / "docs" / "benchmarks.md"


def fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if float(value).is_integer() and abs(value) < 100:
        return str(int(value))
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"


@dataclass
class Row:
    name: str
    figure: float | None
    unit: str
    note: str = ""
    section: str = ""


@dataclass
class Results:
    """The rows of a run and its targets. A verdict is True (met), False (not met) or
    None: not judged, because a quick run's figures are not comparable (``unjudged``)."""

    rows: list[Row] = field(default_factory=list)
    targets: list[tuple[str, bool | None, str]] = field(default_factory=list)
    section: str = ""
    unjudged: bool = False

    def add(self, name: str, figure: float | None, unit: str, note: str = "") -> float | None:
        self.rows.append(Row(name, figure, unit, note, self.section))
        return figure

    def target(self, what: str, met: bool, detail: str, comparable: bool = False) -> str:
        """Record a target's verdict; ``comparable``: the figure does not depend on the
        run's sizes (a count, memory per task), so a quick run judges it too."""
        verdict: bool | None = met if comparable or not self.unjudged else None
        self.targets.append((what, verdict, detail))
        return f"target {what}: {WORDS[verdict]}"

    def markdown(self) -> list[str]:
        lines = ["| measurement | figure | unit | target, floor, notes |", "|---|---:|---|---|"]
        section = None
        for row in self.rows:
            if row.section != section:
                section = row.section
                lines.append(f"| **{_cell(section)}** | | | |")
            name = ("&nbsp;&nbsp;" if row.name.startswith("  ") else "") + row.name.strip()
            lines.append(f"| {_cell(name)} | {fmt(row.figure)} | {row.unit} | {_cell(row.note)} |")
        if self.targets:
            lines += ["", self.verdicts()]
        return lines

    def verdicts(self) -> str:
        """One line: how many targets were met, and which were not (or not judged)."""
        out = f"Targets: {sum(1 for _, met, _ in self.targets if met)} met"
        for verdict, word in ((False, "not met"), (None, "not judged (quick run)")):
            missed = [what for what, met, _ in self.targets if met is verdict]
            if missed:
                out += f"; {word}: " + "; ".join(missed)
        return out + "."

    def print(self, title: str) -> None:
        print(title)
        section = None
        for row in self.rows:
            if row.section != section:
                section = row.section
                print(f"\n{section}")
            print(f"  {row.name:<72} {fmt(row.figure):>10} {row.unit:<12} {row.note}")
        for what, met, detail in self.targets:
            print(f"  [{WORDS[met]}] {what}: {detail}")


WORDS = {True: "met", False: "NOT MET", None: "not judged (quick run)"}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markers(area: str) -> tuple[str, str]:
    return f"<!-- bench:{area}:start -->", f"<!-- bench:{area}:end -->"


def write_block(area: str, lines: Sequence[str], command: str, machine: str,
                seconds: float | None = None, path: Path = DOCS) -> None:
    """Replace the block of ``area`` in ``path`` with the run's line (date, command,
    machine, time) and ``lines``. The markers must be there: the prose around them is
    the doc's, and a benchmark adds no section of its own."""
    start, end = markers(area)
    text = path.read_text(encoding="utf-8")
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    if not pattern.search(text):
        raise SystemExit(f"{path} has no {start} ... {end} block")
    took = f", {seconds:.0f} s" if seconds is not None else ""
    head = f"{dt.date.today().isoformat()}, `{command}`{took}. Machine: {machine}."
    block = "\n".join([start, head, "", *lines, end])
    path.write_text(pattern.sub(lambda _m: block, text, count=1), encoding="utf-8")
    print(f"wrote the {area} block of {path}")


def cli_parser(doc: str | None, quick_time: str) -> argparse.ArgumentParser:
    """A parser with the options every benchmark takes (``--quick``, ``--docs PATH``,
    ``--no-docs``); a benchmark adds its own, then reads the docs file with
    :func:`docs_of`."""
    ap = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"smaller sizes ({quick_time}); does not write docs unless --docs")
    ap.add_argument("--docs", type=Path, default=None,
                    help="markdown file to update (default: docs/benchmarks.md on a full run)")
    ap.add_argument("--no-docs", action="store_true", help="only print the table")
    return ap


def docs_of(args: argparse.Namespace) -> Path | None:
    """The markdown file a run writes its block to: none with ``--no-docs``, and none
    for a ``--quick`` run unless ``--docs`` names one."""
    if args.no_docs:
        return None
    return args.docs or (None if args.quick else DOCS)


def cli_args(argv: Sequence[str] | None, doc: str | None, quick_time: str
             ) -> tuple[bool, Path | None]:
    """(quick?, markdown file to update or None) for a benchmark with no options of its
    own."""
    args = cli_parser(doc, quick_time).parse_args(argv)
    return args.quick, docs_of(args)
