# Two commands do all set-up on a fresh machine:  make demo   and   make test
# TORCH picks the torch build; a GPU user overrides it, e.g. make test TORCH='torch==2.13.0 --index-url ...'
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell echo '$(TORCH)' | md5sum | cut -c1-8)

.PHONY: demo test bench venv clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/evenrl demo

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) benchmarks/partition.py

clean:
	rm -rf $(VENV) runs .pytest_cache
