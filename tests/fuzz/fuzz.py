"""fuzz.py — differential fuzzer: random models and configurations, gpipe.Pipe vs plain Sequential.

For each seed it builds a random ``nn.Sequential`` (Linear, Conv1d, activations
incl. in-place ReLU, dropout, LayerNorm, layers taking/returning tuples,
parameterless and frozen layers, tensors that require grad without being
parameters of their layer: an attribute ``W``, a closure over an outside ``W``,
a buffer that requires grad, a weight tied to an earlier Linear) and a random
configuration (balance over 1..4 CPU stages, 1..6 chunks incl. more than rows,
checkpoint mode, float64 or float32, one tensor or a tuple of inputs that
require grad or not, train/eval, ``torch.no_grad()``, and how gradients are
asked for: ``loss.backward()``, ``torch.autograd.grad`` of the inputs or of the
parameters, ``backward(inputs=...)``). It runs the model as
``gpipe.Pipe(model, balance=..., devices=['cpu'] * K, ...)`` and as a deep copy
of the plain Sequential, and compares outputs, output ``requires_grad``, input
grads, returned grads, every parameter's and external tensor's ``.grad`` (also
where the plain model leaves it alone) and exceptions. Tolerance: 1e-10 in
float64, 1e-5 in float32.

Usage (from the repository root, gpipe installed)::

    python3 tests/fuzz/fuzz.py --seeds 0:2000          # the documented run (a few minutes)
    python3 tests/fuzz/fuzz.py --seed 17               # one seed, with a runnable reproduction
    python3 tests/fuzz/fuzz.py --seeds 0:500 --only-category grad,exception
    python3 tests/fuzz/fuzz.py --seeds 0:500 --without external,closure,cond-dropout
    python3 tests/fuzz/fuzz.py --seeds 0:50 --verbose  # every config, snippets for failures

Output: for every failing configuration one line per mismatch category::

    seed 17 [grad] 3.W.grad: max diff 2.0e+00 > 1e-10 (+1 more) | layers=[...] balance=[...] ...

where the configuration shown is the failing one shrunk (fewer layers, stages,
chunks, rows...) while the same category still fails (``--no-shrink`` shows
the original). ``--verbose`` or ``--seed N`` also prints the shrunk
configuration as a standalone Python snippet (it imports this file's layer
classes and :func:`check`). The last line is ``fuzz: N configurations, M
mismatches`` (M counts configuration x category); the exit code is 1 when M > 0.

Categories: ``exception`` (one side raises and the other does not, or the
types differ), ``output`` (values, shapes, dtypes or tuple structure),
``requires_grad`` (an output's flag differs), ``grad`` (an input grad, a
returned grad or a ``.grad`` differs or is missing), ``side-effect`` (a
``.grad`` the plain model leaves untouched is filled or changed: autograd.grad
and backward(inputs=...) must touch nothing else), ``hang`` (no answer within
``--timeout`` seconds; the run stops there, since stuck threads may hold
locks), ``harness`` (the fuzzer itself failed: a bug here, not in gpipe).

Dropout: masks differ between the Pipe and the plain model, so outputs cannot
be compared directly. The fuzzer's dropout layers (:class:`MaskDropout`,
:class:`CondDropout`) log the mask each micro-batch draws in its first
forward (never in a recompute, told by ``gpipe.is_recomputing()``), and the
plain copy then replays the concatenated masks of the whole batch. So outputs
and grads are compared exactly: the plain model's grads are those of the
masks the Pipe's forward actually used, and a recompute that draws a
different mask shows up as a ``[grad]`` mismatch. :class:`CondDropout` draws
only on micro-batches with fewer rows than a threshold (the small last one).
"""
import argparse
import copy
import math
import os
import random
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import gpipe

TOL = {"float64": 1e-10, "float32": 1e-5}
MODES = ("always", "except_last", "never")
BACKWARDS = ("backward", "grad_inputs", "grad_params", "backward_inputs", "backward_subset")
CATEGORIES = ("exception", "output", "requires_grad", "grad", "side-effect", "hang", "harness")

Tensors = Union[Tensor, Tuple[Tensor, ...]]


# -- layers the fuzzer composes (importable by the printed reproductions) ----------------------

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
        mask = F.dropout(torch.ones_like(x), self.p, True) if self.draws(x) else torch.ones_like(x)
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


# -- the differential check ------------------------------------------------------------------

@dataclass
class Mismatch:
    category: str  # one of CATEGORIES
    detail: str
    # Finer than the category, e.g. 'exception:forward:pipe=None:plain=RuntimeError'; shrinking
    # keeps it.
    kind: str = ""

    def __post_init__(self) -> None:
        self.kind = self.kind or self.category


