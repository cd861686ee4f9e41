"""A benchmark made of sections (``benchmarks.control``, ``benchmarks.flow``): each a
function ``measure_<name>(quick) -> dict`` of rows and targets, run all or by
``--only NAME``, printed, and written as one block of docs/benchmarks.md."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from benchmarks.harness.meters import machine_info
from benchmarks.harness.report import Results, cli_parser, docs_of, write_block
from benchmarks.harness.server import compile_tree


def run_sections(block: str, doc: str | None, takes: str,
                 sections: Mapping[str, Callable[[bool], dict[str, Any]]],
                 titles: Mapping[str, str], argv: Sequence[str] | None = None) -> int:
    """Run ``python -m benchmarks.BLOCK``: the sections asked for (all by default),
    the table printed, and the ``BLOCK`` block written when every section ran or
    ``--docs`` was given (a partial run would drop the other sections' rows).
    Returns the exit code: 1 if a target was missed."""
    ap = cli_parser(doc, takes)
    ap.add_argument("--only", action="append", choices=sorted(sections),
                    help="run only this section (repeatable)")
    args = ap.parse_args(argv)
    names = args.only or list(sections)
    docs = docs_of(args) if args.docs or set(names) == set(sections) else None
    compile_tree()
    results = Results(unjudged=args.quick)
    started = time.time()
    for name in names:
        results.section = titles.get(name, name)
        section = sections[name](args.quick)
        for row in section["rows"]:
            results.add(*row)
        for what, met, detail, comparable in section.get("targets", ()):
            results.target(what, met, detail, comparable)
    results.print(f"mtq {block} benchmark")
    if docs is not None:
        command = f"python -m benchmarks.{block}" + "".join(
            f" --only {n}" for n in names if set(names) != set(sections))
        load = os.getloadavg()[0]
        write_block(block, results.markdown(), command,
                    machine_info(None, f"load average {load:.1f} at the end"),
                    time.time() - started, docs)
    return 0 if all(met is not False for _, met, _ in results.targets) else 1
