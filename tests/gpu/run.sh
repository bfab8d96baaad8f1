#!/usr/bin/env bash
# run.sh — the one-call GPU check: builds gpipe on this machine, runs the CUDA tests and bench/gpu.py, writes a report.
#
#   bash tests/gpu/run.sh          # at the repo root of a machine with a GPU (docs/gpu.md)
#
# Made for a borrowed GPU machine: torch, CMake, ninja and a CUDA toolkit
# installed, perhaps no network and no Catch2, minutes of device time. So it downloads
# nothing, keeps going after a failed step, gives every step a time limit
# out of one budget, and always writes the report:
#
#   $OUT/gpu-report.md and $OUT/logs/   when OUT is set (a folder to bring back)
#   <build>/gpu-report.md and logs/     otherwise
#
# Steps, most important first (optional ones run only while time is left):
#   configure, build-lib, build-tests    CMake + Ninja against this python's torch, all cores
#   catch2-cuda                          gpipe_tests "[cuda]"   (while python-build runs)
#   python-build                         gpipe._C: pip install, or setup.py build if pip can't
#   pytest-cuda, bench                   tests/python/test_cuda.py (and the distributed
#                                        pipe's GPU test), bench/gpu.py
#   bench-sim (optional)                 bench_sim --schedules: the schedules on 8 simulated
#                                        devices, each with a core of its own here
#   catch2-cpu, pytest-rest (optional)   the rest of both suites
# Exits 0 when every step that ran passed (CUDA tests skipped for want of a
# device count as passed: the report says "no CUDA device"), 1 otherwise.
#
# Catch2 (v2, Debian's) is taken from, in order: $CATCH2_DIR (a prefix with
# include/catch2/catch.hpp and lib/cmake/Catch2/), .gpu-kit/catch2/ (made by
# tests/gpu/prepare.sh and copied along with the tree), the system. Without it
# the C++ tests cannot build: the report says so and the run fails.
#
# Environment: PYTHON (default python3), GPIPE_GPU_BUILD_DIR (default
# build-gpu), GPIPE_GPU_BUDGET (seconds for everything, default 450),
# GPIPE_GPU_PY_INSTALL (auto | pip | build; default auto), GPIPE_JOBS.
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root" || exit 1
kit="$root/tests/gpu"

python="${PYTHON:-python3}"
build="${GPIPE_GPU_BUILD_DIR:-build-gpu}"
mkdir -p "$build" && build="$(cd "$build" && pwd)"
budget="${GPIPE_GPU_BUDGET:-450}"
jobs="${GPIPE_JOBS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}"
out="${OUT:-$build}"
mkdir -p "$out/logs" && out="$(cd "$out" && pwd)"
logs="$out/logs"
report="$out/gpu-report.md"
: >"$logs/steps.tsv"
# Seconds kept back from every limit for the report at the end.
reserve=15
# pip and friends must not wait on a network that is not there.
export PIP_NO_INDEX=1 PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
export MAX_JOBS="$jobs"  # torch's BuildExtension

echo "gpu kit: root $root, build $build, report $report, budget ${budget}s, $jobs jobs"

remaining() { echo $((budget - SECONDS - reserve)); }

# record NAME OUTCOME RC SECONDS KIND: one line of steps.tsv.
record() { printf '%s\t%s\t%s\t%s\t%s\n' "$@" >>"$logs/steps.tsv"; }

# step NAME KIND MAX_SECONDS COMMAND...: runs COMMAND with its output in
# logs/NAME.log, limited to MAX_SECONDS and to what the budget has left.
# KIND: required (failing or not running it fails the check) or optional.
step() {
  local name="$1" kind="$2" limit="$3"
  shift 3
  local left
  left="$(remaining)"
  if ((left < 20)); then
    echo "== $name: not run (out of time)"
    record "$name" "not run (out of time)" - 0 "$kind"
    return 1
  fi
  ((limit > left)) && limit="$left"
  echo "== $name (limit ${limit}s): $*"
  local start=$SECONDS rc outcome
  timeout -k 10 "$limit" "$@" >"$logs/$name.log" 2>&1
  rc=$?
  if ((rc == 0)); then
    outcome=ok
  elif ((rc == 124 || rc == 137)); then
    outcome="timed out after ${limit}s"
  else
    outcome="failed"
  fi
  record "$name" "$outcome" "$rc" $((SECONDS - start)) "$kind"
  echo "== $name: $outcome ($((SECONDS - start))s)"
  if [[ $outcome != ok ]]; then
    echo "---- last lines of logs/$name.log"
    tail -n 40 "$logs/$name.log"
    echo "----"
  fi
  return "$rc"
}

