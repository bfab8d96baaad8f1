"""modules.py — random plain nn.Modules run through gpipe.pipeline (a kind of configuration).

About a fifth of the seeds (:func:`draws_module`) draw, instead of a random
``nn.Sequential`` (:mod:`configs`), a random ``nn.Module`` written out as
Python source: its forward is a chain of blocks ``self.b0`` ... ``self.bN``
(flat float64 layers: Linear, activations, LayerNorm, small MLPs, the
fuzzer's external / closure / buffer tensors of :mod:`layers`, ``Split``
returning a tuple) with random operations between them:

* edges: a block's (or an input's) output used again further on, added
  (directly or through a projection submodule), concatenated or multiplied
  in, so that the cut routes it across 1 to 3 stages (hand-off or skip);
* ties: a Linear's weight assigned to a later Linear (``b5.weight =
  b1.weight``), read by ``F.linear`` / ``@`` in the forward, used by a
  ``TiedLinear`` block, or the whole Linear called again later;
* inputs: a second positional batch input used late, a keyword tensor not cut
  by batch (``batch_dim={'scale': None}``) used in one or more stages, sizes
  (``x.size(0)``) read in another stage than where the tensor is made;
* outputs: a tensor, a tuple (maybe with a None) or a dict with an
  intermediate value.

It is cut with ``gpipe.pipeline(model, split_points, example_args,
example_kwargs, ...)`` at 1 to 3 blocks (sometimes inside a small MLP), with
1 to 4 chunks, a checkpoint mode (sometimes one per stage), and is compared
with a deep copy of the module (:func:`check_module`): outputs and their
structure, ``requires_grad``, every grad and ``.grad``, the parameters being
the module's own (ties one parameter) and ``state_dict`` keys; about a third
of them run ``pipe.train_step`` under a drawn schedule (interleaved also with
virtual stages) against the plain loss and grads. Every run that raised
nothing is run again from the same state and must give bitwise the same.

Each draw comes from its own generator (seeded by the seed and a name), so
the Sequential configurations of the other seeds stay exactly as they were.
"""
import random
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from compare import TOL, Findings, Mismatch, _attempt, _bitwise, _clone, _describe, _diff
from compare import _leaf_copy
from layers import MaskDropout

#: The share of seeds drawing a module for gpipe.pipeline instead of a Sequential.
MODULE_ODDS = 0.2
#: Seeds that the docs and tests name for their Sequential configuration (fixed bugs,
#: tolerance cases): they keep it whatever the draw says.
NAMED_SEEDS = frozenset({913, 939, 2166, 2386, 4967, 5241, 6539, 6843})
#: As configs.SCHEDULES and configs.MODES (configs imports this module, not the reverse).
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")
MODES = ("always", "except_last", "never")


def draws_module(seed: int) -> bool:
    """Whether ``seed`` names a module configuration (its own generator: the draw of the
    Sequential configurations is untouched)."""
    return seed not in NAMED_SEEDS and random.Random(f"module {seed}").random() < MODULE_ODDS


@dataclass
class ModuleInput:
    name: str
    width: int
    requires_grad: bool
    cut: bool = True      # False: batch_dim None (every micro-batch gets it whole)
    keyword: bool = False

    def expr(self, rows: int) -> str:
        shape = f"{rows}, {self.width}" if self.cut else f"{self.width}"
        return (f"torch.randn({shape}, dtype=dtype, generator=g)"
                f".requires_grad_({self.requires_grad})")


