# python.sh — sourced by the other scripts: the Python, and so the torch, that gpipe builds and tests with.
#
#   root=<repository root>; source "$root/scripts/python.sh"
#   "$gpipe_python" -m pytest ...          # $GPIPE_PYTHON when set, else .venv/bin/python
#   gpipe_torch_cmake_args DIR             # sets torch_args: CMake arguments naming its torch
#
# scripts/setup.sh makes .venv (or checks GPIPE_PYTHON); run it first.
# shellcheck shell=bash disable=SC2034  # gpipe_python, torch_args: for the sourcing script

gpipe_python="${GPIPE_PYTHON:-$root/.venv/bin/python}"

# gpipe_torch_cmake_args BUILD_DIR: sets the array torch_args to -DTorch_DIR=... and
# -DGPIPE_PYTHON_EXECUTABLE=... for gpipe_python's torch. CMake caches the
# libraries of the torch it first found, so a build dir configured against
# another torch (another Python) is emptied first: gpipe._C, built by pip
# with that Python, must link the same torch as libgpipe.
gpipe_torch_cmake_args() {
  local build_dir="$1" torch_dir cached
  torch_dir="$("$gpipe_python" -c '
import importlib.util, os, sys
spec = importlib.util.find_spec("torch")
if spec is None:
    sys.exit(f"{sys.executable} has no torch; run scripts/setup.sh, or set GPIPE_PYTHON to a Python with torch")
print(os.path.realpath(os.path.join(spec.submodule_search_locations[0], "share", "cmake", "Torch")))
')" || return 1
  if [[ -f $build_dir/CMakeCache.txt ]]; then
    cached="$(sed -n 's/^Torch_DIR:[A-Z]*=//p' "$build_dir/CMakeCache.txt")"
    if [[ -n $cached && $(realpath -m "$cached") != "$torch_dir" ]]; then
      echo "build: $build_dir was configured against the torch at $cached; starting it afresh" \
           "for $gpipe_python's ($torch_dir)" >&2
      rm -rf "$build_dir"
    fi
  fi
  torch_args=("-DTorch_DIR:PATH=$torch_dir" "-DGPIPE_PYTHON_EXECUTABLE:FILEPATH=$gpipe_python")
}
