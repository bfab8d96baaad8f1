#!/usr/bin/env bash
# sanitize.sh — builds the Catch2 suite with ASan+UBSan or TSan (build-asan/, build-tsan/) and runs it under ctest.
#
#   bash scripts/sanitize.sh address            # AddressSanitizer + UndefinedBehaviorSanitizer + LeakSanitizer
#   bash scripts/sanitize.sh thread             # ThreadSanitizer
#   bash scripts/sanitize.sh thread -R Pipe     # extra arguments go to ctest
#
# libtorch is NOT instrumented (it is the PyPI binary). What that means:
#  * ASan: works. Only gpipe's own code (and torch's inline header code
#    compiled into it) is checked; allocations are intercepted everywhere, so
#    use-after-free and leaks of tensors gpipe mishandles are still found.
#  * TSan: memory accesses inside libtorch are invisible, and so are its
#    atomics (refcounts, the generator publication, OpenMP's futex barriers).
#    Sync through pthread mutexes and condition variables is still seen. We
#    run with ignore_noninstrumented_modules=1, so interceptors (malloc, free,
#    memcpy, mutex memory) called from libtorch/libgomp don't report races on
#    memory whose ordering TSan could not see; races between two accesses in
#    gpipe's code are still reported (checked with a deliberate race).
#    scripts/tsan.supp holds what remains, each line explained. OpenMP is
#    limited to one thread (OMP_NUM_THREADS=1, override by exporting it):
#    its worker team synchronises in ways TSan cannot see.
#  * LSan: at exit, memory libtorch still holds in globals is reachable and not
#    reported; scripts/lsan.supp lists the few known leaks outside gpipe.
set -euo pipefail

mode="${1:-}"
case "$mode" in
  address) build_dir=build-asan ;;
  thread) build_dir=build-tsan ;;
  *) echo "usage: bash scripts/sanitize.sh address|thread [ctest arguments...]" >&2; exit 2 ;;
esac
shift

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# Counted before OMP_NUM_THREADS is set below: nproc honours it.
jobs="${GPIPE_JOBS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}"

# The runtime options apply already at build time: catch_discover_tests runs
# gpipe_tests after linking it, to list its test cases.
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
# protect_shadow_gap=0: the CUDA driver maps memory where ASan's shadow gap
# is (only matters on a GPU machine). detect_stack_use_after_return: worker
# threads holding references to a caller's stack frame are a bug class we
# care about.
export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:protect_shadow_gap=0:detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1"
export LSAN_OPTIONS="suppressions=$root/scripts/lsan.supp:print_suppressions=0"
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:ignore_noninstrumented_modules=1:suppressions=$root/scripts/tsan.supp:print_suppressions=0"
runner=()
if [[ "$mode" == thread ]]; then
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  # TSan's fixed memory layout can clash with a randomised mmap base on some
  # kernels ("unexpected memory mapping"); running without ASLR avoids it.
  if command -v setarch >/dev/null 2>&1 && setarch "$(uname -m)" -R true 2>/dev/null; then
    runner=(setarch "$(uname -m)" -R)
  fi
fi

bash scripts/setup.sh
source scripts/python.sh
gpipe_torch_cmake_args "$build_dir"  # -> torch_args: .venv's torch (or GPIPE_PYTHON's)
# -O1 -g1: line tables for the reports at a fraction of full debug info's
# build time; no NDEBUG, so asserts stay on.
cmake -S . -B "$build_dir" -G Ninja "${torch_args[@]}" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1" \
  -DGPIPE_SANITIZE="$mode" -DGPIPE_BUILD_EXAMPLES=OFF -DGPIPE_TEST_INSTALL=OFF
"${runner[@]}" cmake --build "$build_dir" --parallel "$jobs" --target gpipe_tests
cd "$build_dir"
"${runner[@]}" ctest --output-on-failure --no-tests=error --parallel "$jobs" -L unit "$@"
