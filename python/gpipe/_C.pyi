"""Type stubs for gpipe._C, the private C++ engine (use gpipe.Pipe)."""
from typing import List, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

class Engine:
    """Runs stages of Python modules as a GPipe pipeline."""

    def __init__(self, partitions: Sequence[Sequence[nn.Module]], devices: Sequence[torch.device],
                 chunks: int, checkpoint: str) -> None: ...
    def forward(self, input: Union[Tensor, Tuple[Tensor, ...]],
                training: bool) -> Union[Tensor, Tuple[Tensor, ...]]: ...

def is_checkpointing() -> bool:
    """True inside the first forward of a checkpointed micro-batch (no graph kept)."""

def is_recomputing() -> bool:
    """True inside the recompute of a checkpointed micro-batch, just before its backward."""

class MemoryCounter:
    """Context manager: bytes allocated minus bytes freed on this thread while inside."""

    current: int
    def __enter__(self) -> "MemoryCounter": ...
    def __exit__(self, *exc: object) -> None: ...

def balance_cost(costs: List[float], partitions: int) -> List[int]:
    """The contiguous split of per-layer costs minimising the largest stage."""