@dataclass
class ModuleConfig:
    """A module configuration: the module's source, its cut and how it runs."""

    seed: int
    init: List[str]
    forward: List[str]
    inputs: List[ModuleInput]
    outputs: List[int]            # widths of the float batch outputs, in pytree order
    blocks: List[str]             # short names of the blocks, for the summary
    ops: List[str]                # short names of the operations between blocks
    split_points: List[str]
    stages: int
    chunks: int
    checkpoint: Any               # a mode, or a list of one per stage
    rows: int
    example_rows: int
    backward: str = "backward"
    pre_grad: bool = False
    no_grad: bool = False
    step: Optional[str] = None
    virtual_stages: int = 1
    #: Stage boundaries crossed by each edge and each tie (for features and tests).
    edge_spans: List[int] = field(default_factory=list)
    tie_spans: List[int] = field(default_factory=list)
    features: List[str] = field(default_factory=list)

    def workers(self) -> int:
        return self.stages // self.virtual_stages

    def summary(self) -> str:
        inputs = ", ".join(f"{s.name}{'*' if s.cut else ''}({s.width})"
                           f"{'+grad' if s.requires_grad else ''}" for s in self.inputs)
        return (f"module blocks=[{', '.join(self.blocks)}] ops=[{', '.join(self.ops)}] "
                f"split_points={self.split_points} chunks={self.chunks} "
                f"checkpoint={self.checkpoint} rows={self.rows} inputs=({inputs}) "
                f"{f'train_step={self.step}' if self.step else f'backward={self.backward}'}"
                f"{f' virtual_stages={self.virtual_stages}' if self.virtual_stages > 1 else ''}"
                f"{' no_grad' if self.no_grad else ''}{' pre_grad' if self.pre_grad else ''}")

    def _pipe_args(self) -> str:
        text = (f"chunks={self.chunks}, checkpoint={self.checkpoint!r}, "
                f"devices=['cpu'] * {self.workers()}")
        shared = [s.name for s in self.inputs if not s.cut]
        if shared:
            text += f", batch_dim={ {n: None for n in shared}!r}"
        if self.step:
            text += f", schedule={self.step!r}"
        if self.virtual_stages > 1:
            text += f", virtual_stages={self.virtual_stages}"
        return text

    def _call(self, rows: int) -> List[str]:
        pos = [s for s in self.inputs if not s.keyword]
        kw = [s for s in self.inputs if s.keyword]
        return [f"({''.join(s.expr(rows) + ', ' for s in pos)})",
                "{" + ", ".join(f"{s.name!r}: {s.expr(rows)}" for s in kw) + "}"]

    def body(self) -> str:
        """The reproduction: the module's class, the pipe, the inputs, :func:`check_module`."""
        names = ", ".join(["self"] + [s.name if s.cut else f"{s.name}=None"
                                      for s in self.inputs])
        lines = ["import torch.nn.functional as F",
                 "from modules import check_module",
                 f"dtype = torch.float64",
                 "",
                 "class Net(nn.Module):",
                 "    def __init__(self):",
                 "        super().__init__()"]
        lines += [f"        {line}" for line in self.init]
        lines += ["", f"    def forward({names}):"]
        lines += [f"        {line}" for line in self.forward]
        ex_args, ex_kwargs = self._call(self.example_rows)
        args, kwargs = self._call(self.rows)
        lines += [
            "",
            f"torch.manual_seed({self.seed})",
            "model = Net()",
            "ref = copy.deepcopy(model)",
            f"g = torch.Generator().manual_seed({self.seed})",
            f"pipe = gpipe.pipeline(model, {self.split_points!r}, {ex_args}, {ex_kwargs}, "
            f"{self._pipe_args()})",
            f"args = {args}",
            f"kwargs = {kwargs}",
        ]
        if self.step:
            targets = [f"torch.randn({self.rows}, {w}, dtype=dtype, generator=g)"
                       for w in self.outputs]
            lines += [f"target = ({''.join(t + ', ' for t in targets)})",
                      f"mismatches = check_module(pipe, ref, model, args, kwargs, "
                      f"target=target, pre_grad={self.pre_grad}, tol={TOL['float64']}, "
                      f"seed={self.seed})"]
        else:
            lines.append(f"mismatches = check_module(pipe, ref, model, args, kwargs, "
                         f"backward={self.backward!r}, no_grad={self.no_grad}, "
                         f"pre_grad={self.pre_grad}, tol={TOL['float64']}, seed={self.seed})")
        return "\n".join(lines) + "\n"

    def snippet(self) -> str:
        return ("import copy, sys\nimport torch\nfrom torch import nn\nimport gpipe\n"
                "sys.path.insert(0, 'tests/fuzz')  # run from the repository root\n"
                "from layers import *  # the fuzzer's layers\n"
                + self.body() + "for m in mismatches:\n    print(f'[{m.category}] {m.detail}')\n")


# -- drawing ---------------------------------------------------------------------------------

