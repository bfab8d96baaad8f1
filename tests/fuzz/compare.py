"""compare.py — runs a model as gpipe.Pipe and as its references; lists every difference.

The reference is the plain Sequential (a deep copy made before the Pipe took
the layers): outputs, output ``requires_grad``, the caller's inputs after
forward, input grads, returned grads, every parameter's and external tensor's
``.grad`` (also where the plain model leaves it alone) and exceptions are
compared. Tolerance: :data:`TOL`.

Given a ``target``, :func:`check` runs the training step instead:
``pipe.train_step(inputs, target, step_loss)`` (the Pipe's schedule) against
``step_loss(ref(inputs), target).backward()``; the returned loss (which must
be detached), the caller's inputs afterwards, every ``.grad`` and exceptions
are compared as above (outputs are not returned). :func:`step_loss` is a
mean over the micro-batch's rows, as train_step requires.

Two documented gpipe rules make the Pipe differ from the plain model on
purpose; each is compared against what the rule says, never skipped silently:

* Stage inputs are handed over so that a stage's first layer may work in
  place (see :mod:`reference`). When the plain model refuses such an in-place
  operation and the Pipe does not raise the same, the Pipe is compared in full
  against :class:`reference.BoundaryCloned` instead, and
  :attr:`Findings.reference` says so (the fuzzer counts those configurations).
  If that reference raises too, the mismatch stands.
* With several micro-batches, a forward error is the first one in time of a
  cell (stage x micro-batch), while the plain model raises the first of its
  whole-batch layer order: when both raise, but different types, the Pipe's
  may be that of any cell :meth:`reference.BoundaryCloned.first_errors`
  allows (e.g. a row-wise RaiseIf that only the second micro-batch trips, in
  front of a wrong-shaped Linear that the first one reaches). Under
  train_step a micro-batch's loss and backward may also come before a later
  micro-batch's forward (all schedules compute a loss right after its
  forward): the Pipe's error may also be of a type that the whole step of a
  micro-batch whose forward passes raises, run alone (the plain model's loss,
  say, requires no grad for the rows that pass a RaiseIf: seed 6539).
* Under ``torch.no_grad()`` the Pipe's outputs are fresh tensors and never
  require grad (csrc/engine.cpp: without grad mode nothing is kept), while the
  plain model may return one of its inputs, or a view of one, which does: only
  that output's ``requires_grad`` is not compared.

Reproducibility (README, "Random numbers"): a seeded run is bitwise
reproducible, dropout masks and grad sums included. Compared with the plain
model, dropout replays the Pipe's masks, which cannot tell whether the Pipe
would draw them again; so :func:`check` then runs the Pipe again from the
generator state its first run started from (as ``torch.manual_seed`` would
leave it) and requires bitwise the same outputs, loss, returned grads and
every ``.grad`` (:func:`_repeat`; category ``reproducibility``). The first
run is a fresh Pipe's first step, the second its second step. The rule's one
exception, a stage whose first micro-batch draws nothing drawing on a later
one after a step in which it drew nothing (:class:`layers.CondDropout`), can
make the first step differ: there the second and a third run are compared.
"""
import copy
import itertools
import random
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

import gpipe
import layers
from layers import MaskDropout, ReplayError
from reference import BoundaryCloned, _entries, is_input_or_view, needs_cloned
from reference import as_tuple as _as_tuple

#: float64: absolute. float32: relative to the compared tensor's scale, max(1, max|want|).
#: Micro-batching reorders float sums (a parameter's grad is summed per micro-batch, then over
#: them; convolutions and LayerNorm reduce over other shapes), which perturbs a result by about
#: eps * (sum of |terms|), and ill-conditioned layers amplify that: LayerNorm over 2 features
#: with a small variance, or a bias grad in front of a LayerNorm, which cancels to ~0 from O(1)
#: terms (seeds 2386, 5241: the Pipe and the plain float32 model each differ from float64 by up
#: to ~5e-5 of the scale). float32 eps is 1.2e-7; 1e-4 of the scale is ~800 eps of headroom and
#: still far below what a real bug (a missing, doubled or wrong micro-batch) changes: O(scale).
TOL = {"float64": 1e-10, "float32": 1e-4}
CATEGORIES = ("exception", "output", "requires_grad", "grad", "side-effect", "reproducibility",
              "hang", "harness")

