"""reference.py — the boundary-cloned model: the reference where gpipe's hand-over is deliberate.

gpipe hands every stage its input (``enter`` in csrc/stage.cpp) so that the
stage's first layer may work in place, even where the plain model refuses: on
a leaf that requires grad or a view of one ("a leaf Variable that requires
grad is being used in an in-place operation"), and, with checkpointing, on a
tensor an earlier stage saved ("one of the variables needed for gradient
computation has been modified by an inplace operation": the recompute
regenerates it). There the Pipe is compared against :class:`BoundaryCloned`,
the same layers run cell by cell (stage x micro-batch) with gpipe's rules:

* Micro-batches: each input value cut along its ``batch_dim`` entry like
  ``torch.tensor_split`` (a None entry: every micro-batch gets all of it); with
  more than one, every piece counts its versions on its own (csrc/engine.cpp),
  and the outputs are concatenated along their ``output_batch_dim`` entry (a
  None entry: micro-batch 0's value).
* Hand-over: a stage gets a detached alias of what it is given (same storage
  and version counter; :class:`_Handover` keeps the grad flowing), so in-place
  work changes the previous stage's output, or the caller's tensor.
* A cell that is not checkpointed keeps its graph: an in-place change of what
  it saved, by a later stage too, fails the backward as in the plain model.
* A checkpointed cell (``'always'``: every micro-batch, ``'except_last'``: all
  but the last, ``'never'``: none; none in eval mode or without grad mode)
  rebuilds its graph from its input as it was at its forward: what it saved
  can't be spoilt by later stages, but a change made by its own layers (which
  the recompute repeats) still fails. :class:`_Checkpointed` models that with
  saved-tensor hooks (each saved tensor kept as a copy taken when saved), and
  gpipe's watch: when the stage neither changes its input nor returns an alias
  of it, a change of that input before the backward fails too.
* A checkpointed cell that draws random numbers after its stage's first
  checkpointed cell did not keeps its graph (csrc/stage.cpp, "verify only").
  Not modelled: a cell keeping its graph because another stage drew
  concurrently, which needs dropout and an in-place spoiling stage together.
* Skips (``gpipe.skip``): each micro-batch runs its cells with a skip tracker
  of its own, so a skip goes from its stash to its pop within the micro-batch
  (across stages as the Pipe routes it); nothing is left over after an error.
"""
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from gpipe.skip.tracker import SkipTracker, use_skip_tracker
from layers import MaskDropout

#: The plain model's in-place refusals that gpipe's hand-over at stage boundaries avoids.
INPLACE_ERRORS = (
    "leaf Variable that requires grad is being used in an in-place operation",  # also 'a view of'
    "one of the variables needed for gradient computation has been modified by an inplace "
    "operation",
)
CHECKPOINT_STOPS = {"always": lambda m: m, "except_last": lambda m: m - 1, "never": lambda m: 0}


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
    """A non-leaf alias of x as gpipe hands a stage its input: the same storage, and the same
    version counter (``fresh``: its own, as each micro-batch piece gets with chunks > 1)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, fresh: bool) -> Tensor:  # type: ignore[override]
        return x.data if fresh else x.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None]:  # type: ignore[override]
        return grad, None


def hand_over(x: Any, fresh: bool) -> Any:
    handed = tuple(_Handover.apply(t, fresh) if t.requires_grad else t.data if fresh else t
                   for t in as_tuple(x))
    return handed if isinstance(x, tuple) else handed[0]


class _Checkpointed:
    """Saved-tensor hooks for one checkpointed cell: what it saves is what its recompute would
    regenerate, a copy taken when saved; a saved tensor its own stage changed in place later
    (:meth:`seal` at the end of the stage) fails, as in the recompute; so does a watched input
    changed since the forward."""

    def __init__(self) -> None:
        self.saved: List[List[Any]] = []  # [tensor, version when saved, copy, version at seal]
        self.watched: List[Tuple[Tensor, int]] = []

    def pack(self, t: Tensor) -> List[Any]:
        record = [t, t._version, t.detach().clone(), None]
        self.saved.append(record)
        return record

    def seal(self, watched: Sequence[Tensor]) -> None:
        for record in self.saved:
            record[3] = record[0]._version
            record[0] = None
        self.watched = [(t, t._version) for t in watched]

    def unpack(self, record: List[Any]) -> Tensor:
        for t, version in self.watched:
            if t._version != version:
                raise RuntimeError(f"{INPLACE_ERRORS[1]}: the checkpointed stage's input is at "
                                   f"version {t._version}; expected version {version}")
        if record[3] is not None and record[3] != record[1]:
            raise RuntimeError(f"{INPLACE_ERRORS[1]}: a tensor its stage saved (at version "
                               f"{record[1]}) is at version {record[3]} (the recompute fails)")
        return record[2]


def _draws(stage: Sequence[nn.Module], rows: int) -> bool:
    """Whether gpipe's cell of ``stage`` draws random numbers on a micro-batch of ``rows``."""
    dummy = torch.empty(rows, 0)
    return any(isinstance(l, MaskDropout) and l.training and l.draws(dummy) for l in stage)


def _entries(dims: List[Optional[int]], count: int) -> List[Optional[int]]:
    """One batch dim entry per value (a single entry serves them all)."""
    return dims * count if len(dims) == 1 else dims