class _Builder:
    """The module's source as it is drawn: __init__ and forward lines, the values a later
    operation may use again (name, width, block index that made it; -1 for an input)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.init: List[str] = []
        self.forward: List[str] = []
        self.blocks: List[str] = []
        self.ops: List[str] = []
        self.values: List[Tuple[str, int, int]] = []
        self.linears: List[Tuple[int, int, int]] = []  # (block, in, out) of trainable Linears
        self.ties: List[Tuple[int, int, bool]] = []     # (source block, user block, in slot)
        self.edges: List[Tuple[int, int]] = []          # (source block, user slot)
        self.temps = 0

    def temp(self) -> str:
        self.temps += 1
        return f"t{self.temps}"


def _block(b: _Builder, i: int, h: str, d: int) -> Tuple[str, int]:
    """Block ``b{i}`` applied to ``h`` (``d`` wide): its __init__ and forward lines; returns
    the output's name and width."""
    rng = b.rng
    w = rng.randint(1, 6)
    same_in = [(k, a, o) for k, a, o in b.linears if a == d]
    either = [(k, a, o) for k, a, o in b.linears if d in (a, o)]
    menu = {"linear": 14, "act": 8, "layernorm": 4, "mlp": 6, "external": 3, "closure": 1.5,
            "buffer": 2, "split": 3, "dropout": 2.5, "tied-linear": 5 if same_in else 0,
            "tied-module": 4 if either else 0}
    kind = rng.choices(list(menu), weights=list(menu.values()))[0]
    name, out = f"b{i}", f"h{i}"
    ctor, width = "", d
    if kind == "linear":
        bias = "" if rng.random() < 0.8 else ", bias=False"
        ctor, width = f"nn.Linear({d}, {w}{bias}, dtype=dtype)", w
        frozen = rng.random() < 0.1
        if not frozen:
            b.linears.append((i, d, w))
    elif kind == "act":
        ctor = rng.choice(("nn.Tanh()", "nn.GELU()", "nn.ReLU()", "nn.Identity()", "nn.SiLU()"))
        frozen = False
    elif kind == "layernorm":
        ctor, frozen = f"nn.LayerNorm({d}, dtype=dtype)", rng.random() < 0.15
    elif kind == "mlp":
        m = rng.randint(1, 6)
        ctor = (f"nn.Sequential(nn.Linear({d}, {m}, dtype=dtype), nn.Tanh(), "
                f"nn.Linear({m}, {w}, dtype=dtype))")
        width, frozen = w, False
    elif kind in ("external", "closure"):
        cls = "ExternalMatmul" if kind == "external" else "ClosureMatmul"
        ctor, width, frozen = f"{cls}({d}, {w}, dtype=dtype)", w, False
    elif kind == "dropout":  # the plain copy replays the pipe's masks (check_module)
        ctor, frozen = "MaskDropout(0.5)", False
    elif kind == "buffer":
        ctor, frozen = f"BufferScale({d}, dtype=dtype)", False
    elif kind == "split":
        ctor, frozen = f"Split({d}, dtype=dtype)", rng.random() < 0.1
    elif kind == "tied-linear":  # a Linear of its own (bias and all) whose weight is another's
        k, a, o = rng.choice(same_in)
        ctor, width, frozen = f"nn.Linear({a}, {o}, dtype=dtype)", o, False
        b.ties.append((k, i, False))
    else:  # TiedLinear: uses another block's weight from inside a submodule
        k, a, o = rng.choice(either)
        transpose = d == o and (d != a or rng.random() < 0.5)
        ctor, width, frozen = f"TiedLinear(self.b{k}, transpose={transpose})", (
            a if transpose else o), False
        b.ties.append((k, i, False))
    b.init.append(f"self.{name} = {ctor}")
    if kind == "tied-linear":
        b.init.append(f"self.{name}.weight = self.b{k}.weight")
    if frozen:
        b.init.append(f"self.{name}.requires_grad_(False)")
    b.blocks.append(f"{name}={kind}{'/frozen' if frozen else ''}")
    if kind == "split":  # a tuple: the chain goes on with the first, the second waits
        b.forward.append(f"{out}, g{i} = self.{name}({h})")
        b.values.append((f"g{i}", d, i))
    else:
        b.forward.append(f"{out} = self.{name}({h})")
    return out, width


