"""pytest plugin of the RQ conformance run (scripts/rq-conformance): runs RQ's own test
suite with mtq's ``BatchWorker`` in place of RQ's workers.

Loaded with ``-p rq_conformance.plugin`` (``scripts/`` on ``PYTHONPATH``), so it is
imported before the test modules: when pytest configures itself, it replaces
``rq.Worker``, ``rq.SimpleWorker``, ``rq.worker.Worker``, ``rq.worker.SimpleWorker`` and
the same two names of ``rq.worker.worker_classes`` (where ``rq.worker`` takes them
from; RQ's CLI and ``import_worker_class('rq.worker.Worker')`` read ``rq.worker``) with
:class:`ConformanceWorker`, a ``BatchWorker`` that accepts pickled jobs (RQ's tests
enqueue with RQ's default serializer, pickle). The test modules' ``from rq import
Worker`` then get it. RQ's other worker classes (``HerokuWorker``, ``SpawnWorker``,
``RandomWorker``, ``RoundRobinWorker``) subclass RQ's own ``Worker`` and stay as they are.

It also checks, once the tests are collected, that ``rq`` is the installed package
and ``tests`` the sdist's (not the sdist's ``rq/`` copy or mtq's own ``tests``), and,
for the runner, records the run as it goes in the file ``$RQ_CONFORMANCE_PROGRESS``
names: ``collected NODE``, ``start NODE`` and ``end NODE OUTCOME`` lines, each written
at once, and each failure's traceback to ``$RQ_CONFORMANCE_FAILURES``. So a test that
ends the pytest process (``BatchWorker`` calls ``os._exit`` on a second SIGTERM) is
known, and the runner goes on with the tests left, which this plugin deselects: those
of the file ``$RQ_CONFORMANCE_SKIP`` names (a node id a line).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import IO, Any

import pytest
import rq
import rq.worker
import rq.worker.worker_classes

from mtq.rq.worker import BatchWorker

PROGRESS_ENV = "RQ_CONFORMANCE_PROGRESS"
SKIP_ENV = "RQ_CONFORMANCE_SKIP"
FAILURES_ENV = "RQ_CONFORMANCE_FAILURES"
#: the modules and names that hold RQ's worker classes, as the tests import them
REPLACED = [(rq, "Worker"), (rq, "SimpleWorker"), (rq.worker, "Worker"),
            (rq.worker, "SimpleWorker"), (rq.worker.worker_classes, "Worker"),
            (rq.worker.worker_classes, "SimpleWorker")]


class ConformanceWorker(BatchWorker):
    """``BatchWorker`` as RQ's tests construct ``Worker`` and ``SimpleWorker``: the
    arguments go to ``BatchWorker`` unchanged (one it does not take fails the test,
    which the expected-failures list then records), with ``accept_pickle=True``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("accept_pickle", True)
        super().__init__(*args, **kwargs)


def install() -> None:
    """Put :class:`ConformanceWorker` in place of RQ's ``Worker`` and ``SimpleWorker``."""
    for module, name in REPLACED:
        setattr(module, name, ConformanceWorker)


class Progress:
    """Writes the run's progress to a file, a line per event, and the failures'
    tracebacks to another, as they come (see the module docstring); deselects the node
    ids of the skip file."""

    def __init__(self, path: str, failures: str, skip: set[str]) -> None:
        self.file: IO[str] = open(path, "a", buffering=1)
        self.failures: IO[str] = open(failures, "a", buffering=1)
        self.skip = skip
        self.outcome: dict[str, str] = {}

    def pytest_collection_modifyitems(self, config: pytest.Config,
                                      items: list[pytest.Item]) -> None:
        if not self.skip:
            return
        gone = [item for item in items if item.nodeid in self.skip]
        items[:] = [item for item in items if item.nodeid not in self.skip]
        config.hook.pytest_deselected(items=gone)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        for item in session.items:
            self.file.write(f"collected {item.nodeid}\n")

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        self.file.write(f"start {nodeid}\n")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            self.outcome[report.nodeid] = "failed"
            self.failures.write(f"{'_' * 20} {report.nodeid} ({report.when})\n"
                                f"{report.longreprtext}\n\n")
        elif report.skipped and report.nodeid not in self.outcome:
            self.outcome[report.nodeid] = "skipped"

    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        self.file.write(f"end {nodeid} {self.outcome.pop(nodeid, 'passed')}\n")

    def pytest_unconfigure(self) -> None:
        self.file.close()
        self.failures.close()


def pytest_configure(config: pytest.Config) -> None:
    install()
    path = os.environ.get(PROGRESS_ENV)
    if path:
        skip_file = os.environ.get(SKIP_ENV)
        skip = set(Path(skip_file).read_text().splitlines()) if skip_file else set()
        failures = os.environ.get(FAILURES_ENV) or os.devnull
        config.pluginmanager.register(Progress(path, failures, skip),
                                      "rq_conformance_progress")


def pytest_report_header(config: pytest.Config) -> str:
    return (f"rq-conformance: rq {rq.__version__} from {Path(rq.__file__).parent}; "
            "rq.Worker and rq.SimpleWorker are mtq's BatchWorker (accept_pickle=True)")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Stop before the first test if ``rq`` or ``tests`` is not the module meant."""
    root = session.config.rootpath.resolve()
    rq_dir = Path(rq.__file__).resolve().parent
    if rq_dir.is_relative_to(root):
        raise pytest.UsageError(f"rq was imported from {rq_dir}, under the test tree "
                                f"{root}: the installed package is the one to test")
    tests = sys.modules.get("tests")
    if tests is not None and not Path(tests.__file__ or "").resolve().is_relative_to(root):
        raise pytest.UsageError(f"the tests package was imported from {tests.__file__}, "
                                f"not from the sdist's tree {root}")
