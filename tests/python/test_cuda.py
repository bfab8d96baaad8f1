# test_cuda.py — the Pipe contract on CUDA from Python: one GPU, mixed devices, memory, streams, trace, failures.
"""CUDA tests of gpipe.Pipe with Python layers; skipped (with the reason shown by
``pytest -rs``) when no CUDA device is present. tests/gpu/run.sh runs them on a
machine with a GPU; tests/cpp/test_cuda.cpp holds the C++ twins.

Why these prove gpipe's CUDA rules (docs/gpu.md): with every stage on cuda:0, each
stage computes on its own stream and hand-overs are ordered by events only;
the output lives on cuda:0, so ``backward()`` reaches the Pipe's node on the
autograd engine's cuda:0 thread, which every stage's own backward also needs
(the deadlock rule; a hang fails the test through ``call_with_timeout``).

The caller's streams: training loops with ``optimizer.step()`` between steps
and grads read on the current stream right after ``backward()``, with no
synchronisation; a "ballast" (tens of ms of matmuls on the current stream)
makes a missing wait show as wrong numbers. The trace: a CPU stage's backward
overlaps the CUDA stage's, on its own worker thread.
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
    want = ref(x_ref)
    # A weight of the output's shape, so every output element's grad differs.
    weight = torch.randn(want.shape, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(1))

    def step() -> Tensor:
        out = pipe(x_pipe)
        (out * weight.to(out.device)).sum().backward()
        return out

    out = result(step)
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


# -- the caller's streams -------------------------------------------------------------

def ballast(device: torch.device = GPU) -> None:
    """Keeps the current stream of ``device`` busy for tens of milliseconds (20 float32
    matmuls of 4096 x 4096, values kept bounded): work queued after it there runs late."""
    a = torch.randn(4096, 4096, device=device)
    for _ in range(20):
        a = torch.tanh(a @ a / 64)


@pytest.mark.parametrize("checkpoint", ["except_last", "never"])
def test_optimizer_steps_between_steps_match_the_plain_model(checkpoint):
    """20 steps, CPU input, GPU stages. ``optimizer.step()`` updates the parameters in
    place on the current stream, late (behind a ballast): the next forward's stages must
    wait for it or compute with the old parameters. The grads it reads must be the
    finished ones; ``zero_grad()`` frees them every step."""
    torch.manual_seed(11)
    model = nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                          nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 4)).double()
    ref = copy.deepcopy(model).to(GPU)
    pipe = gpipe.Pipe(model, balance=[2, 2, 2, 1], devices=[GPU] * 4, chunks=8,
                      checkpoint=checkpoint)
    data = [(torch.randn(128, 32, dtype=torch.float64), torch.randn(128, 4, dtype=torch.float64))
            for _ in range(20)]

    def train(module: nn.Module, late: bool) -> List[Tensor]:
        sgd = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
        losses = []
        for x, target in data:
            sgd.zero_grad()
            out = module(x if late else x.to(GPU))  # the Pipe takes the CPU batch
            loss = nn.functional.mse_loss(out, target.to(out.device))
            loss.backward()
            if late:
                ballast()
            sgd.step()
            losses.append(loss.detach())
        return losses

    got = result(lambda: train(pipe, late=True))
    want = train(ref, late=False)
    for k, (a, b) in enumerate(zip(got, want)):
        assert max_diff(a, b) <= TOL, f"step {k}: loss"
    for (name, p), (_, q) in zip(pipe.named_parameters(), ref.named_parameters()):
        assert max_diff(p, q) <= TOL, f"parameter {name} after 20 steps"


def test_a_pinned_input_refilled_right_after_forward_was_read_first():
    """A pinned CPU batch into GPU stages: as with ``x.to('cuda')``, forward has read it
    when it returns, so the caller may refill its pinned buffer at once. The copy is
    queued behind a ballast on the current stream (the stages wait for it), so a copy
    left running after forward returned would read the refill."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64)).double()
    ref = copy.deepcopy(model).to(GPU)
    pipe = gpipe.Pipe(model, balance=[2, 1], devices=[GPU] * 2, chunks=4)
    buffer = torch.randn(32, 64, dtype=torch.float64).pin_memory()
    want = ref(buffer.to(GPU))

    def step() -> Tensor:
        ballast()
        with torch.no_grad():
            out = pipe(buffer)
        buffer.fill_(float("nan"))  # the next batch
        return out

    out = result(step)
    assert max_diff(out, want) <= TOL


