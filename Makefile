# make lint: ruff and the import layers of DESIGN.md; make test: the README's test command.
PY ?= python3

.PHONY: lint test check format
lint:
	$(PY) -m ruff check .
	lint-imports

test:
	$(PY) -m pytest -q

check: lint test

format:
	$(PY) -m ruff check --fix .
