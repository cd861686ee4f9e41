"""Helpers the tests import: plain functions, classes and constants, grouped by topic.

Fixtures live in ``tests/conftest.py`` (and ``tests/integration/conftest.py``), which
import what they need from here; a test module imports helpers from here, never from
conftest or from another test module. The modules that name command-line targets
(``tests.models``, ``tests.handlers``, ``tests.web_app``, ``tests.flask_app``,
``tests.gpt_models``, ``tests.rq_jobs``, ``tests/django_project``) stay where those
strings point.

* :mod:`tests.support.paths`: the repository root and the interpreter.
* :mod:`tests.support.waits`: bounded waits, a reader of an iterator in a thread.
* :mod:`tests.support.processes`: free ports, ``mtq worker run`` processes.
* :mod:`tests.support.workers`: in-process Workers, the recording model, worker
  processes in the registry.
* :mod:`tests.support.supervisors`: a supervisor subprocess and the models' call logs.
* :mod:`tests.support.servers`: the Redis 7 binary; :mod:`tests.support.clusters`:
  Redis Cluster and Sentinel deployments.
* :mod:`tests.support.web`: web servers under uvicorn and gunicorn, an SSE reader,
  the Django test project's environment.
* :mod:`tests.support.faults`: the fault harness the benchmarks and the tests share.
* :mod:`tests.support.cli_parse`, :mod:`tests.support.doc_commands`: command lines of
  the docs, parsed.
"""
