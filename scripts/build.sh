#!/usr/bin/env bash
# build.sh — runs setup.sh, then configures and builds gpipe with CMake + Ninja in build/ (all cores), against .venv's torch.
#
#   bash scripts/build.sh                      # everything: library, tests, examples
#   bash scripts/build.sh example_train_mlp    # just these targets
#
# Environment: GPIPE_BUILD_DIR (default build), GPIPE_BUILD_TYPE (default
# Release), GPIPE_CMAKE_ARGS (extra arguments for the configure step, split
# on spaces), GPIPE_JOBS (default: nproc), GPIPE_PYTHON (whose torch to build
# against, default .venv/bin/python; see setup.sh).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
source scripts/python.sh

build_dir="${GPIPE_BUILD_DIR:-build}"
# (plain nproc would honour OMP_NUM_THREADS, which limits torch, not the build)
jobs="${GPIPE_JOBS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}"
# A build dir made by another generator can't be reused by Ninja.
if [[ -f "$build_dir/CMakeCache.txt" ]] && ! grep -q '^CMAKE_GENERATOR:INTERNAL=Ninja$' "$build_dir/CMakeCache.txt"; then
  echo "build: $build_dir was configured with another generator; starting it afresh"
  rm -rf "$build_dir"
fi
gpipe_torch_cmake_args "$build_dir"  # -> torch_args
# shellcheck disable=SC2086  # GPIPE_CMAKE_ARGS is a list of words on purpose
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE="${GPIPE_BUILD_TYPE:-Release}" \
  "${torch_args[@]}" ${GPIPE_CMAKE_ARGS:-}
targets=()
for target in "$@"; do targets+=(--target "$target"); done
cmake --build "$build_dir" --parallel "$jobs" "${targets[@]}"
