#!/usr/bin/env bash
# test.sh — the one command that runs every test: builds, runs ctest (Catch2, examples, install, README), then pytest.
#
#   bash scripts/test.sh
#
# Exits non-zero when the build or any test fails. Build settings: see
# scripts/build.sh (GPIPE_BUILD_TYPE, GPIPE_JOBS, ...). The package gpipe is
# installed into, and pytest run by, the project's .venv (or GPIPE_PYTHON,
# see scripts/setup.sh).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/build.sh
source scripts/python.sh  # gpipe_python

build_dir="${GPIPE_BUILD_DIR:-build}"
# (plain nproc would honour OMP_NUM_THREADS, which limits torch, not the build)
jobs="${GPIPE_JOBS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}"
status=0

# C++: one ctest test per Catch2 TEST_CASE, one per example, the install test.
(cd "$build_dir" && ctest --output-on-failure --no-tests=error --parallel "$jobs") || status=1

# Python: only when there are test files.
if [[ -n "$(find tests/python -name 'test_*.py' -o -name '*_test.py' 2>/dev/null | head -1)" ]]; then
  if [[ -f setup.py ]]; then
    # Install the package gpipe (gpipe._C + libgpipe) into gpipe_python's
    # environment, reusing the libgpipe just built (see setup.py).
    GPIPE_CMAKE_BUILD_DIR="$(cd "$build_dir" && pwd)" PIP_ROOT_USER_ACTION=ignore \
      "$gpipe_python" -m pip install --no-build-isolation --no-deps --no-input --progress-bar off \
      --disable-pip-version-check -q . || status=1
  fi
  pytest_status=0
  # The CPU tests are the CPU machines' contract, and a Pipe given no devices
  # takes every visible GPU: they run with CUDA hidden (the GPU tests skip
  # there), then, on a machine with a GPU, the GPU tests run with it.
  # (GPIPE_CMAKE_BUILD_DIR: test_readme.py checks the README programs ctest ran.)
  GPIPE_CMAKE_BUILD_DIR="$(cd "$build_dir" && pwd)" CUDA_VISIBLE_DEVICES="" \
    "$gpipe_python" -m pytest tests/python -q || pytest_status=$?
  # 5: no tests collected, which is not a failure here.
  if [[ $pytest_status -ne 0 && $pytest_status -ne 5 ]]; then status=1; fi
  if "$gpipe_python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
    2>/dev/null; then
    "$gpipe_python" -m pytest tests/python/test_cuda.py \
      "tests/python/test_distributed.py::test_stages_on_the_gpu" \
      "tests/python/test_distributed.py::test_stages_on_several_gpus_over_nccl" -q -rs || status=1
  fi
fi

if [[ $status -ne 0 ]]; then
  echo "test.sh: FAILED" >&2
fi
exit $status