def _op(b: _Builder, i: int, h: str, d: int,
        scale: Optional[ModuleInput]) -> Tuple[str, int]:
    """One operation in front of block ``b{i}`` on ``h`` (``d`` wide), in the forward
    itself: an edge from an earlier value, a tie, the keyword tensor, a size read."""
    rng = b.rng
    earlier = [v for v in b.values if v[0] != h]
    menu = {"edge": 10 if earlier else 0, "tie": 5 if b.linears else 0,
            "scale": 4 if scale is not None else 0, "size": 1.5 if earlier else 0}
    kind = rng.choices(list(menu), weights=list(menu.values()))[0]
    t = b.temp()
    if kind == "edge":
        # Leaning early: an older value crosses more stages.
        src, ds, made = min(rng.choice(earlier), rng.choice(earlier), key=earlier.index)
        how = rng.choices(["add", "cat", "mul"], weights=[5, 3, 2])[0]
        if how == "add" and ds == d and rng.random() < 0.5:
            b.forward.append(f"{t} = {h} + {src}")
        elif how == "add":
            b.init.append(f"self.e{i}_{b.temps} = nn.Linear({ds}, {d}, dtype=dtype)")
            b.forward.append(f"{t} = {h} + self.e{i}_{b.temps}({src})")
        elif how == "cat":
            b.forward.append(f"{t} = torch.cat([{h}, {src}], 1)")
            d += ds
        else:
            b.forward.append(f"{t} = {h} * torch.tanh({src}).sum(1, keepdim=True)")
        b.ops.append(f"{how}:{src}>{i}")
        b.edges.append((made, i))
        return t, d
    if kind == "tie":
        # Leaning early: the weight's two uses lie further apart, often in other stages.
        k, a, o = min(rng.choice(b.linears), rng.choice(b.linears))
        if d not in (a, o):  # an adapter first, so that the weight fits
            b.init.append(f"self.a{i}_{b.temps} = nn.Linear({d}, {a}, dtype=dtype)")
            b.forward.append(f"{t} = self.a{i}_{b.temps}({h})")
            h, d, t = t, a, b.temp()
        how = rng.choice(["linear", "matmul", "call"]) if d == a else "matmul"
        if how == "linear":  # F.linear on another block's weight (its bias too, or not)
            bias = f", self.b{k}.bias" if rng.random() < 0.5 else ""
            b.forward.append(f"{t} = F.linear({h}, self.b{k}.weight{bias})")
            d = o
        elif how == "call":  # the whole Linear called again: a submodule used twice
            b.forward.append(f"{t} = self.b{k}({h})")
            d = o
        elif d == o:
            b.forward.append(f"{t} = {h} @ self.b{k}.weight")
            d = a
        else:
            b.forward.append(f"{t} = {h} @ self.b{k}.weight.t()")
            d = o
        b.ops.append(f"tie-{how}:b{k}>{i}")
        b.ties.append((k, i, True))
        return t, d
    if kind == "scale":
        assert scale is not None
        if scale.width == 0:  # the first use decides its width
            scale.width = d
        if scale.width == d and rng.random() < 0.7:
            b.forward.append(f"{t} = {h} * {scale.name}")
        else:
            b.forward.append(f"{t} = {h} + torch.tanh({scale.name}).sum()")
        b.ops.append(f"{scale.name}>{i}")
        return t, d
    src = rng.choice(earlier)[0]
    b.forward.append(f"{t} = {h}.reshape({src}.size(0), -1)")
    b.ops.append(f"size:{src}>{i}")
    return t, d


