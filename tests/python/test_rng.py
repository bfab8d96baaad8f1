"""Seeded runs are bitwise reproducible: in one process, across fresh processes, in every schedule and checkpoint mode; one micro-batch draws the plain model's masks."""
import copy
import hashlib
import os
import subprocess
import threading
import sys
from typing import Dict, List

import pytest
import torch
from torch import nn

import gpipe
from conftest import MODES, assert_close, assert_same_grads

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1"]


class TiedLinear(nn.Module):
    """x @ other.weight^T with another stage's Linear: a weight tied across stages."""

    def __init__(self, other: nn.Linear) -> None:
        super().__init__()
        self.other = [other]  # a list: not registered as a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.other[0].weight.t()


def drawing_model(tied: bool = False) -> nn.Sequential:
    """8 float32 layers for 4 stages of 2: dropout in stages 0, 1 and 3; with ``tied`` the last
    layer reuses the first Linear's weight."""
    torch.manual_seed(17)
    first = nn.Linear(64, 64)
    last = TiedLinear(first) if tied else nn.Linear(64, 64)
    return nn.Sequential(first, nn.Dropout(0.3), nn.Linear(64, 64), nn.Dropout(0.5),
                         nn.Linear(64, 64), nn.Tanh(), nn.Dropout(0.2), last)


def digest(tensors: List[torch.Tensor]) -> str:
    """One hash of the tensors' bytes: equal iff every value is bitwise equal."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def run_job(checkpoint: str, schedule: str, tied: bool = False) -> str:
    """Two seeded steps on a fresh Pipe over 4 CPU stages, chunks 4: drop-in (``schedule``
    'drop-in') or train_step. Returns the digest of outputs, losses, grads and the generator's
    next numbers."""
    v = 2 if schedule == "interleaved_1f1b" else 1
    pipe = gpipe.Pipe(drawing_model(tied), balance=[2, 2, 2, 2], devices=["cpu"] * (4 // v),
                      chunks=4, checkpoint=checkpoint,
                      schedule=schedule if schedule != "drop-in" else "1f1b", virtual_stages=v)
    seen: List[torch.Tensor] = []
    torch.manual_seed(1234)
    for _ in range(2):
        x = torch.randn(32, 64, requires_grad=True)
        if schedule == "drop-in":
            out = pipe(x)
            (out ** 2).sum().backward()
            seen.append(out)
        else:
            seen.append(pipe.train_step(x, torch.randn(32, 64), nn.functional.mse_loss))
        seen.append(x.grad)
    seen += [p.grad for p in pipe.parameters()]
    seen.append(torch.rand(4))
    return digest(seen)


def all_jobs() -> Dict[str, str]:
    jobs = {}
    for checkpoint in MODES:
        for schedule in ["drop-in"] + SCHEDULES:
            jobs[f"{schedule} {checkpoint}"] = run_job(checkpoint, schedule)
    for schedule in ("drop-in", "1f1b", "zb_h1"):
        jobs[f"{schedule} tied"] = run_job("never", schedule, tied=True)
    return jobs


_SCRIPT = """
import sys
sys.path[:0] = {path!r}
import test_rng
for name, h in test_rng.all_jobs().items():
    print("JOB", name.replace(" ", "/"), h, flush=True)
