"""Type stubs for gpipe._C, the private C++ engine (use gpipe.Pipe)."""
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

class Engine:
    """Runs stages of Python modules as a GPipe pipeline."""

    def __init__(self, partitions: Sequence[Sequence[nn.Module]], devices: Sequence[torch.device],
                 chunks: int, checkpoint: str, intra_op_threads: int = ...,
                 virtual_stages: int = ..., schedule: str = ...,
                 skip_routes: Sequence[Tuple[int, int]] = ..., group: str = ...,
                 reverse_group: str = ..., dp_group: str = ...) -> None: ...
    def forward(self, input: Union[Tensor, Tuple[Tensor, ...]],
                training: bool) -> Union[Tensor, Tuple[Tensor, ...]]: ...
    def train_step(self, input: Optional[Union[Tensor, Tuple[Tensor, ...]]],
                   target: Optional[Union[Tensor, Tuple[Tensor, ...]]],
                   loss_fn: Callable[..., Tensor], training: bool) -> Optional[Tensor]: ...
    def abandon_step(self, what: str, training_step: bool) -> None: ...
    def set_plan_csv(self, text: str) -> None: ...
    def plan_csv(self, microbatches: int) -> str: ...
    def eval_step(self, input: Optional[Union[Tensor, Tuple[Tensor, ...]]]
                  ) -> Optional[Union[Tensor, Tuple[Tensor, ...]]]: ...
    tracing: bool
    handoffs: str  # 'in-process', 'tagged' (Gloo) or 'ordered' (NCCL)
    intra_op_threads: List[int]
    def trace(self) -> "Trace": ...
    def clear_trace(self) -> None: ...
    trace_capacity: int
    trace_origin_ns: int  # the trace's time zero on the steady clock (time.monotonic_ns())

class TraceEvent:
    """One executed cell (or cross-device copy); times in µs since the Pipe was built."""

    step: int
    stage: int
    microbatch: int
    phase: str  # 'forward', 'backward', 'recompute', 'copy', 'loss', 'input_grad', 'weight_grad', 'send', 'receive'
    start_us: float
    end_us: float
    thread: int
    peer: int  # 'send', 'receive': the stage at the other end; -1 otherwise

class TraceSummary:
    """The measured bubble against GPipe's ideal, busy time per stage."""

    stages: int
    microbatches: int
    steps: int
    busy_us: List[float]
    span_us: float
    bubble: float
    ideal_bubble: float

class Trace:
    """What a Pipe ran while tracing was on."""

    events: List[TraceEvent]
    dropped: int
    def __init__(self) -> None: ...
    def to_chrome_json(self) -> str: ...
    def save_chrome_json(self, path: str) -> None: ...
    def summary(self) -> TraceSummary: ...
    def __len__(self) -> int: ...

DEFAULT_TRACE_CAPACITY: int

def is_checkpointing() -> bool:
    """True inside the first forward of a checkpointed micro-batch (no graph kept).
    Public as gpipe.is_checkpointing, a Python function calling this one."""

def is_recomputing() -> bool:
    """True inside the recompute of a checkpointed micro-batch, just before its backward.
    Public as gpipe.is_recomputing, a Python function calling this one."""

class MemoryCounter:
    """Context manager: bytes allocated minus bytes freed on this thread while inside."""

    current: int
    def __enter__(self) -> "MemoryCounter": ...
    def __exit__(self, *exc: object) -> None: ...

def parse_schedule_csv(text: str) -> Tuple[int, int, int, str, bool]:
    """(rows, stages, micro-batches, the CSV without idle cells, whether its stages lie in
    ZB-V's V) of a schedule table."""

def balance_cost(costs: List[float], partitions: int) -> List[int]:
    """The contiguous split of per-layer costs minimising the largest stage."""
