# Two commands on a fresh clone: `make demo` and `make test`. Each creates .venv if missing.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.gradshard-installed
# torch 2.13.0: the CPU build where the machine has no CUDA (pip takes the local CPU wheel
# here), the CUDA build from PyPI on GPU machines.
TORCH  ?= torch==2.13.0

.PHONY: demo test test-all test-fast bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/gradshard demo

# The default suite skips tests marked `slow` (the full cost-model validation matrix, ~25 min
# on 2 cores); `make test-all` runs everything.
# WORKERS pytest-xdist processes (one thread each), a file per worker at a time: module
# fixtures are built once per file.
WORKERS ?= 2
XDIST   := -n $(WORKERS) --dist loadfile --no-loadscope-reorder

test: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q -p no:cacheprovider -m "not slow" $(XDIST)

test-all: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q -p no:cacheprovider $(XDIST)

test-fast: $(STAMP)
	$(PY) -m pytest -q -x -m "not slow" tests/core

bench: $(STAMP)
	$(VENV)/bin/gradshard bench all

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