@pytest.mark.parametrize("devices", [[GPU] * 4, [CPU, GPU, GPU, CPU]],
                         ids=["gpu-only", "cpu-gpu-gpu-cpu"])
def test_grads_read_right_after_backward_match_the_plain_model(devices):
    """Wide float64 layers keep the GPU busy after the host returns from ``backward()``:
    a clone of ``.grad`` on the current stream, unsynchronised, must still read the
    finished grads. All on cuda:0, ``backward()`` reaches the Pipe on the autograd
    engine's cuda:0 thread; with a CPU last stage, on this thread."""
    torch.manual_seed(12)
    model = nn.Sequential(nn.Linear(64, 2048), nn.Tanh(), nn.Linear(2048, 2048), nn.Tanh(),
                          nn.Linear(2048, 2048), nn.Tanh(), nn.Linear(2048, 8)).double()
    ref = copy.deepcopy(model)  # stays on the CPU
    pipe = gpipe.Pipe(model, balance=[2, 2, 2, 1], devices=devices, chunks=8, checkpoint="never")
    inputs = [torch.randn(2048, 64, dtype=torch.float64) for _ in range(3)]

    def run() -> List[List[Tensor]]:
        grads = []
        for x in inputs:
            pipe.zero_grad(set_to_none=True)
            pipe(x).pow(2).mean().backward()
            grads.append([p.grad.clone() for p in pipe.parameters()])  # no synchronisation
        return grads

    got = result(run)
    for k, x in enumerate(inputs):
        ref.zero_grad(set_to_none=True)
        ref(x).pow(2).mean().backward()
        for (name, p), g in zip(ref.named_parameters(), got[k]):
            assert max_diff(g, p.grad) <= TOL, f"step {k}: grad of {name}"


def test_cpu_stage_backward_overlaps_the_cuda_stage_in_the_trace():
    """Stage 0 on the CPU, stage 1 on cuda:0 (milliseconds of GPU work per micro-batch).
    The output is on cuda:0, so the Pipe's backward runs on the autograd engine's cuda:0
    thread: stage 1 runs inline there and stage 0 keeps its worker, so the CPU stage's
    backward of micro-batch i runs while the GPU still runs stage 1's backward of i-1.
    The trace shows that only if stage 1's cells are timed by the device."""
    torch.manual_seed(13)
    stage0: List[nn.Module] = [nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256)]
    stage1: List[nn.Module] = [nn.Linear(256, 2048)]
    for _ in range(8):
        stage1 += [nn.ReLU(), nn.Linear(2048, 2048)]
    stage1.append(nn.Linear(2048, 8))
    pipe = gpipe.Pipe(nn.Sequential(*stage0, *stage1), balance=[len(stage0), len(stage1)],
                      devices=[CPU, GPU], chunks=4, checkpoint="never")
    x = torch.randn(8192, 64)

    def step() -> None:
        pipe(x).pow(2).mean().backward()

    result(step)  # warm-up: cuBLAS, the caching allocator
    torch.cuda.synchronize()
    with gpipe.tracing(pipe) as trace:
        result(step)

    def cells(stage: int, phase: str) -> list:
        return sorted((e for e in trace.events if e.stage == stage and e.phase == phase),
                      key=lambda e: e.start_us)

    f0, b0, b1 = cells(0, "forward"), cells(0, "backward"), cells(1, "backward")
    assert len(b0) == len(b1) == 4
    shown = " ".join(f"stage {e.stage} B{e.microbatch} [{e.start_us:.0f}, {e.end_us:.0f}] "
                     f"thread {e.thread}" for e in b0 + b1)
    worker = {e.thread for e in f0}
    engine = {e.thread for e in b1}
    for e in b0:
        assert e.thread in worker, f"stage 0's backward not on its worker: {shown}"
        assert e.thread not in engine, f"stage 0's backward on the engine thread: {shown}"
    assert any(a.start_us < b.end_us and b.start_us < a.end_us for a in b0 for b in b1), \
        f"no CPU backward cell overlaps a CUDA one: {shown}"
    # Stage 0's B(i) needs stage 1's B(i): on the common timeline it starts after it
    # ended (within the placement error of device times).
    for a in b0:
        b = next(b for b in b1 if b.microbatch == a.microbatch)
        assert a.start_us >= b.end_us - 200, shown


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="fewer than 2 CUDA devices")
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_stages_alternating_between_two_gpus_transparent(checkpoint):
    """Every hand-over a device-to-device copy, forward and backward."""
    gpu1 = torch.device("cuda", 1)
    model = mlp()
    ref = copy.deepcopy(model)
    pipe = gpipe.Pipe(model, balance=[1, 2, 2, 2], devices=[GPU, gpu1, GPU, gpu1], chunks=4,
                      checkpoint=checkpoint)
    check_step(pipe, ref, torch.randn(12, 5, dtype=torch.float64, device=GPU), CPU, gpu1)
    check_step(pipe, ref, torch.randn(12, 5, dtype=torch.float64), CPU, gpu1)


