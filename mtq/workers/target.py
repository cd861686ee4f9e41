"""Loading a worker target named ``package.module:attr``.

A target is a :class:`~mtq.workers.model.Model` subclass (or instance) or a plain
function. Every mistake is a :class:`~mtq.errors.TargetError` raised at start-up,
which the supervisor reports once instead of restarting into a crash loop.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Any

from mtq.errors import OptionError, TargetError
from mtq.workers.generator import Generator
from mtq.workers.model import FunctionModel, Model
from mtq.workers.options import apply as apply_options
from mtq.workers.options import resolve as resolve_options

Target = Model | Generator

#: short module names of the targets mtq ships: ``hf:CausalLM`` is
#: ``mtq.backends.hf:CausalLM``
ALIASES = {"hf": "mtq.backends.hf"}


def add_app_dir(path: str | os.PathLike[str] = ".") -> str:
    """Make the code under ``path`` importable as targets, as ``rq worker``, ``celery -A``
    and ``uvicorn`` do for the current directory: first on ``sys.path`` here, and on
    ``PYTHONPATH`` for every process started from here on (worker processes, the fork
    server, a generator's outlet). Returns the absolute path."""
    full = os.path.abspath(path)
    if not os.path.isdir(full):
        raise TargetError(f"--app-dir {path!r} is not a directory")
    if full in sys.path:
        sys.path.remove(full)
    sys.path.insert(0, full)
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != full]
    os.environ["PYTHONPATH"] = os.pathsep.join([full, *rest])
    return full


def _split(spec: str) -> tuple[str, str]:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise TargetError(f"bad target {spec!r}: write it as package.module:attr, "
                          "e.g. myapp.models:Embedder")
    return ALIASES.get(module_name, module_name), attr


def _not_found_hint() -> str:
    return (f" (mtq looks in the current directory, {os.getcwd()}, and on PYTHONPATH: "
            "run it from the directory that holds the code, or pass --app-dir DIR)")


def find_target_module(spec: str) -> None:
    """Check that ``spec`` is well formed and its module can be found, without
    running the module (a supervisor imports it in its worker processes only).
    Raises TargetError."""
    module_name, _ = _split(spec)
    try:
        found = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as exc:  # a parent package is missing or broken
        found, error = None, f"{type(exc).__name__}: {exc}"
    else:
        error = f"ModuleNotFoundError: No module named {module_name!r}"
    if found is None:
        raise TargetError(f"cannot import {module_name!r} for target {spec!r}: "
                          f"{error}{_not_found_hint()}")


def _resolve(spec: str, reload: bool = False) -> Any:
    module_name, attr = _split(spec)
    try:
        if reload and module_name in sys.modules:
            module = importlib.reload(sys.modules[module_name])
        else:
            module = importlib.import_module(module_name)
    except Exception as exc:
        hint = ""
        if isinstance(exc, ModuleNotFoundError) and exc.name and \
                module_name.startswith(exc.name):
            hint = _not_found_hint()
        raise TargetError(f"cannot import {module_name!r} for target {spec!r}: "
                          f"{type(exc).__name__}: {exc}{hint}") from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise TargetError(f"module {module_name!r} has no attribute {attr!r} "
                              f"(target {spec!r})") from None
    return obj


def load_target(spec: str) -> Any:
    """Import ``package.module:attr`` and return the attribute, which must be callable.

    Raises TargetError when the spec is malformed, the module cannot be imported or
    the attribute is missing or not callable.
    """
    obj = _resolve(spec)
    if not callable(obj):
        raise TargetError(f"target {spec!r} is a {type(obj).__name__}, not a callable")
    return obj


