"""The Pipe module: an nn.Sequential run as a GPipe pipeline by the C++ engine."""
import operator
import warnings
from collections import OrderedDict
from typing import (Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple,
                    Union)

import torch
from torch import Tensor, nn

from gpipe import _C
from gpipe.balance import balance_by_params
from gpipe.batchnorm import DeferredBatchNorm, _deferred_copy
from gpipe.schedule import Schedule
from gpipe.skip.layout import stage_runners
from gpipe.skip.skippable import verify_skippables

__all__ = ["Pipe", "GPipe", "is_checkpointing", "is_recomputing"]

Device = Union[torch.device, int, str]
TensorOrTensors = Union[Tensor, Tuple[Tensor, ...]]

_CHECKPOINT_MODES = ("always", "except_last", "never")

_MOVING_DENIED = TypeError("denied to move parameters and buffers, because a gpipe.Pipe manages "
                           "device placement itself; pass devices=[...] when you create it "
                           "(casting such as .double() or .to(torch.float16) is allowed)")

_COMPILE_SEES_NOTHING = (
    "torch.compile of a gpipe.Pipe (or of a model holding one) compiles none of the Pipe's "
    "layers: the pipeline runs in C++, where dynamo cannot see it, so the layers run uncompiled "
    "(results are unaffected). Call pipe.compile(...) (same arguments as torch.compile) to "
    "compile each stage, which then runs compiled on its worker thread.")


def is_checkpointing() -> bool:
    """True while a layer runs in the first forward of a checkpointed
    micro-batch, whose graph is not kept (it is recomputed before backward)."""
    return _C.is_checkpointing()


def is_recomputing() -> bool:
    """True while a layer runs in the recompute of a checkpointed
    micro-batch, just before its backward. A forward hook (or a layer's side
    effect) that must happen once per micro-batch skips this pass."""
    return _C.is_recomputing()


def _is_bool(value: Any) -> bool:
    # bool is an int to Python; numpy's and torch's bools carry a dtype.
    return isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool")


def _as_int(value: Any, what: str, fix: str) -> int:
    """``value`` as a Python int if it is an integer (int, numpy or torch integer), else a
    TypeError naming it: a float is refused rather than truncated."""
    try:
        if _is_bool(value):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {value!r} ({type(value).__name__}); "
                        f"{fix}") from None


def _count(n: int, noun: str) -> str:
    """'1 device', '2 devices': a count with its noun, for messages."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _parse_chunks(chunks: Any) -> int:
    # As torchgpipe: an integral float (chunks=42.0) is that many; 2.7 is refused.
    if isinstance(chunks, float) and chunks.is_integer():
        chunks = int(chunks)
    chunks = _as_int(chunks, "chunks", "pass the number of micro-batches per mini-batch, "
                     "e.g. chunks=4")
    if chunks <= 0:
        raise ValueError(f"number of chunks must be positive integer, got {chunks}; pass the "
                         f"number of micro-batches per mini-batch, e.g. chunks=4")
    return chunks


def _parse_checkpoint(checkpoint: Any) -> Union[str, List[str]]:
    """A mode, or a list of modes (one per stage)."""
    if isinstance(checkpoint, (list, tuple)):
        if not checkpoint:
            raise ValueError("checkpoint is an empty list; give one mode, or one per stage")
        return [_parse_checkpoint_mode(c) for c in checkpoint]
    return _parse_checkpoint_mode(checkpoint)


def _parse_checkpoint_mode(checkpoint: Any) -> str:
    # As torchgpipe: anything that prints as a mode (an enum, say) is that mode.
    mode = str(checkpoint)
    if mode not in _CHECKPOINT_MODES:
        raise ValueError(f"checkpoint is not one of 'always', 'except_last', or 'never', got "
                         f"{mode!r}")
    return mode


def _engine_checkpoint(checkpoint: Union[str, List[str]]) -> str:
    """The engine's one mode (a per-stage list is set after: set_stage_checkpoints)."""
    return checkpoint if isinstance(checkpoint, str) else "never"


_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v")


def _parse_schedule(schedule: Any) -> Union[str, Schedule]:
    if isinstance(schedule, Schedule):
        return schedule
    name = str(schedule)
    if name not in _SCHEDULES:
        raise ValueError(f"schedule is not one of 'gpipe', '1f1b', 'interleaved_1f1b', 'zb_h1' "
                         f"or 'zb_v' (or a gpipe.Schedule, e.g. from a CSV file), got {name!r}")
    return name


def _stages_per_device(schedule: Any, virtual_stages: int) -> str:
    """What puts several stages on each device, for messages (the C++ core's words)."""
    if _v_shaped(schedule):
        return f"schedule zb_v runs {virtual_stages} stages on each device (a V)"
    return f"virtual_stages {virtual_stages} runs {virtual_stages} stages on each device"


def _v_shaped(schedule: Any) -> bool:
    """Whether ``schedule`` lays its stages out in ZB-V's V: 'zb_v', or a table placing them
    so (``Schedule.v_shaped``; a Schedule pickled before it existed: a loop)."""
    return schedule == "zb_v" or getattr(schedule, "v_shaped", False)


