.PHONY: install test test-slow test-all lint bench demo

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
