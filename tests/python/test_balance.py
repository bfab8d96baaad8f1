"""gpipe.balance: the exact partitioner against brute force, profiling by time and by size, side effects."""
import copy
import itertools
import random
from typing import List, Sequence

import pytest
import torch
from torch import nn

import gpipe
from conftest import Sleep
from gpipe.balance import balance_by_params, balance_by_size, balance_by_time, balance_cost

CPU = torch.device("cpu")


def _brute_force(costs: Sequence[float], partitions: int) -> List[int]:
    """Every contiguous split, the smallest largest-stage cost, ties to the
    lexicographically smallest balance."""
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), partitions - 1):
        bounds = (0,) + cuts + (n,)
        balance = [bounds[i + 1] - bounds[i] for i in range(partitions)]
        worst = max(sum(costs[bounds[i]:bounds[i + 1]]) for i in range(partitions))
        key = (worst, balance)
        if best is None or key < best:
            best = key
    assert best is not None
    return best[1]


def test_balance_cost_matches_brute_force():
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 12)
        partitions = rng.randint(1, min(5, n))
        # Small integers make ties common, so the tie rule is exercised too.
        costs = [float(rng.randint(0, 5)) for _ in range(n)]
        assert balance_cost(costs, partitions) == _brute_force(costs, partitions), costs


def test_balance_cost_examples():
    assert balance_cost([1, 1, 1, 1], 2) == [2, 2]
    assert balance_cost([10, 1, 1, 1], 2) == [1, 3]
    assert balance_cost([1, 2, 3, 4, 5, 6], 3) == [3, 2, 1]
    assert balance_cost([5], 1) == [1]


def test_balance_cost_refuses_bad_input():
    with pytest.raises(ValueError, match="partitions"):
        balance_cost([1.0, 2.0], 3)
    with pytest.raises(ValueError):
        balance_cost([1.0, 2.0], 0)
    with pytest.raises(ValueError):
        balance_cost([1.0, -2.0], 1)


def test_balance_by_params():
    model = nn.Sequential(nn.Linear(100, 100), nn.Linear(10, 10), nn.Linear(10, 10),
                          nn.Linear(10, 10), nn.ReLU())
    assert balance_by_params(2, model) == [1, 4]


def test_balance_by_time_puts_the_slow_layer_alone():
    model = nn.Sequential(Sleep(0.001), Sleep(0.001), Sleep(0.02), Sleep(0.001), Sleep(0.001),
                          Sleep(0.001))
    balance = balance_by_time(3, model, torch.randn(4, 2), timeout=0.1, device=CPU)
    assert balance == [2, 1, 3]


def test_balance_by_size_weighs_activations_and_parameters():
    big = nn.Sequential(nn.Linear(8, 4096), nn.ReLU(), nn.Linear(4096, 8), nn.ReLU())
    sample = torch.randn(64, 8)
    # Parameters dominate: the two Linear layers end up on different stages.
    assert balance_by_size(2, big, sample, device=CPU) in ([1, 3], [2, 2])
    # Without parameters, the stage that keeps the large activations stands alone.
    acts = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4096), nn.ReLU(),
                         nn.Linear(4096, 8))
    assert balance_by_size(2, acts, sample, param_scale=0.0, device=CPU)[0] >= 3


def test_profiling_leaves_the_model_as_it_was():
    # In-place and parameterless layers too (profiling hands them a non-leaf copy).
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.BatchNorm1d(4),
                          nn.Dropout(0.5), nn.Linear(4, 2))
    model.eval()
    model[0].weight.grad = torch.full_like(model[0].weight, 3.0)
    before = copy.deepcopy(model.state_dict())
    storages = [p.data_ptr() for p in model.parameters()]
    sample = torch.randn(8, 4)
    balance_by_time(2, model, sample, timeout=0.02, device=CPU)
    balance_by_size(2, model, sample, device=CPU)
    assert not model.training and not any(m.training for m in model.modules())
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert [p.data_ptr() for p in model.parameters()] == storages
    assert torch.equal(model[0].weight.grad, torch.full_like(model[0].weight, 3.0))
    assert all(p.grad is None for p in list(model.parameters())[1:])


def test_cuda_default_device_is_refused_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match="device=torch.device\\('cpu'\\)"):
        balance_by_time(2, model, torch.randn(2, 2))


def test_sample_must_be_a_batch():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(TypeError, match="sample"):
        balance_by_time(2, model, 3.0, device=CPU)  # type: ignore[arg-type]


def test_pipe_without_balance_trains():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 1))
    pipe = gpipe.Pipe(model, devices=[CPU, CPU], chunks=4)
    assert len(pipe.balance) == 2 and sum(pipe.balance) == len(model)
    assert pipe.balance == balance_by_params(2, model)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.05)
    x = torch.randn(64, 4)
    y = x.sum(dim=1, keepdim=True)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = (pipe(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