def _as_tuple(x: Any) -> Tuple[Any, ...]:
    return x if isinstance(x, tuple) else (x,)


def _leaf_copy(x: Tensors) -> Tensors:
    """Fresh leaves with the same values and requires_grad (each side gets its own)."""
    if isinstance(x, tuple):
        return tuple(_leaf_copy(t) for t in x)  # type: ignore[misc]
    return x.detach().clone().requires_grad_(x.requires_grad)


def _clone(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.detach().clone()


def _describe(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:160]}"


def _diff(got: Tensor, want: Tensor, tol: float) -> Optional[str]:
    """None when equal within tol, else what differs."""
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} vs the plain model's {tuple(want.shape)}"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype} vs the plain model's {want.dtype}"
    if got.numel() == 0:
        return None
    d = (got.detach().double() - want.detach().double()).abs().max().item()
    if not d <= tol:  # also catches NaN
        return f"max diff {d:.1e} > {tol:.0e}"
    return None


def grad_targets(model: nn.Module) -> Dict[str, Tensor]:
    """Every tensor whose .grad a run may fill: parameters, buffers that require grad, and the
    fuzzer's external tensors, named as in state_dict ('<layer>.<attr>')."""
    targets = dict(model.named_parameters())
    targets.update((n, b) for n, b in model.named_buffers() if b.requires_grad)
    for i, layer in enumerate(model):
        for attr, t in getattr(layer, "fuzz_externals", lambda: [])():
            targets[f"{i}.{attr}"] = t
    return targets


def _attempt(fn: Callable[[], Any]) -> Tuple[Any, Optional[BaseException]]:
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - compared with the other side's exception
        return None, e


def _exception_mismatch(phase: str, pipe_e: Optional[BaseException],
                        ref_e: Optional[BaseException]) -> List[Mismatch]:
    if ref_e is None and pipe_e is None:
        return []
    name = lambda e: type(e).__name__ if e is not None else None  # noqa: E731
    kind = f"exception:{phase.split()[0]}:pipe={name(pipe_e)}:plain={name(ref_e)}"
    return [replace(m, kind=kind) for m in _exception_details(phase, pipe_e, ref_e)]


def _exception_details(phase: str, pipe_e: Optional[BaseException],
                       ref_e: Optional[BaseException]) -> List[Mismatch]:
    if ref_e is None:
        return [Mismatch("exception", f"{phase}: the Pipe raised {_describe(pipe_e)}; the plain "
                                      f"model raised nothing")]
    if pipe_e is None:
        return [Mismatch("exception", f"{phase}: the plain model raised {_describe(ref_e)}; the "
                                      f"Pipe raised nothing")]
    if type(pipe_e) is not type(ref_e):
        return [Mismatch("exception", f"{phase}: the Pipe raised {_describe(pipe_e)}; the plain "
                                      f"model {_describe(ref_e)}")]
    return []


def same_structure(got: Any, want: Any) -> bool:
    return (isinstance(got, tuple) == isinstance(want, tuple)
            and len(_as_tuple(got)) == len(_as_tuple(want))
            and all(isinstance(g, Tensor) for g in _as_tuple(got)))


def _compare_outputs(got: Any, want: Any, tol: float) -> List[Mismatch]:
    if not same_structure(got, want):
        return [Mismatch("output", f"the Pipe returns {type(got).__name__} of "
                                   f"{len(_as_tuple(got))}, the plain model {type(want).__name__} "
                                   f"of {len(_as_tuple(want))}", "output:structure")]
    found = []
    for k, (g, w) in enumerate(zip(_as_tuple(got), _as_tuple(want))):
        d = _diff(g, w, tol)
        if d:
            found.append(Mismatch("output", f"output {k}: {d}", "output:value"))
        if g.requires_grad != w.requires_grad:
            found.append(Mismatch("requires_grad", f"output {k}: requires_grad "
                                                   f"{g.requires_grad}, the plain model's "
                                                   f"{w.requires_grad}",
                                  f"requires_grad:pipe={g.requires_grad}"))
    return found


def _loss(out: Any, weights: Sequence[Optional[Tensor]]) -> Tensor:
    """sum(out * w) over the float outputs: every output element gets its own, nonzero weight."""
    terms = [(o * w).sum() for o, w in zip(_as_tuple(out), weights) if w is not None]
    return torch.stack(terms).sum()


def _backward(out: Any, weights: Sequence[Optional[Tensor]], pool: Dict[str, Tensor], mode: str,
              names: List[str]) -> Dict[str, Tensor]:
    """Asks for grads the way ``mode`` says; returns what autograd.grad returned, by name."""
    loss = _loss(out, weights)
    chosen = [pool[n] for n in names]
    if mode == "backward":
        loss.backward()
        return {}
    if mode in ("grad_inputs", "grad_params"):
        return dict(zip(names, torch.autograd.grad(loss, chosen)))
    loss.backward(inputs=chosen)
    return {}