@pytest.mark.parametrize("checkpoint", MODES)
def test_skip_from_a_cpu_stage_to_a_cuda_stage(checkpoint: str) -> None:
    """A skip stashed on a CPU stage and popped on a CUDA stage two stages later goes
    straight there: transparent (outputs and grads), its copy is in the trace at the
    popping stage, and its grad comes back to the CPU stage."""
    from gpipe.skip import pop, skippable, stash

    @skippable(stash=["s"])
    class Keep(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(8, 8)

        def forward(self, x):  # type: ignore[no-untyped-def]
            yield stash("s", x * 2)
            return torch.tanh(self.layer(x))

    @skippable(pop=["s"])
    class Use(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(8, 8)

        def forward(self, x):  # type: ignore[no-untyped-def]
            s = yield pop("s")
            return self.layer(x) + s

    torch.manual_seed(0)
    model = nn.Sequential(Keep(), nn.Linear(8, 8), Use()).double()
    ref = copy.deepcopy(model)
    pipe = gpipe.Pipe(model, balance=[1, 1, 1], devices=[CPU, GPU, GPU], chunks=2,
                      checkpoint=checkpoint, trace=True)
    x = torch.randn(6, 8, dtype=torch.float64)
    check_step(pipe, ref, x, CPU, GPU)
    copies = [e for e in pipe.trace.events if e.phase == "copy" and e.stage == 2]
    # Micro-batch 0 and 1: the main input comes from cuda:0 (no copy), the skip from the CPU.
    assert sorted(e.microbatch for e in copies) == [0, 1]


# -- issue 23: what a careful reading found, by construction ----------------------------

def tied_mlp(width: int) -> nn.Sequential:
    """7 layers (float64) whose first and last Linear share one weight: with balance
    [2, 2, 2, 1], a weight tied between stages 0 and 3."""
    first, last = nn.Linear(width, width), nn.Linear(width, width)
    last.weight = first.weight
    return nn.Sequential(first, nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, width), nn.Tanh(), last).double()


@pytest.mark.parametrize("checkpoint", MODES)
def test_a_weight_tied_between_stages_0_and_3_gets_every_grad(checkpoint):
    """Stages 0 and 3 on cuda:0 share a weight: each adds its grads into the one .grad on
    its own stream, 32 micro-batches, no synchronisation. The writers are ordered by the
    slot's last-writer event (graph.h), so no update is lost: the sum is the plain model's."""
    torch.manual_seed(3)
    model = tied_mlp(128)
    ref = copy.deepcopy(model).to(GPU)
    pipe = gpipe.Pipe(model, balance=[2, 2, 2, 1], devices=[GPU] * 4, chunks=32,
                      checkpoint=checkpoint)
    assert pipe[0].weight is pipe[6].weight
    x = torch.randn(256, 128, dtype=torch.float64, device=GPU)

    def step() -> None:
        for _ in range(2):  # grads accumulate over two steps, as in the plain model
            pipe(x).sum().backward()

    result(step)
    for _ in range(2):
        ref(x).sum().backward()
    assert_same_grads(pipe, ref)


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_train_step_on_one_gpu_with_a_tied_weight(schedule):
    """In-process train_step over 4 stages on cuda:0, a weight tied between stages 0 and 3:
    loss and grads equal the plain model's (zb_h1 writes weight grads in W tasks, late)."""
    torch.manual_seed(4)
    model = tied_mlp(64)
    ref = copy.deepcopy(model).to(GPU)
    pipe = gpipe.Pipe(model, balance=[2, 2, 2, 1], devices=[GPU] * 4, chunks=8,
                      schedule=schedule)
    x = torch.randn(64, 64, dtype=torch.float64, device=GPU)
    y = torch.randn(64, 64, dtype=torch.float64, device=GPU)
    loss = result(lambda: pipe.train_step(x, y, nn.functional.mse_loss))
    want = nn.functional.mse_loss(ref(x), y)
    want.backward()
    assert max_diff(loss, want) <= TOL
    assert_same_grads(pipe, ref)


def test_dropout_on_cuda_draws_the_same_masks_in_every_checkpoint_mode():
    """One seed, dropout in three stages on cuda:0: recompute replays each cell's masks,
    so 'always', 'except_last' and 'never' give bitwise the same outputs and grads."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Dropout(0.5), nn.Linear(32, 32), nn.Dropout(0.3),
                          nn.Linear(32, 32), nn.Dropout(0.2), nn.Linear(32, 4)).double()
    x = torch.randn(32, 32, dtype=torch.float64, device=GPU)
    got = {}
    for mode in MODES:
        pipe = gpipe.Pipe(copy.deepcopy(model), balance=[2, 2, 2, 1], devices=[GPU] * 4,
                          chunks=4, checkpoint=mode)
        torch.manual_seed(5)
        out = result(lambda: pipe(x))
        result(lambda: out.sum().backward())
        got[mode] = (out.detach(), [p.grad.clone() for p in pipe.parameters()])
    for mode in ("except_last", "never"):
        assert torch.equal(got[mode][0], got["always"][0]), mode
        for a, b in zip(got[mode][1], got["always"][1]):
            assert torch.equal(a, b), mode


def test_a_training_loop_under_a_stream_of_its_own_matches_the_plain_model():
    """The whole loop (forward, backward, optimizer.step()) under
    ``torch.cuda.stream(s)``, a stream that is neither the default nor a stage's, behind a
    ballast: the stages wait for it at each step's start, and it waits for them at the end."""
    torch.manual_seed(12)
    model = nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(),
                          nn.Linear(128, 4)).double()
    ref = copy.deepcopy(model).to(GPU)
    pipe = gpipe.Pipe(model, balance=[2, 2, 1], devices=[GPU] * 3, chunks=4)
    data = [(torch.randn(64, 32, dtype=torch.float64), torch.randn(64, 4, dtype=torch.float64))
            for _ in range(10)]

    def train(module: nn.Module, stream) -> List[Tensor]:
        sgd = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
        losses = []
        with torch.cuda.stream(stream):
            for x, target in data:
                sgd.zero_grad()
                if stream is not None:
                    ballast()
                out = module(x.to(GPU))
                loss = nn.functional.mse_loss(out, target.to(GPU))
                loss.backward()
                sgd.step()
                losses.append(loss.detach().clone())
        torch.cuda.synchronize()
        return losses

    got = result(lambda: train(pipe, torch.cuda.Stream()))
    want = train(ref, None)
    for k, (a, b) in enumerate(zip(got, want)):
        assert max_diff(a, b) <= TOL, f"step {k}: loss"
    for (name, p), (_, q) in zip(pipe.named_parameters(), ref.named_parameters()):
        assert max_diff(p, q) <= TOL, f"parameter {name} after 10 steps"


