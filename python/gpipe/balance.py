"""Choosing ``balance`` (layers per stage): by profiled time, by memory, or by parameter count.

Every function returns the contiguous split of the Sequential's layers into
``partitions`` stages that minimises the most expensive stage, exactly (not
greedily), computed by the C++ engine's partitioner. Profiling leaves the
model's parameters, buffers, grads, devices and training mode as it found them.

Example::

    from gpipe.balance import balance_by_time
    balance = balance_by_time(4, model, sample, timeout=0.5, device=torch.device('cpu'))
    pipe = gpipe.Pipe(model, balance, chunks=8)
"""
import contextlib
import itertools
import statistics
import time
from typing import Iterator, List, Sequence, Union

import torch
from torch import Tensor, nn

from gpipe import _C

__all__ = ["balance_cost", "balance_by_params", "balance_by_time", "balance_by_size"]

Device = Union[torch.device, int, str]


def balance_cost(costs: Sequence[float], partitions: int) -> List[int]:
    """The balance minimising the largest stage cost (ties: the
    lexicographically smallest balance). ``partitions`` must not exceed the
    number of layers."""
    try:
        return list(_C.balance_cost([float(c) for c in costs], int(partitions)))
    except RuntimeError as e:
        raise ValueError(str(e)) from None


def balance_by_params(partitions: int, module: nn.Sequential) -> List[int]:
    """Balances by the number of parameter elements of each layer."""
    return balance_cost([sum(p.numel() for p in layer.parameters()) for layer in module],
                        partitions)


def _device(device: Device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("balancing on device 'cuda', but CUDA is not available; pass "
                         "device=torch.device('cpu') to profile on the CPU")
    return device


@contextlib.contextmanager
def _untouched(module: nn.Module) -> Iterator[None]:
    """Restores parameters (storage, values, grads), buffers, devices and
    training mode on exit; grads read as None meanwhile."""
    params = [(p, p.data, p.grad) for p in module.parameters()]
    buffers = [(b, b.data, b.detach().clone()) for b in module.buffers()]
    modes = [(m, m.training) for m in module.modules()]
    for p, _, _ in params:
        p.grad = None
    try:
        yield
    finally:
        with torch.no_grad():
            for p, data, grad in params:
                p.data = data
                p.grad = grad
            for b, data, values in buffers:
                b.data = data
                b.copy_(values)
        for m, training in modes:
            m.training = training


def _graph_input(x: Tensor) -> Tensor:
    # A non-leaf copy, so layers working in place are fine.
    if x.is_floating_point() or x.is_complex():
        return x.detach().requires_grad_().clone()
    return x


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check_sample(sample: Tensor) -> None:
    if not isinstance(sample, Tensor) or sample.dim() < 1:
        raise TypeError("the sample must be a tensor with a batch dimension, got "
                        f"{type(sample).__name__ if not isinstance(sample, Tensor) else '0-d'}")


def balance_by_time(partitions: int, module: nn.Sequential, sample: Tensor, *,
                    timeout: float = 1.0, device: Device = torch.device("cuda")) -> List[int]:
    """Balances by forward+backward time: each layer runs on what the
    previous layers make of ``sample``, once to warm up, then repeatedly for
    about ``timeout`` seconds (at least once), and the median time of each
    layer is its cost."""
    _check_sample(sample)
    device = _device(device)
    times: List[List[float]] = [[] for _ in module]
    with _untouched(module):
        module.to(device).train()
        inputs: List[Tensor] = []
        start = time.perf_counter()
        # Pass 0 warms up (the first backward starts autograd's threads,
        # allocators fill) and is not counted.
        for rep in itertools.count():
            x = sample.to(device)
            for i, layer in enumerate(module):
                if len(inputs) <= i:
                    inputs.append(x)
                x_in = _graph_input(inputs[i])
                _sync(device)
                t0 = time.perf_counter()
                y = layer(x_in)
                if not isinstance(y, Tensor):
                    raise TypeError(f"layer {i} returned {type(y).__name__}; balancing by "
                                    f"profile needs layers that take and return one tensor")
                if y.requires_grad:
                    y.backward(torch.ones_like(y))
                _sync(device)
                if rep > 0:
                    times[i].append(time.perf_counter() - t0)
                x = y.detach()
            if rep > 0 and time.perf_counter() - start >= timeout:
                break
    return balance_cost([statistics.median(t) for t in times], partitions)


def balance_by_size(partitions: int, module: nn.Sequential, input: Tensor, *, chunks: int = 1,
                    param_scale: float = 2.0,
                    device: Device = torch.device("cuda")) -> List[int]:
    """Balances by memory: per layer, its parameter bytes × ``param_scale``
    (the parameters, their grads and optimizer state) plus the bytes its
    forward keeps alive for backward, measured on the first of ``chunks``
    micro-batches of ``input``. Works on CPU and CUDA (allocator reports)."""
    _check_sample(input)
    if param_scale < 0:
        raise ValueError(f"param_scale must be non-negative, got {param_scale}")
    device = _device(device)
    costs: List[float] = []
    with _untouched(module):
        module.to(device).train()
        x = input.chunk(int(chunks))[0].to(device)
        for i, layer in enumerate(module):
            params = sum(p.numel() * p.element_size() for p in layer.parameters())
            x_in = _graph_input(x)
            with _C.MemoryCounter() as counter:
                y = layer(x_in)
                kept = counter.current
            if not isinstance(y, Tensor):
                raise TypeError(f"layer {i} returned {type(y).__name__}; balancing by profile "
                                f"needs layers that take and return one tensor")
            costs.append(params * param_scale + max(kept, 0))
            x = y.detach()
            del y, x_in
    return balance_cost(costs, partitions)