Tensors = Union[Tensor, Tuple[Tensor, ...]]

@dataclass
class Mismatch:
    category: str  # one of CATEGORIES
    detail: str
    # Finer than the category, e.g. 'exception:forward:pipe=None:plain=RuntimeError'; shrinking
    # keeps it.
    kind: str = ""

    def __post_init__(self) -> None:
        self.kind = self.kind or self.category


class Findings(List[Mismatch]):
    """The mismatches of one check, and which reference they were found against."""

    #: None: the plain model; 'forward' or 'backward': the boundary-cloned model, chosen when
    #: the plain model raised an in-place error there.
    reference: Optional[str] = None
    #: Whether the Pipe's run was repeated from the same seed (:func:`_repeat`), and whether
    #: its dropout layers drew random numbers then.
    repeated: bool = False
    drew: bool = False


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


def _diff(got: Tensor, want: Tensor, tol: float, ref: str) -> Optional[str]:
    """None when equal within tol (see :data:`TOL`: relative to the scale below float64),
    else what differs."""
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} vs {ref}'s {tuple(want.shape)}"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype} vs {ref}'s {want.dtype}"
    if got.numel() == 0:
        return None
    d = (got.detach().double() - want.detach().double()).abs().max().item()
    if want.is_floating_point() and want.dtype != torch.float64:
        tol *= max(1.0, want.detach().double().abs().max().item())
    if not d <= tol:  # also catches NaN
        return f"max diff {d:.1e} > {tol:.1e}"
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


class _Side:
    """One model's run: its own input leaves and grad targets, its output, error and grads."""

    def __init__(self, model: nn.Module, inputs: Tensors, name: str, short: str) -> None:
        self.model, self.name, self.short = model, name, short
        self.x = _leaf_copy(inputs)
        self.targets = grad_targets(model)
        self.out: Any = None
        self.error: Optional[BaseException] = None
        self.returned: Dict[str, Tensor] = {}
        self.grads: Dict[str, Optional[Tensor]] = {}
        self.loss: Optional[Tensor] = None  # train_step's references: the detached step_loss
        #: What ran, in order (method name, arguments): :func:`_repeat` runs it again.
        self.calls: List[Tuple[str, Tuple[Any, ...]]] = []

    def pool(self) -> Dict[str, Tensor]:
        """What a run may ask grads of: the inputs, then the grad targets."""
        return {**{f"input{k}": x for k, x in enumerate(_as_tuple(self.x))}, **self.targets}

    def forward(self) -> None:
        self.calls.append(("forward", (torch.is_grad_enabled(),)))
        self.out, self.error = _attempt(lambda: self.model(self.x))

    def backward(self, weights: Sequence[Optional[Tensor]], mode: str, names: List[str],
                 initial: Dict[str, Optional[Tensor]]) -> None:
        self.calls.append(("backward", (weights, mode, names, initial)))
        self._reset(initial)
        self.returned, self.error = _attempt(
            lambda: _backward(self.out, weights, self.pool(), mode, names))
        self.grads = {n: _clone(t.grad) for n, t in self.pool().items()}

    def _reset(self, initial: Dict[str, Optional[Tensor]]) -> None:
        for n, t in self.targets.items():  # a shared closure W holds another side's grad
            t.grad = _clone(initial[n])

    def train_step(self, target: Tensors, initial: Dict[str, Optional[Tensor]]) -> None:
        """The Pipe's side: forward, loss and backward in one call; ``out`` is the loss."""
        self.calls.append(("train_step", (target, initial)))
        self._reset(initial)
        with torch.enable_grad():
            self.out, self.error = _attempt(
                lambda: self.model.train_step(self.x, target, step_loss))
        self.grads = {n: _clone(t.grad) for n, t in self.pool().items()}

    def loss_backward(self, target: Tensors, initial: Dict[str, Optional[Tensor]]) -> None:
        """A reference's side after :meth:`forward`: ``loss``, its detached step_loss, then
        ``loss.backward()``."""
        self._reset(initial)

        def run() -> Tensor:
            loss = step_loss(self.out, target)
            loss.backward()
            return loss.detach()

        self.loss, self.error = _attempt(run)
        self.grads = {n: _clone(t.grad) for n, t in self.pool().items()}


