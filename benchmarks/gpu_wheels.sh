#!/bin/sh
# The wheels benchmarks/gpu_suite.py needs on the GPU machine (Python 3.12, x86-64, no network), downloaded here into
# .whl/ (git-ignored; the device call carries it). That machine already has torch, transformers, accelerate,
# pandas, pyarrow, xxhash, fsspec, jinja2, psutil, pyyaml and tqdm (/work/.library/device/KINDS.md); what it lacks:
# evenrl's pydantic (+ its three needs), TRL, and TRL's datasets (+ dill, multiprocess). Its transformers (5.17) is
# older than the one the suite is tested with, so transformers 5.19 goes too (+ the regex it requires; its other
# needs are there). Versions: constraints.txt's.
#
#   sh benchmarks/gpu_wheels.sh            # from the repository root; prints the folder's size
#
# There: python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
set -e
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] && PY=${PY:-.venv/bin/python} || PY=${PY:-python3}  # any Python with pip does
rm -rf .whl
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 transformers==5.19.0 regex==2026.11.19
ls -l .whl
du -sh .whl
