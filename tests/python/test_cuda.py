# test_cuda.py — the Pipe contract on CUDA from Python: one GPU, mixed devices, memory, failures.
"""CUDA tests of gpipe.Pipe with Python layers; skipped (with the reason shown by
``pytest -rs``) when no CUDA device is present. tests/gpu/run.sh runs them on a
lent GPU machine; tests/cpp/test_cuda.cpp holds the C++ twins.

Why these prove the CUDA rules of DESIGN.md: with every stage on cuda:0, each
stage computes on its own stream and hand-overs are ordered by events only;
the output lives on cuda:0, so ``backward()`` reaches the Pipe's node on the
autograd engine's cuda:0 thread, which every stage's own backward also needs
(the deadlock rule; a hang fails the test through ``call_with_timeout``).
"""
import copy
import time
from typing import Any, List

import pytest
import torch
from torch import Tensor, nn

import gpipe
from conftest import (CPU, MODES, TOL, MyError, RaiseInBackward, RaiseOnMicrobatch,
                      assert_same_grads, check_recovers, max_diff, mlp, notes, raises_within_timeout,
                      result)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

GPU = torch.device("cuda", 0)


def check_step(pipe: gpipe.Pipe, ref: nn.Sequential, x: Tensor, ref_device: torch.device,
               out_device: torch.device) -> None:
    """One forward and backward through ``pipe`` and through ``ref`` (on ``ref_device``):
    output, input grad and every parameter grad agree; the output is on ``out_device``
    and the input grad where the input is."""
    x_pipe = x.detach().clone().requires_grad_()
    x_ref = x.detach().to(ref_device).requires_grad_()
    weight = torch.randn(x.shape[0], 3, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(1))

    def step() -> Tensor:
        out = pipe(x_pipe)
        (out * weight.to(out.device)).sum().backward()
        return out

    out = result(step)
    want = ref(x_ref)
    (want * weight.to(ref_device)).sum().backward()

    assert out.device == out_device
    d = max_diff(out, want)
    assert d <= TOL, f"output: max difference {d:.3e}"
    assert x_pipe.grad is not None and x_pipe.grad.device == x_pipe.device
    d = max_diff(x_pipe.grad, x_ref.grad)
    assert d <= TOL, f"input grad: max difference {d:.3e}"
    assert_same_grads(pipe, ref)


# -- one GPU: separate streams, events, the deadlock rule ---------------------

@pytest.mark.parametrize("rows", [16, 7])
@pytest.mark.parametrize("balance", [[5, 2], [1, 2, 2, 2]], ids=["2-stages", "4-stages"])
@pytest.mark.parametrize("checkpoint", MODES)
def test_one_gpu_transparent(checkpoint, balance, rows):
    model = mlp()
    ref = copy.deepcopy(model).to(GPU)
    pipe = gpipe.Pipe(model, balance=balance, devices=[GPU] * len(balance), chunks=4,
                      checkpoint=checkpoint)
    assert all(p.device == GPU for p in pipe.parameters())
    x = torch.randn(rows, 5, dtype=torch.float64, device=GPU)
    check_step(pipe, ref, x, GPU, GPU)
    # A second step accumulates grads like the Sequential.
    check_step(pipe, ref, torch.randn(rows, 5, dtype=torch.float64, device=GPU), GPU, GPU)


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_one_gpu_inference(checkpoint):
    model = mlp()
    ref = copy.deepcopy(model).to(GPU)
    pipe = gpipe.Pipe(model, balance=[1, 2, 2, 2], devices=[GPU] * 4, chunks=4,
                      checkpoint=checkpoint)
    x = torch.randn(13, 5, dtype=torch.float64, device=GPU)
    with torch.no_grad():
        want = ref(x)

    def infer() -> Tensor:
        with torch.no_grad():
            return pipe(x)

    out = result(infer)
    assert not out.requires_grad
    assert max_diff(out, want) <= TOL
    pipe.eval()
    assert max_diff(result(lambda: pipe(x)), want) <= TOL