# -- comparing -------------------------------------------------------------------------------

def _exception_mismatch(phase: str, pipe_e: Optional[BaseException], ref: _Side,
                        ref_e: Optional[BaseException]) -> List[Mismatch]:
    if ref_e is None and pipe_e is None:
        return []
    name = lambda e: type(e).__name__ if e is not None else None  # noqa: E731
    kind = f"exception:{phase.split()[0]}:pipe={name(pipe_e)}:{ref.short}={name(ref_e)}"
    if ref_e is None:
        detail = f"the Pipe raised {_describe(pipe_e)}; {ref.name} raised nothing"
    elif pipe_e is None:
        detail = f"{ref.name} raised {_describe(ref_e)}; the Pipe raised nothing"
    elif type(pipe_e) is not type(ref_e):
        detail = f"the Pipe raised {_describe(pipe_e)}; {ref.name} {_describe(ref_e)}"
    else:
        return []
    return [Mismatch("exception", f"{phase}: {detail}", kind)]


def same_structure(got: Any, want: Any) -> bool:
    return (isinstance(got, tuple) == isinstance(want, tuple)
            and len(_as_tuple(got)) == len(_as_tuple(want))
            and all(isinstance(g, Tensor) for g in _as_tuple(got)))


def _compare_outputs(got: Any, ref: _Side, tol: float, no_grad: bool) -> List[Mismatch]:
    want = ref.out
    if not same_structure(got, want):
        return [Mismatch("output", f"the Pipe returns {type(got).__name__} of "
                                   f"{len(_as_tuple(got))}, {ref.name} {type(want).__name__} "
                                   f"of {len(_as_tuple(want))}", "output:structure")]
    found = []
    for k, (g, w) in enumerate(zip(_as_tuple(got), _as_tuple(want))):
        d = _diff(g, w, tol, ref.name)
        if d:
            found.append(Mismatch("output", f"output {k}: {d}", "output:value"))
        # Documented: under no_grad, Pipe outputs are fresh tensors and never require grad;
        # the plain model's output that is an input (or a view of one) still does.
        if no_grad and is_input_or_view(w, _as_tuple(ref.x)):
            continue
        if g.requires_grad != w.requires_grad:
            found.append(Mismatch("requires_grad", f"output {k}: requires_grad "
                                                   f"{g.requires_grad}, {ref.name}'s "
                                                   f"{w.requires_grad}",
                                  f"requires_grad:pipe={g.requires_grad}"))
    return found


def _loss(out: Any, weights: Sequence[Optional[Tensor]]) -> Tensor:
    """sum(out * w) over the float outputs: every output element gets its own, nonzero weight."""
    terms = [(o * w).sum() for o, w in zip(_as_tuple(out), weights) if w is not None]
    return torch.stack(terms).sum()


def step_loss(out: Any, target: Tensors) -> Tensor:
    """train_step's loss_fn: sum(output * target) over the float outputs (one target tensor per
    float output, in order), divided by the micro-batch's rows (the target's along dim 0): a
    mean over rows, so the Pipe's rows_i/rows scaling gives the plain model's loss."""
    floats = [o for o in _as_tuple(out) if o.is_floating_point()]
    targets = _as_tuple(target)
    terms = [(o * t).sum() for o, t in zip(floats, targets)]
    return torch.stack(terms).sum() / targets[0].shape[0]


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


def _forward_orders(pipe: nn.Module) -> Optional[List[List[int]]]:
    """Per stage, the micro-batches in the order their forwards ran, where the Pipe runs a
    table (a gpipe.Schedule may run a stage's micro-batches out of order); None where every
    stage runs them in order (the built-in schedules, and every Pipe outside train_step)."""
    schedule = getattr(pipe, "schedule", None)
    if not isinstance(schedule, gpipe.Schedule):
        return None
    orders: List[List[int]] = [[] for _ in range(schedule.stages)]
    for row in schedule.to_rows():
        for action in row:
            stage, op, mb = _parse_action(action)
            if op == "F":
                orders[stage].append(mb)
    return orders


