.PHONY: install test test-slow test-all lint bench demo gpu-wheels gpu-check gpu-check-dry-run

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

lint:
	ruff check mtq tests benchmarks
	mypy mtq

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
