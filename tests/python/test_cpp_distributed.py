"""C++ beyond one process with no Python in the ranks: examples/train_distributed.cpp (a
LibTorch program that makes its Gloo group with gpipe::distributed::init_process_group) trains
2 ranks under ``torchrun --no-python``, exactly as the plain model (the example checks loss,
grads and weights on every rank and prints ``rank r: OK``). ctest runs the same program with
no launcher, where it starts its ranks itself."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_distributed import SPAWN_DEADLINE, _free_port

ROOT = Path(__file__).resolve().parents[2]


def _example() -> Path:
    build = Path(os.environ.get("GPIPE_CMAKE_BUILD_DIR") or ROOT / "build")
    return build / "example_train_distributed"


def test_cpp_ranks_train_under_torchrun_no_python():
    example = _example()
    if not example.is_file():
        pytest.skip(f"no {example}: build the examples (scripts/build.sh) or point "
                    f"GPIPE_CMAKE_BUILD_DIR at such a build")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(_free_port()), "--no-python", str(example)],
                          env=env, capture_output=True, text=True, timeout=SPAWN_DEADLINE)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "rank 0: OK" in out and "rank 1: OK" in out, out
    for schedule in ("gpipe", "1f1b", "zb_h1", "zb_v"):
        assert out.count(f" {schedule} ") >= 2, (schedule, out)
