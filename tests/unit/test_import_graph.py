"""mtq's import graph, read with ast (nothing is imported): no cycle, and the arrows
between the rooms point down: cli, dashboard and contrib use the client and the
workers, which use the broker, which uses errors, settings, serialization and
validation; nothing below imports from above.

Every import counts: at the top of a module, inside a function, under
``if TYPE_CHECKING:``, and ``importlib.import_module("mtq....")`` with a literal
name. ``from mtq.x import y`` is an edge to ``mtq.x.y`` when ``y`` is a module of
its own, else to ``mtq.x``; importing a package is an edge to its ``__init__.py``.
Importing ``mtq.x.y`` runs ``mtq/__init__.py`` and ``mtq/x/__init__.py`` first, but
that is not counted as an edge (every module would then sit in a cycle with
``mtq/__init__.py``, which re-exports the public API).
"""

from __future__ import annotations

import ast
import itertools
from collections import deque
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import mtq

ROOT = Path(mtq.__file__).parent
BASE = ROOT.parent


@cache
def modules() -> dict[str, Path]:
    """Dotted name -> file of every module under mtq/ (a package by its __init__.py)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(BASE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def is_package(name: str) -> bool:
    return modules()[name].name == "__init__.py"


def _resolve(current: str, level: int, module: str | None) -> str:
    """The absolute name of a relative ``from`` import in module ``current``."""
    if level == 0:
        return module or ""
    package = current if is_package(current) else current.rpartition(".")[0]
    for _ in range(level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{module}" if module else package


def _known(name: str) -> str | None:
    """The mtq module ``name`` stands for: itself, or the nearest enclosing module
    (``mtq.x.attr`` -> ``mtq.x``); None outside mtq."""
    while name:
        if name in modules():
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(name: str) -> Iterator[tuple[str, int]]:
    """(imported mtq module, line) for every import in module ``name``."""
    tree = ast.parse(modules()[name].read_text("utf-8"), str(modules()[name]))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _known(alias.name)
                if target:
                    yield target, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, node.level, node.module)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                target = sub if sub in modules() else _known(base)
                if target:
                    yield target, node.lineno
        elif isinstance(node, ast.Call) and node.args and \
                isinstance(node.args[0], ast.Constant) and \
                isinstance(node.args[0].value, str) and \
                ast.unparse(node.func) in ("importlib.import_module", "import_module"):
            target = _known(node.args[0].value)
            if target:
                yield target, node.lineno


@cache
def graph() -> dict[str, dict[str, int]]:
    """module -> {imported module: first line}, mtq modules only, no self-edges."""
    out: dict[str, dict[str, int]] = {}
    for name in modules():
        edges: dict[str, int] = {}
        for target, line in imports_of(name):
            if target != name:
                edges[target] = min(line, edges.get(target, line))
        out[name] = edges
    return out


def strongly_connected(g: dict[str, dict[str, int]]) -> list[list[str]]:
    """The components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(g):
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(g[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return sorted(out)


def _shortest_path(g: dict[str, dict[str, int]], start: str, goal: str,
                   within: set[str]) -> list[str]:
    prev: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        if node == goal:
            path = [node]
            while prev[path[-1]] is not None:
                path.append(prev[path[-1]])  # type: ignore[arg-type]
            return path[::-1]
        for nxt in sorted(g[node]):
            if nxt in within and nxt not in prev:
                prev[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"no path {start} -> {goal} inside its component")


def cycles(g: dict[str, dict[str, int]]) -> list[list[str]]:
    """Cycles that together use every edge lying on a cycle: for each such edge a -> b,
    the shortest way back b -> ... -> a (duplicates, as rotations, dropped)."""
    out: list[list[str]] = []
    seen: set[tuple[str, ...]] = set()
    for component in strongly_connected(g):
        members = set(component)
        for a in component:
            for b in sorted(g[a]):
                if b not in members:
                    continue
                cycle = [a, *_shortest_path(g, b, a, members)]  # a, b, ..., a
                ring = cycle[:-1]
                turn = ring.index(min(ring))
                key = tuple(ring[turn:] + ring[:turn])
                if key not in seen:
                    seen.add(key)
                    out.append([*key, key[0]])
    return sorted(out)


def describe(cycle: list[str]) -> str:
    """``a.py:LINE -> b.py:LINE -> a.py``: each file with the line importing the next."""
    g = graph()
    steps = [f"{modules()[a].relative_to(BASE)}:{g[a][b]}"
             for a, b in itertools.pairwise(cycle)]
    return " -> ".join([*steps, str(modules()[cycle[-1]].relative_to(BASE))])


def test_no_import_cycle() -> None:
    found = cycles(graph())
    assert not found, (f"{len(found)} import cycle(s) in mtq/ (lazy and TYPE_CHECKING "
                       "imports count):\n" + "\n".join(describe(c) for c in found))


# -- the rooms ---------------------------------------------------------------------------
#: the rooms, by module name (the modules at the package root that re-export a room,
#: kept for the import paths the docs name, belong to that room)
ROOMS = {
    "foundation": ("mtq.errors", "mtq.settings", "mtq.serialization", "mtq.validation"),
    "broker": ("mtq.broker",),
    "observe": ("mtq.observe", "mtq.metrics", "mtq.trace", "mtq.tracing"),
    "client": ("mtq.client", "mtq.group", "mtq.replies", "mtq.admin"),
    "workers": ("mtq.workers",),
    "rq": ("mtq.rq",),
    "reference": ("mtq.reference",),
    "cli": ("mtq.cli",),
    "contrib": ("mtq.contrib",),
    "gateway": ("mtq.gateway",),
    "dashboard": ("mtq.dashboard",),
    "package": (),  # mtq/__init__.py: the public API, which imports client and workers
}

#: what each room must never import (rooms not named here import freely)
FORBIDDEN = {
    "foundation": {"broker", "client", "workers", "cli", "contrib", "dashboard", "package"},
    "broker": {"observe", "client", "workers", "rq", "reference", "cli", "contrib", "dashboard",
               "package"},
    "observe": {"client", "workers", "rq", "reference", "cli", "contrib", "dashboard", "package"},
    "client": {"workers", "rq", "reference", "cli", "contrib", "dashboard"},
    "workers": {"rq", "reference", "cli", "contrib", "dashboard"},
    "rq": {"reference", "cli", "contrib", "dashboard"},
    "reference": {"rq", "cli", "contrib", "dashboard"},
    # the OpenAI gateway is client-side: it submits and reads, never runs models
    "gateway": {"workers", "rq", "reference", "cli", "dashboard"},
}


def room(name: str) -> str | None:
    if name == "mtq":
        return "package"
    for r, prefixes in ROOMS.items():
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return r
    return None


def violations() -> list[str]:
    out = []
    for name, edges in sorted(graph().items()):
        mine = room(name)
        for target, line in sorted(edges.items()):
            theirs = room(target)
            if mine in FORBIDDEN and theirs in FORBIDDEN[mine]:
                out.append(f"{modules()[name].relative_to(BASE)}:{line} ({mine}) imports "
                           f"{target} ({theirs})")
    return out


def test_arrows_point_down() -> None:
    found = violations()
    assert not found, "imports against the rule of the rooms:\n" + "\n".join(found)


# -- the checker itself ------------------------------------------------------------------
def test_the_graph_sees_every_kind_of_import() -> None:
    g = graph()
    assert "mtq.broker.protocol" in g["mtq.broker.consumer"]             # top level
    assert "mtq.broker.connection" in g["mtq.cli.cancel"]                # in a function
    assert "mtq.rq" in g["mtq"]                                         # import_module
    assert "mtq.errors" in g["mtq.rq.jobs"] and "mtq.broker" not in g["mtq.broker.protocol"]
    # from a package, a name that is a module of its own: an edge to that module
    assert {"mtq.broker.lane", "mtq.broker.scripts", "mtq.broker.codes"} <= \
        set(g["mtq.broker.protocol"])


def test_cycles_are_found_and_named() -> None:
    g = {"a": {"b": 1}, "b": {"c": 2, "d": 5}, "c": {"a": 3}, "d": {"b": 4}, "e": {"a": 1}}
    assert strongly_connected(g) == [["a", "b", "c", "d"]]
    assert cycles(g) == [["a", "b", "c", "a"], ["b", "d", "b"]]
    assert cycles({"a": {"b": 1}, "b": {}}) == []
