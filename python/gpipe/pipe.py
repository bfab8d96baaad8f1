"""The Pipe module: an nn.Sequential run as a GPipe pipeline by the C++ engine."""
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from gpipe import _C
from gpipe.balance import balance_by_params
from gpipe.batchnorm import DeferredBatchNorm

__all__ = ["Pipe", "GPipe"]

Device = Union[torch.device, int, str]
TensorOrTensors = Union[Tensor, Tuple[Tensor, ...]]

_CHECKPOINT_MODES = ("always", "except_last", "never")

_MOVING_DENIED = TypeError("denied to move parameters and buffers, because a gpipe.Pipe manages "
                           "device placement itself; pass devices=[...] when you create it "
                           "(casting such as .double() or .to(torch.float16) is allowed)")


def _check_balance(module: nn.Sequential, balance: List[int]) -> None:
    if len(module) != sum(balance):
        raise ValueError(f"module and sum of balance have different length (module: "
                         f"{len(module)}, sum of balance: {sum(balance)}); pass one entry per "
                         f"stage summing to {len(module)}, or compute one with gpipe.balance")
    if any(x <= 0 for x in balance):
        raise ValueError(f"all balance numbers must be positive integer (balance: {balance}); "
                         f"see gpipe.balance to compute one")


def _check_distinct(module: nn.Sequential) -> None:
    seen = {}
    for i, layer in enumerate(module):
        if id(layer) in seen:
            raise ValueError(f"layer {i} is the same module object as layer {seen[id(layer)]}; "
                             f"each layer of a Pipe must be its own module (use copy.deepcopy)")
        seen[id(layer)] = i


def _check_input(input: Any) -> None:
    if isinstance(input, tuple):
        for i, x in enumerate(input):
            if not isinstance(x, Tensor):
                raise TypeError(f"expected Tensor or Tuple[Tensor, ...] as input, but element "
                                f"{i} of the tuple is {type(x).__name__}")
        if not input:
            raise TypeError("expected Tensor or Tuple[Tensor, ...] as input, but got an empty "
                            "tuple")
    elif not isinstance(input, Tensor):
        raise TypeError(f"expected Tensor or Tuple[Tensor, ...] as input, but got "
                        f"{type(input).__name__}")