def _parse_action(action: str) -> Tuple[int, str, int]:
    """'12F3' -> (12, 'F', 3)."""
    k = next(i for i, c in enumerate(action) if not c.isdigit())
    return int(action[:k]), action[k], int(action[k + 1:])


def _replay_dropout(pipe: nn.Module, refs: Sequence[nn.Module], use_logs: bool,
                    complete: Optional[int] = None) -> Dict[int, Tensor]:
    """Hands the masks the Pipe's dropout layers drew (micro-batch order) to the references.
    ``complete``: the batch's rows, where the Pipe stopped at an error before every micro-batch
    ran its forward (train_step interleaves): the rows it did not reach get fresh masks, so
    the references raise (or not) as the Pipe's micro-batches did. A layer logs its masks in
    the order its stage ran the forwards, which a table may choose (:func:`_forward_orders`).
    Returns the masks handed over, by layer."""
    masks = {}
    orders = _forward_orders(pipe) if use_logs else None
    starts = list(itertools.accumulate(getattr(pipe, "balance", [len(pipe)])))
    for i, p in enumerate(pipe):
        if isinstance(p, MaskDropout):
            logged, rest_rows = p.log, complete
            if orders is not None and logged:
                order = orders[next(j for j, end in enumerate(starts) if i < end)]
                logged = _in_microbatch_order(logged, order, p.p, complete)
                rest_rows = None  # the rows not reached are in place already
            mask = torch.cat(logged) if use_logs and logged else None
            if mask is not None and rest_rows is not None and mask.shape[0] < rest_rows:
                rest = torch.ones((rest_rows - mask.shape[0],) + mask.shape[1:], dtype=mask.dtype)
                mask = torch.cat([mask, torch.nn.functional.dropout(rest, p.p, True)])
            for ref in refs:
                ref[i].replay = mask
            if mask is not None:
                masks[i] = mask
            p.log = []
    return masks


def _in_microbatch_order(logged: List[Tensor], order: List[int], p: float,
                         complete: Optional[int]) -> List[Tensor]:
    """The masks ``logged`` in the forwards' ``order`` (micro-batches; a prefix of it ran where
    the Pipe stopped at an error), put in micro-batch order; with ``complete`` (the batch's
    rows) the micro-batches not reached get fresh masks of their rows (the Pipe's cut: rows
    differing by at most one, larger first)."""
    m = len(order)
    by_mb: Dict[int, Tensor] = dict(zip(order, logged))
    if complete is None or len(by_mb) == m:
        return [by_mb[k] for k in sorted(by_mb)]
    sizes = [len(r) for r in torch.arange(complete).tensor_split(m)]
    like = logged[0]
    return [by_mb[k] if k in by_mb else torch.nn.functional.dropout(
        torch.ones((sizes[k],) + like.shape[1:], dtype=like.dtype), p, True) for k in range(m)]


def _compare_grads(pipe: _Side, ref: _Side, mode: str, names: List[str],
                   tol: float) -> List[Mismatch]:
    found = []
    for n, w in ref.returned.items():
        d = _diff(pipe.returned[n], w, tol, ref.name)
        if d:
            found.append(Mismatch("grad", f"autograd.grad for {n}: {d}", "grad:returned"))
    for n, got_g in pipe.grads.items():
        want_g = ref.grads[n]
        # With autograd.grad or backward(inputs=...), a tensor not asked about keeps its .grad.
        aside = mode != "backward" and (mode.startswith("grad") or n not in names)
        category = "side-effect" if aside else "grad"
        if want_g is None:
            if got_g is not None:
                found.append(Mismatch(category, f"{n}.grad: {ref.name} leaves None, the Pipe "
                                                f"fills it", f"{category}:fills"))
        elif got_g is None:
            found.append(Mismatch("grad", f"{n}.grad: None, {ref.name}'s is set", "grad:missing"))
        else:
            d = _diff(got_g, want_g, tol, ref.name)
            if d:
                found.append(Mismatch(category, f"{n}.grad: {d}", f"{category}:value"))
    return found


