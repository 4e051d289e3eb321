# One-command set-up: every target below creates .venv and installs what it needs.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo test test-slow test-newest bench install clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# torch is pinned first so no other requirement can pull a CUDA build.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev,ray,flower]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/leakbench demo

test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/python -m pytest -q --durations=20

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# the CLI against the newest typer / rich / click the index has (a standalone install resolves those, not the venv's)
test-newest: $(STAMP)
	rm -rf .newest && $(BIN)/pip install --quiet --no-deps --upgrade --target .newest typer rich click
	PYTHONPATH=.newest:src $(BIN)/python -m pytest -q tests/cli

bench: $(STAMP)
	$(BIN)/python -m benchmarks

clean:
	rm -rf $(VENV) leakbench-demo .newest
