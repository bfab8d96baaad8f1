"""Checkpointing: what each mode checkpoints and recomputes, the phase flags, exact recompute."""
import copy
import weakref
from typing import List, Tuple

import pytest
import torch
from torch import nn

import gpipe
from conftest import MODES, Counter, assert_close, assert_same_grads

FIRST = (True, False)      # (is_checkpointing, is_recomputing) in a checkpointed first forward
RECOMPUTE = (False, True)  # ... in a recompute
PLAIN = (False, False)     # ... anywhere else


def probed(chunks: int, checkpoint, schedule: str = "1f1b") -> Tuple[gpipe.Pipe, List[Counter]]:
    """Two stages, each opening with a probe that records the flags it sees per call."""
    probes = [Counter(), Counter()]
    seq = nn.Sequential(probes[0], nn.Linear(3, 3), probes[1], nn.Linear(3, 2)).double()
    return gpipe.Pipe(seq, balance=[2, 2], chunks=chunks, checkpoint=checkpoint,
                      schedule=schedule), probes


def expected_flags(checkpoint: str, m: int) -> List[Tuple[bool, bool]]:
    """What one stage's probe sees over one forward and backward of m micro-batches."""
    checkpointed = {"always": m, "except_last": m - 1, "never": 0}[checkpoint]
    forwards = [FIRST] * checkpointed + [PLAIN] * (m - checkpointed)
    return forwards + [RECOMPUTE] * checkpointed


@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("checkpoint", MODES)
def test_flags_per_mode(checkpoint, chunks):
    pipe, probes = probed(chunks, checkpoint)
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    out = pipe(x)
    for probe in probes:
        assert len(probe.forwards) == chunks
    out.sum().backward()
    for j, probe in enumerate(probes):
        assert probe.forwards == expected_flags(checkpoint, chunks), f"stage {j}"
        assert probe.backwards == chunks, f"stage {j}: one backward per micro-batch"


@pytest.mark.parametrize("modes", [["always", "never"], ["never", "except_last"],
                                   ["except_last", "always"]])
def test_a_mode_per_stage(modes):
    """Issue 26 item 3: checkpoint=[mode per stage]: each stage checkpoints as its own mode
    says, drop-in and train_step, and the grads are the plain model's."""
    pipe, probes = probed(3, modes)
    assert pipe.checkpoint == modes
    ref = copy.deepcopy(nn.Sequential(*pipe.children()))
    x = torch.randn(6, 3, dtype=torch.float64)
    pipe(x).sum().backward()
    for j, probe in enumerate(probes):
        assert probe.forwards == expected_flags(modes[j], 3), f"stage {j}"
    ref(x).sum().backward()
    assert_same_grads(pipe, ref)
    # train_step, every schedule: the flags and the grads again.
    for schedule in ("gpipe", "1f1b", "zb_h1"):
        pipe, probes = probed(3, modes, schedule)
        ref = copy.deepcopy(nn.Sequential(*pipe.children()))
        y = torch.randn(6, 2, dtype=torch.float64)
        loss = pipe.train_step(x, y, nn.functional.mse_loss)
        want = nn.functional.mse_loss(ref(x), y)
        want.backward()
        assert abs(loss.item() - want.item()) <= 1e-12
        assert_same_grads(pipe, ref)
        for j, probe in enumerate(probes):
            checkpointed = sum(1 for f in probe.forwards if f == FIRST)
            assert checkpointed == {"always": 3, "except_last": 2, "never": 0}[modes[j]], (
                schedule, j, probe.forwards)


def test_a_mode_per_stage_is_checked():
    seq = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    with pytest.raises(ValueError, match="checkpoint has 3 modes for 2 stages; give one mode, "
                                         "or one per stage"):
        gpipe.Pipe(seq, balance=[1, 1], chunks=2, checkpoint=["never"] * 3)
    with pytest.raises(ValueError, match="checkpoint is not one of .* got 'sometimes'"):
        gpipe.Pipe(seq, balance=[1, 1], chunks=2, checkpoint=["never", "sometimes"])
    with pytest.raises(ValueError, match="checkpoint is an empty list"):
        gpipe.Pipe(seq, balance=[1, 1], chunks=2, checkpoint=[])


def test_flags_with_fewer_rows_than_chunks():
    pipe, probes = probed(chunks=5, checkpoint="always")
    pipe(torch.randn(2, 3, dtype=torch.float64, requires_grad=True)).sum().backward()
    for probe in probes:
        assert probe.forwards == expected_flags("always", 2)