def _replay_dropout(pipe: nn.Module, ref: nn.Module, use_logs: bool) -> None:
    """Hands the masks the Pipe's dropout layers drew (micro-batch order) to the plain copy."""
    for p, r in zip(pipe, ref):
        if isinstance(p, MaskDropout):
            r.replay = torch.cat(p.log) if use_logs and p.log else None
            p.log = []


def check(pipe: nn.Module, ref: nn.Sequential, inputs: Tensors, *, training: bool = True,
          no_grad: bool = False, backward: str = "backward", pre_grad: bool = False,
          tol: float = 1e-10, seed: int = 0) -> List[Mismatch]:
    """Runs ``inputs`` through ``pipe`` and through ``ref`` (the plain copy) forward and, unless
    ``no_grad``, backward as ``backward`` says, and lists every difference."""
    found: List[Mismatch] = []
    pipe.train(training)
    ref.train(training)
    pipe_targets, ref_targets = grad_targets(pipe), grad_targets(ref)
    if list(pipe_targets) != list(ref_targets):
        return [Mismatch("harness", f"targets differ: {list(pipe_targets)} vs {list(ref_targets)}")]
    rng = torch.Generator().manual_seed(seed)
    if pre_grad:  # existing grads: backward must add to them, autograd.grad leave them
        for name in pipe_targets:
            if ref_targets[name].requires_grad:
                g = torch.randn(ref_targets[name].shape, generator=rng,
                                dtype=ref_targets[name].dtype)
                ref_targets[name].grad, pipe_targets[name].grad = g.clone(), g.clone()
    initial = {n: _clone(t.grad) for n, t in pipe_targets.items()}
    x_pipe, x_ref = _leaf_copy(inputs), _leaf_copy(inputs)

    # Forward: the Pipe first, so that the plain copy can replay its dropout masks.
    with torch.set_grad_enabled(not no_grad):
        got, pipe_e = _attempt(lambda: pipe(x_pipe))
        _replay_dropout(pipe, ref, use_logs=pipe_e is None)
        want, ref_e = _attempt(lambda: ref(x_ref))
    if isinstance(ref_e, ReplayError):
        return [Mismatch("output", f"dropout replay: {ref_e}", "output:replay")]
    found += _exception_mismatch("forward", pipe_e, ref_e)
    if pipe_e is not None or ref_e is not None:
        return found
    found += _compare_outputs(got, want, tol)
    for k, (a, b) in enumerate(zip(_as_tuple(x_pipe), _as_tuple(x_ref))):
        d = _diff(a, b, tol)  # an in-place first layer may modify the caller's input
        if d:
            found.append(Mismatch("output", f"input {k} after forward: {d} (left otherwise "
                                            f"than the plain model leaves it)", "output:input"))
    if no_grad or not same_structure(got, want):
        return found
    weights = [torch.randn(w.shape, generator=rng, dtype=w.dtype) if w.is_floating_point()
               else None for w in _as_tuple(want)]
    if all(w is None for w in weights):
        return found

    # Which tensors the call asks grads of; the same names on both sides.
    xs_pipe, xs_ref = _as_tuple(x_pipe), _as_tuple(x_ref)
    pool_ref = {**{f"input{k}": x for k, x in enumerate(xs_ref)}, **ref_targets}
    pool_pipe = {**{f"input{k}": x for k, x in enumerate(xs_pipe)}, **pipe_targets}
    wanting = [n for n, t in pool_ref.items() if t.requires_grad]
    names = {"grad_inputs": [n for n in wanting if n.startswith("input")],
             "backward_inputs": [n for n in wanting if n.startswith("input")],
             "grad_params": [n for n in wanting if not n.startswith("input")],
             "backward_subset": sorted(random.Random(seed).sample(
                 wanting, random.Random(seed + 1).randint(1, len(wanting)))) if wanting else [],
             "backward": []}[backward]
    if backward != "backward" and not names:
        backward = "backward"  # nothing to ask for: the plain loss.backward() it is

    ref_returned, ref_e = _attempt(lambda: _backward(want, weights, pool_ref, backward, names))
    ref_grads = {n: _clone(t.grad) for n, t in pool_ref.items()}
    for n, t in pipe_targets.items():  # a shared closure W got the plain model's grad: undo it
        t.grad = _clone(initial[n])
    pipe_returned, pipe_e = _attempt(lambda: _backward(got, weights, pool_pipe, backward, names))
    found += _exception_mismatch(f"backward ({backward})", pipe_e, ref_e)
    if pipe_e is not None or ref_e is not None:
        return found

    for n, w in ref_returned.items():
        d = _diff(pipe_returned[n], w, tol)
        if d:
            found.append(Mismatch("grad", f"autograd.grad for {n}: {d}", "grad:returned"))
    for n, t in pool_pipe.items():
        want_g, got_g = ref_grads[n], t.grad
        # With autograd.grad or backward(inputs=...), a tensor not asked about keeps its .grad.
        aside = backward != "backward" and (backward.startswith("grad") or n not in names)
        category = "side-effect" if aside else "grad"
        if want_g is None:
            if got_g is not None:
                found.append(Mismatch(category, f"{n}.grad: the plain model leaves None, the "
                                                f"Pipe fills it", f"{category}:fills"))
        elif got_g is None:
            found.append(Mismatch("grad", f"{n}.grad: None, the plain model's is set",
                                  "grad:missing"))
        else:
            d = _diff(got_g, want_g, tol)
            if d:
                found.append(Mismatch(category, f"{n}.grad: {d}", f"{category}:value"))
    return found


