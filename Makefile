# Quick start: `make demo` runs the heat-equation study, `make test` the suite, `make docs` the docs site.
# Both create .venv when it is missing. torch is pinned to the CPU build that
# the machines of this project have on disk; any other version downloads a
# multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
RANKS ?= 2
SOLVER ?= python
# pytest-xdist workers of `make test` (0: none, one test at a time, in the files' order). With 4 (CI's too), the
# tests of the Slurm and host clusters (xdist_group "clusters") run one after another on one worker, started first,
# and the rest spread over the others as they come free (loadgroup). Then the tests marked alone (1-second
# heartbeats that parallel load would delay) run after them, one at a time; a serial run keeps them in place (a
# second pytest would build the native programs again). Times in docs/how-to/run-the-tests.md
TEST_WORKERS ?= 4
ALONE = $(filter-out 0,$(TEST_WORKERS))

.PHONY: demo test test-fast lint docs install install-test native clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# The packages' __init__ files too: the editable install records which ones are namespace packages.
$(VENV)/.installed: $(BIN)/python pyproject.toml melissa_dl/__init__.py launcher/__init__.py
	$(BIN)/pip install --quiet $(TORCH) mpich
	$(BIN)/pip install --quiet -e .
	touch $@

# the docs extra too: the suite builds the docs site (tests/integration/test_docs.py)
$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install --quiet -e '.[test,docs]'
	touch $@

$(VENV)/.installed-docs: $(VENV)/.installed
	$(BIN)/pip install --quiet -e '.[docs]'
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

# SOLVER=c or SOLVER=fortran: the same study with the C or Fortran heat solver (2 ranks each)
demo: install $(if $(filter-out python,$(SOLVER)),native)
	$(BIN)/mpirun -n $(RANKS) $(BIN)/melissa-server --fresh examples/heat_pde/config$(if $(filter-out python,$(SOLVER)),_$(SOLVER)).json

# The Debian packages of the C/Fortran tests and of the test Slurm cluster come
# from scripts/system-packages, installed when it may (root, passwordless sudo);
# otherwise it prints the command, and those tests are skipped with that reason
# (failed under CI=true).
test: install-test lint
	-scripts/system-packages install native slurm
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --durations=30 $(if $(ALONE),-m "not alone") tests/unit tests/integration
	$(if $(ALONE),$(BIN)/python -m pytest -m alone tests/integration)
	$(BIN)/mpirun -n 1 $(BIN)/python -m pytest tests/mpi
	$(BIN)/mpirun -n 2 $(BIN)/python -m pytest tests/mpi
	$(BIN)/mpirun -n 3 $(BIN)/python -m pytest tests/mpi

# The edit loop's tier: the unit tests alone (no MPI job, no sockets, no Slurm), under a minute on 2 cores
test-fast: install-test
	$(BIN)/python -m pytest -q tests/unit

# The docs site (mkdocs.yml, docs/) into site/; --strict: a warning (a broken link or anchor) is an error.
# NO_MKDOCS_2_WARNING: Material's notice of its end of life (2027), printed on every build, is no warning of ours
docs: $(VENV)/.installed-docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# ruff's rules and format, and mypy on melissa_dl/ and launcher/ (pyproject.toml)
lint: install-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# C and Fortran: the client library (native/) installed into $(NATIVE), and the
# programs linked to it in $(NATIVE)/bin: the heat example's C and Fortran
# solvers, the tests' Fortran client, Melissa-style simulations (C and Fortran, on
# Melissa's API) and persistent workers (C and Fortran) and the ingest and scale benches' C clients (through
# pkg-config, as a user builds) and the tests' C client (statically). Debian's
# MPICH (libmpich-dev): the mpich wheel has no Fortran bindings, and its mpirun
# launches these programs (docs/tutorials/your-simulation.md, "Which MPI here").
NATIVE ?= build/native
MPICC ?= mpicc.mpich
MPIFC ?= mpifort.mpich
NATIVE_DIR = $(abspath $(NATIVE))
NATIVE_PC = PKG_CONFIG_PATH=$(NATIVE_DIR)/lib/pkgconfig pkg-config

