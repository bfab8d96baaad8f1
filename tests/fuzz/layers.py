"""layers.py — the layer kinds the fuzzer composes (importable by the printed reproductions).

Ordinary layers come from ``torch.nn``; these are the fuzzer's own: dropout
whose masks the plain copy replays, tensors that require grad without being
parameters of their layer (an attribute, a closure, a buffer, a tied weight),
layers that raise on purpose in forward or backward, and layers taking or
returning tuples (including an integer mask crossing the stages).

Dropout: masks differ between the Pipe and the plain model, so outputs cannot
be compared directly. :class:`MaskDropout` and :class:`CondDropout` log the
mask each micro-batch draws in its first forward (never in a recompute, told
by ``gpipe.is_recomputing()``), and the plain copy then replays the
concatenated masks of the whole batch. So outputs and grads are compared
exactly: the plain model's grads are those of the masks the Pipe's forward
actually used, and a recompute that draws a different mask shows up as a
``[grad]`` mismatch. :class:`CondDropout` draws only on micro-batches with
fewer rows than a threshold (the small last one).

Skips (``gpipe.skip``): :func:`Stash`, :func:`Pop` and :func:`Relay` build
``@skippable`` layers for any skip name (one decorated class per name set,
made on first use), so a configuration pairs them freely: a stash of the input
itself, of a function of it or of None; a pop that adds, multiplies,
concatenates, ignores or returns the popped tensor; a relay that pops one skip
and stashes another. Each keeps its flat signature, so they go anywhere a
flat tensor flows. Isolated into ``Namespace`` objects, one name serves
several pairs. A plain ``nn.Sequential`` of them runs as it is (the thread's
skip tracker carries the skips), which is the reference.
"""
import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import gpipe
from gpipe.skip import Namespace, pop, skippable, stash

__all__ = ["FuzzError", "ReplayError", "MaskDropout", "CondDropout", "ExternalMatmul", "Shared",
           "ClosureMatmul", "BufferScale", "TiedLinear", "Detach", "Constant", "RaiseIf",
           "RaiseInBackward", "Split", "Mix", "Swap", "PairTanh", "FirstOnly", "Join",
           "PairProduct", "Masked", "Unmask", "MoveBatch", "WithTable", "Tagged",
           "Stash", "Pop", "Relay", "Namespace"]

class FuzzError(Exception):
    """Raised on purpose by RaiseIf / RaiseInBackward: the Pipe must raise this very type."""


class ReplayError(Exception):
    """The Pipe's dropout logs do not cover the batch (a forward ran other than once per cell)."""


class MaskDropout(nn.Dropout):
    """Dropout whose first-forward masks are logged, so the plain copy can replay them."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__(p)
        self.log: List[Tensor] = []        # one mask per first forward, in micro-batch order
        self.replay: Optional[Tensor] = None  # set on the plain copy: the whole batch's mask
        self.drawn = 0  # forwards that drew (first ones and recomputes)

    def draws(self, x: Tensor) -> bool:
        return True

    def forward(self, x: Tensor) -> Tensor:
        if not self.training:
            return x
        if self.replay is not None:
            mask, self.replay = self.replay, None
            if mask.shape != x.shape:
                raise ReplayError(f"logged masks cover {tuple(mask.shape)}, the batch is "
                                  f"{tuple(x.shape)}")
            return x * mask
        # Dropout of ones is the mask itself (0 or 1/(1-p)): exact, and it draws
        # from the default generator as nn.Dropout does.
        drawing = self.draws(x)
        self.drawn += drawing
        mask = F.dropout(torch.ones_like(x), self.p, True) if drawing else torch.ones_like(x)
        if not gpipe.is_recomputing():
            self.log.append(mask)
        return x * mask


class CondDropout(MaskDropout):
    """Draws only when the input has fewer than ``below`` rows (the small last micro-batch)."""

    def __init__(self, p: float = 0.5, below: int = 3) -> None:
        super().__init__(p)
        self.below = below

    def draws(self, x: Tensor) -> bool:
        return x.shape[0] < self.below


class ExternalMatmul(nn.Module):
    """x @ W with W a plain tensor attribute that requires grad (no Parameter, no buffer)."""

    def __init__(self, d_in: int, d_out: int, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.W = (torch.randn(d_in, d_out, dtype=dtype) / math.sqrt(d_in)).requires_grad_()

    def fuzz_externals(self) -> List[Tuple[str, Tensor]]:
        return [("W", self.W)]

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.W


class Shared:
    """Holds a tensor that deepcopy does not copy (so the plain copy and the Pipe share it)."""

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor

    def __deepcopy__(self, memo: Dict[int, Any]) -> "Shared":
        return self


def _matmul_by(W: Tensor) -> Callable[[Tensor], Tensor]:
    return lambda x: x @ W


class ClosureMatmul(nn.Module):
    """Applies a closure over an outside W: shared by the plain copy and the Pipe (deepcopy keeps
    functions), so the fuzzer runs them one after the other and resets W.grad in between."""

    def __init__(self, d_in: int, d_out: int, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        W = (torch.randn(d_in, d_out, dtype=dtype) / math.sqrt(d_in)).requires_grad_()
        self.fn = _matmul_by(W)
        self.shared = Shared(W)  # only so the fuzzer can find W and compare its grad

    def fuzz_externals(self) -> List[Tuple[str, Tensor]]:
        return [("W", self.shared.tensor)]

    def forward(self, x: Tensor) -> Tensor:
        return self.fn(x)


class BufferScale(nn.Module):
    """x * s with s a buffer that requires grad (a buffer turned trainable by hand)."""

    def __init__(self, d: int, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.register_buffer("s", (torch.rand(d, dtype=dtype) + 0.5).requires_grad_())

    def forward(self, x: Tensor) -> Tensor:
        return x * self.s


class TiedLinear(nn.Module):
    """Uses another layer's weight (tied, not registered here): F.linear(x, W) or x @ W."""

    def __init__(self, source: nn.Linear, transpose: bool = False) -> None:
        super().__init__()
        self._source = [source]  # a list: not a submodule, so the weight stays the source's only
        self.transpose = transpose

    def forward(self, x: Tensor) -> Tensor:
        W = self._source[0].weight
        return x @ W if self.transpose else F.linear(x, W)