# -- random configurations -------------------------------------------------------------------

@dataclass
class LayerSpec:
    kind: str                 # feature name, e.g. 'linear', 'inplace', 'closure'
    src: str                  # Python expression; {ref} is the index of a referenced layer
    sig_in: Tuple[Any, ...]   # ('flat', d) / ('seq', c, l) / ('pair', d1, d2) / ('masked', d)
    sig_out: Tuple[Any, ...]
    ref: Optional[int] = None
    frozen: bool = False
    dims: Tuple[int, ...] = ()  # (in, out) of a Linear, for TiedLinear

    def expr(self) -> str:
        e = self.src.replace("{ref}", str(self.ref))
        return e + ".requires_grad_(False)" if self.frozen else e

    def short(self) -> str:
        e = self.src.replace("layers[{ref}]", f"#{self.ref}").replace(", dtype=dtype", "")
        e = e.replace("dtype=dtype", "").replace("nn.", "")
        return e + "/frozen" if self.frozen else e


@dataclass
class InputSpec:
    kind: str                 # 'float' or 'mask' (an int64 0/1 vector)
    features: Tuple[int, ...]
    requires_grad: bool = False

    def expr(self, rows: int) -> str:
        if self.kind == "mask":
            return f"torch.randint(0, 2, ({rows},), generator=g)"
        shape = ", ".join(map(str, (rows,) + self.features))
        return (f"torch.randn({shape}, dtype=dtype, generator=g)"
                f".requires_grad_({self.requires_grad})")


@dataclass
class Config:
    seed: int
    layers: List[LayerSpec]
    balance: List[int]
    chunks: int
    checkpoint: str
    dtype: str
    rows: int
    inputs: List[InputSpec]
    training: bool = True
    no_grad: bool = False
    backward: str = "backward"
    pre_grad: bool = False
    features: List[str] = field(default_factory=list)

    def summary(self) -> str:
        inputs = ", ".join(("mask" if s.kind == "mask" else
                            f"{(self.rows,) + s.features}{'+grad' if s.requires_grad else ''}")
                           for s in self.inputs)
        return (f"layers=[{', '.join(s.short() for s in self.layers)}] balance={self.balance} "
                f"chunks={self.chunks} checkpoint={self.checkpoint} dtype={self.dtype} "
                f"inputs=({inputs}) {'train' if self.training else 'eval'}"
                f"{' no_grad' if self.no_grad else ''} backward={self.backward}"
                f"{' pre_grad' if self.pre_grad else ''}")

    def body(self) -> str:
        """The reproduction: builds model, Pipe and inputs, then runs :func:`check`."""
        lines = [f"dtype = torch.{self.dtype}", f"torch.manual_seed({self.seed})", "layers = []"]
        lines += [f"layers.append({s.expr()})  # {i}" for i, s in enumerate(self.layers)]
        k = len(self.balance)
        inputs = [s.expr(self.rows) for s in self.inputs]
        lines += [
            "model = nn.Sequential(*layers)",
            "ref = copy.deepcopy(model)",
            f"pipe = gpipe.Pipe(model, balance={self.balance}, devices=['cpu'] * {k}, "
            f"chunks={self.chunks}, checkpoint={self.checkpoint!r})",
            f"g = torch.Generator().manual_seed({self.seed})",
            f"inputs = {inputs[0]}" if len(inputs) == 1 else f"inputs = ({', '.join(inputs)})",
            f"mismatches = check(pipe, ref, inputs, training={self.training}, "
            f"no_grad={self.no_grad}, backward={self.backward!r}, pre_grad={self.pre_grad}, "
            f"tol={TOL[self.dtype]}, seed={self.seed})",
        ]
        return "\n".join(lines) + "\n"

    def snippet(self) -> str:
        return ("import copy, sys\nimport torch\nfrom torch import nn\nimport gpipe\n"
                "sys.path.insert(0, 'tests/fuzz')  # run from the repository root\n"
                "from fuzz import *  # the fuzzer's layers and check()\n"
                + self.body() + "for m in mismatches:\n    print(f'[{m.category}] {m.detail}')\n")


