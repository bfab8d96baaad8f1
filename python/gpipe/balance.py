"""Choosing ``balance`` (layers per stage): by profiled time, by memory, or by parameter count.

Every function returns the contiguous split of the Sequential's layers into
``partitions`` stages that minimises the most expensive stage, exactly (not
greedily), computed by the C++ engine's partitioner.

Profiling moves one layer at a time to the profiling ``device`` (by default,
where the model's first parameter or buffer is) and back before the next
layer, with only the activation between them kept there: the peak on the
device is about the largest layer, its grads and its activations, not the
whole model, so a model that needs a pipeline because it does not fit on one
device can still be profiled on one. It leaves the model's parameters (same
storage), buffers, grads, devices and training mode as it found them.

Layers may take and return a tensor or a tuple of tensors (the next layer gets
the tuple as its one argument), and the sample may be either, as in torchgpipe.

Skip connections (``gpipe.skip``) profile too: a skip reaches its popping
layer as a fresh graph input, as each layer's input does, so every layer's
backward stays within that layer (torchgpipe's balance_by_time failed there).

Example::

    from gpipe.balance import balance_by_time
    balance = balance_by_time(4, model, sample, timeout=0.5)
    pipe = gpipe.Pipe(model, balance, chunks=8)
"""
import contextlib
import itertools
import time
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from gpipe import _C
from gpipe.skip.namespace import Namespace
from gpipe.skip.tracker import SkipTracker, use_skip_tracker

__all__ = ["balance_cost", "balance_by_params", "balance_by_time", "balance_by_size"]

Device = Union[torch.device, int, str]
TensorOrTensors = Union[Tensor, Tuple[Tensor, ...]]

#: balance_by_time times each layer at least this many times (after one
#: warm-up run), however short the timeout: under load a single timing can
#: be off by a whole scheduler time slice, many times the layer's own cost.
#: Timed rounds each layer gets at least, after a warm-up round (balance_by_time).
MIN_REPEATS = 3


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


def _device(device: Optional[Device], module: nn.Module) -> torch.device:
    if device is None:
        # Where the model is: profiling then moves nothing it need not.
        first = next(itertools.chain(module.parameters(), module.buffers()), None)
        return first.device if first is not None else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"balancing on device '{device}', but CUDA is not available; pass "
                         "device=torch.device('cpu'), or leave device out to profile where "
                         "the model's layers are")
    return device


@contextlib.contextmanager
def _untouched(module: nn.Module) -> Iterator[None]:
    """Restores parameters (the same objects, storage, values, grads),
    buffers, devices and training mode on exit; grads read as None meanwhile."""
    # Module.to swaps in new Parameter objects where it cannot set .data (to
    # or from 'meta', say): the modules get their own objects back.
    slots = [(table, name, t) for m in module.modules()
             for table in (m._parameters, m._buffers) for name, t in table.items()]
    params = [(p, p.data, p.grad) for p in module.parameters()]
    buffers = [(b, b.data, b.detach().clone()) for b in module.buffers()]
    modes = [(m, m.training) for m in module.modules()]
    for p, _, _ in params:
        p.grad = None
    try:
        yield
    finally:
        for table, name, t in slots:
            table[name] = t
        with torch.no_grad():
            for p, data, grad in params:
                p.data = data
                p.grad = grad
            for b, data, values in buffers:
                b.data = data
                b.copy_(values)
        for m, training in modes:
            m.training = training


@contextlib.contextmanager
def _on(layer: nn.Module, device: torch.device) -> Iterator[None]:
    """The layer on ``device`` meanwhile; afterwards back on its own storage,
    with the grads it made there dropped (so the device holds one layer)."""
    with _untouched(layer):
        layer.to(device)
        yield


def _tensors(value: object) -> Tuple[Tensor, ...]:
    return value if isinstance(value, tuple) else (value,)  # type: ignore[return-value]


def _graph_input(x: TensorOrTensors) -> TensorOrTensors:
    # Non-leaf copies, so layers working in place are fine.
    if isinstance(x, tuple):
        return tuple(_graph_input(t) for t in x)  # type: ignore[misc]
    if x.is_floating_point() or x.is_complex():
        return x.detach().requires_grad_().clone()
    return x


def _detach(x: TensorOrTensors) -> TensorOrTensors:
    return tuple(t.detach() for t in x) if isinstance(x, tuple) else x.detach()


def _to(x: TensorOrTensors, device: torch.device) -> TensorOrTensors:
    return tuple(t.to(device) for t in x) if isinstance(x, tuple) else x.to(device)