def _stage_workers(schedule: Any, workers: int, stages: int) -> List[int]:
    """The worker (device or rank) of each stage: a loop (stage s on worker s mod W), or
    ZB-V's V (worker w runs stages w and 2W-1-w, so the first and the last share worker 0)."""
    if _v_shaped(schedule):
        return [s if s < workers else 2 * workers - 1 - s for s in range(stages)]
    return [s % workers for s in range(stages)]


def _engine_schedule(schedule: Any) -> str:
    """The schedule name the engine is built with: a table's stages lie in a loop, or in a V
    as zb_v's (its plan is set after, set_plan_csv)."""
    if isinstance(schedule, Schedule):
        return "zb_v" if _v_shaped(schedule) else "1f1b"
    return schedule


def _schedule_stages(schedule: Union[str, Schedule], virtual_stages: int, per: str) -> int:
    """``virtual_stages`` checked against ``schedule``: a Schedule's table fixes it (its
    stages over its rows; the default 1 is taken as unset), the built-in ones run one stage
    per ``per`` except interleaved_1f1b (any) and zb_v (two, in a V)."""
    if isinstance(schedule, Schedule):
        table = schedule.stages // schedule.rows
        if virtual_stages not in (1, table):
            raise ValueError(f"virtual_stages is {virtual_stages} but the schedule's table runs "
                             f"{table} stages per row ({schedule.stages} stages in "
                             f"{schedule.rows} rows); leave virtual_stages out")
        return table
    if schedule == "zb_v":
        if virtual_stages not in (1, 2):
            raise ValueError(f"virtual_stages is {virtual_stages} but schedule 'zb_v' runs two "
                             f"stages per {per} in a V; leave virtual_stages out or pass 2")
        return 2
    if virtual_stages != 1 and schedule != "interleaved_1f1b":
        raise ValueError(f"virtual_stages is {virtual_stages} but schedule {schedule!r} runs "
                         f"one stage per {per}; use schedule='interleaved_1f1b', or "
                         f"virtual_stages=1")
    return virtual_stages


def _parse_balance(balance: Any) -> List[int]:
    if isinstance(balance, (str, bytes)) or not isinstance(balance, Iterable):
        stages = balance if isinstance(balance, int) and not _is_bool(balance) else 2
        raise TypeError(f"balance must be a list of layers per stage, e.g. [1, 1] for two "
                        f"stages of one layer, got {balance!r}; to compute one for {stages} "
                        f"stages, pass balance=gpipe.balance.balance_by_params({stages}, model) "
                        f"(or balance_by_time / balance_by_size)")
    balance = list(balance)
    return [_as_int(x, f"balance[{i}]", f"balance is a list of whole numbers of layers per "
                    f"stage, e.g. [2, 3] (got {balance!r})") for i, x in enumerate(balance)]


def _check_balance(module: nn.Sequential, balance: List[int]) -> None:
    if len(module) != sum(balance):
        raise ValueError(f"module and sum of balance have different length (module: "
                         f"{len(module)}, sum of balance: {sum(balance)}); pass one entry per "
                         f"stage summing to {len(module)}, or compute one with gpipe.balance")
    if any(x <= 0 for x in balance):
        raise ValueError(f"all balance numbers must be positive integer (balance: {balance}); "
                         f"see gpipe.balance to compute one")


def _single_device(devices: Any) -> Optional[torch.device]:
    """The device ``devices`` names when it is one device (every stage there), else None."""
    if devices is None:
        return None
    if isinstance(devices, (str, torch.device)):
        return _device(devices, "devices")
    if not isinstance(devices, Iterable) or _is_bool(devices):
        raise TypeError(f"devices must be a list with one device per stage, or one device for "
                        f"every stage, got {devices!r} ({type(devices).__name__}); e.g. "
                        f"devices=['cuda:0', 'cuda:1'] (ints are CUDA indices: devices=[0, 1]) "
                        f"or devices='cpu'")
    return None


def _device(d: Any, what: str) -> torch.device:
    if isinstance(d, int) and not isinstance(d, bool):
        return torch.device("cuda", d)
    try:
        return torch.device(d)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{what} = {d!r} is not a device ({e}); pass a torch.device, a string "
                         f"such as 'cpu' or 'cuda:1', or a CUDA index") from None


def _check_available(devices: List[torch.device]) -> None:
    """Refuses CUDA devices this machine lacks, before any layer moves (torch would say
    'Found no NVIDIA driver' from deep inside .to())."""
    cpu_fix = "devices=" + repr(["cpu"] * len(devices))
    for i, d in enumerate(devices):
        if d.type != "cuda":
            continue
        if not torch.cuda.is_available():
            raise ValueError(f"devices[{i}] is {d}, but CUDA is not available here "
                             f"(torch.cuda.is_available() is False); to run every stage on the "
                             f"CPU, pass {cpu_fix} (or devices='cpu')")
        count = torch.cuda.device_count()
        if d.index is not None and not 0 <= d.index < count:
            fix = repr([f"cuda:{k % count}" for k in range(len(devices))])
            raise ValueError(f"devices[{i}] is {d}, but this machine has {count} CUDA "
                             f"device{'s' if count != 1 else ''} (cuda:0 to cuda:{count - 1}); "
                             f"pass devices that exist, e.g. devices={fix} (stages may share "
                             f"a device)")


