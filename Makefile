.PHONY: install test lint bench demo

install:
	scripts/install-system-deps
	python -m pip install -e '.[dev]'

test:
	python -m pytest -q

lint:
	ruff check mtq tests benchmarks
	mypy mtq

bench:
	python benchmarks/broker.py

demo:
	mtq demo