def check(pipe: nn.Module, ref: nn.Sequential, inputs: Tensors, *, training: bool = True,
          no_grad: bool = False, backward: str = "backward", pre_grad: bool = False,
          tol: float = 1e-10, seed: int = 0, target: Optional[Tensors] = None,
          repeat: bool = True) -> Findings:
    """Runs ``inputs`` through ``pipe`` and through ``ref`` (the plain copy, unused so far)
    forward and, unless ``no_grad``, backward as ``backward`` says, and lists every difference
    (against the boundary-cloned model where the module docstring says). With a ``target``:
    ``pipe.train_step(inputs, target, step_loss)`` against the plain model's step (``no_grad``
    and ``backward`` do not apply). ``repeat``: then the Pipe's run again from the same seed,
    which must give bitwise the same (:func:`_repeat`)."""
    state = torch.get_rng_state()  # where the Pipe's run starts: the seed _repeat reuses
    findings = Findings()
    balance = getattr(pipe, "balance", [len(ref)])
    chunks = getattr(pipe, "chunks", 1)
    sides = (_Side(pipe, inputs, "the Pipe", "pipe"),
             _Side(ref, inputs, "the plain model", "plain"),
             _Side(BoundaryCloned(copy.deepcopy(ref), balance, chunks,
                                  getattr(pipe, "checkpoint", "never"),
                                  getattr(pipe, "batch_dim", 0),
                                  getattr(pipe, "output_batch_dim", None)), inputs,
                   "the boundary-cloned model", "cloned"))
    p, plain, cloned = sides
    for side in sides:
        side.model.train(training)
        if list(side.targets) != list(p.targets):
            findings.append(Mismatch("harness", f"targets differ: {list(p.targets)} vs "
                                                f"{list(side.targets)}"))
            return findings
    rng = torch.Generator().manual_seed(seed)
    if pre_grad:  # existing grads: backward must add to them, autograd.grad leave them
        for name, t in plain.targets.items():
            if t.requires_grad:
                g = torch.randn(t.shape, generator=rng, dtype=t.dtype)
                for side in sides:
                    side.targets[name].grad = g.clone()
    initial = {n: _clone(t.grad) for n, t in p.targets.items()}
    if target is not None:
        _check_step(findings, sides, target, initial, tol, chunks)
    else:
        _check_call(findings, sides, no_grad, backward, tol, seed, chunks, rng, initial)
    if repeat and isinstance(pipe, gpipe.Pipe):
        findings += _repeat(pipe, inputs, p, state, findings)
    return findings


def _check_call(findings: Findings, sides: Tuple[_Side, _Side, _Side], no_grad: bool,
                backward: str, tol: float, seed: int, chunks: int, rng: torch.Generator,
                initial: Dict[str, Optional[Tensor]]) -> None:
    """:func:`check` without a target: forward, then backward as ``backward`` says; adds the
    differences to ``findings``."""
    p, plain, cloned = sides
    pipe, ref = p.model, plain.model

    # Forward: the Pipe first, so that the references can replay its dropout masks.
    with torch.set_grad_enabled(not no_grad):
        p.forward()
        _replay_dropout(pipe, (ref, cloned.model), use_logs=p.error is None)
        plain.forward()
        want = plain
        if needs_cloned(p.error, plain.error):
            findings.reference, want = "forward", cloned
            cloned.forward()
        if (p.error is not None and want.error is not None and chunks > 1
                and type(p.error) is not type(want.error)):
            # Which cell raises first differs from the plain model's layer order (docstring).
            if want is plain:
                cloned.forward()
            if any(type(e) is type(p.error) for e in cloned.model.first_errors()):
                return
    if isinstance(want.error, ReplayError):
        findings.append(Mismatch("output", f"dropout replay: {want.error}", "output:replay"))
        return
    findings += _exception_mismatch("forward", p.error, want, want.error)
    if p.error is not None or want.error is not None:
        return
    findings += _compare_outputs(p.out, want, tol, no_grad)
    for k, (a, b) in enumerate(zip(_as_tuple(p.x), _as_tuple(want.x))):
        d = _diff(a, b, tol, want.name)  # an in-place first layer may modify the caller's input
        if d:
            findings.append(Mismatch("output", f"input {k} after forward: {d} (left otherwise "
                                               f"than {want.name} leaves it)", "output:input"))
    if no_grad or not same_structure(p.out, want.out):
        return
    weights = [torch.randn(w.shape, generator=rng, dtype=w.dtype) if w.is_floating_point()
               else None for w in _as_tuple(want.out)]
    if all(w is None for w in weights):
        return

    # Which tensors the call asks grads of; the same names on every side.
    wanting = [n for n, t in want.pool().items() if t.requires_grad]
    names = {"grad_inputs": [n for n in wanting if n.startswith("input")],
             "backward_inputs": [n for n in wanting if n.startswith("input")],
             "grad_params": [n for n in wanting if not n.startswith("input")],
             "backward_subset": sorted(random.Random(seed).sample(
                 wanting, random.Random(seed + 1).randint(1, len(wanting)))) if wanting else [],
             "backward": []}[backward]
    if backward != "backward" and not names:
        backward = "backward"  # nothing to ask for: the plain loss.backward() it is

    want.backward(weights, backward, names, initial)
    p.backward(weights, backward, names, initial)
    if want is plain and needs_cloned(p.error, plain.error):
        # The plain model's forward matched; its backward refused what the Pipe's recompute
        # regenerates: forward and backward the boundary-cloned model for the grads.
        findings.reference, want = "backward", cloned
        with torch.enable_grad():
            cloned.forward()
        if cloned.error is not None:
            findings += _exception_mismatch("forward", None, cloned, cloned.error)
            return
        findings += _compare_outputs(p.out, cloned, tol, no_grad)
        cloned.backward(weights, backward, names, initial)
    findings += _exception_mismatch(f"backward ({backward})", p.error, want, want.error)
    if p.error is not None or want.error is not None:
        return
    findings += _compare_grads(p, want, backward, names, tol)
    return


