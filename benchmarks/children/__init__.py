"""Processes the benchmarks start: worker targets (``benchmarks.children.noop:handle``)
and programs run with ``python -m benchmarks.children.NAME`` or, for the ones that run
against an older tree (benchmarks.against, .instructions, .threads), by file path with
that tree first on the import path: those import only what every tree has."""
