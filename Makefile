.PHONY: install test test-slow test-all test-rq-conformance lint bench demo gpu-wheels gpu-check \
	gpu-check-dry-run

install:
	scripts/install-system-deps
	python -m pip install -e '.[dev]'

test:
	python -m pytest -q

# the fault and soak tests the default run leaves out (see README.md)
test-slow:
	python -m pytest -q -m slow

test-all:
	python -m pytest -q -m ''

# RQ's own test suite with mtq's BatchWorker in place of RQ's workers, against
# scripts/rq_conformance/expected-failures.txt (needs 127.0.0.1:6379 free; see the script)
test-rq-conformance:
	scripts/rq-conformance

lint:
	ruff check mtq tests benchmarks
	mypy mtq benchmarks

bench:
	python benchmarks/broker.py

demo:
	mtq demo

# the GPU check (docs/benchmarks.md, "GPU"): make gpu-wheels here, then run make
# gpu-check on the lent GPU machine with .whl/ carried; gpu-check-dry-run runs the
# same steps here on the CPU, in a throwaway venv
gpu-wheels:
	scripts/gpu-wheels

gpu-check:
	scripts/gpu-check

gpu-check-dry-run:
	scripts/gpu-check --dry-run