class BoundaryCloned(nn.Sequential):
    """The same layers run cell by cell as gpipe runs them (see the module docstring); layer
    names are the plain model's. ``errors`` lists, after a forward, every cell that raised
    (micro-batch, stage, exception): each micro-batch goes on until its first error."""

    def __init__(self, model: nn.Sequential, balance: Sequence[int], chunks: int = 1,
                 checkpoint: Any = "never", batch_dim: Any = 0,
                 output_batch_dim: Any = None) -> None:
        super().__init__(*model)
        starts = [sum(balance[:j]) for j in range(len(balance) + 1)]
        self.stages = [list(range(a, b)) for a, b in zip(starts, starts[1:])]
        self.chunks, self.checkpoint = chunks, checkpoint
        # The Pipe's rules: one entry serves every value; the output default is batch_dim, or
        # its first entry that is not None.
        self.in_dims = list(batch_dim) if isinstance(batch_dim, (list, tuple)) else [batch_dim]
        if output_batch_dim is None:
            output_batch_dim = next((d for d in self.in_dims if d is not None), 0)
        self.out_dims = (list(output_batch_dim) if isinstance(output_batch_dim, (list, tuple))
                         else [output_batch_dim])
        self.errors: List[Tuple[int, int, BaseException]] = []

    def _cell(self, j: int, x: Any, checkpointed: bool, fresh: bool) -> Any:
        x = hand_over(x, fresh)
        run = lambda: self._layers(j, x)  # noqa: E731
        if not checkpointed:
            return run()
        hooks = _Checkpointed()
        before = [t._version for t in as_tuple(x)]
        with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
            out = run()
        mutated = [t._version for t in as_tuple(x)] != before
        aliased = any(o.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
                      and o.untyped_storage().nbytes() > 0
                      for o in as_tuple(out) for t in as_tuple(x))
        hooks.seal(() if mutated or aliased else as_tuple(x))
        return out

    def _layers(self, j: int, x: Any) -> Any:
        for i in self.stages[j]:
            x = self[i](x)
        return x

    def forward(self, x: Any) -> Any:  # type: ignore[override]
        self.errors = []
        callers = as_tuple(x)
        dims = _entries(self.in_dims, len(callers))
        cut = [(t, d) for t, d in zip(callers, dims) if d is not None and t.dim() > 0]
        # The Pipe's cut: min(chunks, rows) pieces differing by at most one row, larger first.
        total = cut[0][0].shape[cut[0][1]] if cut else 0
        m = min(self.chunks, total) if total else 1
        pieces = ([tuple(t if d is None else t.tensor_split(m, dim=d)[i]
                         for t, d in zip(callers, dims)) for i in range(m)] if m > 1
                  else [callers])
        rows = ([p.shape[cut[0][1]] for p in cut[0][0].tensor_split(m, dim=cut[0][1])] if m > 1
                else [total])
        graph = torch.is_grad_enabled() and self.training
        # The checkpoint mode, or one per stage.
        modes = ([self.checkpoint] * len(self.stages) if isinstance(self.checkpoint, str)
                 else list(self.checkpoint))
        stops = [CHECKPOINT_STOPS[mode](m) if graph else 0 for mode in modes]
        # Dropout replays the Pipe's masks (whole batch, micro-batch order): each cell its slice.
        replays = {i: l.replay for i, l in enumerate(self)
                   if isinstance(l, MaskDropout) and l.replay is not None}
        offsets = [sum(rows[:i]) for i in range(m)]
        state = [None] * len(self.stages)  # per stage: whether its checkpointed cells draw
        results: List[Any] = [None] * m
        for i, piece in enumerate(pieces):
            h: Any = piece if isinstance(x, tuple) else piece[0]
            skips = SkipTracker()  # the micro-batch's skips, from stash to pop
            for j, stage in enumerate(self.stages):
                for k in stage:
                    if k in replays:
                        full = replays[k]
                        self[k].replay = (full[offsets[i]:offsets[i] + rows[i]]
                                          if full.shape[0] == sum(rows) else full)
                checkpointed = i < stops[j]
                if checkpointed:
                    drew = _draws([self[k] for k in stage], rows[i])
                    if state[j] is False and drew:
                        checkpointed = False  # the snapshot may not be its own: keeps the graph
                    if state[j] is None or drew:
                        state[j] = drew
                try:
                    with use_skip_tracker(skips):
                        h = self._cell(j, h, checkpointed, fresh=m > 1 and j == 0)
                except Exception as e:  # noqa: BLE001 - the Pipe's cell raises it
                    self.errors.append((i, j, e))
                    break
            results[i] = h
        if self.errors:
            raise min(self.errors, key=lambda e: (e[0] + e[1], e[0]))[2]
        if m == 1:
            return results[0]
        values = list(zip(*(as_tuple(r) for r in results)))
        outs = tuple(parts[0] if d is None else torch.cat(parts, dim=d)
                     for parts, d in zip(values, _entries(self.out_dims, len(values))))
        return outs if isinstance(results[0], tuple) else outs[0]

    def first_errors(self) -> List[BaseException]:
        """The errors the Pipe's forward may raise (its first in time): a micro-batch's error
        comes first unless an earlier micro-batch fails at the same stage or an earlier one
        (a stage runs its micro-batches in order)."""
        return [e for i, j, e in self.errors
                if not any(i2 < i and j2 <= j for i2, j2, _ in self.errors)]
