"""deferred_batch_norm: running statistics equal the plain model's per mini-batch (1e-9)."""
import copy
from typing import Callable, List

import pytest
import torch
from torch import nn

import gpipe
from gpipe.batchnorm import DeferredBatchNorm

STATS_TOL = 1e-9


def bn1d_model(momentum=0.1) -> nn.Sequential:
    # The batch norm opens stage 1 under balance [1, 3].
    return nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6, momentum=momentum), nn.ReLU(),
                         nn.Linear(6, 3)).double()


def bn2d_model(momentum=0.1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3, momentum=momentum),
                         nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 2)).double()


def bn1d_input(rows: int) -> torch.Tensor:
    # Shifted and scaled, so the running statistics move far from (0, 1).
    return torch.randn(rows, 5, dtype=torch.float64) * 3 + 2


def bn2d_input(rows: int) -> torch.Tensor:
    return torch.randn(rows, 2, 4, 4, dtype=torch.float64) * 2 - 1


def batch_norms(module: nn.Module) -> List[nn.Module]:
    return [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def stats_diff(pipe: nn.Module, ref: nn.Module) -> float:
    worst = 0.0
    for a, b in zip(batch_norms(pipe), batch_norms(ref)):
        worst = max(worst, (a.running_mean - b.running_mean).abs().max().item(),
                    (a.running_var - b.running_var).abs().max().item())
    return worst


def train_both(make_model: Callable[[], nn.Sequential], make_input: Callable[[int], torch.Tensor],
               rows: int, steps: int, deferred: bool, balance: List[int], chunks: int = 4,
               checkpoint: str = "always", same_count: bool = True) -> List[float]:
    """Runs ``steps`` mini-batches (forward and backward, no optimizer step)
    through the plain model and the Pipe; the stats difference after each."""
    seq = make_model()
    ref = copy.deepcopy(seq)
    pipe = gpipe.Pipe(seq, balance=balance, chunks=chunks, checkpoint=checkpoint,
                      deferred_batch_norm=deferred)
    diffs = []
    for _ in range(steps):
        x = make_input(rows)
        ref(x).pow(2).sum().backward()
        pipe(x).pow(2).sum().backward()
        diffs.append(stats_diff(pipe, ref))
        for a, b in zip(batch_norms(pipe), batch_norms(ref)):
            if same_count:
                assert int(a.num_batches_tracked) == int(b.num_batches_tracked)
    moved = max((b.running_mean.abs().max().item() for b in batch_norms(ref)), default=0.0)
    assert moved > 1e-2, "the running mean did not move: the comparison is vacuous"
    return diffs


CASES = {
    "1d-even": (bn1d_model, bn1d_input, 12, [1, 3]),
    "1d-uneven": (bn1d_model, bn1d_input, 11, [2, 2]),     # micro-batches of 3, 3, 3, 2
    "2d-even": (bn2d_model, bn2d_input, 8, [1, 4]),
    "2d-uneven": (bn2d_model, bn2d_input, 10, [2, 3]),     # micro-batches of 3, 3, 3, 1
    "2d-fewer-rows": (bn2d_model, bn2d_input, 2, [1, 4]),  # two micro-batches of 1 row
}


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("case", list(CASES))
def test_running_stats_equal_plain(case, checkpoint):
    make_model, make_input, rows, balance = CASES[case]
    diffs = train_both(make_model, make_input, rows, steps=4, deferred=True, balance=balance,
                       checkpoint=checkpoint)
    assert diffs[0] <= STATS_TOL, f"after one mini-batch: {diffs[0]:.3e}"
    assert max(diffs) <= STATS_TOL, f"after several mini-batches: {diffs}"


@pytest.mark.parametrize("case", ["1d-even", "2d-uneven"])
def test_running_stats_with_cumulative_average(case):
    """momentum=None: the running statistics are a cumulative average."""
    make_model, make_input, rows, balance = CASES[case]
    diffs = train_both(lambda: make_model(momentum=None), make_input, rows, steps=3,
                       deferred=True, balance=balance)
    assert max(diffs) <= STATS_TOL, diffs


@pytest.mark.parametrize("case", ["1d-even", "2d-uneven"])
def test_without_deferred_the_stats_differ(case):
    """Plain BatchNorm in a Pipe updates per micro-batch (and per recompute):
    the comparison above would catch it."""
    make_model, make_input, rows, balance = CASES[case]
    diffs = train_both(make_model, make_input, rows, steps=2, deferred=False, balance=balance,
                       same_count=False)
    assert min(diffs) > 1e-3, diffs


def test_deferred_layers_replace_batch_norm():
    pipe = gpipe.Pipe(bn1d_model(), balance=[1, 3], chunks=4, deferred_batch_norm=True)
    assert isinstance(pipe[1], DeferredBatchNorm)
    assert len(batch_norms(pipe)) == 1


def test_deferred_state_dict_keys_equal_plain():
    seq = bn2d_model()
    ref = copy.deepcopy(seq)
    pipe = gpipe.Pipe(seq, balance=[2, 3], chunks=4, deferred_batch_norm=True)
    assert list(pipe.state_dict()) == list(ref.state_dict())
    plain = bn2d_model()
    plain.load_state_dict(pipe.state_dict())
    pipe.load_state_dict(ref.state_dict())


def test_deferred_normalises_each_microbatch_by_its_own_statistics():
    """Training output of a Pipe with chunks=4 equals the plain model applied
    to each micro-batch separately (torchgpipe's deferred batch norm)."""
    seq = bn1d_model()
    ref = copy.deepcopy(seq)
    pipe = gpipe.Pipe(seq, balance=[1, 3], chunks=4, deferred_batch_norm=True)
    x = bn1d_input(12)
    out = pipe(x)
    with torch.no_grad():
        want = torch.cat([ref(part) for part in x.chunk(4)])
    assert (out.detach() - want).abs().max().item() <= 1e-10
    out.sum().backward()


@pytest.mark.parametrize("case", ["1d-even", "2d-uneven"])
def test_eval_after_training_equals_plain(case):
    make_model, make_input, rows, balance = CASES[case]
    seq = make_model()
    ref = copy.deepcopy(seq)
    pipe = gpipe.Pipe(seq, balance=balance, chunks=4, checkpoint="always",
                      deferred_batch_norm=True)
    for _ in range(3):
        x = make_input(rows)
        ref(x).sum().backward()
        pipe(x).sum().backward()
    pipe.eval()
    ref.eval()
    x = make_input(rows)
    with torch.no_grad():
        assert (pipe(x) - ref(x)).abs().max().item() <= STATS_TOL
    # In eval the running statistics stay put.
    before = [b.running_mean.clone() for b in batch_norms(pipe)]
    pipe(x).sum().backward()
    for b, m in zip(batch_norms(pipe), before):
        assert torch.equal(b.running_mean, m)


def test_forward_only_training_counts_once():
    """Training-mode forwards under no_grad (no recompute) also update once per mini-batch."""
    seq = bn1d_model()
    ref = copy.deepcopy(seq)
    pipe = gpipe.Pipe(seq, balance=[1, 3], chunks=4, deferred_batch_norm=True)
    with torch.no_grad():
        for _ in range(3):
            x = bn1d_input(12)
            ref(x)
            pipe(x)
    assert int(pipe[1].num_batches_tracked) == 3
    assert stats_diff(pipe, ref) <= STATS_TOL


def test_nested_batch_norm_is_converted():
    """A BatchNorm inside a layer (not a direct child) is deferred too."""
    def make() -> nn.Sequential:
        return nn.Sequential(nn.Linear(5, 6),
                             nn.Sequential(nn.BatchNorm1d(6), nn.ReLU()),
                             nn.Linear(6, 3)).double()

    diffs = train_both(make, bn1d_input, 12, steps=3, deferred=True, balance=[1, 2])
    assert max(diffs) <= STATS_TOL, diffs


def test_running_variance_stays_exact_in_float32_far_from_zero():
    """Inputs whose mean is far above their spread (1e4 against 1): the running
    variance must come from centred sums, as plain BatchNorm's does; E[x²] − E[x]²
    in float32 loses every digit of it."""
    torch.manual_seed(5)
    seq = nn.Sequential(nn.BatchNorm1d(3, momentum=1.0))
    ref = copy.deepcopy(seq)
    pipe = gpipe.Pipe(seq, balance=[1], chunks=4, checkpoint="never", deferred_batch_norm=True)
    x = torch.randn(64, 3) + 1e4
    ref(x)
    pipe(x)
    want = x.double().var(0)  # momentum 1: the running variance is this mini-batch's
    assert torch.allclose(ref[0].running_var.double(), want, rtol=1e-3)
    assert torch.allclose(pipe[0].running_var.double(), want, rtol=1e-3), \
        (pipe[0].running_var, want)
    assert torch.allclose(pipe[0].running_mean.double(), x.double().mean(0), rtol=1e-6)