"""


def _fresh_process_jobs() -> Dict[str, str]:
    here = os.path.dirname(os.path.abspath(__file__))
    script = _SCRIPT.format(path=[here] + sys.path)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, f"exit code {proc.returncode}; stderr:\n{proc.stderr[-3000:]}"
    jobs = {}
    for line in proc.stdout.splitlines():
        if line.startswith("JOB "):
            _, name, h = line.split()
            jobs[name.replace("/", " ")] = h
    return jobs


def test_seeded_jobs_are_bitwise_equal_in_two_fresh_processes():
    """Issue 22 item 4: the same seeded job (4 CPU stages, dropout in three, chunks 4; every
    schedule and checkpoint mode, and a weight tied across stages) in two fresh processes gives
    bitwise the same outputs, losses and grads, and leaves the generator in the same state."""
    first = _fresh_process_jobs()
    second = _fresh_process_jobs()
    assert len(first) == len(MODES) * (1 + len(SCHEDULES)) + 3, first
    differing = [name for name in first if first[name] != second.get(name)]
    assert not differing, f"these jobs differ between two processes: {differing}"


@pytest.mark.parametrize("checkpoint", MODES)
def test_seeded_jobs_are_bitwise_equal_in_one_process(checkpoint):
    for schedule in ["drop-in"] + SCHEDULES:
        runs = {run_job(checkpoint, schedule) for _ in range(3)}
        assert len(runs) == 1, f"{schedule}: {len(runs)} different results in 3 runs"


def test_a_weight_tied_across_stages_gets_bitwise_the_same_grad():
    for schedule in ("drop-in", "1f1b", "zb_h1"):
        runs = {run_job("never", schedule, tied=True) for _ in range(3)}
        assert len(runs) == 1, f"{schedule}: {len(runs)} different results in 3 runs"


def test_another_seed_draws_other_masks():
    """The comparisons above could not fail if the seed did not matter."""
    pipe = gpipe.Pipe(drawing_model(), balance=[2, 2, 2, 2], devices=["cpu"] * 4, chunks=4)
    x = torch.randn(32, 64)
    torch.manual_seed(1234)
    out_a = pipe(x)
    torch.manual_seed(1235)
    out_b = pipe(x)
    torch.manual_seed(1234)
    assert not torch.equal(out_a, out_b)
    assert torch.equal(out_a, pipe(x))


@pytest.mark.parametrize("checkpoint", MODES)
def test_one_microbatch_draws_the_plain_models_masks(checkpoint):
    """With chunks=1 the stages run one after the other and draw in the plain model's order:
    from one seed the Pipe gives the plain model's output and grads, and leaves the generator
    where the plain model leaves it."""
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Dropout(0.3),
                          nn.Linear(8, 2)).double()
    ref = copy.deepcopy(model)
    pipe = gpipe.Pipe(model, balance=[2, 2, 1], devices=["cpu"] * 3, chunks=1,
                      checkpoint=checkpoint)
    x = torch.randn(5, 6, dtype=torch.float64)

    torch.manual_seed(5)
    want = ref(x)
    (want ** 2).sum().backward()
    after_want = torch.rand(4)

    torch.manual_seed(5)
    got = pipe(x)
    (got ** 2).sum().backward()
    after_got = torch.rand(4)

    assert_close(got, want, what="output")
    assert_same_grads(pipe, ref)
    assert torch.equal(after_got, after_want)


def test_several_microbatches_advance_the_generator_by_one_draw_per_step():
    """With chunks > 1 on CPU stages the cells draw from streams of their own and the caller's
    generator advances by one draw per step, whatever the cells drew: a training step (three
    dropouts drawing) and an eval step (nothing drawing) leave it in the same state."""
    pipe = gpipe.Pipe(drawing_model(), balance=[2, 2, 2, 2], devices=["cpu"] * 4, chunks=4)
    x = torch.randn(32, 64)
    torch.manual_seed(9)
    pipe(x).sum().backward()
    after_train = torch.rand(4)
    pipe.eval()
    torch.manual_seed(9)
    with torch.no_grad():
        pipe(x)
    after_eval = torch.rand(4)
    torch.manual_seed(9)
    untouched = torch.rand(4)
    assert torch.equal(after_train, after_eval)
    assert not torch.equal(after_train, untouched)


class ColumnsMatmul(nn.Module):
    """x (features, rows) -> x.T @ table: each micro-batch arrives as a column slice."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.t() @ self.table


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_a_fresh_pipes_first_checkpointed_step_equals_its_later_ones(checkpoint):
    """Found by the fuzzer (seeds 46, 601): a fresh Pipe's first checkpointed cell keeps a copy
    of its input (it does not know yet whether the stage changes it in place); a contiguous
    copy of a column slice made the recompute's matmul sum in another order than the first
    forward's, a few ulp off the later steps and checkpoint='never'."""
    torch.manual_seed(46)
    model = nn.Sequential(ColumnsMatmul())
    x = torch.randn(4, 3, dtype=torch.float64)

    def grads(pipe: gpipe.Pipe) -> List[torch.Tensor]:
        xi = x.clone().requires_grad_()
        pipe.zero_grad()
        pipe(xi).sum().backward()
        return [xi.grad] + [p.grad.clone() for p in pipe.parameters()]

    options = dict(balance=[1], devices=["cpu"], chunks=2, batch_dim=1, output_batch_dim=0)
    pipe = gpipe.Pipe(copy.deepcopy(model), checkpoint=checkpoint, **options)
    never = grads(gpipe.Pipe(copy.deepcopy(model), checkpoint="never", **options))
    steps = [grads(pipe) for _ in range(3)]
    for step in steps:
        for got, want in zip(step, never):
            assert torch.equal(got, want), (got - want).abs().max().item()


