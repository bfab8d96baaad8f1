#!/usr/bin/env bash
# run_multi.sh — the GPU check on a machine with 2 or more GPUs: the one-GPU kit plus what needs several.
#
#   OUT=/some/folder bash tests/gpu/run_multi.sh     # at the repo root (docs/gpu.md)
#
# It is tests/gpu/run.sh (same steps, same report) with a larger budget, after
# checking that there are at least two GPUs. With several GPUs the kit's own
# suites run their multi-GPU parts, which skip on one GPU:
#   * Catch2 [cuda]: a copy from cuda:0 into a stage on cuda:1 runs on a copy
#     stream of cuda:0; stages alternating cuda:0, cuda:1 are transparent;
#   * pytest test_cuda.py: the same two from Python;
#   * test_distributed.py::test_stages_on_several_gpus_over_nccl: NCCL with one
#     rank per GPU, 2 and 4 ranks (4 needs 4 GPUs), schedules 1f1b,
#     interleaved_1f1b, zb_h1 and zb_v, loss and grads against the plain model;
#   * ::test_failing_rank_over_nccl (4 GPUs): a rank whose layer raises, then a
#     killed rank, over NCCL: every rank's error names it, survivors exit 0;
#   * ::test_pipeline_times_data_parallel_over_nccl (4 GPUs): 2 pipelines x 2
#     replicas over NCCL, grads the plain model's.
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
python="${PYTHON:-python3}"
count="$("$python" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
if ((count < 2)); then
  echo "run_multi.sh: this machine has $count CUDA device(s); it needs 2 or more." \
    "On one GPU, run tests/gpu/run.sh." >&2
  exit 2
fi
echo "run_multi.sh: $count CUDA devices"
export GPIPE_GPU_BUDGET="${GPIPE_GPU_BUDGET:-720}"
export GPIPE_GPU_PYTEST_LIMIT="${GPIPE_GPU_PYTEST_LIMIT:-420}"
exec bash "$root/tests/gpu/run.sh"