def generate_module(seed: int) -> ModuleConfig:
    """The module configuration of ``seed`` (see the module docstring)."""
    rng = random.Random(f"module config {seed}")
    b = _Builder(rng)
    d = rng.randint(1, 6)
    inputs = [ModuleInput("x", d, rng.random() < 0.6)]
    b.values.append(("x", d, -1))
    n = rng.randint(4, 9)
    late: Optional[ModuleInput] = None
    if rng.random() < 0.3:  # a second batch input, used first in a later block
        late = ModuleInput("y", rng.randint(1, 6), rng.random() < 0.5,
                           keyword=rng.random() < 0.3)  # pipe(x, y=y)
        inputs.append(late)
        late_at = rng.randint(1, n - 1)
    scale: Optional[ModuleInput] = None
    if rng.random() < 0.35:  # a keyword tensor not cut by batch (batch_dim None)
        scale = ModuleInput("scale", 0, rng.random() < 0.6, cut=False, keyword=True)
        inputs.append(scale)
    h = "x"
    for i in range(n):
        if late is not None and i == late_at:
            t = b.temp()
            if rng.random() < 0.5:
                b.init.append(f"self.p{i} = nn.Linear({late.width}, {d}, dtype=dtype)")
                b.forward.append(f"{t} = {h} + self.p{i}(y)")
            else:
                b.forward.append(f"{t} = torch.cat([{h}, y], 1)")
                d += late.width
            b.ops.append(f"y>{i}")
            b.edges.append((-1, i))
            h = t
            b.values.append(("y", late.width, -1))
        while i > 0 and rng.random() < 0.45:
            h, d = _op(b, i, h, d, scale)
        h, d = _block(b, i, h, d)
        b.values.append((h, d, i))
    if scale is not None and scale.width == 0:  # drawn but never used: use it at the end
        scale.width = d
        t = b.temp()
        b.forward.append(f"{t} = {h} * scale")
        b.ops.append(f"scale>{n}")
        h = t
    # The outputs: the last value, maybe with an earlier one, as a tuple or a dict.
    shape = rng.choices(["tensor", "tuple", "dict", "none", "list"], weights=[6, 2, 2, 1, 1])[0]
    mid, dm, made = rng.choice(b.values[:-1])
    outputs = [d] if shape in ("tensor", "none") else [d, dm]
    if shape == "tensor":
        b.forward.append(f"return {h}")
    elif shape == "none":
        b.forward.append(f"return {h}, None")
    elif shape in ("tuple", "list"):
        b.forward.append(f"return {h}, {mid}" if shape == "tuple" else f"return [{h}, {mid}]")
        b.edges.append((made, n))
    else:
        b.forward.append(f"return {{'out': {h}, 'mid': {mid}}}")
        b.edges.append((made, n))

    # The cut: 1 to 3 blocks begin stages (sometimes inside a small MLP, at its last Linear).
    k = rng.randint(1, min(3, n - 1))
    starts = sorted(rng.sample(range(1, n), k))
    split_points = []
    for s in starts:
        inside = f"b{s}=mlp" in b.blocks and rng.random() < 0.3
        split_points.append(f"b{s}.2" if inside else f"b{s}")
    rng.shuffle(split_points)  # their order does not matter: the forward's does
    stages = k + 1

    def stage(i: int, slot: bool = False) -> int:
        """The stage of block i (slot: of the operations in front of it)."""
        return sum(s <= i - slot for s in starts) if i >= 0 else 0

    edge_spans = [stage(i, True) - stage(j) for j, i in b.edges]
    tie_spans = [abs(stage(u, slot) - stage(src)) for src, u, slot in b.ties]

    cfg = ModuleConfig(seed=seed, init=b.init, forward=b.forward, inputs=inputs,
                       outputs=outputs, blocks=b.blocks, ops=b.ops, split_points=split_points,
                       stages=stages, chunks=rng.randint(1, 4), checkpoint=rng.choice(MODES),
                       rows=rng.randint(1, 8), example_rows=rng.randint(1, 3),
                       edge_spans=edge_spans, tie_spans=tie_spans)
    if rng.random() < 0.15:
        cfg.checkpoint = [rng.choice(MODES) for _ in range(stages)]
    grads = any(s.requires_grad for s in inputs)
    cfg.backward = rng.choices(["backward", "grad_params", "grad_inputs"],
                               weights=[6, 2, 2 if grads else 0])[0]
    cfg.pre_grad = rng.random() < 0.25
    cfg.no_grad = rng.random() < 0.08
    if rng.random() < 0.35:  # train_step under a schedule
        cfg.step, cfg.no_grad, cfg.backward = rng.choice(SCHEDULES), False, "backward"
        divisors = [v for v in (2, 3) if stages % v == 0]
        if cfg.step == "interleaved_1f1b" and divisors and rng.random() < 0.75:
            cfg.virtual_stages = rng.choice(divisors)
    cfg.features = module_features(cfg)
    return cfg


def module_features(cfg: ModuleConfig) -> List[str]:
    """Names --with / --without know: 'pipeline' (every module configuration), the block
    kinds ('linear', 'mlp', ..., 'tied-linear', 'tied-module'), the operations ('edge-add',
    'edge-cat', 'edge-mul', 'tie-linear', 'tie-matmul', 'tie-call', 'size'), 'edge-crossing'
    (an edge crosses a stage boundary), 'tie-crossing' (a weight used in two stages),
    'second-input', 'shared-kwarg' (the keyword tensor not cut), 'tuple-output',
    'dict-output', 'list-output', 'split-inside' (a split point inside a block), 'dropout'
    (MaskDropout blocks, their masks replayed by the plain copy), the checkpoint mode(s),
    'pre_grad', 'no_grad', the backward mode or 'train_step' with its schedule and
    'virtual_stages'."""
    found = {"pipeline"} | {s.split("=")[1].split("/")[0] for s in cfg.blocks}
    found |= {"frozen"} if any(s.endswith("/frozen") for s in cfg.blocks) else set()
    for op in cfg.ops:  # 'add:h1>3', 'tie-linear:b1>4', 'size:h0>2'; 'y>2', 'scale>3'
        kind = op.split(":")[0]
        if ">" not in kind:
            found.add({"add": "edge-add", "cat": "edge-cat", "mul": "edge-mul"}.get(kind, kind))
    found |= {"edge-crossing"} if any(cfg.edge_spans) else set()
    found |= {"tie-crossing"} if any(cfg.tie_spans) else set()
    found |= {"second-input"} if any(s.name == "y" for s in cfg.inputs) else set()
    found |= {"shared-kwarg"} if any(not s.cut for s in cfg.inputs) else set()
    last = cfg.forward[-1]
    found |= ({"dict-output"} if "{" in last else {"list-output"} if "[" in last
              else {"tuple-output"} if "," in last else set())
    found |= {"split-inside"} if any("." in s for s in cfg.split_points) else set()
    modes = cfg.checkpoint if isinstance(cfg.checkpoint, list) else [cfg.checkpoint]
    found |= set(modes)
    found |= {"train_step", cfg.step} if cfg.step else {cfg.backward}
    found |= {"virtual_stages"} if cfg.virtual_stages > 1 else set()
    found |= {"pre_grad"} if cfg.pre_grad else set()
    found |= {"no_grad"} if cfg.no_grad else set()
    return sorted(found)


