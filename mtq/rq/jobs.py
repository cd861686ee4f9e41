"""Reading RQ jobs safely and running them: serializer choice, pickle refusal, the
functions' resolution (plain, batched, mtq.Model) and the outcome of each job.

Nothing here writes to Redis; :mod:`mtq.rq.worker` claims, prepares and finishes.
"""

from __future__ import annotations

import asyncio
import traceback
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, ClassVar, cast

from rq.job import Job, Retry
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.serializers import JSONSerializer, PickleSerializer

from mtq.errors import JobRefused as JobRefused  # defined there; imported from here too
from mtq.errors import ResultNotStorable
from mtq.rq.batched import BatchArityError, Batched, batched_spec, check_arity

PICKLE_REFUSED = (
    "this job was pickled; mtq rq worker refuses pickled jobs because unpickling runs "
    "code that anyone with write access to Redis chose. Enqueue with "
    "Queue(..., serializer=JSONSerializer) (from rq.serializers import JSONSerializer), "
    "or start the worker with --serializer pickle if you trust every writer to this Redis")


def raw_data(raw: dict[bytes, bytes]) -> bytes:
    data = raw.get(b"data", b"")
    try:
        return zlib.decompress(data)
    except zlib.error:
        return data


def is_pickle(data: bytes) -> bool:
    """A pickle of protocol 2 or later opens with the PROTO opcode (0x80); RQ's JSON
    serializer writes a JSON array, which opens with '['."""
    return data[:1] == b"\x80"


def memoize_serializer_resolution() -> None:
    """Make RQ's ``resolve_serializer`` remember its answers, in this process.

    RQ resolves the serializer every time it builds a Job or a Result (twice a job
    here), and each time checks it against a runtime-checkable Protocol, which Python
    3.11 does by listing the protocol's members anew: a noticeable share of the
    worker's time on short jobs. The answer depends on the argument alone (a class,
    an alias or a dotted path), so it is kept per argument. Installed by the worker process only,
    in the modules of RQ that call it."""
    import rq.job
    import rq.registry
    import rq.results
    from rq import serializers

    original = serializers.resolve_serializer
    if getattr(original, "_mtq_memo", False):
        return
    known: dict[Any, Any] = {}

    def resolve(serializer: Any = None) -> Any:
        try:
            return known[serializer]
        except KeyError:
            known[serializer] = found = original(serializer)
            return found
        except TypeError:  # unhashable: not kept
            return original(serializer)

    resolve._mtq_memo = True  # type: ignore[attr-defined]
    for module in (rq.job, rq.results, rq.registry):
        module.resolve_serializer = resolve  # type: ignore[attr-defined]


class BatchJob(Job):
    """RQ's Job, with the registries of its queue made once per process.

    RQ builds a new registry object at each access of ``started_job_registry`` (and
    the finished and failed ones), and each build resolves the serializer through a
    runtime-checkable Protocol check: three per job, a noticeable share of the
    worker's time on short jobs. The registries hold nothing but their queue's name, the
    connection and the serializer, so one per (queue, connection, serializer) is
    the same thing."""

    _registries: ClassVar[dict[tuple[type, str, int, Any], Any]] = {}

    def _registry(self, cls: type) -> Any:
        key = (cls, self.origin, id(self.connection), self.serializer)
        reg = self._registries.get(key)
        if reg is None or reg.connection is not self.connection:
            reg = self._registries[key] = cls(self.origin, connection=self.connection,
                                              job_class=type(self), serializer=self.serializer)
        return reg

    @property
    def started_job_registry(self) -> StartedJobRegistry:
        return cast(StartedJobRegistry, self._registry(StartedJobRegistry))

    @property
    def finished_job_registry(self) -> FinishedJobRegistry:
        return cast(FinishedJobRegistry, self._registry(FinishedJobRegistry))

    @property
    def failed_job_registry(self) -> FailedJobRegistry:
        return cast(FailedJobRegistry, self._registry(FailedJobRegistry))


