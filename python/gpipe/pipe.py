"""The Pipe module: an nn.Sequential run as a GPipe pipeline by the C++ engine."""
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

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


BatchDim = Union[int, Sequence[Optional[int]]]


def _batch_dims(value: Any, name: str) -> List[Optional[int]]:
    """``value`` as the engine's list: one entry for every value, or one per value."""
    def one(entry: Any) -> Optional[int]:
        if entry is None:
            return None
        if isinstance(entry, bool) or not isinstance(entry, int):
            raise TypeError(f"{name} entries must be ints (a dim, negative counts from the end) "
                            f"or None (a value not cut), got {entry!r}")
        return int(entry)

    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"{name} is empty; give one int for every value (0 by default) or "
                             f"one entry per value")
        return [one(e) for e in value]
    if value is None:
        raise TypeError(f"{name}=None would cut nothing; give None inside a list for a value "
                        f"that is not cut, e.g. {name}=[0, None]")
    return [one(value)]


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


class _NoStages:
    """The engine of a Pipe over an empty Sequential: the identity, as nn.Sequential()."""

    def __init__(self) -> None:
        self.tracing = False

    def set_batch_dims(self, input: List[Optional[int]], output: List[Optional[int]]) -> None:
        pass

    def microbatches(self, input: TensorOrTensors) -> int:
        return 1

    def forward(self, input: TensorOrTensors, training: bool) -> TensorOrTensors:
        return input

    def trace(self) -> "_C.Trace":
        return _C.Trace()

    def clear_trace(self) -> None:
        pass


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
    other ``.grad``.

    **Inputs are cut along dim 0 by default** and outputs joined along dim 0;
    a sequence-first model (``[seq, batch, features]``, e.g. PyTorch's
    Transformer layers without ``batch_first=True``) needs ``batch_dim=1``.

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
        chunks: micro-batches per mini-batch (default 1). A batch of ``rows``
            rows is cut into ``chunks`` pieces whose sizes differ by at most
            one, the larger first (17 rows, ``chunks=16``: 2, then fifteen
            1s, as ``torch.tensor_split``); into ``rows`` one-row pieces when
            there are fewer rows; a 0-row batch is one empty micro-batch.
        batch_dim: where the batch dimension lies: an int for every input
            value (**0 by default**; negative counts from the end), or one
            entry per value of a tuple input, where ``None`` marks a value
            that is not cut: every micro-batch gets all of it (a shared mask,
            a lookup table) and its grad is summed over them.
        output_batch_dim: where the micro-batches' outputs are joined,
            entries as in ``batch_dim``; a ``None`` entry returns micro-batch
            0's value (for an output that does not depend on the cut inputs,
            such as a mask passed on). Default: ``batch_dim`` when it is an
            int, else its first entry that is not ``None``. Each output keeps
            its own size along that dim, so outputs may have other row
            counts than the input.
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

        # Sequence-first layers ([seq, batch, features]) are cut along dim 1:
        model = nn.Sequential(nn.TransformerEncoderLayer(16, 4),
                              nn.TransformerEncoderLayer(16, 4))
        pipe = gpipe.Pipe(model, balance=[1, 1], chunks=4, batch_dim=1)
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
                 checkpoint: str = "except_last", batch_dim: BatchDim = 0,
                 output_batch_dim: Optional[BatchDim] = None, deferred_batch_norm: bool = False,
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
        input_dims = _batch_dims(batch_dim, "batch_dim")
        output_dims = [] if output_batch_dim is None else _batch_dims(output_batch_dim,
                                                                      "output_batch_dim")
        if len(module) == 0:
            # nn.Sequential() is the identity; so is its Pipe (torchgpipe's too).
            balance = [] if balance is None else balance
            devices = [] if devices is None else devices
        elif balance is None:
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
        #: Where inputs are cut and outputs joined (see the class docstring).
        self.batch_dim = batch_dim
        self.output_batch_dim = output_batch_dim

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
        self._engine = (_C.Engine(partitions, devices, chunks, checkpoint) if partitions
                        else _NoStages())
        self._engine.set_batch_dims(input_dims, output_dims)
        self._engine.tracing = bool(trace)

    @property
    def tracing(self) -> bool:
        """Whether every cell is being recorded (see :attr:`trace`)."""
        return self._engine.tracing

    @tracing.setter
    def tracing(self, on: bool) -> None:
        self._engine.tracing = bool(on)

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
            microbatches = self._engine.microbatches(input)
            for bn in self._deferred:
                bn.begin(microbatches)
        return self._engine.forward(input, self.training)

    def extra_repr(self) -> str:
        text = (f"balance={self.balance}, devices={[str(d) for d in self.devices]}, "
                f"chunks={self.chunks}, checkpoint={self.checkpoint!r}")
        if self.batch_dim != 0:
            text += f", batch_dim={self.batch_dim!r}"
        if self.output_batch_dim is not None:
            text += f", output_batch_dim={self.output_batch_dim!r}"
        return text


#: torchgpipe's name for the same class.
GPipe = Pipe