# -- checking --------------------------------------------------------------------------------

def module_targets(model: nn.Module) -> Dict[str, Tensor]:
    """Every tensor whose .grad a run may fill: parameters (a tied one once), buffers that
    require grad, and the fuzzer's external tensors ('<submodule>.<attr>')."""
    targets = dict(model.named_parameters())
    targets.update((n, b) for n, b in model.named_buffers() if b.requires_grad)
    for name, m in model.named_modules():
        for attr, t in getattr(m, "fuzz_externals", lambda: [])():
            targets[f"{name}.{attr}"] = t
    return targets


def _floats(out: Any) -> List[Tensor]:
    return [o for o in pytree.tree_leaves(out) if isinstance(o, Tensor) and o.is_floating_point()]


def module_loss(out: Any, target: Tuple[Tensor, ...]) -> Tensor:
    """train_step's loss_fn: sum(output * target) over the float outputs (pytree order),
    divided by the micro-batch's rows (a mean over rows)."""
    terms = [(o * t).sum() for o, t in zip(_floats(out), target)]
    return torch.stack(terms).sum() / target[0].shape[0]


class _Run:
    """One side's run: its own input leaves, output, error, returned grads, .grads."""

    def __init__(self, model: nn.Module, targets: Dict[str, Tensor], args: Tuple[Any, ...],
                 kwargs: Dict[str, Any]) -> None:
        self.model, self.targets = model, targets
        self.args = tuple(_leaf_copy(a) for a in args)
        self.kwargs = {k: _leaf_copy(v) for k, v in kwargs.items()}
        self.out: Any = None
        self.loss: Optional[Tensor] = None
        self.error: Optional[BaseException] = None
        self.returned: Dict[str, Tensor] = {}
        self.grads: Dict[str, Optional[Tensor]] = {}

    def pool(self) -> Dict[str, Tensor]:
        inputs = {f"input.{i}": a for i, a in enumerate(self.args)}
        inputs.update((f"input.{k}", v) for k, v in self.kwargs.items())
        return {**inputs, **self.targets}

    def reset(self, initial: Dict[str, Optional[Tensor]]) -> None:
        for n, t in self.targets.items():  # a shared closure W holds the other side's grad
            t.grad = _clone(initial[n])

    def forward(self, no_grad: bool) -> None:
        with torch.set_grad_enabled(not no_grad):
            self.out, self.error = _attempt(lambda: self.model(*self.args, **self.kwargs))

    def backward(self, weights: List[Tensor], mode: str, names: List[str],
                 initial: Dict[str, Optional[Tensor]]) -> None:
        self.reset(initial)

        def run() -> Dict[str, Tensor]:
            loss = torch.stack([(o * w).sum() for o, w in zip(_floats(self.out), weights)]).sum()
            if mode == "backward":
                loss.backward()
                return {}
            pool = self.pool()
            # allow_unused: a parameter the outputs do not depend on (None on both sides).
            return dict(zip(names, torch.autograd.grad(loss, [pool[n] for n in names],
                                                       allow_unused=True)))

        self.returned, self.error = _attempt(run)
        self.grads = {n: _clone(t.grad) for n, t in self.pool().items()}

    def train_step(self, target: Tuple[Tensor, ...], initial: Dict[str, Optional[Tensor]],
                   plain: bool) -> None:
        self.reset(initial)

        def pipe() -> Tensor:
            return self.model.train_step(self.args, target, module_loss, kwargs=self.kwargs)

        def ref() -> Tensor:
            loss = module_loss(self.model(*self.args, **self.kwargs), target)
            loss.backward()
            return loss.detach()

        with torch.enable_grad():
            self.loss, self.error = _attempt(ref if plain else pipe)
        self.grads = {n: _clone(t.grad) for n, t in self.pool().items()}

    def record(self) -> Dict[str, Optional[Tensor]]:
        found: Dict[str, Optional[Tensor]] = {f"output {k}": o for k, o in
                                              enumerate(pytree.tree_leaves(self.out))
                                              if isinstance(o, Tensor)}
        if self.loss is not None:
            found["train_step's loss"] = self.loss
        found.update((f"autograd.grad for {n}", t) for n, t in self.returned.items())
        found.update((f"{n}.grad", g) for n, g in self.grads.items())
        return found