def _check_step(findings: Findings, sides: Tuple[_Side, _Side, _Side], target: Tensors,
                initial: Dict[str, Optional[Tensor]], tol: float, chunks: int) -> None:
    """:func:`check` with a target: the Pipe's train_step against the references' forward,
    :func:`step_loss` and ``loss.backward()``; adds the differences to ``findings``."""
    p, plain, cloned = sides
    p.train_step(target, initial)
    # The Pipe first, so that the references can replay its dropout masks.
    rows = _as_tuple(target)[0].shape[0]
    masks = _replay_dropout(p.model, (plain.model, cloned.model), use_logs=True,
                            complete=rows if p.error is not None else None)
    with torch.enable_grad():
        plain.forward()
        want = plain
        if needs_cloned(p.error, plain.error):
            findings.reference, want = "forward", cloned
            cloned.forward()
        forward_error = want.error
        if forward_error is None:
            want.loss_backward(target, initial)
            if want is plain and needs_cloned(p.error, plain.error):
                # As in check: the plain backward refused what the Pipe's recompute regenerates.
                findings.reference, want = "backward", cloned
                cloned.forward()
                if cloned.error is None:
                    cloned.loss_backward(target, initial)
        if (p.error is not None and forward_error is not None and chunks > 1
                and type(p.error) is not type(forward_error)):
            # Which cell raises first differs from the plain model's layer order (docstring).
            if want is plain:
                cloned.forward()
            if any(type(e) is type(p.error) for e in cloned.model.first_errors()):
                return
            # Or a micro-batch whose forward passed raised in its loss or backward before
            # another's forward failed (train_step runs them as the schedule interleaves).
            if type(p.error) in _alone_errors(plain, cloned.model, target, masks):
                return
    if isinstance(want.error, ReplayError):
        findings.append(Mismatch("output", f"dropout replay: {want.error}", "output:replay"))
        return
    findings += _exception_mismatch("train_step", p.error, want, want.error)
    if p.error is not None or want.error is not None:
        return
    loss = p.out
    if not isinstance(loss, Tensor):
        findings.append(Mismatch("output", f"train_step returned {type(loss).__name__}, not a "
                                           f"tensor", "output:loss"))
        return
    d = _diff(loss, want.loss, tol, want.name)
    if d:
        findings.append(Mismatch("output", f"train_step's loss: {d}", "output:loss"))
    if loss.requires_grad or loss.grad_fn is not None:
        findings.append(Mismatch("requires_grad", "train_step's loss is not detached "
                                                  f"(requires_grad {loss.requires_grad})",
                                 "requires_grad:loss"))
    for k, (a, b) in enumerate(zip(_as_tuple(p.x), _as_tuple(want.x))):
        d = _diff(a, b, tol, want.name)  # an in-place first layer may modify the caller's input
        if d:
            findings.append(Mismatch("output", f"input {k} after train_step: {d} (left "
                                               f"otherwise than {want.name} leaves it)",
                                     "output:input"))
    findings += _compare_grads(p, want, "backward", [], tol)