# -- CPU and GPU mixed ----------------------------------------------------------

@pytest.mark.parametrize("devices", [[CPU, GPU, GPU, CPU], [CPU, CPU, GPU, GPU]],
                         ids=["cpu-gpu-gpu-cpu", "cpu-cpu-gpu-gpu"])
@pytest.mark.parametrize("checkpoint", MODES)
def test_mixed_devices_transparent(checkpoint, devices):
    model = mlp()
    ref = copy.deepcopy(model)  # stays on the CPU
    balance = [1, 2, 2, 2]
    pipe = gpipe.Pipe(model, balance=balance, devices=devices, chunks=4, checkpoint=checkpoint)
    stage_of = [0, 1, 1, 2, 2, 3, 3]
    for k, layer in enumerate(pipe):
        for p in layer.parameters():
            assert p.device == devices[stage_of[k]], f"layer {k}"
    # Input on the CPU, output on the last stage's device.
    check_step(pipe, ref, torch.randn(10, 5, dtype=torch.float64), CPU, devices[-1])


@pytest.mark.parametrize("input_device, first", [(CPU, GPU), (GPU, CPU)],
                         ids=["cpu-input-gpu-stage", "gpu-input-cpu-stage"])
def test_input_grad_comes_back_on_the_input_device(input_device, first):
    """autograd refuses a grad on another device than its tensor, so the Pipe must hand
    the input grad back where the input is: a CPU batch into GPU stages (the usual
    case), and a GPU batch into a CPU first stage."""
    model = mlp()
    ref = copy.deepcopy(model)
    pipe = gpipe.Pipe(model, balance=[5, 2], devices=[first, GPU], chunks=3)
    check_step(pipe, ref, torch.randn(9, 5, dtype=torch.float64, device=input_device), CPU, GPU)


# -- checkpoint memory ------------------------------------------------------------

def deep_mlp() -> nn.Sequential:
    """32 x (Linear(256, 256), ReLU), float32: at 16384 rows one activation is 16 MiB, all
    parameters together 8 MiB, so activations decide the peak."""
    layers: List[nn.Module] = []
    for _ in range(32):
        layers += [nn.Linear(256, 256), nn.ReLU()]
    return nn.Sequential(*layers)


def step_peak_bytes(checkpoint: str) -> int:
    """Bytes allocated on cuda:0 above the step's start, at the peak of one training step."""
    pipe = gpipe.Pipe(deep_mlp(), balance=[16] * 4, devices=[GPU] * 4, chunks=4,
                      checkpoint=checkpoint)
    x = torch.randn(16384, 256, device=GPU)

    def step() -> None:
        result(lambda: pipe(x).mean().backward())

    # The first step creates what later ones reuse (cuBLAS workspaces per
    # stream and thread, the parameters' grads): not what we measure.
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(GPU)
    before = torch.cuda.memory_allocated(GPU)
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(GPU) - before


def test_checkpoint_always_needs_clearly_less_memory_than_never():
    peaks = {mode: step_peak_bytes(mode) for mode in ["never", "except_last", "always"]}
    mib = {mode: round(b / 2**20, 1) for mode, b in peaks.items()}
    print(f"checkpoint memory, peak MiB above the step's start: {mib}")
    assert peaks["never"] > 0
    assert peaks["always"] < 0.6 * peaks["never"], mib
    assert peaks["except_last"] < peaks["never"], mib
    assert peaks["always"] <= peaks["except_last"], mib


# -- caching allocator and streams under load ----------------------------------------