def _grads(p: _Run, r: _Run, mode: str, tol: float) -> List[Mismatch]:
    found = []
    for n, w in r.returned.items():
        got = p.returned.get(n)
        if w is None or got is None:
            if (w is None) != (got is None):
                found.append(Mismatch("grad", f"autograd.grad for {n}: "
                                              f"{'None' if got is None else 'set'}, the "
                                              f"module's {'None' if w is None else 'set'}",
                                      "grad:returned"))
            continue
        d = _diff(got, w, tol, "the module")
        if d:
            found.append(Mismatch("grad", f"autograd.grad for {n}: {d}", "grad:returned"))
    for n, want in r.grads.items():
        got = p.grads[n]
        category = "grad" if mode == "backward" else "side-effect"
        if want is None or got is None:
            if (want is None) != (got is None):
                found.append(Mismatch(category if want is None else "grad",
                                      f"{n}.grad: {'set' if got is not None else 'None'}, the "
                                      f"module's {'set' if want is not None else 'None'}",
                                      f"grad:{'fills' if want is None else 'missing'}"))
            continue
        d = _diff(got, want, tol, "the module")
        if d:
            found.append(Mismatch(category, f"{n}.grad: {d}", f"{category}:value"))
    return found


def _outputs(got: Any, want: Any, tol: float, no_grad: bool) -> List[Mismatch]:
    g_leaves, g_spec = pytree.tree_flatten(got)
    w_leaves, w_spec = pytree.tree_flatten(want)
    if g_spec != w_spec:
        return [Mismatch("output", f"the pipe returns {g_spec}, the module {w_spec}",
                         "output:structure")]
    found = []
    for k, (g, w) in enumerate(zip(g_leaves, w_leaves)):
        if not isinstance(w, Tensor) or not isinstance(g, Tensor):
            if type(g) is not type(w) or (not isinstance(w, Tensor) and g != w):
                found.append(Mismatch("output", f"output {k}: {g!r}, the module's {w!r}",
                                      "output:structure"))
            continue
        d = _diff(g, w, tol, "the module")
        if d:
            found.append(Mismatch("output", f"output {k}: {d}", "output:value"))
        if not no_grad and g.requires_grad != w.requires_grad:
            found.append(Mismatch("requires_grad", f"output {k}: requires_grad "
                                                   f"{g.requires_grad}, the module's "
                                                   f"{w.requires_grad}",
                                  f"requires_grad:pipe={g.requires_grad}"))
    return found


def check_module(pipe: nn.Module, ref: nn.Module, model: nn.Module, args: Tuple[Any, ...],
                 kwargs: Dict[str, Any], *, backward: str = "backward", no_grad: bool = False,
                 pre_grad: bool = False, tol: float = 1e-10, seed: int = 0,
                 target: Optional[Tuple[Tensor, ...]] = None, repeat: bool = True) -> Findings:
    """``pipe`` (gpipe.pipeline of ``model``) against ``ref`` (a deep copy of ``model`` made
    before): forward and backward as ``backward`` says, or with a ``target``
    ``pipe.train_step`` against the plain step; lists every difference. The grads are read
    off ``model``'s own parameters, which the pipe must use (not copies). ``repeat``: then
    the pipe's run again from the same state, which must give bitwise the same."""
    findings = Findings()
    for m in model.modules():  # gpipe.pipeline ran the graph once on the examples (documented)
        if isinstance(m, MaskDropout):
            m.log = []
    targets, ref_targets = module_targets(model), module_targets(ref)
    if list(targets) != list(ref_targets):
        findings.append(Mismatch("harness", f"targets differ: {list(targets)} vs "
                                            f"{list(ref_targets)}"))
        return findings
    mine = {id(t) for t in model.parameters()}
    held = {id(t) for t in pipe.parameters()}
    if mine != held:
        findings.append(Mismatch("grad", f"the pipe holds {len(held - mine)} parameters that "
                                         f"are not the module's and misses {len(mine - held)}",
                                 "grad:parameters"))
    if list(pipe.state_dict()) != list(model.state_dict()):
        findings.append(Mismatch("output", f"state_dict keys {list(pipe.state_dict())} are not "
                                           f"the module's {list(model.state_dict())}",
                                 "output:state_dict"))
    rng = torch.Generator().manual_seed(seed)
    if pre_grad:  # existing grads: backward must add to them, autograd.grad leave them
        for name, t in ref_targets.items():
            if t.requires_grad:
                g = torch.randn(t.shape, generator=rng, dtype=t.dtype)
                t.grad, targets[name].grad = g.clone(), g.clone()
    initial = {n: _clone(t.grad) for n, t in targets.items()}
    state = torch.get_rng_state()
    p = _Run(pipe, targets, args, kwargs)
    r = _Run(ref, ref_targets, args, kwargs)
    calls: List[Tuple[str, Tuple[Any, ...]]] = []
    if target is not None:
        p.train_step(target, initial, plain=False)
        calls.append(("train_step", (target, initial, False)))
        _replay_dropout(model, ref)
        r.train_step(target, initial, plain=True)
        findings += _exceptions("train_step", p, r)
        if p.error is None and r.error is None:
            if not isinstance(p.loss, Tensor):
                findings.append(Mismatch("output", f"train_step returned "
                                                   f"{type(p.loss).__name__}", "output:loss"))
            else:
                d = _diff(p.loss, r.loss, tol, "the module")
                if d:
                    findings.append(Mismatch("output", f"train_step's loss: {d}", "output:loss"))
                if p.loss.requires_grad:
                    findings.append(Mismatch("requires_grad", "train_step's loss is not "
                                                              "detached", "requires_grad:loss"))
                findings += _grads(p, r, "backward", tol)
    else:
        p.forward(no_grad)
        calls.append(("forward", (no_grad,)))
        _replay_dropout(model, ref)
        r.forward(no_grad)
        findings += _exceptions("forward", p, r)
        ran = p.error is None and r.error is None
        outputs = _outputs(p.out, r.out, tol, no_grad) if ran else []
        findings += outputs
        floats = _floats(r.out) if ran else []
        if (ran and not outputs and not no_grad
                and any(o.requires_grad for o in floats)):
            weights = [torch.randn(o.shape, generator=rng, dtype=o.dtype) for o in floats]
            wanting = [n for n, t in r.pool().items() if t.requires_grad]
            names = [n for n in wanting if n.startswith("input.") == (backward == "grad_inputs")]
            mode = backward if names else "backward"
            p.backward(weights, mode, names, initial)
            calls.append(("backward", (weights, mode, names, initial)))
            r.backward(weights, mode, names, initial)
            findings += _exceptions(f"backward ({mode})", p, r)
            if p.error is None and r.error is None:
                findings += _grads(p, r, mode, tol)
    if repeat and p.error is None:
        findings += _repeat(model, pipe, targets, args, kwargs, p, calls, state, findings)
    return findings