class ThroughTheGpu(nn.Module):
    """A layer of a CPU stage that computes on cuda:0 and comes back: its backward has
    nodes on cuda:0, which autograd runs on cuda:0's engine thread."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.linear(x).to(GPU)).cpu()


@pytest.mark.parametrize("checkpoint", MODES)
def test_a_cpu_stage_whose_graph_reaches_the_gpu_does_not_hang(checkpoint):
    """Stage 0 (CPU) runs part of its layer on cuda:0; the output lives on cuda:0, so
    backward reaches the Pipe on cuda:0's engine thread, which stage 0's backward needs
    too. Its cells' graphs name cuda:0, so it runs there, inline (the deadlock rule):
    no hang (the timeout of ``result``), and transparent."""
    torch.manual_seed(2)
    model = nn.Sequential(ThroughTheGpu(), nn.Linear(8, 8)).double()
    ref = copy.deepcopy(model)
    pipe = gpipe.Pipe(model, balance=[1, 1], devices=[CPU, GPU], chunks=4, checkpoint=checkpoint)
    check_step(pipe, ref, torch.randn(12, 8, dtype=torch.float64), CPU, GPU)


class SlowBackward(torch.autograd.Function):
    """Identity whose backward first keeps its stream busy for tens of milliseconds:
    the grad it hands on is written late on the stage's stream."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        ballast(grad.device)
        return grad * 1