def _check_distinct(module: nn.Sequential) -> None:
    seen = {}
    for i, layer in enumerate(module):
        if id(layer) in seen:
            raise ValueError(f"layer {i} is the same module object as layer {seen[id(layer)]}; "
                             f"each layer of a Pipe must be its own module (use copy.deepcopy)")
        seen[id(layer)] = i


class _TiedCopies:
    """The uses, in one layer on ``device``, of parameters that live on another device (a
    weight tied across devices): for each forward of the layer, each use is handed a copy on
    ``device`` (``param.to(device)``, part of the graph, so autograd brings its grad home into
    the one parameter), and the parameter itself is put back when the forward ends. Between
    forwards the layer holds the parameter as the plain model does: ``state_dict`` keys,
    ``parameters()`` and the optimizer see one parameter, on its home device.

    A layer's forwards run one at a time (its stage's cells, recomputes included), so the
    swap is never seen by another cell. A callable object, not a closure: copies and
    unpickled Pipes keep their hooks on their own layers and parameters."""

    def __init__(self, uses: List[Tuple[nn.Module, str, nn.Parameter]],
                 device: torch.device) -> None:
        self.uses, self.device = uses, device

    def before(self, layer: nn.Module, args: Any) -> None:
        for owner, name, param in self.uses:
            # copy=True: a copy also where the devices compare equal (tests on the CPU).
            owner._parameters[name] = param.to(self.device, copy=True)  # type: ignore[assignment]

    def after(self, layer: nn.Module, args: Any, output: Any) -> None:
        for owner, name, param in self.uses:
            owner._parameters[name] = param


def _tie_across_devices(module: nn.Module, layers: Sequence[nn.Module],
                        layer_devices: Sequence[torch.device],
                        install: bool = True) -> List[_TiedCopies]:
    """Lets layers on different devices share a parameter (a GPT's embedding and lm_head):
    the parameter lives on the device of its first layer (home) and the later layers on
    other devices use a copy per forward (see :class:`_TiedCopies`). Call after the layers
    moved to their devices: moving a later layer moved the shared parameter with it, so it is
    moved home again here. Refuses a buffer shared across devices (a running statistic
    updated on a copy would be lost) and a module object (not a parameter) shared by layers
    on different devices, naming both uses. Returns the hooks installed, one per layer that
    uses another device's parameter; with ``install`` false only checks (before anything
    moves)."""
    first: Dict[int, Tuple[str, int]] = {}  # tensor id -> (name, layer)
    owners: Dict[int, Tuple[str, int]] = {}  # module id -> (name, layer)
    copies: Dict[int, List[Tuple[nn.Module, str, nn.Parameter]]] = {}
    homes: Dict[int, Tuple[nn.Parameter, torch.device]] = {}
    names = [name for name, _ in module.named_children()]
    for i, (name, layer, device) in enumerate(zip(names, layers, layer_devices)):
        for sub, owner in layer.named_modules(remove_duplicate=False):
            here = f"{name}.{sub}" if sub else name
            holds = next(owner.parameters(), None) is not None or next(owner.buffers(),
                                                                          None) is not None
            seen = owners.setdefault(id(owner), (here, i))
            if holds and layer_devices[seen[1]] != device:
                raise ValueError(
                    f"module {here!r} of layer {i} (on {device}) is the same module object as "
                    f"{seen[0]!r} of layer {seen[1]} (on {layer_devices[seen[1]]}); layers on "
                    f"different devices may share a parameter (it lives on the first one's "
                    f"device), not a module: share the parameter (b.weight = a.weight) or put "
                    f"those layers on one device")
            for kind, table in (("parameter", owner._parameters), ("buffer", owner._buffers)):
                for attr, tensor in table.items():
                    if tensor is None:
                        continue
                    full = f"{here}.{attr}" if here else attr
                    where = first.setdefault(id(tensor), (full, i))
                    j = where[1]
                    if layer_devices[j] == device:
                        continue
                    if kind == "buffer":
                        raise ValueError(
                            f"buffer {full!r} of layer {i} (on {device}) is the same tensor as "
                            f"{where[0]!r} of layer {j} (on {layer_devices[j]}), so it cannot "
                            f"live on both devices (a copy's updates would be lost); put those "
                            f"layers on one device, or give each its own buffer")
                    homes[id(tensor)] = (tensor, layer_devices[j])  # type: ignore[assignment]
                    copies.setdefault(i, []).append((owner, attr, tensor))  # type: ignore[arg-type]
    if not install:
        return []
    with torch.no_grad():
        for param, home in homes.values():
            if param.device != home:
                param.data = param.data.to(home)
                if param.grad is not None:
                    param.grad = param.grad.to(home)
    hooks = []
    for i, uses in copies.items():
        hook = _TiedCopies(uses, layer_devices[i])
        layers[i].register_forward_pre_hook(hook.before)
        layers[i].register_forward_hook(hook.after, always_call=True)
        hooks.append(hook)
    return hooks


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