@dataclass(frozen=True)
class BatchPolicy:
    """How a worker batches and guards one model (class attributes, then overrides)."""

    max_batch_size: int
    max_wait_ms: float
    timeout_s: float | None

    @classmethod
    def of(cls, model: Target, *, max_batch_size: int | None = None,
           max_wait_ms: float | None = None, timeout_s: float | None = None) -> BatchPolicy:
        """Read the model's attributes, apply the overrides that are not None, check them.
        For a generator, the batch size is ``max_running`` and there is no wait.

        Raises TargetError naming the bad value."""
        name = model.describe()[0]
        if isinstance(model, Generator):
            b = model.max_running if max_batch_size is None else max_batch_size
            w: Any = 0.0
            for attr in ("max_prefill_tokens", "max_total_tokens"):
                v = getattr(model, attr)
                if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                    raise TargetError(f"{name}: {attr} must be an int >= 1 or None, got {v!r}")
        else:
            b = model.max_batch_size if max_batch_size is None else max_batch_size
            w = model.max_wait_ms if max_wait_ms is None else max_wait_ms
        t = model.timeout_s if timeout_s is None else timeout_s
        if not isinstance(b, int) or isinstance(b, bool) or not 1 <= b <= 100_000:
            raise TargetError(f"{name}: max_batch_size must be an int in 1..100000, got {b!r}")
        if not isinstance(w, (int, float)) or isinstance(w, bool) or not 0 <= w <= 60_000:
            raise TargetError(f"{name}: max_wait_ms must be a number in 0..60000, got {w!r}")
        if t is not None and (not isinstance(t, (int, float)) or isinstance(t, bool) or t <= 0):
            raise TargetError(f"{name}: timeout_s must be a positive number or None, got {t!r}")
        return cls(b, float(w), None if t is None else float(t))


def load_model(spec: str, *, reload: bool = False,
               options: dict[str, str] | None = None) -> Target:
    """Import the target and turn it into a :class:`Model` or
    :class:`~mtq.workers.generator.Generator` instance (not set up yet), with its
    ``options`` (``--set`` text values, see :mod:`mtq.workers.options`) set.

    ``reload``: re-import the module first (the ``reload`` control command).
    Raises TargetError for anything that is not a Model subclass, a Model instance
    or a plain callable, or a Model class that cannot be constructed without
    arguments; OptionError (a TargetError) for options it does not take.
    """
    model = _instance(spec, reload)
    if isinstance(model, FunctionModel):
        if options:
            raise OptionError(f"target {spec!r} is a plain function: it declares no options "
                              f"(--set {next(iter(options))}=...); make it an mtq.Model "
                              "that declares them with mtq.Option")
        return model
    return apply_options(model, options or {}, text=True, name=spec)


def check_options(spec: str, options: dict[str, str]) -> None:
    """Import the target (without constructing it) and check ``options`` against what
    it declares: OptionError before any process starts."""
    obj = _resolve(spec)
    if isinstance(obj, (type, Model, Generator)) and not (
            isinstance(obj, type) and not issubclass(obj, (Model, Generator))):
        resolve_options(obj, options, text=True, name=spec)
    elif options:
        raise OptionError(f"target {spec!r} is not an mtq.Model or mtq.Generator: it "
                          f"declares no options (--set {next(iter(options))}=...)")


def _instance(spec: str, reload: bool) -> Target:
    obj = _resolve(spec, reload)
    if isinstance(obj, type):
        if not issubclass(obj, (Model, Generator)):
            if callable(getattr(obj, "decode", None)) and callable(getattr(obj, "prefill", None)):
                raise TargetError(f"target {spec!r}: class {obj.__name__} has prefill and decode "
                                  "methods but does not subclass mtq.Generator; write "
                                  f"'class {obj.__name__}(mtq.Generator)'")
            if callable(getattr(obj, "predict", None)):
                raise TargetError(f"target {spec!r}: class {obj.__name__} has a predict method "
                                  "but does not subclass mtq.Model; write "
                                  f"'class {obj.__name__}(mtq.Model)'")
            raise TargetError(f"target {spec!r} is a class that is not an mtq.Model")
        try:
            return obj()
        except Exception as exc:
            raise TargetError(f"target {spec!r}: {obj.__name__}() failed: "
                              f"{type(exc).__name__}: {exc} (load weights in setup(), "
                              "and give __init__ no required arguments)") from exc
    if isinstance(obj, (Model, Generator)):
        return obj
    if callable(obj):
        return FunctionModel(obj)
    raise TargetError(f"target {spec!r} is a {type(obj).__name__}, not an mtq.Model "
                      "or a function")
