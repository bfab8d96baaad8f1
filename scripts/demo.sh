#!/usr/bin/env bash
# demo.sh — builds and runs the C++ example examples/train_mlp.cpp (a Pipe training an MLP).
#
#   bash scripts/demo.sh
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/build.sh example_train_mlp
exec "${GPIPE_BUILD_DIR:-build}/example_train_mlp"