@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_many_microbatches_without_synchronisation(checkpoint):
    """Four stages of unequal cost on one GPU, 32 micro-batches: cheap stages race
    ahead, so a buffer freed too early would be reused while the next stage still
    reads it. No synchronisation until all steps are done."""
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(),
                          nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(),
                          nn.Linear(512, 64), nn.Tanh(), nn.Linear(64, 8)).double()
    ref = copy.deepcopy(model).to(GPU)
    pipe = gpipe.Pipe(model, balance=[1, 6, 2, 2], devices=[GPU] * 4, chunks=32,
                      checkpoint=checkpoint)
    steps = 6

    def run() -> List[Any]:
        kept = []
        for _ in range(steps):
            x = torch.randn(512, 64, dtype=torch.float64, device=GPU, requires_grad=True)
            out = pipe(x)
            # Churn the allocator on the caller's stream meanwhile.
            junk = torch.full((512, 512), float("nan"), dtype=torch.float64, device=GPU)
            out.pow(2).sum().backward()
            del junk
            kept.append((x.detach(), out.detach(), x.grad))
        return kept

    for k, (x, out, grad) in enumerate(result(run)):
        x_ref = x.clone().requires_grad_()
        want = ref(x_ref)
        want.pow(2).sum().backward()
        assert max_diff(out, want) <= TOL, f"step {k}: output"
        assert max_diff(grad, x_ref.grad) <= TOL, f"step {k}: input grad"
    assert_same_grads(pipe, ref)


# -- failures -------------------------------------------------------------------------

def three_gpu_stages(middle: nn.Module) -> nn.Sequential:
    """Stage 0: Linear; stage 1: Linear, ``middle``; stage 2: Linear (float64)."""
    return nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), middle, nn.Linear(3, 3)).double()


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_forward_error_in_a_cuda_stage_is_the_layers_own(checkpoint):
    err = MyError("boom on micro-batch 2")
    seq = three_gpu_stages(RaiseOnMicrobatch(err, 2))
    ref = copy.deepcopy(seq).to(GPU)
    pipe = gpipe.Pipe(seq, balance=[1, 2, 1], devices=[GPU] * 3, chunks=4, checkpoint=checkpoint)
    x = torch.randn(8, 3, dtype=torch.float64, device=GPU, requires_grad=True)
    raised = raises_within_timeout(lambda: pipe(x))
    assert raised is err
    text = notes(raised)
    assert "stage 1" in text and "micro-batch 2" in text and "forward" in text, text
    check_recovers(pipe, ref, GPU)


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_backward_error_in_a_cuda_stage_is_the_layers_own(checkpoint):
    """Raised on the autograd engine's cuda:0 thread, which drives the backward."""
    err = MyError("boom in backward")
    seq = three_gpu_stages(RaiseInBackward(err))
    ref = copy.deepcopy(seq).to(GPU)
    pipe = gpipe.Pipe(seq, balance=[1, 2, 1], devices=[GPU] * 3, chunks=4, checkpoint=checkpoint)
    x = torch.randn(8, 3, dtype=torch.float64, device=GPU, requires_grad=True)
    out = result(lambda: pipe(x))
    raised = raises_within_timeout(lambda: out.sum().backward())
    assert raised is err
    text = notes(raised)
    # Backward runs micro-batches last to first: stage 1 fails on 3.
    assert "stage 1" in text and "micro-batch 3" in text and "backward" in text, text
    del out
    check_recovers(pipe, ref, GPU)


def test_destroying_cuda_pipes_never_blocks():
    """Idle, after a success, right after a failure: each Pipe dies promptly."""
    def make_and_drop() -> float:
        slowest = 0.0
        for k in range(9):
            middle = RaiseOnMicrobatch(MyError("dropped"), 1)
            middle.armed = k % 3 == 2
            pipe = gpipe.Pipe(three_gpu_stages(middle), balance=[1, 2, 1], devices=[GPU] * 3,
                              chunks=3)
            x = torch.randn(6, 3, dtype=torch.float64, device=GPU)
            if k % 3 == 1:
                pipe(x).sum().backward()
            elif k % 3 == 2:
                with pytest.raises(MyError):
                    pipe(x)
            start = time.monotonic()
            del pipe
            slowest = max(slowest, time.monotonic() - start)
        return slowest

    assert result(make_and_drop) < 5.0
