"""The RQ conformance run's pieces (scripts/rq-conformance runs them): ``plugin``, the
pytest plugin that puts mtq's ``BatchWorker`` in place of RQ's workers, and
``expected-failures.txt``, the RQ tests known to fail under it, each with its reason."""
