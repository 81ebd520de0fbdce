# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

.PHONY: demo test test-all bench clean
demo: $(VENV)/.installed
	$(PY) -m jshard.demo

test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 --durations=25 tests

test-all: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 -m "" tests

bench: $(VENV)/.installed
	$(PY) benchmarks/propagation.py
	$(PY) benchmarks/engine.py
	$(PY) benchmarks/redistribute.py
	$(PY) benchmarks/train_step.py

clean:
	rm -rf $(VENV) *.egg-info