class Pipe(nn.Module):
    """Wraps an ``nn.Sequential`` to train it with GPipe pipeline parallelism.

    The layers are cut into consecutive stages (``balance`` layers each), one
    per device, and each mini-batch into ``chunks`` micro-batches that flow
    through the stages on one C++ worker thread per stage. Outputs and
    gradients equal those of the plain Sequential, and autograd sees what it
    sees with the plain model: outputs require grad where the plain model's
    would; every tensor a layer uses that requires grad (parameters, tied
    weights, closures) gets its grad, summed over micro-batches, once per
    backward; ``torch.autograd.grad`` and ``backward(inputs=...)`` fill no
    other ``.grad``. Inputs are cut along dim 0.

    One forward or backward runs at a time: calls from several threads wait
    for each other. A Pipe inside another Pipe's layer is refused.

    Args:
        module: the ``nn.Sequential`` to pipeline. Its layers become the
            Pipe's children under their own names, so ``state_dict()`` keys
            are the Sequential's ("0.weight", ...).
        balance: layers per stage, e.g. ``[2, 3]``. None: one stage per device,
            balanced by parameter count (see :mod:`gpipe.balance` for balancing
            by time or memory).
        devices: one device per stage (extra ones are dropped). Default: all
            CUDA devices, or the CPU for every stage when there is no CUDA.
        chunks: micro-batches per mini-batch (default 1).
        checkpoint: ``'always'``, ``'except_last'`` (default) or ``'never'``:
            which micro-batches keep only their stage inputs in forward and
            recompute the rest before their backward.
        deferred_batch_norm: replace BatchNorm layers by ones whose running
            statistics are updated once per mini-batch (see
            :class:`gpipe.batchnorm.DeferredBatchNorm`).
        trace: record every forward, backward, recompute and copy from the
            start (see :attr:`trace` and :func:`gpipe.tracing`).

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``.
        ValueError: bad ``balance``, ``chunks`` or ``checkpoint``.
        IndexError: fewer devices than stages.

    Example::

        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        pipe = gpipe.Pipe(model, balance=[2, 1], chunks=4)
        loss = pipe(x).pow(2).mean()
        loss.backward()
    """

    #: Layers per stage.
    balance: List[int]
    #: One device per stage.
    devices: List[torch.device]
    #: Micro-batches per mini-batch.
    chunks: int
    #: Which micro-batches are checkpointed: 'always', 'except_last' or 'never'.
    checkpoint: str

    def __init__(self, module: nn.Sequential, balance: Optional[Iterable[int]] = None, *,
                 devices: Optional[Iterable[Device]] = None, chunks: int = 1,
                 checkpoint: str = "except_last", deferred_batch_norm: bool = False,
                 trace: bool = False) -> None:
        super().__init__()
        if not isinstance(module, nn.Sequential):
            raise TypeError(f"module must be nn.Sequential to be partitioned, got "
                            f"{type(module).__name__}")
        chunks = int(chunks)
        if chunks <= 0:
            raise ValueError(f"number of chunks must be positive integer, got {chunks}")
        if checkpoint not in _CHECKPOINT_MODES:
            raise ValueError(f"checkpoint is not one of 'always', 'except_last', or 'never', "
                             f"got {checkpoint!r}")
        if balance is None:
            # One stage per device given (or per CUDA device), by parameter count.
            if devices is None and torch.cuda.is_available():
                devices = range(torch.cuda.device_count())
            if devices is None:
                raise ValueError("balance is None and there are no devices to count stages "
                                 "by; pass balance (layers per stage, see gpipe.balance to "
                                 "compute one) or devices (one per stage, e.g. ['cpu', 'cpu'])")
            devices = list(devices)
            balance = balance_by_params(min(len(devices), len(module)), module)
        balance = [int(x) for x in balance]
        _check_balance(module, balance)
        _check_distinct(module)

        if devices is None:
            if torch.cuda.is_available():
                devices = range(torch.cuda.device_count())
            else:
                devices = ["cpu"] * len(balance)
        devices = [torch.device(d) if not isinstance(d, int) else torch.device("cuda", d)
                   for d in devices]
        if len(devices) < len(balance):
            raise IndexError(f"too few devices to hold given partitions (devices: "
                             f"{len(devices)}, partitions: {len(balance)})")
        devices = devices[:len(balance)]

        if deferred_batch_norm:
            module = DeferredBatchNorm.convert(module, chunks)

        self.balance = balance
        self.devices = devices
        self.chunks = chunks
        self.checkpoint = checkpoint

        # The Sequential's own names: state_dict() keys read "0.weight".
        for name, layer in module.named_children():
            self.add_module(name, layer)
        layers = list(module)
        partitions: List[List[nn.Module]] = []
        offset = 0
        for n, device in zip(balance, devices):
            part = layers[offset:offset + n]
            for layer in part:
                layer.to(device)
            partitions.append(part)
            offset += n
        self._layers = layers
        self._deferred = [m for m in self.modules() if isinstance(m, DeferredBatchNorm)]
        self._engine = _C.Engine(partitions, devices, chunks, checkpoint)
        self._engine.tracing = bool(trace)

    @property
    def tracing(self) -> bool:
        """Whether every cell is being recorded (see :attr:`trace`)."""
        return self._engine.tracing

    @tracing.setter
    def tracing(self, on: bool) -> None:
        self._engine.tracing = bool(on)

    @property
    def trace_capacity(self) -> int:
        """How many of the most recent events tracing keeps (default
        100,000): past it, whole steps are dropped, oldest first (see
        :class:`gpipe.Trace`). At least 1; setting it trims at once."""
        return self._engine.trace_capacity

    @trace_capacity.setter
    def trace_capacity(self, events: int) -> None:
        self._engine.trace_capacity = events

    @property
    def trace(self) -> "_C.Trace":
        """What was recorded while :attr:`tracing` was on: ``.events`` (stage,
        micro-batch, phase, start, end, thread), ``.summary()`` (measured
        bubble against GPipe's ideal) and ``.save_chrome_json(path)``. See
        :func:`gpipe.tracing` and :func:`gpipe.plot_timeline`."""
        return self._engine.trace()

    def clear_trace(self) -> None:
        """Forgets the recorded events; the next forward is step 0."""
        self._engine.clear_trace()

    def __len__(self) -> int:
        return len(self._layers)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._layers)

    def __getitem__(self, index: int) -> nn.Module:
        n = len(self._layers)
        i = index + n if index < 0 else index
        if not 0 <= i < n:
            raise IndexError(f"index {index} is out of range for a Pipe of {n} layers")
        return self._layers[i]

    def _moves(self, device: Optional[Device]) -> bool:
        """Whether moving to ``device`` would change where any stage lives."""
        if device is None:
            return False
        target = torch.device(device)
        for d in self.devices:
            if d.type != target.type:
                return True
            if target.index is not None and d.index != target.index:
                return True
        return False

    def cuda(self, device: Optional[Device] = None) -> "Pipe":
        """Allowed only when every stage already lives on that CUDA device
        (nothing moves); a Pipe's stages keep the devices given at creation."""
        if self._moves(torch.device("cuda", device) if isinstance(device, int) else device or "cuda"):
            raise _MOVING_DENIED
        return self

    def cpu(self) -> "Pipe":
        """Allowed only when every stage already lives on the CPU (nothing
        moves); a Pipe's stages keep the devices given at creation."""
        if self._moves("cpu"):
            raise _MOVING_DENIED
        return self

    def to(self, *args: Any, **kwargs: Any) -> "Pipe":
        """Casts parameters and buffers (``.to(torch.float64)``) like
        ``nn.Module.to``. A device (or a tensor to take one from) is allowed
        only when every stage already lives there: stages keep the devices
        given at creation."""
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if self._moves(device):
            raise _MOVING_DENIED
        if dtype is None and memory_format is None:
            return self
        cast: Dict[str, Any] = {"non_blocking": non_blocking}
        if dtype is not None:
            cast["dtype"] = dtype
        if memory_format is not None:
            cast["memory_format"] = memory_format
        return super().to(**cast)

    def forward(self, input: TensorOrTensors) -> TensorOrTensors:  # type: ignore[override]
        """Runs ``input`` (a tensor, or a tuple of tensors handed to the first
        layer as one tuple) through the pipeline. The output lives on the
        last stage's device."""
        _check_input(input)
        if self._deferred and self.training:
            first = input[0] if isinstance(input, tuple) else input
            microbatches = len(first.chunk(self.chunks)) if first.dim() > 0 else 1
            for bn in self._deferred:
                bn.begin(microbatches)
        return self._engine.forward(input, self.training)

    def extra_repr(self) -> str:
        return (f"balance={self.balance}, devices={[str(d) for d in self.devices]}, "
                f"chunks={self.chunks}, checkpoint={self.checkpoint!r}")


#: torchgpipe's name for the same class.
GPipe = Pipe