def _replay_dropout(model: nn.Module, ref: nn.Module) -> None:
    """Hands the masks the pipe's dropout drew (its first forwards, micro-batch order) to the
    same-named dropout of the plain copy, which replays them for the whole batch."""
    for name, m in model.named_modules():
        if isinstance(m, MaskDropout):
            ref.get_submodule(name).replay = torch.cat(m.log) if m.log else None
            m.log = []


def _exceptions(phase: str, p: _Run, r: _Run) -> List[Mismatch]:
    if type(p.error) is type(r.error):
        return []
    name = lambda e: type(e).__name__ if e is not None else None  # noqa: E731
    detail = (f"the pipe raised {_describe(p.error) if p.error else None}; the module "
              f"{_describe(r.error) if r.error else None}")
    return [Mismatch("exception", f"{phase}: {detail}",
                     f"exception:{phase.split()[0]}:pipe={name(p.error)}:plain={name(r.error)}")]


def _repeat(model: nn.Module, pipe: nn.Module, targets: Dict[str, Tensor],
            args: Tuple[Any, ...], kwargs: Dict[str, Any], first: _Run,
            calls: List[Tuple[str, Tuple[Any, ...]]], state: Tensor,
            findings: Findings) -> List[Mismatch]:
    """The pipe's calls again on fresh input leaves, the default generator at ``state``:
    bitwise the same outputs, loss, returned grads and .grads (dropout masks, and grad sums
    in a fixed order)."""
    again = _Run(pipe, targets, args, kwargs)
    drawing = [m for m in model.modules() if isinstance(m, MaskDropout)]
    before = sum(m.drawn for m in drawing)
    torch.set_rng_state(state)
    for name, call in calls:
        if name == "forward":
            again.forward(*call)
        elif name == "backward":
            again.backward(*call)
        else:
            again.train_step(*call)
        if again.error is not None:
            break
    for m in drawing:
        m.log = []
    findings.repeated, findings.drew = True, sum(m.drawn for m in drawing) > before
    if type(again.error) is not type(first.error):
        return [Mismatch("reproducibility", f"run again, the pipe raised "
                                            f"{_describe(again.error) if again.error else None}",
                         "reproducibility:exception")]
    want, got = first.record(), again.record()
    found = []
    for name in dict.fromkeys(list(want) + list(got)):
        d = _bitwise(got.get(name), want.get(name))
        if d:
            what = "grad" if "grad" in name else "output"
            found.append(Mismatch("reproducibility", f"run again: {name}: {d}",
                                  f"reproducibility:{what}"))
    return found