def load_job(job_id: str, raw: dict[bytes, bytes], connection: Any, accept_pickle: bool
             ) -> tuple[Job, str | None]:
    """A Job from its hash, with the serializer its data was written with: (job, why it
    is refused or None). A pickled job is refused unless ``accept_pickle``; it is read
    with the JSON serializer then (its data stays undecoded), so that it can be failed."""
    pickled = is_pickle(raw_data(raw))
    serializer = PickleSerializer if pickled and accept_pickle else JSONSerializer
    job = BatchJob(job_id, connection=connection, serializer=serializer)
    job.restore(raw)
    if pickled and not accept_pickle:
        return job, PICKLE_REFUSED
    return job, None


@dataclass
class Outcome:
    """How one job ended: ``ok`` (value), ``retry`` (a returned rq.Retry) or ``fail``
    (exc_string: a traceback or a message)."""

    kind: str
    value: Any = None
    exc_string: str = ""
    ended_at: datetime | None = None


def format_exc(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


@dataclass
class Unit:
    """What one call runs: one plain job, or the jobs of one batched function or
    mtq.Model (``batch`` set)."""

    jobs: list[Job]
    func: Any = None
    batch: Batched | None = None
    model: Any = None
    key: str = ""
    payloads: list[Any] = field(default_factory=list)


class Resolver:
    """Job function by name, cached per process (an instance method is resolved each
    time, as RQ does). An mtq.Model subclass is instantiated, given its options
    (``options``: class path -> ``{key: text}``, see :func:`model_options`) and set up
    once."""

    def __init__(self, device: str = "cpu",
                 options: dict[str, dict[str, str]] | None = None) -> None:
        self.device = device
        self.options = options or {}
        self._funcs: dict[str, Any] = {}
        self._models: dict[str, Any] = {}

    def func(self, job: Job) -> Any:
        name = job.func_name
        if job.instance is not None or name is None:
            return job.func
        f = self._funcs.get(name)
        if f is None:
            f = job.func  # rq's import_attribute, with rq's errors
            self._funcs[name] = f
        return f

    def model(self, name: str, cls: type) -> Any:
        m = self._models.get(name)
        if m is None:
            from mtq.workers.devices import torch_device
            from mtq.workers.options import apply

            m = apply(cls(), self.options.get(class_path(cls), {}), text=True, name=name,
                      prefix=f"{name}.")
            m.setup(torch_device(self.device))
            self._models[name] = m
        return m


def class_path(cls: type) -> str:
    """``package.module.Class``: the one name of a class however it was enqueued."""
    return f"{cls.__module__}.{cls.__qualname__}"


def model_options(pairs: Iterable[str]) -> dict[str, dict[str, str]]:
    """``mtq rq worker --set CLASS.KEY=VALUE`` (CLASS: an mtq.Model's dotted path, as
    enqueued; its last dot separates the key): each named class imported and the
    values checked against the options it declares (an unknown name, a value it
    cannot take, a required option missing: OptionError). Returns class path ->
    ``{key: text}``, for :class:`Resolver`."""
    from rq.utils import import_attribute

    from mtq.errors import OptionError
    from mtq.workers.options import resolve

    by_name: dict[str, dict[str, str]] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        name, dot, opt = key.strip().rpartition(".")
        if not sep or not dot or not name or not opt:
            raise OptionError(f"--set takes CLASS.KEY=VALUE, CLASS the model's dotted path as "
                              f"enqueued (e.g. myapp.models.Embedder.model=/srv/minilm); "
                              f"got {pair!r}")
        given = by_name.setdefault(name, {})
        if opt in given:
            raise OptionError(f"--set {name}.{opt} is given twice")
        given[opt] = value
    out: dict[str, dict[str, str]] = {}
    named: dict[str, str] = {}  # class path -> the name --set gave it
    for name, given in by_name.items():
        try:
            cls: Any = import_attribute(name)
        except Exception as exc:  # not found, or the module raised as it was imported
            raise OptionError(f"--set {name}.{next(iter(given))}=...: cannot import {name!r}: "
                              f"{type(exc).__name__}: {exc} (mtq rq worker looks in the "
                              "current directory, on PYTHONPATH and under --path)") from None
        if not is_model_class(cls):
            raise OptionError(f"--set {name}.{next(iter(given))}=...: {name!r} is not an "
                              "mtq.Model class: only a model declares options (mtq.Option)")
        resolve(cls, given, text=True, name=name, prefix=f"{name}.")
        path = class_path(cls)
        if path in named:
            raise OptionError(f"--set names the class {path} twice, as {named[path]} and "
                              f"{name}: give its options under one name")
        named[path], out[path] = name, given
    return out


def is_model_class(f: Any) -> bool:
    if not isinstance(f, type):
        return False
    try:
        from mtq.workers.model import Model
    except ImportError:  # pragma: no cover
        return False
    return issubclass(f, Model)


def plan(jobs: list[Job], resolver: Resolver) -> tuple[list[Unit], dict[str, Outcome]]:
    """Group jobs into units (plain jobs alone, batched ones by function, in the order
    of their first job); the jobs that fail before running (function cannot be
    imported, wrong arity) get their outcome at once."""
    units: list[Unit] = []
    groups: dict[str, Unit] = {}
    failed: dict[str, Outcome] = {}
    for job in jobs:
        try:
            f = resolver.func(job)
        except Exception as exc:
            failed[job.id] = Outcome("fail", exc_string=(
                f"mtq rq worker cannot import the function of job {job.id} "
                f"({job.func_name!r}): {type(exc).__name__}: {exc}; check that the module "
                "is importable where the worker runs (its current directory, PYTHONPATH, "
                "--app-dir)\n" + format_exc(exc)))
            continue
        spec = batched_spec(f)
        model_cls = f if is_model_class(f) else None
        if spec is None and model_cls is None:
            units.append(Unit([job], func=f))
            continue
        try:
            payload = check_arity(spec.func if spec else f, job.args, job.kwargs)
        except BatchArityError as exc:
            failed[job.id] = Outcome("fail", exc_string=format_exc(exc))
            continue
        key = job.func_name or ""
        unit = groups.get(key)
        if unit is None:
            if model_cls is not None:
                try:
                    model = resolver.model(key, model_cls)
                except Exception as exc:
                    failed[job.id] = Outcome("fail", exc_string=(
                        f"setup of {key} failed: {type(exc).__name__}: {exc}\n"
                        + format_exc(exc)))
                    continue
                spec = Batched(model.predict, int(getattr(model, "max_batch_size", 32)),
                               float(getattr(model, "max_wait_ms", 5.0)))
            unit = groups[key] = Unit([], batch=spec, key=key)
            units.append(unit)
        unit.jobs.append(job)
        unit.payloads.append(payload)
    return units, failed


def call_plain(job: Job, func: Any) -> Any:
    """Call a plain job's function as Job.perform does (get_current_job() works; an
    async function runs in an event loop of its own)."""
    from rq.job import _job_stack

    _job_stack.push(job)
    try:
        result = func(*job.args, **job.kwargs)
        if asyncio.iscoroutine(result):
            loop = asyncio.new_event_loop()
            try:
                result = loop.run_until_complete(result)
            finally:
                loop.close()
        return result
    finally:
        _job_stack.pop()


_SCALARS = frozenset((str, int, float, bool, type(None)))


def _plain_json(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is made of JSON's own types only (then json.dumps takes it):
    a walk of the types, far cheaper than encoding (it builds no text, and most values
    are small lists of floats or strings). False means "not sure": the caller encodes to
    know."""
    t = type(value)
    if t in _SCALARS:
        return True
    if depth > 20:
        return False
    if t is list or t is tuple:
        return all(type(v) in _SCALARS for v in value) or all(
            _plain_json(v, depth + 1) for v in value)
    if t is dict:
        return all(type(k) is str for k in value) and all(
            _plain_json(v, depth + 1) for v in value.values())
    return False


def check_storable(job: Job, value: Any) -> None:
    """Raise ResultNotStorable when ``value`` cannot be written with the job's
    serializer (RQ would store the text 'Unserializable return value' instead)."""
    if isinstance(value, Retry):
        return
    if job.serializer is JSONSerializer and _plain_json(value):
        return  # RQ serializes it once more when it stores it: once is enough here
    try:
        job.serializer.dumps(value)
    except Exception as exc:
        kind = "JSON" if job.serializer is JSONSerializer else "its"
        raise ResultNotStorable(
            f"the return value of job {job.id} ({type(value).__name__}) cannot be stored "
            f"with {kind} serializer: {type(exc).__name__}: {exc}; return plain data "
            "(dict, list, str, int, float, bool, None)") from exc