class Slow(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return SlowBackward.apply(x)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="fewer than 2 CUDA devices")
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_an_input_grad_consumed_on_another_gpu_than_the_output_waits_for_its_stage(checkpoint):
    """Issue 23 item 7. A layer before the Pipe on cuda:0, run (forward and backward)
    under a stream of its own there; the Pipe's first stage on cuda:0 writes the input's
    grad late (``SlowBackward``), its last stage is on cuda:1. Autograd (torch 2.9+)
    orders the layer's backward on cuda:0 after PipeBackward's stream, the current stream
    of cuda:1: that stream must wait for the stage on cuda:0 too, or the layer reads an
    unfinished grad."""
    gpu1 = torch.device("cuda", 1)
    torch.manual_seed(13)
    pre = nn.Linear(64, 64).double().to(GPU)
    model = nn.Sequential(Slow(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)).double()
    ref_pre, ref = copy.deepcopy(pre), copy.deepcopy(model).to(GPU)
    pipe = gpipe.Pipe(model, balance=[2, 2], devices=[GPU, gpu1], chunks=4,
                      checkpoint=checkpoint)
    x = torch.randn(32, 64, dtype=torch.float64, device=GPU)

    def step() -> Tensor:
        with torch.cuda.stream(torch.cuda.Stream(GPU)):
            pipe(pre(x)).square().sum().backward()
            got = pre.weight.grad.clone()
        torch.cuda.synchronize()
        return got

    got = result(step)
    ref(ref_pre(x)).square().sum().backward()
    assert max_diff(got, ref_pre.weight.grad) <= TOL
    assert_same_grads(pipe, ref)


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_backward_under_another_stream_than_forward_waits_for_the_stages(checkpoint):
    """Issue 23 item 10. Forward under the default stream, ``backward()`` under a stream
    of its own, and the grads read there right after it returns, with no synchronisation.
    The stages add the grads into ``.grad`` themselves (no AccumulateGrad node runs),
    late (``SlowBackward`` in the last stage): the stream current at ``backward()`` must
    wait for them (the Pipe's stream leaves, csrc/pipe_backward.h)."""
    torch.manual_seed(14)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), Slow(),
                          nn.Linear(64, 8)).double()
    ref = copy.deepcopy(model).to(GPU)
    pipe = gpipe.Pipe(model, balance=[2, 3], devices=[GPU, GPU], chunks=4, checkpoint=checkpoint)
    x = torch.randn(32, 64, dtype=torch.float64, device=GPU)

    def step() -> List[Tensor]:
        loss = pipe(x).square().sum()
        side = torch.cuda.Stream(GPU)
        side.wait_stream(torch.cuda.current_stream(GPU))  # the loss is ready there
        with torch.cuda.stream(side):
            loss.backward()
            grads = [p.grad.clone() for p in pipe.parameters()]
        torch.cuda.synchronize()
        return grads

    got = result(step)
    ref(x).square().sum().backward()
    for k, (g, p) in enumerate(zip(got, ref.parameters())):
        assert max_diff(g, p.grad) <= TOL, f"parameter {k}"
