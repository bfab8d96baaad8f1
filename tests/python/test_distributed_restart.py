"""Restarts: under torchrun --max-restarts 1, a rank that dies mid-training takes the job down,
torchrun's agent starts all four ranks again, and they resume from the last checkpoint and end
with the plain model's weights (examples/train_restartable.py, 4 Gloo ranks on localhost).

The launch uses the c10d rendezvous with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as
docs/distributed.md says: with torch 2.11's defaults, Gloo's init_process_group fails in the
restarted attempt, without gpipe too (pytorch/pytorch#135712).
"""
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_distributed as td  # noqa: E402

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir,
                       "examples", "train_restartable.py")


def test_a_lost_rank_restarts_the_job_from_its_last_checkpoint(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path),
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
         "--max-restarts", "1", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"localhost:{td._free_port()}", EXAMPLE,
         "--dir", str(tmp_path / "run"), "--fail-at-step", "3"],
        env=env, capture_output=True, text=True, timeout=2 * td.SPAWN_DEADLINE)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "rank 1: dying in step 3 (attempt 0)" in out, out
    assert "attempt 1: resumed after step 2" in out, out
    assert "attempt 0 step 3" not in out and "attempt 1 step 5: loss" in out, out
    assert out.count("attempt 1, weights differ") == 4 and out.count(": OK") == 4, out