class Detach(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.detach()


class Constant(nn.Module):
    """A float output that depends on nothing that requires grad."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.d = d

    def forward(self, x: Tensor) -> Tensor:
        return torch.full((x.shape[0], self.d), 0.5, dtype=x.dtype)


class RaiseIf(nn.Module):
    """Raises FuzzError when some element exceeds ``limit``: row-wise, so the plain model raises
    exactly when some micro-batch does."""

    def __init__(self, limit: float) -> None:
        super().__init__()
        self.limit = limit

    def forward(self, x: Tensor) -> Tensor:
        if x.detach().abs().max().item() > self.limit:
            raise FuzzError(f"an element exceeds {self.limit}")
        return x


class _RaiseOnBigGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, limit: float) -> Tensor:  # type: ignore[override]
        ctx.limit = limit
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None]:  # type: ignore[override]
        if grad.abs().max().item() > ctx.limit:
            raise FuzzError(f"a grad element exceeds {ctx.limit}")
        return grad, None


class RaiseInBackward(nn.Module):
    """Identity whose backward raises FuzzError when some grad element exceeds ``limit``."""

    def __init__(self, limit: float) -> None:
        super().__init__()
        self.limit = limit

    def forward(self, x: Tensor) -> Tensor:
        return _RaiseOnBigGrad.apply(x, self.limit)


class Split(nn.Module):
    """Tensor -> (tensor, tensor)."""

    def __init__(self, d: int, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d, dtype=dtype)

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        return self.lin(x), torch.sin(x)


class Mix(nn.Module):
    """(h, g) -> (h', g'), with parameters."""

    def __init__(self, d1: int, d2: int, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.lin_h = nn.Linear(d1, d1, dtype=dtype)
        self.lin_g = nn.Linear(d1, d2, dtype=dtype)

    def forward(self, inputs: Tuple[Tensor, Tensor]) -> Tuple[Tensor, Tensor]:
        h, g = inputs
        return torch.relu(self.lin_h(h)), g * torch.sigmoid(self.lin_g(h))


class Swap(nn.Module):
    def forward(self, inputs: Tuple[Tensor, Tensor]) -> Tuple[Tensor, Tensor]:
        h, g = inputs
        return g, h


class PairTanh(nn.Module):
    def forward(self, inputs: Tuple[Tensor, Tensor]) -> Tuple[Tensor, Tensor]:
        h, g = inputs
        return torch.tanh(h), torch.tanh(g)


class FirstOnly(nn.Module):
    """(h, g) -> (lin(h), g): g passes through as the very same tensor."""

    def __init__(self, d1: int, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.lin = nn.Linear(d1, d1, dtype=dtype)

    def forward(self, inputs: Tuple[Tensor, Tensor]) -> Tuple[Tensor, Tensor]:
        h, g = inputs
        return self.lin(h), g


class Join(nn.Module):
    """(h, g) -> tensor, with parameters."""

    def __init__(self, d1: int, d2: int, d_out: int, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.lin_h = nn.Linear(d1, d_out, dtype=dtype)
        self.lin_g = nn.Linear(d2, d_out, bias=False, dtype=dtype)

    def forward(self, inputs: Tuple[Tensor, Tensor]) -> Tensor:
        h, g = inputs
        return self.lin_h(h) + self.lin_g(g)


class PairProduct(nn.Module):
    """(h, g) -> h * rowsum(g), parameterless."""

    def forward(self, inputs: Tuple[Tensor, Tensor]) -> Tensor:
        h, g = inputs
        return h * g.sum(1, keepdim=True)


class Masked(nn.Module):
    """(x, integer mask) -> (tanh(lin(x)) * mask, mask): an integer tensor crosses the stages."""

    def __init__(self, d_in: int, d_out: int, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out, dtype=dtype)

    def forward(self, inputs: Tuple[Tensor, Tensor]) -> Tuple[Tensor, Tensor]:
        x, mask = inputs
        return torch.tanh(self.lin(x)) * mask.to(x.dtype).unsqueeze(1), mask


class Unmask(nn.Module):
    def forward(self, inputs: Tuple[Tensor, Tensor]) -> Tensor:
        x, mask = inputs
        return x * mask.to(x.dtype).unsqueeze(1)


# -- batch dims: the Pipe's batch_dim / output_batch_dim -----------------------------------------

class MoveBatch(nn.Module):
    """Moves value v's dim ``src[v]`` to ``dst[v]`` (None: left alone), parameterless: the first
    layer of a batch-second configuration (inputs given with the batch at dim 1, the Pipe's
    ``batch_dim=1``) moves the batch to dim 0 for the layers that follow; a last one may move it
    back (``output_batch_dim=1``). The plain model runs the very same layers."""

    def __init__(self, src: Tuple[Optional[int], ...], dst: Tuple[Optional[int], ...]) -> None:
        super().__init__()
        self.src, self.dst = tuple(src), tuple(dst)

    def forward(self, x: Any) -> Any:
        values = x if isinstance(x, tuple) else (x,)
        moved = tuple(t if s is None or s == d else t.movedim(s, d)
                      for t, s, d in zip(values, self.src, self.dst))
        return moved if isinstance(x, tuple) else moved[0]


class WithTable(nn.Module):
    """(x, ..., table) -> (x @ table, ...) or (x + table.sum(), ...): the table is an input the
    Pipe does not cut (batch_dim entry None); every micro-batch uses all of it, so its grad is
    the sum over micro-batches."""

    def __init__(self, how: str = "matmul") -> None:
        super().__init__()
        self.how = how

    def forward(self, inputs: Tuple[Tensor, ...]) -> Any:
        *rest, table = inputs
        x = rest[0] @ table if self.how == "matmul" else rest[0] + table.sum()
        out = (x,) + tuple(rest[1:])
        return out if len(out) > 1 else out[0]


class Tagged(nn.Module):
    """x -> (x, 2 * t) with t a parameter: the second output does not depend on the batch, so
    the Pipe returns micro-batch 0's (output_batch_dim entry None); t's grad comes from it once."""

    def __init__(self, n: int, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.t = nn.Parameter(torch.randn(n, dtype=dtype))

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        return x, 2.0 * self.t


# -- skips: gpipe.skip's @skippable layers ---------------------------------------------------

_SKIPPABLES: Dict[Tuple[type, Tuple[str, ...], Tuple[str, ...]], type] = {}


def _skippable(body: type, stashes: Tuple[str, ...] = (), pops: Tuple[str, ...] = ()) -> type:
    """``@skippable(stash=stashes, pop=pops)`` over ``body``, one class per name set (the
    names are the class's: a configuration picks them freely)."""
    key = (body, stashes, pops)
    if key not in _SKIPPABLES:
        _SKIPPABLES[key] = skippable(stash=list(stashes), pop=list(pops))(body)
    return _SKIPPABLES[key]


class StashBody(nn.Module):
    """What :func:`Stash` stashes under ``name`` and returns, by ``how``:

    * 'input': stashes x itself, returns lin(x);
    * 'tanh': stashes tanh(x), returns x (the very input);
    * 'linear': stashes lin(x), ``ds`` wide, returns sin(x);
    * 'detached': stashes tanh(x).detach() (a skip that requires no grad), returns 1.5 x;
    * 'none': stashes None (a skip that carries nothing), returns x + 1."""

    def __init__(self, name: str, how: str, d: int, ds: Optional[int],
                 dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.name, self.how = name, how
        if how in ("input", "linear"):
            self.lin = nn.Linear(d, d if how == "input" else int(ds or 1), dtype=dtype)

    def forward(self, x: Tensor) -> Any:
        if self.how == "input":
            yield stash(self.name, x)
            return self.lin(x)
        if self.how == "tanh":
            yield stash(self.name, torch.tanh(x))
            return x
        if self.how == "linear":
            yield stash(self.name, self.lin(x))
            return torch.sin(x)
        if self.how == "detached":
            yield stash(self.name, torch.tanh(x).detach())
            return 1.5 * x
        yield stash(self.name, None)
        return x + 1


def _combine(layer: nn.Module, how: str, x: Tensor, skip: Optional[Tensor]) -> Tensor:
    """x with the popped ``skip``, by ``how`` (see :class:`PopBody`)."""
    if how == "none":
        if skip is not None:  # the plain model pops None: the Pipe must too
            raise FuzzError(f"the None skip arrived as {type(skip).__name__}")
        return torch.tanh(x)
    assert skip is not None
    if how == "add":
        return x + layer.lin(skip)
    if how == "mul":
        return x * torch.tanh(skip).sum(1, keepdim=True)
    if how == "cat":
        return layer.lin(torch.cat([x, skip], 1))
    if how == "ignore":
        return torch.tanh(x)
    return skip  # 'take'


class PopBody(nn.Module):
    """What :func:`Pop` returns from its input x and the skip popped under ``name`` (``ds``
    wide, None for a None skip), by ``how``: 'add' x + lin(skip), 'mul' x * rowsum(tanh(skip)),
    'cat' lin([x, skip]), 'ignore' tanh(x) (the skip unused), 'take' the skip itself (x
    dropped; ds == d), 'none' tanh(x), raising FuzzError unless the skip is None."""

    def __init__(self, name: str, how: str, d: int, ds: Optional[int],
                 dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.name, self.how = name, how
        if how in ("add", "cat"):
            n = int(ds or 1)
            self.lin = (nn.Linear(n, d, dtype=dtype) if how == "add"
                        else nn.Linear(d + n, d, dtype=dtype))

    def forward(self, x: Tensor) -> Any:
        skip = yield pop(self.name)
        return _combine(self, self.how, x, skip)


class RelayBody(nn.Module):
    """Pops ``name`` (``ds`` wide, or None) and stashes ``out``: the popped tensor itself
    ('forward') or tanh(x) ('fresh'); returns x + lin(skip) (x + 1 for a None skip)."""

    def __init__(self, name: str, out: str, how: str, d: int, ds: Optional[int],
                 dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.name, self.out, self.how = name, out, how
        if ds is not None:
            self.lin = nn.Linear(ds, d, dtype=dtype)

    def forward(self, x: Tensor) -> Any:
        skip = yield pop(self.name)
        yield stash(self.out, skip if self.how == "forward" else torch.tanh(x))
        return x + 1 if skip is None else x + self.lin(skip)


def Stash(name: str, how: str, d: int, ds: Optional[int] = None,
          dtype: torch.dtype = torch.float64) -> nn.Module:
    """A skippable layer stashing ``name`` (see :class:`StashBody`)."""
    return _skippable(StashBody, stashes=(name,))(name, how, d, ds, dtype)


def Pop(name: str, how: str, d: int, ds: Optional[int] = None,
        dtype: torch.dtype = torch.float64) -> nn.Module:
    """A skippable layer popping ``name`` (see :class:`PopBody`)."""
    return _skippable(PopBody, pops=(name,))(name, how, d, ds, dtype)


def Relay(name: str, out: str, how: str, d: int, ds: Optional[int] = None,
          dtype: torch.dtype = torch.float64) -> nn.Module:
    """A skippable layer popping ``name`` and stashing ``out`` (see :class:`RelayBody`)."""
    return _skippable(RelayBody, stashes=(out,), pops=(name,))(name, out, how, d, ds, dtype)
