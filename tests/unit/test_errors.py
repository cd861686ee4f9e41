"""The one exception tree: every exception class defined anywhere in mtq derives from
MtqError, except control-flow exceptions that never reach a user (each listed here
with its reason). No Redis."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import mtq
import mtq.errors as errors

ROOT = Path(mtq.__file__).parent

#: exceptions that never reach a user, and why
INTERNAL = {
    # raised by the stop signal's handler while the worker is idle (waiting for
    # work) and caught by BatchWorker.work around its loop: it never leaves
    # mtq.rq.worker
    "mtq.rq.worker._Interrupted",
    # raised inside a load when the engine stops while it waits for room in the
    # budget, and caught by the engine command that loads: it never leaves mtq.workers.ops
    "mtq.workers.ops._Stopping",
}


def _modules() -> list[str]:
    names = ["mtq"]
    for info in pkgutil.walk_packages([str(ROOT)], prefix="mtq."):
        if info.name != "mtq.__main__":  # runs the command line when imported
            names.append(info.name)
    return sorted(names)


def _source(module: str) -> Path:
    path = ROOT.parent / Path(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _exception_classes() -> dict[str, type[BaseException]]:
    """Qualified name -> class of every exception class mtq's modules define."""
    found: dict[str, type[BaseException]] = {}
    for name in _modules():
        module = importlib.import_module(name)
        tree = ast.parse(_source(name).read_text("utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            obj = getattr(module, node.name, None) if node in tree.body else None
            if obj is None:  # a class defined inside a function: judged by its bases
                bases = [ast.unparse(b) for b in node.bases]
                assert not any(b.endswith(("Error", "Exception", "Exit")) for b in bases), (
                    f"{name}.{node.name} looks like an exception defined in a function "
                    "(no test can reach it): define it in mtq.errors")
                continue
            if isinstance(obj, type) and issubclass(obj, BaseException) \
                    and obj.__module__ == name:
                found[f"{name}.{node.name}"] = obj
    return found


def test_the_walk_finds_the_tree() -> None:
    found = _exception_classes()
    assert "mtq.errors.MtqError" in found and "mtq.errors.BatchShapeError" in found
    assert set(INTERNAL) <= set(found), f"allow-listed but gone: {set(INTERNAL) - set(found)}"


def test_every_exception_mtq_defines_is_an_mtq_error() -> None:
    outside = sorted(name for name, cls in _exception_classes().items()
                     if not issubclass(cls, errors.MtqError) and name not in INTERNAL)
    assert not outside, (
        f"exceptions a user can meet outside the MtqError tree: {outside}; derive them "
        "from MtqError (mtq.errors), or list them in INTERNAL with the reason")


def test_internal_ones_are_private() -> None:
    for name in INTERNAL:
        assert name.rsplit(".", 1)[1].startswith("_"), f"{name} is public: make it an MtqError"


@pytest.mark.parametrize("name, bases", [
    ("BatchShapeError", (ValueError, TypeError)),
    ("BatchArityError", (TypeError,)),
    ("JobRefused", ()),
    ("ResultNotStorable", (TypeError,)),
    ("InvalidArgument", (ValueError,)),
    ("TaskFinished", ()),
])
def test_moved_and_new_classes_keep_their_builtin_bases(name: str, bases: tuple[type, ...]
                                                        ) -> None:
    cls = getattr(errors, name)
    assert cls.__bases__ == (errors.MtqError, *bases)
    assert getattr(mtq, name) is cls and name not in mtq.__all__


def test_old_import_paths_still_work() -> None:
    from mtq.rq.batched import BatchArityError
    from mtq.rq.jobs import JobRefused, ResultNotStorable
    from mtq.workers.batching import BatchShapeError

    assert BatchShapeError is errors.BatchShapeError
    assert BatchArityError is errors.BatchArityError
    assert JobRefused is errors.JobRefused
    assert ResultNotStorable is errors.ResultNotStorable