# not_run NAME KIND WHY
not_run() {
  echo "== $1: not run ($3)"
  record "$1" "not run ($3)" - 0 "$2"
}

# ---- the machine ------------------------------------------------------------------
# torch's CMake package needs a CUDA toolkit (nvcc): find one if the usual
# places (CUDA_HOME, CUDA_PATH, /usr/local/cuda) have none.
if [[ ! -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" \
      && ! -x "${CUDA_PATH:-/nonexistent}/bin/nvcc" ]]; then
  for nvcc in "$(command -v nvcc 2>/dev/null)" /usr/local/cuda-*/bin/nvcc /opt/cuda/bin/nvcc; do
    if [[ -n "$nvcc" && -x "$nvcc" ]]; then
      CUDA_HOME="$(cd "$(dirname "$nvcc")/.." && pwd)"
      export CUDA_HOME
      echo "gpu kit: CUDA toolkit at $CUDA_HOME"
      break
    fi
  done
fi
export PATH="$PATH:${CUDA_HOME:-/usr/local/cuda}/bin"
# A compiler that links libstdc++ dynamically, as torch does (compiler.sh says why).
source "$kit/compiler.sh"
gpu_kit_pick_cxx "$build/probe"
"$python" "$kit/report.py" env >"$logs/env.json" 2>"$logs/env.log" || echo "{}" >"$logs/env.json"
cuda="$("$python" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)"
if [[ $cuda == 1 ]]; then
  echo "gpu kit: CUDA device:" \
       "$("$python" -c 'import torch; print(torch.cuda.get_device_name(0))' 2>/dev/null)"
else
  echo "gpu kit: no CUDA device: the CUDA tests will skip; this run proves the build only"
fi

# ---- Catch2 -------------------------------------------------------------------------
catch2_dir=""
for prefix in "${CATCH2_DIR:-}" "$root/.gpu-kit/catch2"; do
  [[ -z $prefix ]] && continue
  for dir in "$prefix/lib/cmake/Catch2" "$prefix"; do
    if [[ -f "$dir/Catch2Config.cmake" ]]; then
      catch2_dir="$(cd "$dir" && pwd)"
      break 2
    fi
  done
done
cmake_args=(-DCMAKE_BUILD_TYPE=Release -DGPIPE_BUILD_EXAMPLES=OFF -DGPIPE_TEST_INSTALL=OFF
            -DGPIPE_BUILD_BENCHMARKS=ON "-DGPIPE_PYTHON_EXECUTABLE=$(command -v "$python")")
tests=1
if [[ -n $catch2_dir ]]; then
  echo "gpu kit: Catch2 from $catch2_dir"
  cmake_args+=("-DCatch2_DIR=$catch2_dir")
elif [[ -f /usr/include/catch2/catch.hpp ]] \
  || compgen -G "/usr/lib*/cmake/Catch2/Catch2Config.cmake" >/dev/null \
  || compgen -G "/usr/lib/*/cmake/Catch2/Catch2Config.cmake" >/dev/null; then
  echo "gpu kit: Catch2 from the system"
else
  echo "gpu kit: no Catch2 (set CATCH2_DIR, or run tests/gpu/prepare.sh and copy .gpu-kit along):" \
       "building without the C++ tests"
  cmake_args+=(-DGPIPE_BUILD_TESTS=OFF)
  tests=0
fi

# ---- Gloo's headers (for process groups made from C++) --------------------------------
# The system's, else the copy prepare.sh made; CMake checks them against torch.
if [[ ! -f /usr/include/gloo/algorithm.h && -f "$root/.gpu-kit/gloo/include/gloo/algorithm.h" ]]; then
  echo "gpu kit: Gloo headers from $root/.gpu-kit/gloo/include"
  cmake_args+=("-DGPIPE_GLOO_INCLUDE_DIR=$root/.gpu-kit/gloo/include")
fi

# ---- build ----------------------------------------------------------------------------
generator=(-G Ninja)
if ! command -v ninja >/dev/null 2>&1; then
  echo "gpu kit: no ninja on PATH; using CMake's default generator"
  generator=()
fi
# A build tree made by another generator or compiler can't be reused.
want_generator="${generator[1]:-Unix Makefiles}"
if [[ -f "$build/CMakeCache.txt" ]] \
  && { ! grep -q "^CMAKE_GENERATOR:INTERNAL=$want_generator\$" "$build/CMakeCache.txt" \
       || ! grep -q "^CMAKE_CXX_COMPILER:[A-Z]*=${CXX:-}\$" "$build/CMakeCache.txt"; }; then
  rm -rf "$build/CMakeCache.txt" "$build/CMakeFiles"
fi

built_lib=0
built_tests=0
if step configure required 180 cmake -S . -B "$build" "${generator[@]}" "${cmake_args[@]}"; then
  if step build-lib required 360 cmake --build "$build" --target gpipe --parallel "$jobs"; then
    built_lib=1
  fi
  if ((tests)); then
    step build-tests required 360 cmake --build "$build" --target gpipe_tests --parallel "$jobs" \
      && built_tests=1
  else
    not_run build-tests required "no Catch2"
  fi
else
  not_run build-lib required "configure failed"
  not_run build-tests required "configure failed"
fi

# ---- the Python package ---------------------------------------------------------------
# pip builds a wheel, which needs setuptools' own bdist_wheel (>= 70.1) or the
# `wheel` package; without either (and nothing can be downloaded here),
# `setup.py build` puts the package in <build>/pylib for PYTHONPATH instead.
# Both reuse the libgpipe just built (GPIPE_CMAKE_BUILD_DIR) and compile
# only the bindings; the fallback reuses pip's objects in build/temp.*.
# shellcheck disable=SC2317  # called through `bash -c python_build`
python_build() {
  export GPIPE_CMAKE_BUILD_DIR="$build"
  local how="${GPIPE_GPU_PY_INSTALL:-auto}"
  if [[ $how == auto ]]; then
    how=build
    if "$python" -c 'from setuptools.command.bdist_wheel import bdist_wheel' 2>/dev/null \
      || "$python" -c 'import wheel.bdist_wheel' 2>/dev/null; then
      how=pip
    fi
  fi
  if [[ $how == pip ]]; then
    echo "python-build: pip install (no index, no deps, no build isolation)"
    if "$python" -m pip install --no-build-isolation --no-deps --no-index --progress-bar off . \
      && (cd / && "$python" -c 'import gpipe; print("gpipe from", gpipe.__file__)'); then
      echo "pythonpath="
      return 0
    fi
    echo "python-build: pip failed; trying setup.py build"
  fi
  echo "python-build: setup.py build into $build/pylib"
  rm -rf "$build/pylib"
  "$python" setup.py build --build-lib "$build/pylib" || return 1
  (cd / && PYTHONPATH="$build/pylib" "$python" -c 'import gpipe; print("gpipe from", gpipe.__file__)') \
    || return 1
  echo "pythonpath=$build/pylib"
}
export -f python_build
export python build

# Compiles while the CUDA tests run (it uses a couple of cores; they use the GPU).
python_pid=""
if ((built_lib)); then
  (step python-build required 420 bash -c python_build >/dev/null) &
  python_pid=$!
else
  not_run python-build required "libgpipe did not build"
fi

# ---- C++ CUDA tests ---------------------------------------------------------------------
if ((built_tests)); then
  step catch2-cuda required 240 "$build/gpipe_tests" "[cuda]"
else
  not_run catch2-cuda required "gpipe_tests did not build"
fi

if [[ -n $python_pid ]]; then
  wait "$python_pid"
  echo "== python-build: $(awk -F'\t' '$1 == "python-build" {print $2 " (" $4 "s)"}' "$logs/steps.tsv")"
fi
python_ok=0
if [[ "$(awk -F'\t' '$1 == "python-build" {print $2}' "$logs/steps.tsv")" == ok ]]; then
  python_ok=1
  pythonpath="$(grep '^pythonpath=' "$logs/python-build.log" | tail -n 1 | cut -d= -f2-)"
  if [[ -n $pythonpath ]]; then
    export PYTHONPATH="$pythonpath${PYTHONPATH:+:$PYTHONPATH}"
    echo "gpu kit: PYTHONPATH=$PYTHONPATH"
  fi
else
  tail -n 40 "$logs/python-build.log" 2>/dev/null
fi

# ---- Python CUDA tests and the bench ----------------------------------------------------------
pytest_args=(-p no:cacheprovider -rfEs)
if ((python_ok)); then
  # (test_stages_on_several_gpus_over_nccl skips below 2 GPUs: run_multi.sh's part.)
  step pytest-cuda required "${GPIPE_GPU_PYTEST_LIMIT:-240}" "$python" -m pytest \
    tests/python/test_cuda.py tests/python/test_ties.py::test_a_weight_tied_between_the_cpu_and_a_gpu \
    tests/python/test_distributed.py::test_stages_on_the_gpu \
    tests/python/test_distributed.py::test_stages_on_several_gpus_over_nccl \
    tests/python/test_distributed.py::test_failing_rank_over_nccl \
    tests/python/test_distributed.py::test_pipeline_times_data_parallel_over_nccl \
    "${pytest_args[@]}" -v -s
  step bench required 180 "$python" bench/gpu.py
else
  not_run pytest-cuda required "the Python package did not build"
  not_run bench required "the Python package did not build"
fi

# ---- the rest, while time is left ---------------------------------------------------------------
# The schedules on simulated devices, on a host with a core for each of its 8
# (the CPU machines run them 4 to a core): zb_v's efficiency against perfect
# parallelism (issue 26 item 1, docs/benchmarks.md "sim").
if ((built_lib)); then
  step build-bench-sim optional 240 cmake --build "$build" --target bench_sim --parallel "$jobs" \
    && step bench-sim optional 120 "$build/bench_sim" --schedules
else
  not_run bench-sim optional "libgpipe did not build"
fi
if ((built_tests)); then
  # The CPU suites are the CPU machines' contract: Pipes there default to CPU
  # devices, and with a GPU visible they would default to cuda:0. Hidden here.
  step catch2-cpu optional 300 env CUDA_VISIBLE_DEVICES= "$build/gpipe_tests" "~[cuda]"
else
  not_run catch2-cpu optional "gpipe_tests did not build"
fi
if ((python_ok)); then
  step pytest-rest optional 300 env CUDA_VISIBLE_DEVICES= "$python" -m pytest tests/python \
    --ignore=tests/python/test_cuda.py \
    "${pytest_args[@]}" -q
else
  not_run pytest-rest optional "the Python package did not build"
fi

# ---- report ----------------------------------------------------------------------------------
if ! "$python" "$kit/report.py" write "$logs" "$report"; then
  {
    echo "# gpipe GPU check"
    echo
    echo "tests/gpu/report.py failed; the raw step records:"
    echo
    sed 's/^/    /' "$logs/steps.tsv"
  } >"$report"
fi
echo
cat "$report"
echo "gpu kit: ${SECONDS}s in all; report at $report"

status=0
while IFS=$'\t' read -r _name outcome _rc _seconds kind; do
  if [[ $outcome == ok ]]; then continue; fi
  if [[ $kind == optional && $outcome == "not run (out of time)" ]]; then continue; fi
  status=1
done <"$logs/steps.tsv"
exit $status
