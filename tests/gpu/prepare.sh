#!/usr/bin/env bash
# prepare.sh — copies Debian's Catch2 (header and CMake package) into .gpu-kit/catch2/ and Gloo's headers into .gpu-kit/gloo/, to take along to a GPU machine.
#
#   bash tests/gpu/prepare.sh [DEST]      # DEST defaults to .gpu-kit/catch2
#
# Run on a machine where the Debian package catch2 (v2) is installed (ours:
# scripts/setup.sh installs it). A GPU machine may have neither Catch2 nor a
# network; tests/gpu/run.sh then finds it in the copied folder instead. The
# copy keeps Debian's layout, so its CMake package finds its header relative
# to itself:
#
#   DEST/include/catch2/*.hpp
#   DEST/lib/cmake/Catch2/*.cmake            (Catch2Config, Catch.cmake, CatchAddTests ...)
#   DEST/lib/libCatch2WithMain.a             (named by Catch2Targets; CMake checks it exists)
#
# .gpu-kit/ is ignored by git: copy it along with the tree (docs/gpu.md).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
dest="${1:-$root/.gpu-kit/catch2}"

# Where Debian put the files (dpkg knows; the usual paths otherwise).
files=()
if command -v dpkg >/dev/null 2>&1 && dpkg -L catch2 >/dev/null 2>&1; then
  mapfile -t files < <(dpkg -L catch2)
fi
find_file() {  # find_file NAME FALLBACK: the packaged file named NAME
  local f
  for f in "${files[@]}"; do
    if [[ $(basename "$f") == "$1" && -f $f ]]; then echo "$f"; return 0; fi
  done
  [[ -f $2 ]] && echo "$2"
}
header="$(find_file catch.hpp /usr/include/catch2/catch.hpp || true)"
config="$(find_file Catch2Config.cmake /usr/lib/cmake/Catch2/Catch2Config.cmake || true)"
archive="$(find_file libCatch2WithMain.a /usr/lib/libCatch2WithMain.a || true)"
if [[ -z $header || -z $config ]]; then
  echo "prepare.sh: Debian's catch2 (v2) is not installed here (no catch.hpp / Catch2Config.cmake);" \
       "install it with: bash scripts/setup.sh   (or: apt-get install catch2)" >&2
  exit 1
fi
if ! grep -q 'define CATCH_VERSION_MAJOR 2' "$header"; then
  echo "prepare.sh: $header is not Catch2 v2; the tests use <catch2/catch.hpp> from Catch2 v2" >&2
  exit 1
fi

rm -rf "$dest"
mkdir -p "$dest/include/catch2" "$dest/lib/cmake/Catch2"
cp "$(dirname "$header")"/*.hpp "$dest/include/catch2/"
cp "$(dirname "$config")"/*.cmake "$dest/lib/cmake/Catch2/"
if [[ -n $archive ]]; then
  cp "$archive" "$dest/lib/"
elif grep -q libCatch2WithMain.a "$dest"/lib/cmake/Catch2/Catch2Targets-*.cmake 2>/dev/null; then
  echo "prepare.sh: Catch2Targets names libCatch2WithMain.a but it was not found;" \
       "CMake would refuse the package" >&2
  exit 1
fi

# Prove the copy works on its own: a throwaway CMake project finds it by
# Catch2_DIR alone and gets the header from the copy.
probe="$(mktemp -d)"
trap 'rm -rf "$probe"' EXIT
cat >"$probe/CMakeLists.txt" <<'CMAKE'
cmake_minimum_required(VERSION 3.16)
project(catch2_probe NONE)
find_package(Catch2 2 REQUIRED)
include(Catch)
get_target_property(dirs Catch2::Catch2 INTERFACE_INCLUDE_DIRECTORIES)
if(NOT EXISTS "${dirs}/catch2/catch.hpp")
  message(FATAL_ERROR "Catch2::Catch2 points at ${dirs}, which holds no catch2/catch.hpp")
endif()
message(STATUS "probe: Catch2 ${Catch2_VERSION} includes ${dirs}")
CMAKE
if ! cmake -S "$probe" -B "$probe/build" "-DCatch2_DIR=$dest/lib/cmake/Catch2" \
  -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF >"$probe/log" 2>&1; then
  cat "$probe/log" >&2
  echo "prepare.sh: CMake cannot use the copy in $dest" >&2
  exit 1
fi
grep 'probe:' "$probe/log" | sed 's/^-- /prepare.sh: /'

# Gloo's headers too (Debian's libgloo-dev), beside the Catch2 copy: a GPU
# machine without apt then still builds gpipe::distributed::init_process_group
# with Gloo (run.sh points CMake at them; CMake's own check decides whether
# they build torch's ProcessGroupGloo there).
gloo_dest="$(dirname "$dest")/gloo/include"
if [[ -f /usr/include/gloo/algorithm.h ]]; then
  rm -rf "$gloo_dest"
  mkdir -p "$gloo_dest"
  cp -r /usr/include/gloo "$gloo_dest/"
  echo "prepare.sh: Gloo's headers copied to $gloo_dest ($(du -sh "$gloo_dest" | cut -f1))"
else
  echo "prepare.sh: no Gloo headers here (install libgloo-dev: bash scripts/setup.sh); the GPU" \
       "machine's build will make no Gloo groups from C++ unless it has them"
fi

echo "prepare.sh: Catch2 copied to $dest ($(du -sh "$dest" | cut -f1)); copy it along with the tree"
echo "  to the GPU machine (it is git-ignored) and run there: bash tests/gpu/run.sh"
