"""gpipe.balance: the exact partitioner against brute force, profiling by time and by size, side effects."""
import copy
import itertools
import random
import subprocess
import sys
import time
from typing import List, Sequence, Tuple


import pytest
import torch
from torch import nn

import gpipe
from conftest import Sleep
from gpipe.balance import balance_by_params, balance_by_size, balance_by_time, balance_cost

CPU = torch.device("cpu")


class Probe(nn.Module):
    """Scales by its own parameter; each run logs (its index, the device of
    every probe's parameter), so a test sees what profiling had moved."""

    def __init__(self, log: list, probes: list, index: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        # Plain attributes (not submodules): the probes are the Sequential's.
        self.log, self.probes, self.index = log, probes, index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append((self.index, [p.w.device.type for p in self.probes]))
        return x * self.w


class Pair(nn.Module):
    """Takes and returns (float activations, int64 ids): sleeps, scales the
    floats by its parameter's first element and passes the ids on."""

    def __init__(self, seconds: float, params: int = 1) -> None:
        super().__init__()
        self.seconds = seconds
        self.w = nn.Parameter(torch.ones(params))

    def forward(self, xs: Tuple[torch.Tensor, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        x, ids = xs
        assert ids.dtype == torch.int64 and not ids.requires_grad
        time.sleep(self.seconds)
        return x * self.w[0], ids


class Join(nn.Module):
    def forward(self, xs: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, ids = xs
        return x + ids.to(x.dtype).unsqueeze(1)


class Hiccup(nn.Module):
    """Sleeps ``seconds``, and ``extra`` more on its second run: a time slice
    lost to another process, in the first run that balance_by_time times."""

    def __init__(self, seconds: float, extra: float) -> None:
        super().__init__()
        self.seconds, self.extra, self.runs = seconds, extra, 0
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        time.sleep(self.seconds + (self.extra if self.runs == 2 else 0.0))
        return x * self.w


def _tensors(x):
    return x if isinstance(x, tuple) else (x,)


def _sizes_whole_model(model: nn.Sequential, input, device, chunks: int = 1,
                       param_scale: float = 2.0) -> List[float]:
    """balance_by_size's costs as first written: the whole model on the
    device at once (a copy), each layer run on the previous one's output."""
    model = copy.deepcopy(model).to(device).train()
    first = tuple(t.chunk(chunks)[0].to(device) for t in _tensors(input))
    x = first if isinstance(input, tuple) else first[0]
    costs = []
    for layer in model:
        params = sum(p.numel() * p.element_size() for p in layer.parameters())
        x_in = tuple(t.detach().requires_grad_().clone() if t.is_floating_point() else t
                     for t in _tensors(x))
        with gpipe._C.MemoryCounter() as counter:
            y = layer(x_in if isinstance(x, tuple) else x_in[0])
            kept = counter.current
        costs.append(params * param_scale + max(kept, 0))
        x = tuple(t.detach() for t in y) if isinstance(y, tuple) else y.detach()
        del y, x_in
    return costs


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
    parameters = list(model.parameters())
    sample = torch.randn(8, 4)
    # On the CPU nothing moves; on 'meta' each layer moves (Module.to swaps
    # in new Parameter objects there) and must come back.
    for device in (CPU, torch.device("meta")):
        balance_by_time(2, model, sample, timeout=0.02, device=device)
        balance_by_size(2, model, sample, device=device)
    params = dict(model.named_parameters())
    assert all(params[name] is p for name, p in zip(params, parameters))
    assert not model.training and not any(m.training for m in model.modules())
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert [p.data_ptr() for p in model.parameters()] == storages
    assert torch.equal(model[0].weight.grad, torch.full_like(model[0].weight, 3.0))
    assert all(p.grad is None for p in list(model.parameters())[1:])


def test_explicit_cuda_is_refused_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match="device=torch.device\\('cpu'\\)"):
        balance_by_time(2, model, torch.randn(2, 2), device="cuda")


def test_default_device_is_where_the_model_is():
    # On the CPU: profiled there, with no device named (the default was 'cuda').
    model = nn.Sequential(Sleep(0.01), Sleep(0.01), Sleep(0.04))
    assert balance_by_time(2, model, torch.randn(2, 2), timeout=0) == [2, 1]
    assert balance_by_size(2, nn.Sequential(nn.Linear(2, 64), nn.Linear(64, 2)),
                           torch.randn(2, 2)) == [1, 1]
    # No parameters or buffers at all: the CPU.
    assert balance_by_size(2, nn.Sequential(nn.ReLU(), nn.Tanh()), torch.randn(2, 2)) == [1, 1]
    # A model on another device is profiled there, sample moved to it, nothing moved back.
    log: List[List[str]] = []
    probes: List[nn.Module] = []
    meta = nn.Sequential(*[Probe(log, probes, i) for i in range(3)]).to("meta")
    probes.extend(meta)
    balance_by_time(2, meta, torch.randn(4, 2), timeout=0)
    assert log and all(devices == ["meta"] * 3 for _, devices in log)


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


def test_profiling_holds_one_layer_on_the_device_at_a_time():
    # The model on the CPU, profiled on 'meta': each layer, while it runs, is
    # the only one moved; afterwards all are back on their own storage.
    log: list = []
    probes: List[nn.Module] = []
    model = nn.Sequential(*[Probe(log, probes, i) for i in range(4)])
    probes.extend(model)
    storages = [p.data_ptr() for p in model.parameters()]
    balance_by_time(2, model, torch.randn(4, 3), timeout=0, device="meta")
    timed = len(log)
    balance_by_size(2, model, torch.randn(4, 3), device="meta")
    assert timed >= 4 * 4 and len(log) == timed + 4  # warm-up + 3 timed rounds; one run each
    for index, devices in log:
        assert devices == ["meta" if i == index else "cpu" for i in range(4)], (index, devices)
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert [p.data_ptr() for p in model.parameters()] == storages


def test_balance_by_size_is_what_the_whole_model_on_the_device_gives():
    # Moving a layer at a time changes where the model is, not what is
    # counted: on deterministic costs, the same balance for every partition.
    sample = torch.randn(16, 8)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(inplace=True), nn.Linear(64, 512),
                          nn.Tanh(), nn.BatchNorm1d(512), nn.Linear(512, 8), nn.Linear(8, 8))
    for device, chunks, scale in [(CPU, 1, 2.0), (CPU, 4, 0.0), (torch.device("meta"), 1, 2.0)]:
        costs = _sizes_whole_model(model, sample, device, chunks, scale)
        for k in range(2, 6):
            assert balance_by_size(k, model, sample, chunks=chunks, param_scale=scale,
                                   device=device) == balance_cost(costs, k), (device, chunks, k)


def test_balance_by_time_takes_tuples():
    # A tuple sample; layers taking and returning tuples (int64 ids among
    # them, passed on without grad); the last returns one tensor.
    model = nn.Sequential(Pair(0.005), Pair(0.005), Pair(0.05), Pair(0.005), Join())
    sample = (torch.randn(4, 1), torch.arange(4))
    assert balance_by_time(3, model, sample, timeout=0) == [2, 1, 2]


def test_balance_by_size_takes_tuples():
    model = nn.Sequential(Pair(0, 8), Pair(0, 4096), Pair(0, 8), Pair(0, 4096), Join())
    sample = (torch.randn(16, 8), torch.arange(16))
    for chunks in (1, 4):
        costs = _sizes_whole_model(model, sample, CPU, chunks)
        for k in range(1, 6):
            assert balance_by_size(k, model, sample, chunks=chunks) == balance_cost(costs, k)
    assert balance_by_size(2, model, sample) == [2, 3]
    # Every tensor of the tuple is cut into the micro-batch.
    seen = []
    first = Pair(0, 8)
    first.register_forward_pre_hook(lambda _, args: seen.append([t.shape[0] for t in args[0]]))
    balance_by_size(1, nn.Sequential(first), (torch.randn(10, 8), torch.arange(10)), chunks=4)
    assert seen == [[3, 3]]


def test_profiling_refuses_what_is_not_tensors():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(TypeError, match="tuple of them, got str"):
        balance_by_time(2, model, (torch.randn(2, 2), "mask"))
    with pytest.raises(TypeError, match="empty tuple"):
        balance_by_size(2, model, ())

    class Listy(nn.Module):
        def forward(self, x):
            return [x, x]

    with pytest.raises(TypeError, match="layer 1 returned list"):
        balance_by_size(2, nn.Sequential(nn.Linear(2, 2), Listy()), torch.randn(2, 2))
    with pytest.raises(ValueError, match="chunks must be a positive int, got 0"):
        balance_by_size(2, model, torch.randn(2, 2), chunks=0)


def test_balance_by_time_shrugs_off_one_slow_run():
    # Layer 0 loses 0.3 s in its first timed run (as to another process):
    # timed once, it would look like the slowest layer, giving [1, 2].
    model = nn.Sequential(Hiccup(0.01, extra=0.3), Sleep(0.01), Sleep(0.04))
    assert balance_by_time(2, model, torch.randn(2, 2), timeout=0) == [2, 1]


def test_balance_by_time_is_steady_under_load():
    # One layer ten times the others' work, while a busy process per core
    # competes for the CPU: every call gives that layer a stage of its own.
    def work(n: int) -> nn.Sequential:
        return nn.Sequential(*[nn.Linear(64, 64) for _ in range(n)])

    model = nn.Sequential(work(1), work(1), work(10), work(1), work(1), work(1))
    sample = torch.randn(16, 64)
    # One intra-op thread: with several, every op would also wait for a
    # descheduled helper thread, which makes the test slow, not harder.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    busy = [subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 30\n"
                              "while time.time() < end: pass"]) for _ in range(2)]
    try:
        balances = [balance_by_time(3, model, sample, timeout=0.05) for _ in range(5)]
    finally:
        torch.set_num_threads(threads)
        for p in busy:
            p.kill()
            p.wait()
    assert balances == [[2, 1, 3]] * 5, balances


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_profiling_on_cuda_holds_one_layer_at_a_time():
    # The model on the CPU, profiled on the GPU: eight 4 MiB layers (32 MiB
    # in all), yet the GPU never holds more than about one layer and its
    # grads (8 MiB) besides small activations.
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])
    sample = torch.randn(8, 1024)
    layer_bytes = 1024 * 1024 * 4
    for profile in (lambda: balance_by_time(4, model, sample, timeout=0, device="cuda"),
                    lambda: balance_by_size(4, model, sample, device="cuda")):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        profile()
        assert torch.cuda.max_memory_allocated() - base < 3 * layer_bytes
        assert torch.cuda.memory_allocated() == base
    assert all(p.device.type == "cpu" for p in model.parameters())
    # And while each layer runs, it alone is on the GPU.
    log: list = []
    probes: List[nn.Module] = []
    probed = nn.Sequential(*[Probe(log, probes, i) for i in range(3)])
    probes.extend(probed)
    balance_by_time(2, probed, torch.randn(4, 2), timeout=0, device="cuda")
    assert log and all(devices == ["cuda" if i == index else "cpu" for i in range(3)]
                       for index, devices in log)