class _ProfilingTracker(SkipTracker):
    """Skips while profiling: a stash keeps a detached copy-free view, a pop
    gets a fresh graph input of it on the device, like each layer's input,
    so every layer's backward stays within that layer (the stashing layer's
    graph is neither kept alive nor reached from the popping layer's)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def save(self, batch: object, ns: Namespace, name: str, tensor: Optional[Tensor]) -> None:
        super().save(batch, ns, name, None if tensor is None else tensor.detach())

    def load(self, batch: object, ns: Namespace, name: str) -> Optional[Tensor]:
        tensor = super().load(batch, ns, name)
        if tensor is None:
            return None
        return _graph_input(tensor.to(self.device))  # type: ignore[return-value]


def _check_output(y: object, i: int) -> TensorOrTensors:
    if not all(isinstance(t, Tensor) for t in _tensors(y)):
        raise TypeError(f"layer {i} returned {type(y).__name__}; balancing by profile needs "
                        f"layers that return a tensor or a tuple of tensors")
    return y  # type: ignore[return-value]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check_sample(sample: object, name: str = "sample") -> None:
    for t in _tensors(sample):
        if not isinstance(t, Tensor) or t.dim() < 1:
            got = type(t).__name__ if not isinstance(t, Tensor) else "a 0-d tensor"
            raise TypeError(f"the {name} must be a tensor with a batch dimension, or a tuple of "
                            f"them, got {got}")
    if isinstance(sample, tuple) and not sample:
        raise TypeError(f"the {name} must be a tensor or a tuple of tensors, got an empty tuple")


def balance_by_time(partitions: int, module: nn.Sequential, sample: TensorOrTensors, *,
                    timeout: float = 1.0, device: Optional[Device] = None) -> List[int]:
    """Balances by forward+backward time per layer on ``sample`` (a tensor or
    a tuple of tensors; each layer gets what the previous ones made of it).

    The profile runs in rounds: each round takes the sample through the
    layers, one layer at a time on ``device`` (moved there, run, moved back).
    Round 0 warms up (autograd's threads, allocators) and is not counted;
    rounds go on until ``timeout`` seconds have passed, but at least
    ``MIN_REPEATS`` are timed, so a slow model takes longer than
    ``timeout``. A layer's cost is its fastest timed run: other work on the
    machine (another process, a descheduled intra-op thread) only ever adds
    time to a run, so the fastest is the one it spoiled least, and rounds
    spread a load that comes and goes over all layers alike. ``device``
    defaults to where the model's layers are."""
    _check_sample(sample)
    device = _device(device, module)
    times: List[List[float]] = [[] for _ in module]
    with _untouched(module), torch.enable_grad():
        module.train()
        start = time.perf_counter()
        for round_ in itertools.count():
            x = _to(sample, device)
            # A fresh tracker per round: a skip never outlives its round.
            skips = _ProfilingTracker(device)
            for i, layer in enumerate(module):
                with _on(layer, device), use_skip_tracker(skips):
                    x_in = _graph_input(x)
                    _sync(device)
                    t0 = time.perf_counter()
                    y = _check_output(layer(x_in), i)
                    grads = [t for t in _tensors(y) if t.requires_grad]
                    if grads:
                        torch.autograd.backward(grads, [torch.ones_like(t) for t in grads])
                    _sync(device)
                    if round_ > 0:
                        times[i].append(time.perf_counter() - t0)
                    x = _detach(y)
                    del x_in, y, grads
            if round_ >= MIN_REPEATS and time.perf_counter() - start >= timeout:
                break
    return balance_cost([min(t) for t in times], partitions)


def balance_by_size(partitions: int, module: nn.Sequential, input: TensorOrTensors, *,
                    chunks: int = 1, param_scale: float = 2.0,
                    device: Optional[Device] = None) -> List[int]:
    """Balances by memory: per layer, its parameter bytes × ``param_scale``
    (the parameters, their grads and optimizer state) plus the bytes its
    forward keeps alive for backward, measured on the first of ``chunks``
    micro-batches of ``input`` (a tensor or a tuple of tensors, each cut
    along dim 0). One layer at a time is moved to ``device`` (default: where
    the model's layers are) and back. Works on CPU and CUDA (allocator
    reports)."""
    _check_sample(input, "input")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive int, got {chunks!r}")
    if param_scale < 0:
        raise ValueError(f"param_scale must be non-negative, got {param_scale}")
    device = _device(device, module)
    costs: List[float] = []
    with _untouched(module), torch.enable_grad():
        module.train()
        first = tuple(t.chunk(chunks)[0] for t in _tensors(input))
        x = _to(first if isinstance(input, tuple) else first[0], device)
        skips = _ProfilingTracker(device)
        for i, layer in enumerate(module):
            with _on(layer, device), use_skip_tracker(skips):
                params = sum(p.numel() * p.element_size() for p in layer.parameters())
                x_in = _graph_input(x)
                with _C.MemoryCounter() as counter:
                    y = layer(x_in)
                    kept = counter.current
                _check_output(y, i)
                costs.append(params * param_scale + max(kept, 0))
                x = _detach(y)
                del y, x_in
    return balance_cost(costs, partitions)
