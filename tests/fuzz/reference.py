"""reference.py — the boundary-cloned model: the reference where gpipe's hand-over is deliberate.

gpipe hands every stage its input (``Boundary`` in csrc/stage.cpp) so that the
stage's first layer may work in place, even where the plain model refuses: on
a leaf that requires grad or a view of one ("a leaf Variable that requires
grad is being used in an in-place operation"), and, with checkpointing, on a
tensor an earlier stage saved ("one of the variables needed for gradient
computation has been modified by an inplace operation": the recompute
regenerates it). There the Pipe is compared against :class:`BoundaryCloned`,
the same layers with each stage's input handed over the way gpipe does.
"""
from typing import Any, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

#: The plain model's in-place refusals that gpipe's hand-over at stage boundaries avoids.
INPLACE_ERRORS = (
    "leaf Variable that requires grad is being used in an in-place operation",  # also 'a view of'
    "one of the variables needed for gradient computation has been modified by an inplace "
    "operation",
)


def as_tuple(x: Any) -> Tuple[Any, ...]:
    return x if isinstance(x, tuple) else (x,)


def is_inplace_error(e: Optional[BaseException]) -> bool:
    return e is not None and any(m in str(e) for m in INPLACE_ERRORS)


def needs_cloned(pipe_e: Optional[BaseException], plain_e: Optional[BaseException]) -> bool:
    """The plain model refused an in-place operation and the Pipe did not raise such an error
    too (one that does, e.g. from a cell it does not recompute, matches as it is; any other
    error of the Pipe, even a RuntimeError, is compared against the boundary-cloned model)."""
    return is_inplace_error(plain_e) and not (type(pipe_e) is type(plain_e)
                                               and is_inplace_error(pipe_e))


def is_input_or_view(t: Tensor, inputs: Sequence[Tensor]) -> bool:
    """Whether t is one of ``inputs`` or a view of one (shares its storage)."""
    s = t.untyped_storage()
    return any(t is x or t._base is x or (s.nbytes() > 0 and s.data_ptr()
                                          == x.untyped_storage().data_ptr()) for x in inputs)


class _Handover(torch.autograd.Function):
    """A non-leaf alias of x (same storage and version counter), as gpipe's Boundary hands a
    stage its input: in-place work on it changes the caller's tensor, as in the Pipe."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad


class BoundaryCloned(nn.Sequential):
    """The same layers run plainly, but each stage (per ``balance``, stage 0 included) gets
    every input tensor that requires grad handed over as gpipe does: ``t.clone()``
    (differentiable, so the graph is kept; in-place work on it leaves what earlier stages saved
    intact, as a recompute does), except that the caller's tensors, or views of them, are handed
    over as non-leaf aliases (:class:`_Handover`), since in the Pipe in-place work changes them
    (and bumps their version) as it does in the plain model. Tensors that need no grad are
    handed over as they are. Layer names are the plain model's."""

    def __init__(self, model: nn.Sequential, balance: Sequence[int]) -> None:
        super().__init__(*model)
        self.starts = {sum(balance[:j]) for j in range(len(balance))}

    def forward(self, x: Any) -> Any:  # type: ignore[override]
        callers = as_tuple(x)
        for i, layer in enumerate(self):
            if i in self.starts:
                handed = tuple(t if not t.requires_grad else _Handover.apply(t)
                               if is_input_or_view(t, callers) else t.clone()
                               for t in as_tuple(x))
                x = handed if isinstance(x, tuple) else handed[0]
            x = layer(x)
        return x