def _alone_errors(plain: _Side, cloned: BoundaryCloned, target: Tensors,
                  masks: Dict[int, Tensor]) -> List[type]:
    """The error types of the whole steps of each micro-batch whose forward passed in
    ``cloned`` (after its forward): that micro-batch alone, as a one-micro-batch
    boundary-cloned copy of the plain model, its step_loss scaled by rows_i / rows as the
    Pipe's, then backward (dropout replaying its rows of ``masks``)."""
    failed = {i for i, _, _ in cloned.errors}
    callers = _as_tuple(plain.x)
    dims = _entries(cloned.in_dims, len(callers))
    targets = _as_tuple(target)
    rows = targets[0].shape[0]
    m = min(cloned.chunks, rows)
    balance = [len(stage) for stage in cloned.stages]
    found, offset = [], 0
    for i in range(m):
        t_i = tuple(t.tensor_split(m)[i] for t in targets)
        n = t_i[0].shape[0]
        offset, start = offset + n, offset
        if i in failed:
            continue
        x_i = tuple(t if d is None else t.tensor_split(m, dim=d)[i]
                    for t, d in zip(callers, dims))
        model = BoundaryCloned(copy.deepcopy(plain.model), balance, 1, cloned.checkpoint,
                               cloned.in_dims, cloned.out_dims)
        model.train(plain.model.training)
        for k, mask in masks.items():
            model[k].replay = mask[start:start + n] if mask.shape[0] == rows else mask
        alone = _Side(model, x_i if isinstance(plain.x, tuple) else x_i[0], "", "")

        def step() -> None:
            out = model(alone.x)
            (step_loss(out, t_i if isinstance(target, tuple) else t_i[0]) * (n / rows)).backward()

        with torch.enable_grad():
            _, error = _attempt(step)
        if error is not None:
            found.append(type(error))
    return found


# -- reproducibility -------------------------------------------------------------------------

def _micro_batch_rows(pipe: nn.Module, inputs: Tensors) -> List[int]:
    """The rows of the Pipe's micro-batches, cut as :class:`reference.BoundaryCloned` cuts."""
    dims = getattr(pipe, "batch_dim", 0)
    callers = _as_tuple(inputs)
    cut = [t.shape[d] for t, d in zip(callers, _entries(
        list(dims) if isinstance(dims, (list, tuple)) else [dims], len(callers)))
           if d is not None and t.dim() > 0]
    rows = cut[0] if cut else 0
    m = min(getattr(pipe, "chunks", 1), rows) if rows else 1
    return [len(c) for c in torch.arange(rows).tensor_split(m)] if m > 1 else [rows]


def _first_step_exempt(pipe: nn.Module, inputs: Tensors) -> bool:
    """Whether a fresh Pipe's first step may draw as the RNG rule's exception says: some
    CondDropout draws on a later micro-batch but not on the first (conservatively, whatever
    else its stage holds)."""
    rows = _micro_batch_rows(pipe, inputs)
    return any(isinstance(l, layers.CondDropout) and l.training and rows[0] >= l.below
               and min(rows) < l.below for l in pipe)


def _rerun(pipe: nn.Module, inputs: Tensors, calls: List[Tuple[str, Tuple[Any, ...]]],
           state: Tensor) -> Tuple[_Side, bool]:
    """``calls`` again on a fresh side, the default generator set to ``state`` first; returns
    the side and whether a dropout layer drew random numbers."""
    side = _Side(pipe, inputs, "the Pipe", "pipe")
    drawing = [l for l in pipe if isinstance(l, MaskDropout)]
    before = sum(l.drawn for l in drawing)
    torch.set_rng_state(state)
    for name, args in calls:
        if name == "forward":
            with torch.set_grad_enabled(args[0]):
                side.forward()
        else:
            getattr(side, name)(*args)
        if side.error is not None:
            break
    for l in drawing:
        l.log = []
    return side, sum(l.drawn for l in drawing) > before


