# shardfs: `make demo` runs the main job on a fresh machine, `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup system-deps demo test test-unit lint format clean

setup: system-deps $(STAMP)

system-deps:
	@bash scripts/install-system-deps.sh

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

demo: setup
	$(BIN)/python scripts/demo.py

test: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider

test-unit: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not integration"

lint: setup
	$(BIN)/ruff check shardfs tests scripts
	$(BIN)/ruff format --check shardfs tests scripts
	$(BIN)/mypy

format: setup
	$(BIN)/ruff check --fix shardfs tests scripts
	$(BIN)/ruff format shardfs tests scripts

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
