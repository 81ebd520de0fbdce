# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# the newest releases (jax, flax, optax, numpy) need a newer Python than the floor's 3.11
NEWEST_PYTHON ?= $(shell .ci/find-python 3.12 2>/dev/null)
NEWEST        := .venv-newest

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

$(NEWEST)/.installed: pyproject.toml
	@test -n "$(NEWEST_PYTHON)" || { echo "no Python 3.12 found: set NEWEST_PYTHON=/path/to/python3.12"; exit 1; }
	$(NEWEST_PYTHON) -m venv $(NEWEST)
	$(NEWEST)/bin/python -m pip install -q --upgrade pip
	$(NEWEST)/bin/python -m pip install -q --upgrade --upgrade-strategy eager -e '.[test]'
	touch $@

.PHONY: demo test test-all test-newest bench clean
demo: $(VENV)/.installed
	$(PY) -m jshard.demo

# the floor's share of the suite; `make test-newest` runs the rest and what depends on JAX's own code again
# (tests/conftest.py says which files; `make test-all` runs every test, the slow ones too)
test: $(VENV)/.installed
	JSHARD_SUITE=floor $(PY) -m pytest -q -n 2 --durations=25 tests

# the newest releases' share (what `pip install jshard` gives on Python 3.12 today)
test-newest: $(NEWEST)/.installed
	JSHARD_SUITE=newest $(NEWEST)/bin/python -m pytest -q -n 2 --durations=10 tests

test-all: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 -m "" tests

bench: $(VENV)/.installed
	$(PY) benchmarks/propagation.py
	$(PY) benchmarks/engine.py
	$(PY) benchmarks/redistribute.py
	$(PY) benchmarks/train_step.py
	$(PY) benchmarks/memory.py
	$(PY) benchmarks/checkpoint.py
	$(PY) benchmarks/gpu.py
	$(PY) benchmarks/moe.py

clean:
	rm -rf $(VENV) $(NEWEST) *.egg-info