native:
	$(MAKE) -C native install BUILD=$(NATIVE_DIR)/build PREFIX=$(NATIVE_DIR) MPICC=$(MPICC) MPIFC=$(MPIFC)
	mkdir -p $(NATIVE_DIR)/bin
	PKG_CONFIG_PATH=$(NATIVE_DIR)/lib/pkgconfig $(MAKE) -C examples/heat_pde BIN=$(NATIVE_DIR)/bin MPICC=$(MPICC) MPIFC=$(MPIFC)
	$(MPICC) -O2 -Wall -o $(NATIVE_DIR)/bin/c_client tests/integration/c_client.c $$($(NATIVE_PC) --cflags melissa_dl) \
		$(NATIVE_DIR)/lib/libmelissa_dl.a $$($(NATIVE_PC) --libs libzmq) -lm
	$(MPICC) -O2 -Wall -Wextra -o $(NATIVE_DIR)/bin/c_predictor tests/integration/c_predictor.c \
		$$($(NATIVE_PC) --cflags --libs melissa_dl) -Wl,-rpath,$(NATIVE_DIR)/lib
	$(MPICC) -O2 -Wall -Wextra -o $(NATIVE_DIR)/bin/c_served tests/integration/c_served.c \
		$$($(NATIVE_PC) --cflags --libs melissa_dl) -Wl,-rpath,$(NATIVE_DIR)/lib
	$(MPIFC) -O2 -Wall -o $(NATIVE_DIR)/bin/f_predictor tests/integration/f_predictor.f90 \
		$$($(NATIVE_PC) --cflags --libs melissa_dl_fortran) -Wl,-rpath,$(NATIVE_DIR)/lib
	$(MPIFC) -O2 -Wall -o $(NATIVE_DIR)/bin/f_client tests/integration/f_client.f90 \
		$$($(NATIVE_PC) --cflags --libs melissa_dl_fortran) -Wl,-rpath,$(NATIVE_DIR)/lib
	$(MPICC) -O2 -Wall -o $(NATIVE_DIR)/bin/melissa_sim tests/integration/melissa_sim.c \
		$$($(NATIVE_PC) --cflags --libs melissa_dl) -Wl,-rpath,$(NATIVE_DIR)/lib
	$(MPIFC) -O2 -Wall -o $(NATIVE_DIR)/bin/melissa_sim_f tests/integration/melissa_sim.f90 \
		$$($(NATIVE_PC) --cflags --libs melissa_dl_fortran) -Wl,-rpath,$(NATIVE_DIR)/lib
	$(MPICC) -O2 -Wall -Wextra -o $(NATIVE_DIR)/bin/c_worker tests/integration/c_worker.c \
		$$($(NATIVE_PC) --cflags --libs melissa_dl) -Wl,-rpath,$(NATIVE_DIR)/lib
	$(MPIFC) -O2 -Wall -o $(NATIVE_DIR)/bin/f_worker tests/integration/f_worker.f90 \
		$$($(NATIVE_PC) --cflags --libs melissa_dl_fortran) -Wl,-rpath,$(NATIVE_DIR)/lib
	$(MPICC) -O2 -Wall -Wextra -o $(NATIVE_DIR)/bin/block_client tests/integration/block_client.c \
		$$($(NATIVE_PC) --cflags --libs melissa_dl) -Wl,-rpath,$(NATIVE_DIR)/lib
	$(MPIFC) -O2 -Wall -o $(NATIVE_DIR)/bin/block_client_f tests/integration/block_client.f90 \
		$$($(NATIVE_PC) --cflags --libs melissa_dl_fortran) -Wl,-rpath,$(NATIVE_DIR)/lib
	$(MPICC) -O2 -Wall -o $(NATIVE_DIR)/bin/ingest_client bench/ingest_client.c \
		$$($(NATIVE_PC) --cflags --libs melissa_dl) -Wl,-rpath,$(NATIVE_DIR)/lib
	$(MPICC) -O2 -Wall -o $(NATIVE_DIR)/bin/scale_client bench/scale_client.c \
		$$($(NATIVE_PC) --cflags --libs melissa_dl) -Wl,-rpath,$(NATIVE_DIR)/lib

clean:
	rm -rf $(VENV) build examples/*/output