@pytest.mark.parametrize("checkpoint", MODES)
def test_no_checkpointing_in_eval_with_grad(checkpoint):
    pipe, probes = probed(chunks=3, checkpoint=checkpoint)
    pipe.eval()
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    pipe(x).sum().backward()
    assert x.grad is not None
    for probe in probes:
        assert probe.forwards == [PLAIN] * 3   # nothing checkpointed, nothing recomputed
        assert probe.backwards == 3


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("checkpoint", MODES)
def test_no_checkpointing_under_no_grad(checkpoint, training):
    pipe, probes = probed(chunks=3, checkpoint=checkpoint)
    pipe.train(training)
    with torch.no_grad():
        out = pipe(torch.randn(6, 3, dtype=torch.float64, requires_grad=True))
    assert not out.requires_grad
    for probe in probes:
        assert probe.forwards == [PLAIN] * 3


def test_flags_false_outside_the_pipe():
    assert not gpipe.is_checkpointing() and not gpipe.is_recomputing()
    probe = Counter()
    plain = nn.Sequential(probe, nn.Linear(3, 3)).double()
    plain(torch.randn(4, 3, dtype=torch.float64, requires_grad=True)).sum().backward()
    assert probe.forwards == [PLAIN]

    pipe, _ = probed(chunks=3, checkpoint="always")
    out = pipe(torch.randn(6, 3, dtype=torch.float64, requires_grad=True))
    assert not gpipe.is_checkpointing() and not gpipe.is_recomputing()
    out.sum().backward()
    assert not gpipe.is_checkpointing() and not gpipe.is_recomputing()


