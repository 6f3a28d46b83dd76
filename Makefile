# People and CI use the same targets. `make up` and `make test` create .venv on first use.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: up test lint fmt test-only bench install clean

$(STAMP): pyproject.toml constraints.txt
	@echo "installing agent-reach into $(VENV) (first run or dependencies changed; about a minute) ..."
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@$(BIN)/python -m pip install --quiet --upgrade pip
	@$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	@touch $(STAMP)
	@echo "installed."

install: $(STAMP)

up: $(STAMP)
	$(BIN)/reach up

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

fmt: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

test: lint test-only

test-only: $(STAMP)
	$(BIN)/pytest

bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[bench]'
	$(BIN)/python bench/invoke.py

clean:
	rm -rf $(VENV) .reach .mypy_cache .ruff_cache .pytest_cache
