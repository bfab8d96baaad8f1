#!/usr/bin/env bash
# setup.sh — installs what gpipe builds and tests with (Debian packages, the project's .venv); a no-op when all is there.
#
#   bash scripts/setup.sh
#   GPIPE_PYTHON=/path/to/python bash scripts/setup.sh   # use that environment as it is
#
# Idempotent and non-interactive (works as root without sudo, with CI=true and
# no stdin). Touches the network only when something is missing:
#   * Debian: cmake, ninja-build, g++, catch2 (v2: <catch2/catch.hpp>,
#     Catch.cmake), libgloo-dev (Gloo's headers, for process groups made from
#     C++: cmake/GPipeBackends.cmake), and python3 + python3-venv when there is no python3 able
#     to make a virtual environment; `apt-get update` runs only when one of
#     them is missing.
#   * Python: the project's virtual environment .venv/ (git-ignored), made by
#     `python3 -m venv --system-site-packages`, so packages already installed
#     for python3 (a matching torch: no 2 GB download) are reused, never
#     changed. requirements.txt goes into .venv, and only the pins that the
#     visible distributions don't meet (checked without importing anything,
#     so the no-op takes well under a second). Nothing is installed into
#     python3's own environment.
#   * GPIPE_PYTHON set (an absolute path, or a command on PATH): the scripts
#     build and test with that interpreter and its torch instead of .venv.
#     Nothing is installed into it here; unmet pins are listed with the
#     command that would install them (scripts/test.sh still installs the
#     package gpipe into it, as the README's manual install does).
# The CUDA toolkit (nvcc) is not installed here: the machines come with one at
# /usr/local/cuda, and torch's CMake package (the PyPI wheel is a CUDA 13
# build) needs it even though gpipe compiles no CUDA code.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/python.sh"  # gpipe_python: $GPIPE_PYTHON, else .venv/bin/python
venv="$root/.venv"
export DEBIAN_FRONTEND=noninteractive

# ---- Debian packages ---------------------------------------------------------
debian_packages=(cmake ninja-build g++ catch2 libgloo-dev)
if [[ -z ${GPIPE_PYTHON:-} ]] && [[ ! -x $venv/bin/python || ! -e $venv/bin/pip ]]; then
  # Making .venv needs a python3 with venv and ensurepip; Debian's python3
  # has them only with python3-venv installed. Another python3 (pyenv,
  # conda) is used as it is: apt cannot add ensurepip to it.
  if ! command -v python3 >/dev/null 2>&1; then
    debian_packages+=(python3 python3-venv)
  elif ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1 \
    && [[ $(python3 -c 'import sys; print(sys.base_prefix)') == /usr ]]; then
    debian_packages+=(python3-venv)
  fi
fi
missing=()
for package in "${debian_packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "ok installed"; then
    missing+=("$package")
  fi
done
if ((${#missing[@]})); then
  sudo=()
  if [[ $(id -u) -ne 0 ]]; then sudo=(sudo -n); fi
  echo "setup: installing Debian packages: ${missing[*]}"
  "${sudo[@]}" apt-get update -qq </dev/null
  "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" </dev/null
fi

# ---- the Python environment ------------------------------------------------------
python="$gpipe_python"
if [[ -n ${GPIPE_PYTHON:-} ]]; then
  if ! command -v "$python" >/dev/null 2>&1; then
    echo "setup: GPIPE_PYTHON=$python is not an executable; give an absolute path" \
         "(e.g. GPIPE_PYTHON=\$HOME/env/bin/python) or a command on PATH, or unset it to use" \
         "the project's .venv" >&2
    exit 1
  fi
else
  # A .venv without pip is one whose creation failed half-way (Debian's
  # python3 without python3-venv leaves one): make it again.
  if [[ ! -x $venv/bin/python || ! -e $venv/bin/pip ]]; then
    if ! command -v python3 >/dev/null 2>&1; then
      echo "setup: no python3 to make $venv with; install Python 3.9 or later" \
           "(Debian: apt-get install python3 python3-venv), or set GPIPE_PYTHON" >&2
      exit 1
    fi
    echo "setup: making the project's Python environment $venv ($(python3 -V 2>&1)," \
         "its packages visible)"
    if ! python3 -m venv --clear --system-site-packages "$venv" </dev/null; then
      echo "setup: \`python3 -m venv\` failed ($(command -v python3) has no working venv or" \
           "ensurepip); install them for it (Debian's python3: apt-get install python3-venv)," \
           "or set GPIPE_PYTHON to a Python with torch" >&2
      exit 1
    fi
  fi
fi

# Prints the pins of requirements.txt that the visible distributions don't meet.
unmet="$("$python" - "$root/requirements.txt" <<'PY'
import re, sys
from importlib import metadata

for line in open(sys.argv[1]):
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    match = re.fullmatch(r"([A-Za-z0-9_.\-]+)\s*==\s*(\S+)", line)
    if not match:
        print(line)  # not a plain pin: let pip decide
        continue
    name, version = match.groups()
    try:
        installed = metadata.version(name)
    except metadata.PackageNotFoundError:
        print(line)
        continue
    # Local version labels (torch's "+cu130") don't count against the pin.
    if installed.split("+", 1)[0] != version:
        print(line)
PY
)"
if [[ -n "$unmet" && -n ${GPIPE_PYTHON:-} ]]; then
  echo "setup: note: GPIPE_PYTHON=$python does not meet these pins of requirements.txt:" \
       "${unmet//$'\n'/ }; used as it is (to install them: $python -m pip install -r" \
       "requirements.txt)" >&2
  if ! "$python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)'; then
    echo "setup: GPIPE_PYTHON=$python has no torch, which gpipe builds against; install" \
         "requirements.txt into it, or unset GPIPE_PYTHON to use the project's .venv" >&2
    exit 1
  fi
elif [[ -n "$unmet" ]]; then
  echo "setup: installing into $venv: ${unmet//$'\n'/ }"
  "$python" -m pip install --no-input --progress-bar off --disable-pip-version-check \
    -r "$root/requirements.txt" </dev/null
fi

# ---- checks that install nothing -------------------------------------------------
if ! command -v nvcc >/dev/null 2>&1 && [[ ! -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]]; then
  echo "setup: warning: no CUDA toolkit (nvcc) found; the PyPI torch wheel is a CUDA build" \
       "whose CMake package needs one (set CUDA_HOME)" >&2
fi