def _check_input(input: Any, what: str = "input") -> None:
    if isinstance(input, tuple):
        for i, x in enumerate(input):
            if not isinstance(x, Tensor):
                raise TypeError(f"expected Tensor or Tuple[Tensor, ...] as {what}, but element "
                                f"{i} of the tuple is {type(x).__name__}")
        if not input:
            raise TypeError(f"expected Tensor or Tuple[Tensor, ...] as {what}, but got an empty "
                            "tuple")
    elif not isinstance(input, Tensor):
        raise TypeError(f"expected Tensor or Tuple[Tensor, ...] as {what}, but got "
                        f"{type(input).__name__}")


_READ_ONLY = ("pipe.partitions is a read-only view of the Pipe's stages: changing it would "
              "not change what the Pipe runs; build a new Pipe from the changed nn.Sequential "
              "instead")


_HOOK_NEVER_RUNS = ("a hook on pipe.partitions would never run: the Pipe runs each stage's "
                    "layers, not this view (built anew at each access); register it on a layer "
                    "instead, e.g. pipe.partitions[j][-1].register_forward_hook(...) sees stage "
                    "j's output, pipe.partitions[j][0]'s pre-hook its input")


class _ReadOnlyView:
    """Refuses, once built, what would add, replace or remove a child, move a
    stage to another device (its layers are the Pipe's own objects), or hook a
    view that never runs."""

    _device: Optional[torch.device] = None

    def _freeze(self, device: Optional[torch.device]) -> None:
        object.__setattr__(self, "_device", device)
        object.__setattr__(self, "_frozen", True)

    def _frozen_now(self) -> bool:
        return self.__dict__.get("_frozen", False)

    def add_module(self, name: str, module: Optional[nn.Module]) -> None:
        if self._frozen_now():
            raise TypeError(_READ_ONLY)
        super().add_module(name, module)  # type: ignore[misc]

    register_module = add_module

    def __setattr__(self, name: str, value: Any) -> None:
        if self._frozen_now() and (isinstance(value, nn.Module) or name in self._modules):
            raise TypeError(_READ_ONLY)
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if self._frozen_now() and name in self._modules:
            raise TypeError(_READ_ONLY)
        super().__delattr__(name)

    def insert(self, index: int, module: nn.Module) -> None:
        raise TypeError(_READ_ONLY)

    def _refuse_hook(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(_HOOK_NEVER_RUNS)

    register_forward_hook = register_forward_pre_hook = _refuse_hook
    register_full_backward_hook = register_full_backward_pre_hook = _refuse_hook
    register_backward_hook = _refuse_hook

    def _apply(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        # Casting (.double()) applies to the Pipe's layers as pipe.double() would;
        # a move to another device is refused as the Pipe's own.
        if self._device is not None:
            probe = fn(torch.empty(0, device=self._device))
            if probe.device != self._device:
                raise _MOVING_DENIED
        return super()._apply(fn, *args, **kwargs)  # type: ignore[misc]


class _Stage(_ReadOnlyView, nn.Sequential):
    """One stage of a Pipe: its layers under their names in the Sequential."""


class _Stages(_ReadOnlyView, nn.ModuleList):
    """A Pipe's stages, one :class:`_Stage` each."""


class _NoStages:
    """The engine of a Pipe over an empty Sequential: the identity, as nn.Sequential()."""

    def __init__(self) -> None:
        self.tracing = False
        self.trace_capacity = _C.DEFAULT_TRACE_CAPACITY

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
            are the Sequential's ("0.weight", ...). The Pipe runs the
            Sequential's own layer objects (moved to their stage's device).
        balance: layers per stage, a list of ints, e.g. ``[2, 3]``. None: one
            stage per device, balanced by parameter count (see
            :mod:`gpipe.balance` for balancing by time or memory).
        devices: one device per stage (extra ones are dropped; with several stages per
            device, under ``virtual_stages`` or zb_v, extra ones are refused): torch.device,
            string (``'cuda:1'``) or CUDA index. One device, not in a list
            (``devices='cpu'``), puts every stage there. Default: all CUDA
            devices, or the CPU for every stage when there is no CUDA.
        chunks: micro-batches per mini-batch, an int (default 1). A batch of ``rows``
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
        checkpoint: ``'always'``, ``'except_last'`` (default) or ``'never'``
            (or anything whose ``str()`` is one): which micro-batches keep only
            their stage inputs in forward and recompute the rest before their
            backward; or a list with one mode per stage, e.g.
            ``['always', 'except_last', 'never', 'never']`` (under 1F1B-like
            schedules stage 0 holds K micro-batches in flight, the last stage
            one).
        deferred_batch_norm: run BatchNorm layers as ones whose running
            statistics are updated once per mini-batch (see
            :class:`gpipe.batchnorm.DeferredBatchNorm`). The caller's
            Sequential is left as it was: the Pipe runs converted copies of
            its BatchNorms (and of the containers holding them), which share
            the originals' weight, bias and running-statistics tensors.
        trace: record every forward, backward, recompute and copy from the
            start (see :attr:`trace` and :func:`gpipe.tracing`).
        intra_op_threads: intra-op threads (as ``torch.set_num_threads``) of
            each CPU stage's worker, fixed when the Pipe is built. 0
            (default): split this thread's ``torch.get_num_threads()``
            between the CPU stages, at least 1 each, so K stages do not
            oversubscribe the cores; N > 0: N per CPU stage; -1: leave
            torch's setting (every stage then uses all of it). The caller's
            own count is never changed; GPU stages are left alone.
        schedule: the order :meth:`train_step` runs micro-batches in
            (``forward`` always runs GPipe's): ``'1f1b'`` (default; GPipe's
            bubble, at most K micro-batches' activations per stage instead of
            M), ``'gpipe'`` (every forward, then every backward),
            ``'interleaved_1f1b'`` (Megatron-LM's, with ``virtual_stages``
            stages per device: a bubble v times smaller, more hand-offs) or
            ``'zb_h1'`` (zero bubble: each backward split into input grads and
            weight grads, the weight halves filling the drain; about a third
            of 1F1B's bubble at 1F1B's peak memory), ``'zb_v'`` (zero bubble
            in a V: two stages per device, device w running stages w and
            2W-1-w, so ``balance`` has 2W entries; near-zero bubble at
            1F1B's activation memory; within one process so far), or a
            :class:`gpipe.Schedule`: a table of actions in
            torch.distributed.pipelining's CSV format (its stages fix
            ``virtual_stages``, its micro-batches must equal ``chunks``).
            :meth:`schedule_csv` gives the table a pipe runs.
        virtual_stages: stages per device for ``'interleaved_1f1b'``: then
            ``balance`` has ``virtual_stages`` x W entries for W devices and
            stage s runs on ``devices[s % W]``. 1 (default): one per device.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``; ``balance`` is not
            a list of ints, ``chunks`` not an int, ``devices`` an int.
        ValueError: bad ``balance``, ``chunks`` or ``checkpoint`` values; a
            device that is not one, or a CUDA device this machine lacks; a
            buffer, or a module holding parameters, shared by layers on
            different devices (a parameter may be shared: it lives on its first
            layer's device, and later layers elsewhere use a copy per forward
            whose grad comes home, so tied weights train as in the plain model).
        IndexError: fewer devices than stages.
        ValueError: with several stages per device (``virtual_stages`` or zb_v), more
            devices than the stages use, naming the count it would use and the balance
            that uses them all.

    Attributes:
        balance: layers per stage, a list of ints.
        devices: one ``torch.device`` per stage, a list (extra ones given
            are dropped); with ``virtual_stages``, one per device, stage s
            running on ``devices[s % len(devices)]``.
        chunks: micro-batches per mini-batch, an int.
        checkpoint: the checkpoint mode, a str (or a list, one per stage).
        partitions: each stage's layers (the Pipe's own objects), one
            ``nn.Sequential`` per stage in an ``nn.ModuleList``, as
            torchgpipe's; a read-only view that registers nothing, so
            ``state_dict()`` keys stay the Sequential's (``"0.weight"``). To
            load a checkpoint saved from torchgpipe (keys
            ``"partitions.0.0.weight"``), see
            :func:`gpipe.load_torchgpipe_state_dict`.

    Checkpointed micro-batches run their layers twice (forward, then
    recompute before backward), and so their forward hooks and pre-hooks,
    as with ``torch.utils.checkpoint``: with ``chunks=4`` and
    ``'except_last'`` a layer's hook fires 7 times per step. A hook that must
    fire once per micro-batch returns early when :func:`gpipe.is_recomputing`.

    ``copy.deepcopy(pipe)``, ``pickle`` and ``torch.save(pipe)`` /
    ``torch.load(path, weights_only=False)`` give an independent Pipe with
    the same options and copied layers (its trace starts empty).

    ``torch.compile(pipe)`` compiles none of the layers (the pipeline runs in
    C++, out of dynamo's sight) and warns; :meth:`compile` compiles each
    stage, run compiled on its worker thread.

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
    #: Which micro-batches are checkpointed: 'always', 'except_last' or 'never' (or one per
    #: stage, a list).
    checkpoint: Union[str, List[str]]

    def __init__(self, module: nn.Sequential, balance: Optional[Iterable[int]] = None, *,
                 devices: Optional[Union[Iterable[Device], Device]] = None, chunks: int = 1,
                 checkpoint: Union[str, Sequence[str]] = "except_last",
                 batch_dim: BatchDim = 0,
                 output_batch_dim: Optional[BatchDim] = None, deferred_batch_norm: bool = False,
                 trace: bool = False, intra_op_threads: int = 0, schedule: str = "1f1b",
                 virtual_stages: int = 1) -> None:
        """Cuts ``module`` into ``balance`` stages on ``devices`` and starts one
        worker per stage; ``chunks`` micro-batches per mini-batch (cut along
        dim 0 by default), ``checkpoint`` mode, ``deferred_batch_norm`` and
        ``trace`` as described in the class docstring (``help(gpipe.Pipe)``),
        which also lists the errors raised for bad arguments."""
        super().__init__()
        if not isinstance(module, nn.Sequential):
            raise TypeError(f"module must be nn.Sequential to be partitioned, got "
                            f"{type(module).__name__}")
        chunks = _parse_chunks(chunks)
        checkpoint = _parse_checkpoint(checkpoint)
        schedule = _parse_schedule(schedule)
        virtual_stages = _as_int(virtual_stages, "virtual_stages",
                                 "pass the number of stages per device, e.g. virtual_stages=2")
        if virtual_stages < 1:
            raise ValueError(f"virtual_stages must be at least 1, got {virtual_stages}; it is the "
                             f"number of stages per device")
        virtual_stages = _schedule_stages(schedule, virtual_stages, "device")
        input_dims = _batch_dims(batch_dim, "batch_dim")
        output_dims = [] if output_batch_dim is None else _batch_dims(output_batch_dim,
                                                                      "output_batch_dim")
        single = _single_device(devices)
        if len(module) == 0:
            # nn.Sequential() is the identity; so is its Pipe (torchgpipe's too).
            balance = [] if balance is None else balance
            devices = [] if devices is None and single is None else devices
        elif balance is None:
            # One stage per device given (or per CUDA device), by parameter count.
            if single is not None:
                devices = [single]
            if devices is None and torch.cuda.is_available():
                devices = range(torch.cuda.device_count())
            if devices is None:
                raise ValueError("balance is None and there are no devices to count stages "
                                 "by; pass balance (layers per stage, see gpipe.balance to "
                                 "compute one) or devices (one per stage, e.g. ['cpu', 'cpu'])")
            devices = list(devices)  # type: ignore[arg-type]
            if virtual_stages > 1 and len(module) < virtual_stages * len(devices):
                raise ValueError(f"{_stages_per_device(schedule, virtual_stages)}, so "
                                 f"{_count(len(devices), 'device')} need at least "
                                 f"{virtual_stages * len(devices)} layers to balance over, but "
                                 f"the Sequential has {_count(len(module), 'layer')}; pass "
                                 f"{_count(max(len(module) // virtual_stages, 1), 'device')} "
                                 f"(or a balance)")
            workers = min(len(devices), max(len(module) // virtual_stages, 1))
            balance = balance_by_params(workers * virtual_stages, module)
        balance = _parse_balance(balance)
        _check_balance(module, balance)
        _check_distinct(module)
        verify_skippables(module)
        if len(balance) % virtual_stages != 0:
            raise ValueError(f"balance {balance} has {len(balance)} stages, not a multiple of "
                             f"virtual_stages {virtual_stages}; give virtual_stages entries per "
                             f"device")
        workers = len(balance) // virtual_stages

        if single is not None:
            devices = [single] * workers
        elif devices is None:
            if torch.cuda.is_available():
                devices = range(torch.cuda.device_count())
            else:
                devices = ["cpu"] * workers
        devices = [_device(d, f"devices[{i}]")
                   for i, d in enumerate(devices)]  # type: ignore[union-attr, arg-type]
        if len(devices) < workers:
            per = "stage" if virtual_stages == 1 else f"{virtual_stages} stages"
            raise IndexError(f"too few devices to hold given partitions: got "
                             f"{_count(len(devices), 'device')} for "
                             f"{_count(len(balance), 'stage')}; pass one "
                             f"device per {per}, e.g. devices={['cpu'] * workers!r}, or "
                             f"one device for every stage, e.g. devices='cpu'")
        if virtual_stages > 1 and len(devices) > workers:
            # Several stages per device fill every device or are refused (one stage per
            # device keeps torchgpipe's rule: extra devices are dropped).
            raise ValueError(f"balance {balance} has {_count(len(balance), 'stage')} and "
                             f"{_stages_per_device(schedule, virtual_stages)}, so it uses "
                             f"{_count(workers, 'device')}, but {_count(len(devices), 'device')} "
                             f"are given {[str(d) for d in devices]}; pass "
                             f"{_count(workers, 'device')} to use {workers}, or "
                             f"{virtual_stages * len(devices)} entries ({virtual_stages} per "
                             f"device) to use all {len(devices)}")
        devices = devices[:workers]
        _check_available(devices)

        self.balance = balance
        self.devices = devices
        self.chunks = chunks
        self.checkpoint = checkpoint
        #: The order :meth:`train_step` runs micro-batches in.
        self.schedule = schedule
        #: Stages per device (interleaved_1f1b): stage s runs on devices[s % len(devices)].
        self.virtual_stages = virtual_stages
        #: Intra-op threads per CPU stage: 0 split, N each, -1 torch's setting.
        self.intra_op_threads = _as_int(intra_op_threads, "intra_op_threads",
                                        "pass 0 (split the cores), N or -1")
        #: Where inputs are cut and outputs joined (see the class docstring).
        self.batch_dim = batch_dim
        self.output_batch_dim = output_batch_dim

        # The Sequential's own names: state_dict() keys read "0.weight".
        for name, layer in module.named_children():
            if deferred_batch_norm:
                layer = _deferred_copy(layer, chunks)
            self.add_module(name, layer)
        self._layers: List[nn.Module] = list(self._modules.values())  # type: ignore[arg-type]
        _tie_across_devices(self, self._layers, self._stage_devices(), install=False)
        for layer, device in zip(self._layers, self._stage_devices()):
            layer.to(device)
        _tie_across_devices(self, self._layers, self._stage_devices())
        self._deferred = [m for m in self.modules() if isinstance(m, DeferredBatchNorm)]
        self._batch_dims = (input_dims, output_dims)
        self._stages: Optional[List[nn.Module]] = None  # compiled stages, see compile()
        self._build_engine(trace)

    def _stage_devices(self) -> List[torch.device]:
        """Each layer's device, in order."""
        return [d for n, d in zip(self.balance, self._per_stage_devices()) for _ in range(n)]

    def _per_stage_devices(self) -> List[torch.device]:
        """Each stage's device: stage s runs on devices[s % len(devices)], or with zb_v in a
        V, stage s on devices[s] and stage 2W-1-s on devices[s] too."""
        return [self.devices[w] for w in _stage_workers(getattr(self, "schedule", None),
                                                         len(self.devices), len(self.balance))]

    def _partitions(self) -> List[List[nn.Module]]:
        """Each stage's layers, in order."""
        parts, offset = [], 0
        for n in self.balance:
            parts.append(self._layers[offset:offset + n])
            offset += n
        return parts

    @property
    def partitions(self) -> nn.ModuleList:
        """Each stage's layers as an ``nn.Sequential`` (under their names in
        the Sequential), in an ``nn.ModuleList``, one entry per stage, as
        torchgpipe's ``partitions``: ``pipe.partitions[j]`` holds stage j's own
        layer objects. A read-only view built at each access: it registers
        nothing on the Pipe (``state_dict()`` keys stay ``"0.weight"``), and
        adding, replacing or removing layers through it, or moving a stage to
        another device, raises TypeError."""
        names = list(self._modules)
        stages, offset = [], 0
        for n, device in zip(self.balance, self._per_stage_devices()):
            stage = _Stage(OrderedDict(zip(names[offset:offset + n],
                                           self._layers[offset:offset + n])))
            stage._freeze(device)
            stages.append(stage)
            offset += n
        view = _Stages(stages)
        view._freeze(None)
        return view

    def _build_engine(self, trace: bool = False) -> None:
        """Starts the C++ engine over the stages: the one place it is built, from
        the Pipe's attributes (construction, copies, unpickling and compile())."""
        layers = self._partitions()
        parts: List[Any] = layers if self._stages is None else [[s] for s in self._stages]
        # Pipes pickled before train_step existed have neither attribute.
        self.__dict__.setdefault("schedule", "1f1b")
        self.__dict__.setdefault("virtual_stages", 1)
        # With skips, each stage runs through a runner handing them on (skip/layout.py).
        parts, routes = stage_runners(layers, parts)
        table = self.schedule if isinstance(self.schedule, Schedule) else None
        self._engine = (_C.Engine(parts, self._per_stage_devices(), self.chunks,
                                  _engine_checkpoint(self.checkpoint),
                                  intra_op_threads=self.intra_op_threads,
                                  virtual_stages=self.virtual_stages,
                                  schedule=_engine_schedule(self.schedule),
                                  skip_routes=routes)
                        if parts else _NoStages())
        if table is not None and parts:
            self._engine.set_plan_csv(table.csv)
        if isinstance(self.checkpoint, list) and parts:
            self._engine.set_stage_checkpoints(self.checkpoint)
        self._engine.set_batch_dims(*self._batch_dims)
        self._engine.tracing = bool(trace)

    def __getstate__(self) -> Dict[str, Any]:
        # The engine (threads, C++ state) is not copied: a copy or an unpickled
        # Pipe builds its own from the layers and options. Compiled stages are
        # dropped, as nn.Module's own state drops its compiled call.
        state = super().__getstate__()
        state.pop("_engine", None)
        state["_stages"] = None
        state["_tracing"] = self.tracing
        state["_trace_capacity"] = self.trace_capacity
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        state = dict(state)
        trace = state.pop("_tracing", False)
        capacity = state.pop("_trace_capacity", None)
        super().__setstate__(state)
        self._build_engine(trace)
        if capacity is not None:
            self.trace_capacity = capacity

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
        """Number of layers, as ``len`` of the Sequential."""
        return len(self._layers)

    def __iter__(self) -> Iterator[nn.Module]:
        """The layers in order, as iterating the Sequential."""
        return iter(self._layers)

    def __getitem__(self, index: Union[int, slice]) -> nn.Module:
        """The layer at ``index``; a slice gives those layers as an
        ``nn.Sequential`` (under their names), as ``nn.Sequential`` does."""
        if isinstance(index, slice):
            return nn.Sequential(OrderedDict(list(self._modules.items())[index]))
        i = _as_int(index, "a Pipe's index", "index a Pipe with an int or a slice")
        n = len(self._layers)
        if not -n <= i < n:
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

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Compiles each stage with ``torch.compile(stage, *args, **kwargs)``:
        the stage's layers, run in order, become one compiled module, called
        on that stage's worker thread in forward and in recompute.

        ``torch.compile(pipe)`` cannot do this: the pipeline runs in C++,
        where dynamo sees nothing. The layers themselves are unchanged (same
        objects, parameters and ``state_dict()`` keys); a copy (deepcopy,
        pickle) runs uncompiled, as with ``nn.Module.compile``. The recorded
        trace starts afresh.

        Example::

            pipe = gpipe.Pipe(model, balance=[2, 2], chunks=4)
            pipe.compile()                 # or pipe.compile(mode="max-autotune")
        """
        if not torch.cuda.is_available() and hasattr(torch._C, "_ensureCUDADeviceGuardSet"):
            # Without CUDA, dynamo installs a no-op CUDA device guard the first time it
            # fakes tensors, and (torch 2.11) that guard dies with the thread that installed
            # it: if that is a stage's worker, the next compile after this Pipe is gone
            # segfaults. Installing it first here, on the caller's thread, avoids that.
            torch._C._ensureCUDADeviceGuardSet()
        self._stages = [torch.compile(nn.Sequential(*part), *args, **kwargs)
                        for part in self._partitions()]
        self._build_engine(self.tracing)

    def forward(self, input: TensorOrTensors) -> TensorOrTensors:  # type: ignore[override]
        """Runs ``input`` (a tensor, or a tuple of tensors handed to the first
        layer as one tuple) through the pipeline, cut into micro-batches
        along ``batch_dim`` (dim 0 by default). The output lives on the last
        stage's device."""
        if torch.compiler.is_compiling():
            warnings.warn(_COMPILE_SEES_NOTHING, stacklevel=2)
        _check_input(input)
        if self._deferred and self.training:
            microbatches = self._engine.microbatches(input)
            for bn in self._deferred:
                bn.begin(microbatches)
        return self._engine.forward(input, self.training)

    def schedule_csv(self) -> str:
        """The order :meth:`train_step` runs, for ``chunks`` micro-batches, as a table in
        torch.distributed.pipelining's CSV format (one row per device, actions like ``0F3``,
        ``1I2``, ``1W2``, ``0B1``): save it, edit it, pass it back as
        ``schedule=gpipe.Schedule(text)``."""
        if isinstance(self._engine, _NoStages):
            raise ValueError("a Pipe over an empty Sequential runs no schedule")
        return self._engine.plan_csv(self.chunks)

    def train_step(self, input: TensorOrTensors, target: TensorOrTensors,
                   loss_fn: Callable[[TensorOrTensors, TensorOrTensors], Tensor]) -> Tensor:
        """One training step inside the pipeline, in the order of ``schedule``:
        the forward of every micro-batch, ``loss_fn(output, target)`` on the
        last stage right after its forward, and the backward, interleaved as
        the schedule says (1F1B by default; see the class docstring).

        ``target`` (a tensor or a tuple of tensors) is cut along dim 0 like the
        input; ``loss_fn`` gets one micro-batch's output and target and returns
        its loss as one number, mean-reduced over its rows (e.g.
        ``nn.functional.mse_loss``). Micro-batch i's loss counts rows_i / rows,
        so the returned loss (detached) equals ``loss_fn(model(input),
        target)`` and every ``.grad`` gains what ``loss_fn(model(input),
        target).backward()`` gives with the plain Sequential, also for
        uneven micro-batches. Grads accumulate like a backward does: zero
        them yourself. Checkpointing applies as in :meth:`forward`.

        ``loss_fn`` runs on the last stage's worker thread. An error (in a
        layer, in ``loss_fn``) is raised as itself with a note naming the
        stage, micro-batch and phase ('forward', 'loss', 'backward',
        'input-grad backward', 'weight-grad backward' or 'recompute'); the
        grads of a failed step are partial, and the Pipe works on the next.

        Example::

            pipe = gpipe.Pipe(model, balance=[2, 2], chunks=8, schedule='zb_h1')
            opt.zero_grad()
            loss = pipe.train_step(x, y, nn.functional.cross_entropy)
            opt.step()
        """
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(output, target), got "
                            f"{loss_fn!r}")
        _check_input(input)
        _check_input(target, "target")
        if isinstance(self._engine, _NoStages):
            loss = loss_fn(input, target)
            loss.backward()
            return loss.detach()
        if self._deferred and self.training:
            microbatches = self._engine.microbatches(input)
            for bn in self._deferred:
                bn.begin(microbatches)
        return self._engine.train_step(input, target, loss_fn, self.training)

    def extra_repr(self) -> str:
        text = (f"balance={self.balance}, devices={[str(d) for d in self.devices]}, "
                f"chunks={self.chunks}, checkpoint={self.checkpoint!r}, "
                f"schedule={self.schedule!r}")
        if self.virtual_stages != 1:
            text += f", virtual_stages={self.virtual_stages}"
        if self.batch_dim != 0:
            text += f", batch_dim={self.batch_dim!r}"
        if self.output_batch_dim is not None:
            text += f", output_batch_dim={self.output_batch_dim!r}"
        return text


#: torchgpipe's name for the same class.
GPipe = Pipe