ACTIVATIONS = ("nn.ReLU()", "nn.GELU()", "nn.Tanh()", "nn.Identity()")


def _pick_layer(rng: random.Random, sig: Tuple[Any, ...], layers: List[LayerSpec]) -> LayerSpec:
    """One layer that accepts ``sig``; weights favour the ordinary kinds."""
    w = lambda: rng.randint(1, 6)  # noqa: E731 - a fresh width
    frozen = rng.random() < 0.12
    if sig[0] == "flat":
        d = sig[1]
        ties = [i for i, s in enumerate(layers) if s.kind == "linear" and d in s.dims]
        factors = [c for c in range(1, d) if d % c == 0 and d // c >= 2]
        # Not after dropout: when the Pipe raises there are no masks for the plain copy to
        # replay, and its own masks (or CondDropout's full-batch rule) would decide otherwise.
        drops = any(s.kind in ("dropout", "cond-dropout") for s in layers)
        menu = {"linear": 14, "act": 10, "inplace": 7, "layernorm": 5, "dropout": 4,
                "cond-dropout": 4, "external": 5, "closure": 4, "buffer": 3,
                "tied": 5 if ties else 0, "detach": 2, "constant": 1.5, "split": 5,
                "unflatten": 3 if factors else 0, "raise": 0 if drops else 2, "raise-backward": 2,
                "bad-shape": 1}
    elif sig[0] == "seq":
        c, l = sig[1], sig[2]
        menu = {"conv": 12, "act": 8, "inplace": 6, "layernorm": 4, "dropout": 3,
                "cond-dropout": 3, "flatten": 8}
    elif sig[0] == "pair":
        d1, d2 = sig[1], sig[2]
        menu = {"mix": 8, "swap": 4, "pair-act": 4, "first-only": 5, "join": 6, "product": 4}
    else:
        d = sig[1]
        menu = {"masked": 8, "unmask": 5}
    kind = rng.choices(list(menu), weights=list(menu.values()))[0]

    def spec(src: str, out: Tuple[Any, ...], **kw: Any) -> LayerSpec:
        return LayerSpec(kind, src, sig, out, **kw)

    if kind == "linear":
        d2 = w()
        bias = "" if rng.random() < 0.8 else ", bias=False"
        return spec(f"nn.Linear({d}, {d2}{bias}, dtype=dtype)", ("flat", d2), frozen=frozen,
                    dims=(d, d2))
    if kind == "act":
        return spec(rng.choice(ACTIVATIONS), sig)
    if kind == "inplace":
        return spec("nn.ReLU(inplace=True)", sig)
    if kind == "layernorm":
        n = d if sig[0] == "flat" else l
        if rng.random() < 0.2:
            return spec(f"nn.LayerNorm({n}, elementwise_affine=False, dtype=dtype)", sig)
        return spec(f"nn.LayerNorm({n}, dtype=dtype)", sig, frozen=frozen)
    if kind == "dropout":
        return spec("MaskDropout(0.5)", sig)
    if kind == "cond-dropout":
        return spec(f"CondDropout(0.5, below={rng.randint(2, 5)})", sig)
    if kind in ("external", "closure"):
        d2 = w()
        cls = "ExternalMatmul" if kind == "external" else "ClosureMatmul"
        return spec(f"{cls}({d}, {d2}, dtype=dtype)", ("flat", d2))
    if kind == "buffer":
        return spec(f"BufferScale({d}, dtype=dtype)", sig)
    if kind == "tied":
        ref = rng.choice(ties)
        a, b = layers[ref].dims  # the source is Linear(a, b): weight (b, a)
        transpose = d == b and (d != a or rng.random() < 0.5)
        return spec(f"TiedLinear(layers[{{ref}}], transpose={transpose})",
                    ("flat", a if transpose else b), ref=ref)
    if kind == "detach":
        return spec("Detach()", sig)
    if kind == "constant":
        d2 = w()
        return spec(f"Constant({d2})", ("flat", d2))
    if kind == "split":
        return spec(f"Split({d}, dtype=dtype)", ("pair", d, d), frozen=frozen)
    if kind == "unflatten":
        c = rng.choice(factors)
        return spec(f"nn.Unflatten(1, ({c}, {d // c}))", ("seq", c, d // c))
    if kind == "raise":
        return spec(f"RaiseIf({rng.choice([1.5, 2.0, 3.0])})", sig)
    if kind == "raise-backward":
        return spec(f"RaiseInBackward({rng.choice([0.5, 1.0, 2.0])})", sig)
    if kind == "bad-shape":  # a wrong in_features: the plain model raises RuntimeError
        d2 = w()
        return spec(f"nn.Linear({d + 1}, {d2}, dtype=dtype)", ("flat", d2))
    if kind == "conv":
        c2, pad = rng.randint(1, 3), rng.randint(0, 1)
        k = rng.randint(1, min(3, l + 2 * pad))  # the output keeps at least one position
        return spec(f"nn.Conv1d({c}, {c2}, {k}, padding={pad}, dtype=dtype)",
                    ("seq", c2, l + 2 * pad - k + 1), frozen=frozen)
    if kind == "flatten":
        return spec("nn.Flatten()", ("flat", c * l))
    if kind == "mix":
        return spec(f"Mix({d1}, {d2}, dtype=dtype)", sig, frozen=frozen)
    if kind == "swap":
        return spec("Swap()", ("pair", d2, d1))
    if kind == "pair-act":
        return spec("PairTanh()", sig)
    if kind == "first-only":
        return spec(f"FirstOnly({d1}, dtype=dtype)", sig, frozen=frozen)
    if kind == "join":
        d3 = w()
        return spec(f"Join({d1}, {d2}, {d3}, dtype=dtype)", ("flat", d3), frozen=frozen)
    if kind == "product":
        return spec("PairProduct()", ("flat", d1))
    if kind == "masked":
        d2 = w()
        return spec(f"Masked({d}, {d2}, dtype=dtype)", ("masked", d2), frozen=frozen)
    return spec("Unmask()", ("flat", d))


def features_of(cfg: Config) -> List[str]:
    """Names --without can exclude: layer kinds, 'frozen', 'inplace-first' (an in-place ReLU
    opens a stage), 'tuple-input', 'float32', 'eval', 'no_grad', 'pre_grad', the backward and
    checkpoint modes."""
    found = {s.kind for s in cfg.layers} | {cfg.backward, cfg.checkpoint}
    starts = {sum(cfg.balance[:j]) for j in range(len(cfg.balance))}
    found |= {"frozen"} if any(s.frozen for s in cfg.layers) else set()
    found |= {"inplace-first"} if any(cfg.layers[i].kind == "inplace" for i in starts) else set()
    found |= {"tuple-input"} if len(cfg.inputs) > 1 else set()
    found |= {"float32"} if cfg.dtype == "float32" else set()
    found |= {"eval"} if not cfg.training else set()
    found |= {"no_grad"} if cfg.no_grad else set()
    found |= {"pre_grad"} if cfg.pre_grad else set()
    return sorted(found)


def generate(seed: int) -> Config:
    """The configuration of ``seed`` (the same on every machine and run)."""
    rng = random.Random(seed)
    start = rng.choices(["flat", "seq", "pair", "masked"], weights=[55, 15, 20, 10])[0]
    grad = lambda: rng.random() < 0.6  # noqa: E731
    if start == "flat":
        d = rng.randint(1, 6)
        sig: Tuple[Any, ...] = ("flat", d)
        inputs = [InputSpec("float", (d,), grad())]
    elif start == "seq":
        c, l = rng.randint(1, 3), rng.randint(2, 5)
        sig, inputs = ("seq", c, l), [InputSpec("float", (c, l), grad())]
    elif start == "pair":
        d1, d2 = rng.randint(1, 6), rng.randint(1, 6)
        sig = ("pair", d1, d2)
        inputs = [InputSpec("float", (d1,), grad()), InputSpec("float", (d2,), grad())]
    else:
        d = rng.randint(1, 6)
        sig, inputs = ("masked", d), [InputSpec("float", (d,), grad()), InputSpec("mask", ())]
    layers: List[LayerSpec] = []
    for _ in range(rng.choice([1, 2, 3, 3, 4, 4, 5, 5, 6, 7, 8])):
        layers.append(_pick_layer(rng, sig, layers))
        sig = layers[-1].sig_out
    if rng.random() < 0.08:  # only external tensors (if any) stay trainable
        for s in layers:
            s.frozen = s.kind in ("linear", "layernorm", "split", "conv", "mix", "first-only",
                                  "join", "masked")
    n = len(layers)
    k = rng.randint(1, min(4, n))
    cuts = sorted(rng.sample(range(1, n), k - 1))
    balance = [b - a for a, b in zip([0] + cuts, cuts + [n])]
    float_grad = any(s.requires_grad for s in inputs)
    backward = rng.choices(BACKWARDS, weights=[45, 15, 15, 12, 13])[0]
    if backward in ("grad_inputs", "backward_inputs") and not float_grad:
        backward = "grad_params"
    cfg = Config(seed=seed, layers=layers, balance=balance, chunks=rng.randint(1, 6),
                 checkpoint=rng.choice(MODES),
                 dtype="float32" if rng.random() < 0.1 else "float64",
                 rows=rng.randint(1, 8), inputs=inputs, training=rng.random() < 0.8,
                 no_grad=rng.random() < 0.12, backward=backward, pre_grad=rng.random() < 0.25)
    cfg.features = features_of(cfg)
    return cfg


# -- running, shrinking, reporting -----------------------------------------------------------

class Hang(Exception):
    pass


def run_config(cfg: Config, timeout: float) -> List[Mismatch]:
    """Builds and checks ``cfg`` on a worker thread (so a hang is reported, not waited out)."""
    outcome: Dict[str, Any] = {}

    def target() -> None:
        namespace = dict(globals(), copy=copy, torch=torch, nn=nn, gpipe=gpipe)
        try:
            exec(compile(cfg.body(), f"<fuzz seed {cfg.seed}>", "exec"), namespace)
            outcome["found"] = namespace["mismatches"]
        except Exception as e:  # noqa: BLE001 - a failure of the fuzzer itself
            outcome["found"] = [Mismatch("harness", f"building or checking raised {_describe(e)}")]

    worker = threading.Thread(target=target, name=f"fuzz-{cfg.seed}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise Hang(f"no answer within {timeout:.0f} s")
    return outcome["found"]


def _smaller(cfg: Config) -> Iterable[Config]:
    """Simpler variants of ``cfg``, simplest first; each still a valid model."""
    if cfg.backward != "backward":
        yield replace(cfg, backward="backward")
    for flag in ("pre_grad", "no_grad"):
        if getattr(cfg, flag):
            yield replace(cfg, **{flag: False})
    for i, s in enumerate(cfg.layers):  # drop a layer that keeps the signature
        if len(cfg.layers) > 1 and s.sig_in == s.sig_out and all(t.ref != i for t in cfg.layers):
            yield _without_layer(cfg, i)
    for j in range(len(cfg.balance) - 1):  # merge two neighbouring stages
        yield replace(cfg, balance=cfg.balance[:j] + [cfg.balance[j] + cfg.balance[j + 1]]
                      + cfg.balance[j + 2:])
    for chunks in range(1, cfg.chunks):
        yield replace(cfg, chunks=chunks)
    for rows in range(1, cfg.rows):
        yield replace(cfg, rows=rows)
    for k, s in enumerate(cfg.inputs):
        if s.requires_grad:
            yield replace(cfg, inputs=cfg.inputs[:k] + [replace(s, requires_grad=False)]
                          + cfg.inputs[k + 1:])
    for i, s in enumerate(cfg.layers):
        if s.frozen:
            yield replace(cfg, layers=cfg.layers[:i] + [replace(s, frozen=False)]
                          + cfg.layers[i + 1:])
    for mode in MODES:
        if MODES.index(mode) > MODES.index(cfg.checkpoint):
            yield replace(cfg, checkpoint=mode)


def _without_layer(cfg: Config, i: int) -> Config:
    """``cfg`` less layer i: references shift down, its stage loses one layer (gone if empty)."""
    layers = [replace(s, ref=None if s.ref is None else s.ref - (s.ref > i))
              for j, s in enumerate(cfg.layers) if j != i]
    balance, start = [], 0
    for b in cfg.balance:
        balance.append(b - (start <= i < start + b))
        start += b
    return replace(cfg, layers=layers, balance=[b for b in balance if b > 0])


def shrink(cfg: Config, found: Mismatch, timeout: float,
           budget: int = 60) -> Tuple[Config, Mismatch]:
    """Greedily simplifies ``cfg`` while a mismatch of ``found``'s kind remains; returns the
    simplest configuration and its mismatch of that kind."""
    progress = True
    while progress and budget > 0:
        progress = False
        for candidate in _smaller(cfg):
            budget -= 1
            try:
                again = [m for m in run_config(candidate, timeout) if m.kind == found.kind]
            except Hang:
                return cfg, found
            if again:
                cfg, found, progress = candidate, again[0], True
                break
            if budget <= 0:
                break
    cfg.features = features_of(cfg)
    return cfg, found


@dataclass
class Summary:
    configurations: int = 0
    skipped: int = 0
    mismatches: int = 0
    by_category: Dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


def run(seeds: Iterable[int], *, only: Sequence[str] = (), skip: Sequence[str] = (),
        without: Sequence[str] = (), do_shrink: bool = True, verbose: bool = False,
        snippets: bool = False, timeout: float = 60.0,
        write: Callable[[str], None] = print) -> Summary:
    """Fuzzes ``seeds``; writes a line per (configuration, category) mismatch; returns counts."""
    summary = Summary()
    started = time.perf_counter()
    for seed in seeds:
        cfg = generate(seed)
        if set(without) & set(cfg.features):
            summary.skipped += 1
            continue
        summary.configurations += 1
        if verbose:
            write(f"seed {seed}: {cfg.summary()}")
        try:
            found = run_config(cfg, timeout)
        except Hang as e:
            write(f"seed {seed} [hang] {e} | {cfg.summary()}")
            summary.mismatches += 1
            summary.by_category["hang"] = summary.by_category.get("hang", 0) + 1
            write("fuzz: stopping: the hung threads may hold locks the next configurations need")
            break
        found = [m for m in found if (not only or any(m.kind.startswith(o) for o in only))
                 and not any(m.kind.startswith(o) for o in skip)]
        for category in CATEGORIES:
            mine = [m for m in found if m.category == category]
            if not mine:
                continue
            small, first = (shrink(copy.deepcopy(cfg), mine[0], timeout) if do_shrink
                            else (cfg, mine[0]))
            more = f" (+{len(mine) - 1} more)" if len(mine) > 1 else ""
            write(f"seed {seed} [{category}] {first.detail}{more} | {small.summary()}")
            if snippets:
                write(f"--- reproduction (seed {seed}, [{category}]; run from the repository root)")
                write(small.snippet() + "---")
            summary.mismatches += 1
            summary.by_category[category] = summary.by_category.get(category, 0) + 1
    summary.seconds = time.perf_counter() - started
    return summary


def _seed_range(text: str) -> range:
    a, _, b = text.partition(":")
    return range(int(a), int(b)) if b else range(int(a), int(a) + 1)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=_seed_range, default=range(0, 200),
                        help="A:B runs seeds A..B-1 (default 0:200)")
    parser.add_argument("--seed", type=int, help="one seed; prints its reproduction")
    parser.add_argument("--only-category", default="",
                        help=f"comma-separated categories to report ({', '.join(CATEGORIES)}), "
                             f"or kind prefixes such as exception:backward or "
                             f"exception:forward:pipe=None")
    parser.add_argument("--skip-category", default="",
                        help="comma-separated categories (or kind prefixes) to ignore")
    parser.add_argument("--without", default="",
                        help="skip configurations with any of these features (layer kinds such "
                             "as external, closure, buffer, tied, cond-dropout, dropout, inplace, "
                             "raise; frozen, inplace-first, tuple-input, float32, eval, no_grad, "
                             "pre_grad; backward modes; checkpoint modes)")
    parser.add_argument("--no-shrink", action="store_true", help="report configurations as drawn")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per configuration")
    parser.add_argument("--verbose", action="store_true",
                        help="print every configuration and a runnable snippet per mismatch")
    args = parser.parse_args(argv)
    split = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    unknown = {c.split(":")[0] for c in split(args.only_category) + split(args.skip_category)}
    unknown -= set(CATEGORIES)
    if unknown:
        parser.error(f"unknown categories {sorted(unknown)}; known: {', '.join(CATEGORIES)}")
    seeds = range(args.seed, args.seed + 1) if args.seed is not None else args.seeds
    if args.seed is not None:
        print(f"seed {args.seed}: {generate(args.seed).summary()}")
    summary = run(seeds, only=split(args.only_category), skip=split(args.skip_category),
                  without=split(args.without), do_shrink=not args.no_shrink,
                  verbose=args.verbose, snippets=args.verbose or args.seed is not None,
                  timeout=args.timeout, write=lambda line: print(line, flush=True))
    if args.seed is not None and not summary.mismatches:
        print(f"--- seed {args.seed} as a snippet\n{generate(args.seed).snippet()}---")
    counts = ", ".join(f"{c} {summary.by_category[c]}" for c in CATEGORIES
                       if c in summary.by_category)
    print(f"fuzz: by category: {counts or 'none'}; {summary.skipped} skipped by --without; "
          f"{summary.seconds:.1f} s")
    print(f"fuzz: {summary.configurations} configurations, {summary.mismatches} mismatches")
    if "hang" in summary.by_category:
        # Threads stuck in the engine could block interpreter shutdown (joins in destructors).
        sys.stdout.flush()
        os._exit(1)
    return 1 if summary.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