class SeeGradMode(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seen: List[Tuple[bool, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((gpipe.is_recomputing(), torch.is_grad_enabled()))
        return x * 2


def test_recompute_builds_a_graph():
    """A recompute runs with grad mode on: it is the forward whose graph backward uses."""
    probe = SeeGradMode()
    pipe = gpipe.Pipe(nn.Sequential(nn.Linear(3, 3), probe).double(), balance=[1, 1], chunks=2,
                      checkpoint="always")
    pipe(torch.randn(4, 3, dtype=torch.float64)).sum().backward()
    assert [grad for recomputing, grad in probe.seen if recomputing] == [True, True]


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_dropout_recompute_is_exact(checkpoint):
    """Two Dropout(0.5) on two CPU stages sharing one generator: on ones, the
    input grad equals the output iff each recompute drew its cell's masks."""
    pipe = gpipe.Pipe(nn.Sequential(nn.Dropout(0.5), nn.Dropout(0.5)), balance=[1, 1], chunks=4,
                      checkpoint=checkpoint)
    repeats = 100 if checkpoint == "always" else 30
    for r in range(repeats):
        x = torch.ones(8, 16, dtype=torch.float64, requires_grad=True)
        out = pipe(x)
        out.sum().backward()
        kept = (out != 0).double().mean().item()
        assert 0.05 < kept < 0.5, f"repeat {r}: {kept:.2f} of the output kept (expected ~0.25)"
        assert torch.equal(x.grad, out.detach()), (
            f"repeat {r}: input grad differs from the output at "
            f"{(x.grad != out.detach()).sum().item()} of {out.numel()} places")


@pytest.mark.parametrize("checkpoint", MODES)
def test_single_stage_dropout_equals_plain_per_microbatch(checkpoint):
    """One stage draws its micro-batches' masks in order, as the plain model
    does run micro-batch by micro-batch; after a recompute the generator
    continues where the forward left it."""
    seq = nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.3), nn.Tanh(), nn.Linear(6, 2),
                        nn.Dropout(0.3)).double()
    ref = copy.deepcopy(seq)
    pipe = gpipe.Pipe(seq, balance=[5], chunks=3, checkpoint=checkpoint)
    x = torch.randn(9, 6, dtype=torch.float64)

    torch.manual_seed(123)
    want = torch.cat([ref(part) for part in x.chunk(3)])
    want.pow(2).sum().backward()
    after_want = torch.rand(4)

    torch.manual_seed(123)
    out = pipe(x)
    out.pow(2).sum().backward()
    after_out = torch.rand(4)

    assert_close(out, want, what="output")
    assert_same_grads(pipe, ref)
    assert torch.equal(after_out, after_want), "the generator did not continue where it was"


class Track(nn.Module):
    """Records a weak reference to each activation it makes, to see what a graph keeps."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: List[weakref.ref] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 1  # the next Linear saves it for backward when a graph is kept
        self.refs.append(weakref.ref(y))
        return y

    def alive(self) -> int:
        return sum(r() is not None for r in self.refs)


@pytest.mark.parametrize("training,grad", [(True, True), (False, True), (True, False)],
                         ids=["train", "eval", "no_grad"])
@pytest.mark.parametrize("checkpoint", MODES)
def test_what_a_forward_keeps(checkpoint, training, grad):
    """A checkpointed cell keeps only its boundary input: activations inside a
    stage die after forward. Non-checkpointed cells keep them until backward;
    under no_grad nothing is kept."""
    track = Track()
    seq = nn.Sequential(nn.Linear(3, 8), track, nn.Linear(8, 8), nn.Linear(8, 2)).double()
    pipe = gpipe.Pipe(seq, balance=[3, 1], chunks=4, checkpoint=checkpoint)
    pipe.train(training)
    with torch.set_grad_enabled(grad):
        out = pipe(torch.randn(8, 3, dtype=torch.float64))
    assert len(track.refs) == 4
    kept = {"always": 0, "except_last": 1, "never": 4}[checkpoint] if training else 4
    assert track.alive() == (kept if grad else 0)
    if grad:
        out.sum().backward()
        assert track.alive() == 0, "backward left stage graphs alive"
    del out  # before the Pipe goes: see test_api.py::test_output_outlives_pipe


def _autocast_step(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Forward under CPU autocast (bfloat16), backward after leaving it, as
    training loops do. The graph lives and dies in this frame."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = net(x)
    out.float().pow(2).sum().backward()
    return out.detach()


@pytest.mark.parametrize("checkpoint", MODES)
def test_recompute_under_autocast(checkpoint):
    """A recompute runs under the autocast state of its cell's first forward
    (as torch.utils.checkpoint does), not the state at backward time."""
    seq = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    ref = copy.deepcopy(seq)
    pipe = gpipe.Pipe(seq, balance=[1, 2], chunks=2, checkpoint=checkpoint)
    x = torch.randn(6, 8)
    want = _autocast_step(ref, x)
    got = _autocast_step(pipe, x)
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want)
    for (name, p), q in zip(pipe.named_parameters(), ref.parameters()):
        # bfloat16 arithmetic: the micro-batches sum in another order.
        bound = 2e-2 * q.grad.abs().max().item() + 1e-3
        assert (p.grad - q.grad).abs().max().item() <= bound, name


@pytest.mark.parametrize("checkpoint", MODES)
def test_autocast_casts_afresh_after_an_optimizer_step(checkpoint):
    """Autocast caches each parameter's cast per thread until the autocast
    region ends, which never happens on a worker: a stale cast would survive
    the optimizer step. The second step must see the updated weights."""
    seq = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    ref = copy.deepcopy(seq)
    pipe = gpipe.Pipe(seq, balance=[1, 2], chunks=2, checkpoint=checkpoint)
    x = torch.randn(6, 8)
    _autocast_step(pipe, x)
    with torch.no_grad():
        for p in pipe.parameters():
            p -= 0.5 * p.grad
    ref.load_state_dict(pipe.state_dict())  # the same updated weights on both sides
    assert torch.equal(_autocast_step(pipe, x), _autocast_step(ref, x))


class _Probe(nn.Module):
    """Keeps what passes through it in forward; counts the recomputes that bring bitwise none of
    those back."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: List[torch.Tensor] = []
        self.mismatches = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not gpipe.is_recomputing():
            self.seen.append(x.detach().clone())
        elif not any(s.shape == x.shape and torch.equal(s, x) for s in self.seen):
            self.mismatches += 1
        return x


@pytest.mark.parametrize("layout", ["offset", "table", "in-place"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_a_recompute_is_bitwise_its_forward(checkpoint, layout):
    """A GEMM need not give the same last bits on a copy of its input as on the input: this CPU's
    BLAS takes another path for data at another alignment. A stage's first checkpointed cell
    copies its input (whether the layers change it in place is not known yet), and a stage
    that changes it recomputes from a copy, so a slice at an odd row offset, a table that runs
    micro-batch 1 first, or an in-place first layer made recomputes differ from their forwards
    and the first step's grads from later steps'. Recomputes now see bitwise what their
    forwards saw, and every step's grads are the same."""
    torch.manual_seed(0)
    probe = _Probe()
    layers = [nn.Linear(5, 5), probe, nn.Tanh(), nn.Linear(5, 5)]
    if layout == "in-place":
        layers.insert(0, nn.ReLU(inplace=True))
    model = nn.Sequential(*layers).double()
    ref = copy.deepcopy(model)
    schedule = "gpipe"
    if layout == "table":
        schedule = gpipe.Schedule.from_rows([["0F1", "0F0", "0B0", "0B1"]])
    pipe = gpipe.Pipe(model, balance=[len(layers)], devices=["cpu"], chunks=2,
                      checkpoint=checkpoint, schedule=schedule)
    big = torch.randn(7, 5, dtype=torch.float64)
    x = big[1:] if layout != "table" else big[:6].clone()
    target = torch.randn(6, 5, dtype=torch.float64)

    def loss_fn(out, t):
        return (out * t).mean()

    grads = []
    for _ in range(3):
        pipe.zero_grad(set_to_none=True)
        probe.seen.clear()
        pipe.train_step(x, target, loss_fn)
        assert probe.mismatches == 0
        grads.append([p.grad.clone() for p in pipe.parameters()])
    for later in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], later))
    loss_fn(ref(x), target).backward()
    assert_same_grads(pipe, ref)
