"""The supported import paths, pinned: each one imports and exposes its names, and the
README, docs/*.md (their python code blocks) and examples/ import only from them.

A module that moves keeps its old path working (a re-export shim) as long as it is
listed here; a path missing from the list is not one users are told to import from.
No Redis needed.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

import mtq

ROOT = Path(__file__).resolve().parents[2]

#: module -> the names it must expose. The docs, README and examples import these
#: (or name them in prose, e.g. ``mtq.admin.snapshot``, ``mtq.replies.INBOX_MAX``)
SUPPORTED: dict[str, tuple[str, ...]] = {
    "mtq": tuple(mtq.__all__),
    "mtq.client": ("Queue", "Task", "Request", "TaskInfo", "TraceEntry", "Group", "Event",
                   "new_task_id", "MAX_TTL_S", "SUBMIT_CHUNK"),
    "mtq.group": ("Group",),
    "mtq.admin": ("snapshot", "queue_names", "find_task", "Snapshot", "QueueView", "load",
                  "unload", "reload", "reset"),
    "mtq.replies": ("INBOX_MAX", "INBOX_MAX_BYTES", "INBOX_TTL_S", "INBOX_KINDS", "ENDED",
                    "PARK_S", "RESYNC_S", "Event", "Hub", "hub_of", "decode_message"),
    "mtq.errors": ("MtqError", "TaskFailed", "ResultTimeout"),
    "mtq.settings": ("QueueSettings", "RedisSettings"),
    "mtq.serialization": ("dumps", "loads"),
    "mtq.workers.model": ("Model", "Progress"),
    "mtq.workers.generator": ("Generator", "Generation"),
    "mtq.workers.registry": ("list_workers",),
    "mtq.broker.registry": ("list_workers",),
    "mtq.workers.fetcher": ("AHEAD_WORK_S", "AHEAD_MOST"),
    "mtq.workers.outlet": (),
    "mtq.broker.embedded": ("EmbeddedServer",),
    "mtq.client.apikeys": ("ApiKey", "create", "list_keys", "revoke", "any_keys",
                           "authenticate", "admit"),
    "mtq.client.schedules": ("Schedule", "add", "put", "list_schedules", "remove", "get"),
    "mtq.broker.lane": (),
    "mtq.broker.scripts": (),
    "mtq.reference.gpt": ("TinyGPT",),
    "mtq.backends.hf": ("Embedder", "CrossEncoder"),
    "mtq.rq": ("batched",),
    "mtq.contrib.sse": ("EventStream", "headers", "http_error", "parse_last_event_id",
                        "stream_name"),
    "mtq.contrib.web": ("BadHeader", "DEADLINE_HEADER", "PRIORITY_HEADER", "tenant_name"),
    "mtq.contrib.asgi": ("EventStreamResponse", "Submit", "TaskRoutes", "add_error_handlers",
                         "submitter", "user_stream", "user_tenant", "request_priority"),
    "mtq.contrib.flask": ("MTQ", "user_stream", "user_tenant", "request_priority"),
    "mtq.contrib.django": ("MtqSettingsError", "event_stream", "user_tenant",
                           "request_priority"),
    "mtq.contrib.django.middleware": ("MtqErrorMiddleware",),
    "mtq.gateway": ("create_app",),
    "mtq.dashboard.web": ("create_dashboard",),
}

#: the third-party package a supported module needs (an optional extra)
NEEDS = {
    "mtq.contrib.asgi": "starlette",
    "mtq.contrib.flask": "flask",
    "mtq.contrib.django": "django",
    "mtq.contrib.django.middleware": "django",
    "mtq.gateway": "starlette",
    "mtq.dashboard.web": "jinja2",
}


@pytest.mark.parametrize("module", sorted(SUPPORTED))
def test_each_supported_path_imports_and_exposes_its_names(module: str) -> None:
    if module in NEEDS:
        pytest.importorskip(NEEDS[module])
    mod = importlib.import_module(module)
    missing = [n for n in SUPPORTED[module] if not hasattr(mod, n)]
    assert not missing, f"{module} no longer exposes {missing}"


def _code_blocks(path: Path) -> list[tuple[int, str]]:
    """(first line number, code) of each python code block of a markdown file."""
    out = []
    text = path.read_text()
    for m in re.finditer(r"^```python[^\n]*\n(.*?)^```", text, re.S | re.M):
        out.append((text.count("\n", 0, m.start(1)) + 1, m.group(1)))
    return out


def _sources() -> list[tuple[str, int, str]]:
    """(file, first line, code): the README's and docs' python blocks, the examples."""
    out = []
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for line, code in _code_blocks(md):
            out.append((str(md.relative_to(ROOT)), line, code))
    for py in sorted((ROOT / "examples").rglob("*.py")):
        out.append((str(py.relative_to(ROOT)), 1, py.read_text()))
    return out


def _mtq_imports(code: str) -> list[tuple[int, str, list[str]]]:
    """(line offset, module, imported names) of each import of mtq in ``code``; a block
    that is not valid Python on its own is read line by line with a pattern."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        found = []
        for i, line in enumerate(code.splitlines()):
            m = re.match(r"\s*from\s+(mtq[\w.]*)\s+import\s+\(?([\w\s,]+)", line)
            if m:
                names = [n.strip().split(" as ")[0] for n in m.group(2).split(",") if n.strip()]
                found.append((i, m.group(1), names))
            for mod in re.findall(r"^\s*import\s+(mtq[\w.]*)", line):
                found.append((i, mod, []))
        return found
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "mtq":
            found.append((node.lineno - 1, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "mtq":
                    found.append((node.lineno - 1, a.name, []))
    return found


def test_the_docs_and_examples_import_only_supported_paths() -> None:
    wrong = []
    for where, first, code in _sources():
        for offset, module, names in _mtq_imports(code):
            at = f"{where}:{first + offset}"
            if module not in SUPPORTED:
                # ``from mtq import rq``: a supported module imported by its parent
                wrong.append(f"{at}: imports {module}, not a supported path")
                continue
            for n in names:
                if n not in SUPPORTED[module] and f"{module}.{n}" not in SUPPORTED:
                    wrong.append(f"{at}: imports {n} from {module}, which does not list it")
    assert not wrong, "unsupported imports in the docs or examples:\n" + "\n".join(wrong)


def test_the_docs_name_only_public_attributes_of_mtq() -> None:
    """``mtq.X`` in a python block or an example (after ``import mtq``) is in mtq.__all__
    or a supported module."""
    wrong = []
    for where, first, code in _sources():
        try:
            tree = ast.parse(code)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id == "mtq" and node.attr not in mtq.__all__ \
                    and f"mtq.{node.attr}" not in SUPPORTED:
                wrong.append(f"{where}:{first + node.lineno - 1}: mtq.{node.attr}")
    assert not wrong, "names of mtq that are not public:\n" + "\n".join(wrong)


def test_the_dotted_paths_the_docs_name_resolve() -> None:
    """``mtq.admin.snapshot``, ``mtq.replies.INBOX_MAX`` ... in the README and docs:
    each one under a supported module resolves (``mtq.X`` alone is left out: the docs
    use such names for span names and system check ids too)."""
    wrong = []
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = md.read_text()
        for m in re.finditer(r"`(mtq(?:\.\w+)+)`", text):
            dotted = m.group(1)
            module, _, attr = dotted.rpartition(".")
            if dotted in SUPPORTED or module not in SUPPORTED or module == "mtq":
                continue
            if module in NEEDS and importlib.util.find_spec(NEEDS[module]) is None:
                continue
            if not hasattr(importlib.import_module(module), attr):
                line = text.count("\n", 0, m.start()) + 1
                wrong.append(f"{md.relative_to(ROOT)}:{line}: {dotted}")
    assert not wrong, "paths named in the docs that do not resolve:\n" + "\n".join(wrong)


def test_import_mtq_alone_reaches_the_modules_it_always_reached() -> None:
    """``import mtq`` then ``mtq.replies.INBOX_MAX`` / ``mtq.group.Group`` / ``mtq.rq``,
    with no import of those modules: in a fresh interpreter, as a user's script does."""
    code = ("import mtq; assert mtq.replies.INBOX_MAX > 0; assert mtq.group.Group; "
            "assert mtq.rq.batched; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "ok", out.stderr
