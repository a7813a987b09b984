# make lint: ruff (lint + format check) and the import layers of docs/architecture.md; make test: the README's test
# command, then the slow tests it leaves out; make format: apply ruff's formatting and fixes.
PY ?= python3

.PHONY: lint test check format
lint:
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	lint-imports

test:
	$(PY) -m pytest -q
	$(PY) -m pytest -q -m slow

check: lint test

format:
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .
