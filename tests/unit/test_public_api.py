"""The public surface of ``mtq``: pinned so that changes to it are deliberate."""

from __future__ import annotations

import inspect
import re

import mtq
import mtq.errors as errors

EXPECTED_ALL = [
    "BadRequest",
    "BrokerError",
    "Chain",
    "ChainError",
    "ChainFailed",
    "Claimed",
    "ConfigError",
    "Consumer",
    "Costed",
    "CurrentTask",
    "DeviceOutOfMemory",
    "DuplicateTask",
    "EncodeError",
    "Event",
    "GatewayUnprotected",
    "Generation",
    "Generator",
    "Group",
    "HostFileError",
    "InvalidName",
    "LeaseLost",
    "Model",
    "MtqError",
    "NotDurable",
    "Option",
    "OptionError",
    "Outcome",
    "PayloadError",
    "PayloadTooLarge",
    "PermanentError",
    "Progress",
    "Queue",
    "QueueFull",
    "QueueInUse",
    "RateLimited",
    "RedisAuthError",
    "RedisTLSError",
    "RedisUnavailable",
    "QueueSettings",
    "RedisSettings",
    "Request",
    "Step",
    "ResultTimeout",
    "ServerNotFound",
    "TargetError",
    "Task",
    "TaskCancelled",
    "TaskFailed",
    "TaskInfo",
    "TaskNotFound",
    "TaskTimeout",
    "WouldMissDeadline",
    "current_task",
    "__version__",
    "local",
]


def _exception_classes() -> dict[str, type[BaseException]]:
    return {
        name: obj for name, obj in vars(errors).items()
        if inspect.isclass(obj) and issubclass(obj, BaseException)
        and obj.__module__ == errors.__name__
    }


def test_all_is_pinned():
    assert mtq.__all__ == EXPECTED_ALL
    assert len(set(mtq.__all__)) == len(mtq.__all__), "duplicates in mtq.__all__"


def test_every_public_name_resolves():
    for name in mtq.__all__:
        assert hasattr(mtq, name), f"mtq.{name} is in __all__ but missing"
        assert getattr(mtq, name) is not None


def test_star_import_gives_exactly_all():
    ns: dict[str, object] = {}
    exec("from mtq import *", ns)
    assert set(ns) - {"__builtins__"} == set(mtq.__all__)


def test_version_is_a_string():
    assert isinstance(mtq.__version__, str) and re.fullmatch(r"\d+\.\d+\.\d+.*", mtq.__version__)


def test_every_error_is_exported_from_the_package():
    classes = _exception_classes()
    assert classes, "no exception classes found in mtq.errors"
    for name, cls in classes.items():
        assert getattr(mtq, name, None) is cls, f"mtq.{name} is not mtq.errors.{name}"
    assert set(errors.__all__) == set(classes)


def test_every_exception_derives_from_mtq_error():
    for name, cls in _exception_classes().items():
        assert issubclass(cls, errors.MtqError), f"{name} does not derive from MtqError"


def test_documented_extra_bases():
    assert issubclass(errors.ConfigError, ValueError)
    assert issubclass(errors.InvalidName, ValueError)
    assert issubclass(errors.PayloadError, ValueError)
    assert issubclass(errors.EncodeError, TypeError)
    assert issubclass(errors.TaskNotFound, LookupError)
    assert issubclass(errors.ResultTimeout, TimeoutError)


def _docstring_tree() -> dict[str, str | None]:
    """name -> parent name, parsed from the box-drawing tree in mtq.errors' docstring."""
    doc = errors.__doc__ or ""
    tree: dict[str, str | None] = {}
    stack: list[tuple[int, str]] = []  # (column of the name, name)
    for line in doc.splitlines():
        m = re.match(r"^(\s*(?:[│ ]*(?:├── |└── ))?)([A-Z]\w*)(?:\s|$)", line)
        # tree lines: the root ("MtqError" alone) or a branch ("├── Name", "└── Name")
        if not m or not ("── " in line or line.strip() == m.group(2)):
            continue
        col, name = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= col:
            stack.pop()
        tree[name] = stack[-1][1] if stack else None
        stack.append((col, name))
    return tree


def test_docstring_tree_lists_every_exception():
    tree = _docstring_tree()
    assert set(tree) == set(_exception_classes()), (
        f"in the tree but not defined: {sorted(set(tree) - set(_exception_classes()))}; "
        f"defined but not in the tree: {sorted(set(_exception_classes()) - set(tree))}")


def test_docstring_tree_matches_inheritance():
    classes = _exception_classes()
    for name, parent in _docstring_tree().items():
        cls = classes[name]
        mtq_bases = [b for b in cls.__bases__ if b.__module__ == errors.__name__]
        if parent is None:
            assert name == "MtqError" and not mtq_bases
        else:
            assert mtq_bases == [classes[parent]], (
                f"{name}'s mtq base is {mtq_bases}, the docstring says {parent}")


def test_error_messages_carry_context():
    full = errors.QueueFull("embed", 10, 10, 2)
    assert "embed" in str(full) and "max_length" in str(full) and full.waiting == 10
    failed = errors.TaskFailed("abc", "dead", "ValueError: x")
    assert failed.status == "dead" and "ValueError: x" in str(failed)
    timeout = errors.ResultTimeout("abc", 1.5, "queued")
    assert "1.5s" in str(timeout) and "queued" in str(timeout)
    lost = errors.LeaseLost(["a", "b"])
    assert lost.task_ids == ["a", "b"] and "lease_ms" in str(lost)


def test_mtq_rq_is_reachable_lazily_without_importing_rq() -> None:
    import subprocess
    import sys

    code = ("import sys, mtq; assert 'mtq.rq' not in sys.modules; "
            "f = mtq.rq.batched(lambda xs: xs); assert f(5) == 5; "
            "assert 'rq' not in sys.modules, 'mtq.rq imported the rq package'; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "ok", out.stderr