def _run_record(side: _Side) -> Dict[str, Optional[Tensor]]:
    """What a run of the Pipe gave, by name: outputs (train_step: the loss), returned grads,
    every ``.grad``."""
    step = bool(side.calls) and side.calls[0][0] == "train_step"
    found: Dict[str, Optional[Tensor]] = {
        ("train_step's loss" if step else f"output {k}"): o
        for k, o in enumerate(_as_tuple(side.out)) if isinstance(o, Tensor)}
    found.update((f"autograd.grad for {n}", t) for n, t in side.returned.items())
    found.update((f"{n}.grad", g) for n, g in side.grads.items())
    return found


def _bits(t: Tensor) -> Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _bitwise(got: Optional[Tensor], want: Optional[Tensor]) -> Optional[str]:
    """None when both are None or bitwise equal (NaNs too), else what differs."""
    if got is None or want is None:
        return None if got is None and want is None else (
            f"{'None' if got is None else 'set'}, the first run's "
            f"{'None' if want is None else 'set'}")
    if got.shape != want.shape or got.dtype != want.dtype:
        return (f"{tuple(got.shape)} {got.dtype}, the first run's {tuple(want.shape)} "
                f"{want.dtype}")
    if torch.equal(_bits(got), _bits(want)):
        return None
    if got.is_floating_point():
        d = (got.detach().double() - want.detach().double()).abs().max().item()
        return f"not bitwise equal (max diff {d:.1e})"
    return "not bitwise equal"


def _repeat(pipe: nn.Module, inputs: Tensors, first: _Side, state: Tensor,
            findings: Findings) -> List[Mismatch]:
    """The Pipe's run (``first``) again from the same seed (``state``, the default generator's
    state when it started); lists what is not bitwise the same (see the module docstring).
    Runs nothing where the first run raised."""
    if first.error is not None or not first.calls:
        return []
    calls = first.calls
    again, drew = _rerun(pipe, inputs, calls, state)
    if _first_step_exempt(pipe, inputs):
        first = again  # a step after one that drew: the rule holds from here
        again, drew = _rerun(pipe, inputs, calls, state)
    findings.repeated, findings.drew = True, drew
    if type(again.error) is not type(first.error):
        return [Mismatch("reproducibility", f"run again from the same seed, the Pipe raised "
                                            f"{_describe(again.error) if again.error else None}"
                                            f"; before, "
                                            f"{_describe(first.error) if first.error else None}",
                         "reproducibility:exception")]
    if again.error is not None:
        return []
    want, got = _run_record(first), _run_record(again)
    found = []
    for name in dict.fromkeys(list(want) + list(got)):
        d = _bitwise(got.get(name), want.get(name))
        if d:
            what = "grad" if "grad" in name else "output"
            found.append(Mismatch("reproducibility", f"run again from the same seed: {name}: "
                                                     f"{d}", f"reproducibility:{what}"))
    return found


# -- running a configuration -----------------------------------------------------------------

class Hang(Exception):
    pass


def run_config(cfg: Any, timeout: float) -> Findings:
    """Builds and checks a configuration (its ``body()`` calls :func:`check`) on a worker thread,
    so a hang is reported, not waited out."""
    outcome: Dict[str, Findings] = {}

    def target() -> None:
        namespace = {**{n: getattr(layers, n) for n in layers.__all__}, "check": check,
                     "copy": copy, "torch": torch, "nn": nn, "gpipe": gpipe}
        try:
            exec(compile(cfg.body(), f"<fuzz seed {cfg.seed}>", "exec"), namespace)
            outcome["found"] = namespace["mismatches"]
        except Exception as e:  # noqa: BLE001 - a failure of the fuzzer itself
            outcome["found"] = Findings([Mismatch("harness", f"building or checking raised "
                                                             f"{_describe(e)}")])

    worker = threading.Thread(target=target, name=f"fuzz-{cfg.seed}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise Hang(f"no answer within {timeout:.0f} s")
    return outcome["found"]