def nested_dropouts_model(scripted: bool = False) -> nn.Sequential:
    """4 float32 layers for 4 stages, the dropouts nested in stages 1 and 3 (in ScriptModules
    with ``scripted``)."""
    torch.manual_seed(17)
    wrap = torch.jit.script if scripted else (lambda m: m)
    return nn.Sequential(nn.Linear(64, 64), wrap(nn.Sequential(nn.Tanh(), nn.Dropout(0.3))),
                         nn.Linear(64, 64), wrap(nn.Sequential(nn.Tanh(), nn.Dropout(0.5))))


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("switch", ["pipe", "nested dropouts", "scripted dropouts"])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_a_stage_back_in_training_draws_from_its_cells_own_streams(switch, checkpoint):
    """A stage that drew nothing in a step starts the next one known not to draw while its modes
    stay (its cells then run side by side); a Pipe whose dropouts drew nothing in eval steps must
    draw, once back in training, what a fresh Pipe draws from the same seed (each cell's own
    stream), not from the live generator in the threads' order: also when only a nested
    module's flag changes, in a ScriptModule too."""
    scripted = switch == "scripted dropouts"

    def pipe_of() -> gpipe.Pipe:
        return gpipe.Pipe(nested_dropouts_model(scripted), balance=[1, 1, 1, 1],
                          devices=["cpu"] * 4, chunks=4, checkpoint=checkpoint)

    x = torch.randn(32, 64)
    fresh = pipe_of()
    torch.manual_seed(3)
    want = fresh(x)

    pipe = pipe_of()
    dropouts = [m for m in pipe.modules()
                if isinstance(m, nn.Dropout) or getattr(m, "original_name", "") == "Dropout"]
    assert len(dropouts) == 2

    def set_training(mode: bool) -> None:
        for module in [pipe] if switch == "pipe" else dropouts:
            module.train(mode)

    set_training(False)
    pipe(x)  # draws nothing, and learns it
    pipe(x)  # keeps it
    set_training(True)
    torch.manual_seed(3)
    got = pipe(x)
    assert torch.equal(got, want)
    assert (got == 0).any()  # the dropouts drew


class Meeting:
    """Two cells that should be able to run at once: each waits, up to two seconds, until both
    are inside."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.inside = 0
        self.together = False
        self.met = 0
        self.armed = False


class Meet(nn.Module):
    """Identity that meets on the micro-batch whose first element is ``microbatch``, while the
    meeting is armed (in forwards, not recomputes)."""

    def __init__(self, meeting: Meeting, microbatch: float) -> None:
        super().__init__()
        self.meeting = meeting
        self.microbatch = microbatch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if gpipe.is_recomputing() or x[0, 0].item() != self.microbatch:
            return x
        m = self.meeting
        with m.changed:
            if not m.armed:
                return x
            m.inside += 1
            if m.inside == 2:
                m.together = True
            m.changed.notify_all()
            if m.changed.wait_for(lambda: m.together, timeout=2.0):
                m.met += 1
            m.inside -= 1
        return x


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_from_its_second_step_on_a_stage_that_draws_nothing_runs_at_once_with_the_others(
        checkpoint):
    """The first cell of a stage not known to draw runs alone (it learns); relearning that at
    every step ran each stage's first cell of every step alone. Two CPU stages, two
    micro-batches: stage 1's first cell and stage 0's second must overlap from the second step
    on (the Python stage's training flags must compare equal from step to step)."""
    meeting = Meeting()
    pipe = gpipe.Pipe(nn.Sequential(Meet(meeting, 1.0), Meet(meeting, 0.0)), balance=[1, 1],
                      devices=["cpu", "cpu"], chunks=2, checkpoint=checkpoint)
    x = torch.cat([torch.zeros(2, 4), torch.ones(2, 4)]).requires_grad_()
    pipe(x).sum().backward()  # the first step learns that nothing draws
    for step in (1, 2):
        with meeting.changed:
            meeting.armed, meeting.together, meeting.met = True, False, 0
        pipe(x).sum().backward()
        assert meeting.met == 2, step
