#!/usr/bin/env bash
# setup.sh — installs what gpipe builds and tests with (Debian packages, requirements.txt); a no-op when all is there.
#
#   bash scripts/setup.sh
#
# Idempotent and non-interactive (works as root without sudo, with CI=true and
# no stdin). Touches the network only when something is missing:
#   * Debian: cmake, ninja-build, g++, catch2 (v2: <catch2/catch.hpp>,
#     Catch.cmake); `apt-get update` runs only when one of them is missing.
#   * Python: requirements.txt into the current `python3` environment, only
#     when an installed version differs from a pin (checked without importing
#     anything, so the no-op takes well under a second).
# The CUDA toolkit (nvcc) is not installed here: the machines come with one at
# /usr/local/cuda, and torch's CMake package (the PyPI wheel is a CUDA 13
# build) needs it even though gpipe compiles no CUDA code.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export DEBIAN_FRONTEND=noninteractive

# ---- Debian packages ---------------------------------------------------------
debian_packages=(cmake ninja-build g++ catch2)
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

# ---- Python packages -----------------------------------------------------------
python=python3
# Prints the pins of requirements.txt that the installed distributions don't meet.
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
if [[ -n "$unmet" ]]; then
  echo "setup: installing Python packages: ${unmet//$'\n'/ }"
  PIP_ROOT_USER_ACTION=ignore "$python" -m pip install --no-input --progress-bar off \
    --disable-pip-version-check -r "$root/requirements.txt" </dev/null
fi

# ---- checks that install nothing -------------------------------------------------
if ! command -v nvcc >/dev/null 2>&1 && [[ ! -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]]; then
  echo "setup: warning: no CUDA toolkit (nvcc) found; the PyPI torch wheel is a CUDA build" \
       "whose CMake package needs one (set CUDA_HOME)" >&2
fi
