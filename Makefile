# Quick start: `make demo` runs the heat-equation study, `make test` the suite.
# Both create .venv when it is missing. torch is pinned to the CPU build that
# the machines of this project have on disk; any other version downloads a
# multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
RANKS ?= 2

.PHONY: demo test install install-test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet $(TORCH) mpich
	$(BIN)/pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

demo: install
	$(BIN)/mpirun -n $(RANKS) $(BIN)/melissa-server --fresh examples/heat_pde/config.json

test: install-test
	$(BIN)/python -m pytest tests/unit tests/integration
	$(BIN)/mpirun -n 1 $(BIN)/python -m pytest tests/mpi
	$(BIN)/mpirun -n 2 $(BIN)/python -m pytest tests/mpi

clean:
	rm -rf $(VENV) examples/*/output
