"""configs.py — random configurations: drawn per seed, printed as reproductions, shrunk.

A configuration is a random ``nn.Sequential`` (Linear, Conv1d, activations
incl. in-place ReLU, dropout, LayerNorm, layers taking/returning tuples,
parameterless and frozen layers, the tensors of :mod:`layers` that require
grad without being parameters of their layer) and how it runs: a balance over
1..4 CPU stages, 1..6 chunks (incl. more than rows), checkpoint mode, float64
or float32, one tensor or a tuple of inputs that require grad or not,
train/eval, ``torch.no_grad()``, and how gradients are asked for
(``loss.backward()``, ``torch.autograd.grad`` of the inputs or of the
parameters, ``backward(inputs=...)``), and the Pipe's ``batch_dim`` /
``output_batch_dim`` (inputs and outputs with the batch at dim 1, an input not
cut, an output not joined: :func:`_batch_dims`). About a third of the
configurations run the whole training step inside the pipeline instead
(``pipe.train_step(x, target, loss_fn)`` under one of the four schedules,
``'interleaved_1f1b'`` also with 2 or 3 virtual stages per device:
:func:`_train_step`). About a quarter carry skip connections (``gpipe.skip``
stash/pop pairs at random places, relays, None skips, namespaces:
:func:`_skips`); half of those run over as many stages as the fuzzer uses
(:func:`_skip_balance`), so skips cross 1 to K-1 stage boundaries. About a seventh carry a Linear's
weight tied into a later stage (:func:`_ties`: a pair of ``TiedLinear`` layers,
and a stage boundary moved between the Linear and them), so one leaf gets
grads from two stages. :meth:`Config.body` is the Python that builds it and
calls :func:`compare.check`; :func:`shrink` simplifies a failing one while the
same kind of mismatch remains (keeping its schedule; a skip's stash, relays and
pop go together, so every smaller model stays valid).

About a fifth of the seeds draw a plain ``nn.Module`` for ``gpipe.pipeline`` instead
(:mod:`modules`; :func:`generate` hands them over, :func:`shrink` leaves them as drawn).

Each option added since the first version (the batch dim variants, train_step,
skips, ties
across stages) is drawn from its own generator, seeded by the seed and the option's name, so
the configurations of existing seeds stay as they were: a seed that draws no
variant and no train_step runs exactly the model and configuration it ran
before.
"""
import random
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Iterable, List, Optional, Tuple

from compare import TOL, Hang, Mismatch, run_config
from modules import ModuleConfig, draws_module, generate_module

MODES = ("always", "except_last", "never")
BACKWARDS = ("backward", "grad_inputs", "grad_params", "backward_inputs", "backward_subset")
#: train_step's schedules (gpipe.Pipe's ``schedule``).
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")
#: What a train_step configuration runs: a schedule above, zb_v (drawn in place of some
#: zb_h1) or a random table (a gpipe.Schedule, drawn in place of any).
STEP_KINDS = SCHEDULES + ("zb_v", "table")
#: The share of configurations whose outputs are joined along dim 0 (about 4 in 5) run with
#: train_step (about a third of all), and of the interleaved ones with 2 or 3 virtual stages.
STEP_ODDS, VIRTUAL_ODDS = 0.44, 0.6
#: The share of train_step configurations that run a random table (a gpipe.Schedule) instead
#: of their built-in schedule, and of configurations of several stages given one checkpoint
#: mode per stage.
TABLE_ODDS, STAGE_MODES_ODDS = 0.3, 0.25
#: The share of configurations whose float inputs are views at an odd offset (kernels may give
#: other last bits on data at another alignment: a copy must not change what a cell computes).
OFFSET_ODDS = 0.3


@dataclass
class LayerSpec:
    kind: str                 # feature name, e.g. 'linear', 'inplace', 'closure'
    src: str                  # Python expression; {ref} is the index of a referenced layer
    sig_in: Tuple[Any, ...]   # ('flat', d) / ('seq', c, l) / ('pair', d1, d2) / ('masked', d)
    sig_out: Tuple[Any, ...]
    ref: Optional[int] = None
    frozen: bool = False
    dims: Tuple[int, ...] = ()  # (in, out) of a Linear, for TiedLinear
    #: The skips (by pair id, see :func:`_skips`) this layer stashes and pops.
    stashes: Tuple[int, ...] = ()
    pops: Tuple[int, ...] = ()

    def expr(self) -> str:
        e = self.src.replace("{ref}", str(self.ref))
        return e + ".requires_grad_(False)" if self.frozen else e

    def short(self) -> str:
        e = self.src.replace("layers[{ref}]", f"#{self.ref}").replace(", dtype=dtype", "")
        e = e.replace("dtype=dtype", "").replace("nn.", "").replace(".isolate(", "@(")
        return e + "/frozen" if self.frozen else e


@dataclass
class InputSpec:
    kind: str                 # 'float', 'mask' (an int64 0/1 vector) or 'table' (not cut)
    features: Tuple[int, ...]
    requires_grad: bool = False
    batch_at: int = 0         # where the rows lie in the tensor given (its batch_dim entry)

    def shape(self, rows: int) -> Tuple[int, ...]:
        if self.kind == "table":
            return self.features
        return self.features[:self.batch_at] + (rows,) + self.features[self.batch_at:]

    def expr(self, rows: int, offset: bool = False) -> str:
        """The input's expression; ``offset``: a float input is a slice of one more row, from
        its second row on (a view at an odd offset, as a slice of a dataset is)."""
        if self.kind == "mask":
            return f"torch.randint(0, 2, ({rows},), generator=g)"
        if offset and self.kind == "float":
            shape = ", ".join(map(str, self.shape(rows + 1)))
            return (f"torch.randn({shape}, dtype=dtype, generator=g)"
                    f".narrow({self.batch_at}, 1, {rows}).requires_grad_({self.requires_grad})")
        shape = ", ".join(map(str, self.shape(rows)))
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
    #: The Pipe's batch_dim and output_batch_dim (None: not passed, the default).
    batch_dim: Any = 0
    output_batch_dim: Any = None
    #: None: forward, then backward as ``backward`` says; a schedule name: the Pipe is built
    #: with that schedule and runs ``pipe.train_step`` (see :func:`_train_step`).
    step: Optional[str] = None
    #: Stages per device (interleaved_1f1b): ``len(balance) // virtual_stages`` devices.
    virtual_stages: int = 1
    #: How many gpipe.skip Namespaces the skip layers isolate into (``ns[i]`` in the body).
    namespaces: int = 0
    #: With step 'table': the table's stages lie in a 'loop' or, two per device, in a 'v'
    #: (the table itself is drawn from the seed by :func:`random_table`, for the stages,
    #: devices and micro-batches the configuration has).
    table: str = ""
    #: Whether the Pipe gets one checkpoint mode per stage (drawn from the seed by
    #: :func:`stage_modes`) instead of ``checkpoint``.
    stage_modes: bool = False
    #: Whether the float inputs are views at an odd offset (:meth:`InputSpec.expr`).
    offset_inputs: bool = False

    def summary(self) -> str:
        inputs = ", ".join(("mask" if s.kind == "mask" else
                            f"{s.shape(self.rows)}{'+grad' if s.requires_grad else ''}")
                           for s in self.inputs)
        return (f"layers=[{', '.join(s.short() for s in self.layers)}] balance={self.balance} "
                f"chunks={self.chunks} checkpoint={self.checkpoint_arg()} dtype={self.dtype} "
                f"inputs=({inputs}){self._dims_args()} {'train' if self.training else 'eval'}"
                f"{' no_grad' if self.no_grad else ''} "
                f"{f'train_step={self.step}' if self.step else f'backward={self.backward}'}"
                f"{f'({self.table})' if self.table else ''}"
                f"{f' virtual_stages={self.virtual_stages}' if self.virtual_stages > 1 else ''}"
                f"{' pre_grad' if self.pre_grad else ''}")

    def workers(self) -> int:
        """Devices of the Pipe: one per stage, or per ``virtual_stages`` stages."""
        return len(self.balance) // self.virtual_stages

    def microbatches(self) -> int:
        """The micro-batches the Pipe cuts the batch into (a table is laid out for them)."""
        return min(self.chunks, self.rows) if self.table else self.chunks

    def checkpoint_arg(self) -> Any:
        """The Pipe's ``checkpoint``: the mode, or one mode per stage."""
        return stage_modes(self.seed, len(self.balance)) if self.stage_modes else self.checkpoint

    def _step_args(self) -> str:
        """The Pipe's schedule arguments (none without train_step)."""
        if not self.step:
            return ""
        if self.table:
            rows = random_table(self.seed, len(self.balance), self.workers(),
                                self.microbatches(), self.table == "v" and
                                self.virtual_stages == 2)
            return f", schedule=gpipe.Schedule.from_rows({rows!r})"
        text = f", schedule={self.step!r}"
        return text + (f", virtual_stages={self.virtual_stages}" if self.virtual_stages > 1
                       else "")

    def target_expr(self) -> str:
        """train_step's target: one random weight per element of each float output (the
        outputs' rows at dim 0), drawn after the inputs; the loss (:func:`compare.step_loss`)
        is sum(output * target) over them, divided by the micro-batch's rows."""
        sig = self.layers[-1].sig_out
        shapes = {"flat": [sig[1:2]], "seq": [sig[1:3]], "pair": [sig[1:2], sig[2:3]],
                  "masked": [sig[1:2]]}[sig[0]]
        exprs = [f"torch.randn({', '.join(map(str, (self.rows,) + tuple(s)))}, dtype=dtype, "
                 f"generator=g)" for s in shapes]
        return exprs[0] if len(exprs) == 1 else f"({', '.join(exprs)})"

    def _dims_args(self) -> str:
        """The Pipe's batch dim arguments, as passed (none where the defaults are used)."""
        text = f", batch_dim={self.batch_dim!r}" if self.batch_dim != 0 else ""
        if self.output_batch_dim is not None:
            text += f", output_batch_dim={self.output_batch_dim!r}"
        return text

    def body(self) -> str:
        """The reproduction: builds model, Pipe and inputs, then runs :func:`check`."""
        lines = [f"dtype = torch.{self.dtype}", f"torch.manual_seed({self.seed})", "layers = []"]
        if self.namespaces:
            lines.insert(2, f"ns = [Namespace() for _ in range({self.namespaces})]")
        lines += [f"layers.append({s.expr()})  # {i}" for i, s in enumerate(self.layers)]
        k = self.workers()
        inputs = [s.expr(self.rows, self.offset_inputs) for s in self.inputs]
        lines += [
            "model = nn.Sequential(*layers)",
            "ref = copy.deepcopy(model)",
            f"pipe = gpipe.Pipe(model, balance={self.balance}, devices=['cpu'] * {k}, "
            f"chunks={self.microbatches()}, checkpoint={self.checkpoint_arg()!r}"
            f"{self._dims_args()}{self._step_args()})",
            f"g = torch.Generator().manual_seed({self.seed})",
            f"inputs = {inputs[0]}" if len(inputs) == 1 else f"inputs = ({', '.join(inputs)})",
        ]
        if self.step:  # pipe.train_step(inputs, target, step_loss) vs the plain model's
            lines += [f"target = {self.target_expr()}",
                      f"mismatches = check(pipe, ref, inputs, target=target, "
                      f"training={self.training}, pre_grad={self.pre_grad}, "
                      f"tol={TOL[self.dtype]}, seed={self.seed})"]
        else:
            lines.append(f"mismatches = check(pipe, ref, inputs, training={self.training}, "
                         f"no_grad={self.no_grad}, backward={self.backward!r}, "
                         f"pre_grad={self.pre_grad}, tol={TOL[self.dtype]}, seed={self.seed})")
        return "\n".join(lines) + "\n"

    def snippet(self) -> str:
        return ("import copy, sys\nimport torch\nfrom torch import nn\nimport gpipe\n"
                "sys.path.insert(0, 'tests/fuzz')  # run from the repository root\n"
                "from layers import *  # the fuzzer's layers\n"
                "from compare import check\n"
                + self.body() + "for m in mismatches:\n    print(f'[{m.category}] {m.detail}')\n"
                "if mismatches.reference:  # the plain model refused an in-place operation\n"
                "    print(f'vs the boundary-cloned model ({mismatches.reference})')\n")


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
    checkpoint modes; 'batch_dim' (the Pipe gets batch_dim or output_batch_dim), and the batch
    dim variants 'batch-second', 'batch-out', 'shared-input', 'tagged-output' (layer kinds);
    'train_step' with the schedule's name ('gpipe', '1f1b', 'interleaved_1f1b', 'zb_h1',
    'zb_v', or 'table': a random table given as a gpipe.Schedule) and 'virtual_stages' (more
    than one stage per device) in place of the backward mode; 'stage-modes' (one checkpoint
    mode per stage); 'offset-inputs' (float inputs are views at an odd offset); 'skips'
    (any skip connection, the layer kinds 'stash', 'pop', 'relay'), 'skip-crossing' (one
    crosses a stage boundary), 'skip-namespace' (isolated), 'skip-none' (a None skip);
    'tie-crossing' (a TiedLinear in another stage than its Linear)."""
    found = {s.kind for s in cfg.layers} | {cfg.checkpoint}
    found |= {"stage-modes"} if cfg.stage_modes else set()
    found |= {"offset-inputs"} if cfg.offset_inputs else set()
    found |= {"train_step", cfg.step} if cfg.step else {cfg.backward}
    found |= {"virtual_stages"} if cfg.virtual_stages > 1 else set()
    starts = {sum(cfg.balance[:j]) for j in range(len(cfg.balance))}
    found |= {"frozen"} if any(s.frozen for s in cfg.layers) else set()
    found |= {"inplace-first"} if any(cfg.layers[i].kind == "inplace" for i in starts) else set()
    found |= {"tuple-input"} if len(cfg.inputs) > 1 else set()
    found |= {"float32"} if cfg.dtype == "float32" else set()
    found |= {"eval"} if not cfg.training else set()
    found |= {"no_grad"} if cfg.no_grad else set()
    found |= {"pre_grad"} if cfg.pre_grad else set()
    found |= {"batch_dim"} if cfg.batch_dim != 0 or cfg.output_batch_dim is not None else set()
    spans = skip_spans(cfg)
    found |= {"skips"} if spans else set()
    found |= {"skip-crossing"} if any(spans.values()) else set()
    found |= {"skip-namespace"} if any(".isolate(" in s.src for s in cfg.layers) else set()
    found |= {"skip-none"} if any("'none'" in s.src for s in cfg.layers) else set()
    found |= {"tie-crossing"} if any(tie_spans(cfg)) else set()
    return sorted(found)


def tie_spans(cfg: Any) -> List[int]:
    """How many stage boundaries lie between each TiedLinear and the Linear it uses (in a
    module configuration: between each tie's two uses of the weight)."""
    if isinstance(cfg, ModuleConfig):
        return cfg.tie_spans
    stage = [j for j, b in enumerate(cfg.balance) for _ in range(b)]
    return [stage[i] - stage[s.ref] for i, s in enumerate(cfg.layers)
            if s.kind == "tied" and s.ref is not None]


def skip_spans(cfg: Config) -> Dict[int, int]:
    """How many stage boundaries each skip (by pair id) crosses: 0 within a stage."""
    stage = [j for j, b in enumerate(cfg.balance) for _ in range(b)]
    stashed = {p: stage[i] for i, s in enumerate(cfg.layers) for p in s.stashes}
    return {p: stage[i] - stashed[p] for i, s in enumerate(cfg.layers) for p in s.pops
            if p in stashed}


#: Batch dim variants (each drawn on its own): the batch at dim 1 of the inputs given, the
#: outputs' batch at dim 1 too (of batch-second ones), an input not cut, an output not joined.
BATCH_DIM_ODDS = {"batch-second": 0.15, "batch-out": 0.5, "shared-input": 0.12,
                  "tagged-output": 0.15}


def _batch_dims(seed: int, body: List[LayerSpec], inputs: List[InputSpec],
                sig: Tuple[Any, ...]) -> Tuple[List[LayerSpec], List[InputSpec], Any, Any]:
    """Wraps the drawn model for the Pipe's batch_dim / output_batch_dim: layers around
    ``body`` (whose output signature is ``sig``) that the plain model runs too, the inputs as
    given, and the two arguments (0 and None: the defaults, as without a variant).

    * batch-second: every float input comes with its rows at dim 1 (batch_dim 1, the mask's
      entry 0); a first MoveBatch moves them to dim 0, and (batch-out) a last one may move
      the float outputs' rows back to dim 1 (output_batch_dim 1).
    * shared-input: one more float input, not cut (batch_dim entry None), that WithTable
      uses whole in every micro-batch (its grad: summed over them).
    * tagged-output: a last Tagged returns one more output, a parameter's, that depends on
      no input (output_batch_dim entry None: micro-batch 0's)."""
    # Its own generator (seeded by a string: stable across runs): the drawn model is that of
    # earlier versions of the fuzzer, and configurations without a variant are unchanged.
    rng = random.Random(f"batch dims {seed}")
    second = rng.random() < BATCH_DIM_ODDS["batch-second"]
    moved_out = second and rng.random() < BATCH_DIM_ODDS["batch-out"]
    shared = rng.random() < BATCH_DIM_ODDS["shared-input"]
    tagged = sig[0] in ("flat", "seq") and rng.random() < BATCH_DIM_ODDS["tagged-output"]
    front: List[LayerSpec] = []
    tail: List[LayerSpec] = []
    inputs = [replace(s, batch_at=1 if second and s.kind == "float" else 0) for s in inputs]
    in_dims: List[Optional[int]] = [s.batch_at for s in inputs]
    first = inputs[0].features  # WithTable works on the first value, after MoveBatch
    if shared:
        how = rng.choice(["matmul", "matmul", "sum"])
        n = first[-1]
        table = (n, n) if how == "matmul" else (rng.randint(1, 3), rng.randint(1, 3))
        inputs.append(InputSpec("table", table, rng.random() < 0.6))
        in_dims.append(None)
    if second:
        src = tuple(in_dims)
        dst = tuple(None if d is None else 0 for d in in_dims)
        front.append(LayerSpec("batch-second", f"MoveBatch({src}, {dst})",
                               ("batch-second",) + sig, ("batch-first",)))
    if shared:
        front.append(LayerSpec("shared-input", f"WithTable({how!r})", ("shared-input",),
                               ("no-table",)))
    # The outputs: one per value of sig ('masked': the mask's rows stay at dim 0).
    out_dims: List[Optional[int]] = [1 if moved_out else 0]
    if sig[0] in ("pair", "masked"):
        out_dims.append(out_dims[0] if sig[0] == "pair" else 0)
    if moved_out:
        src = tuple(0 for _ in out_dims)
        only = len(out_dims) == 1
        tail.append(LayerSpec("batch-out", f"MoveBatch({src[:1] if only else src}, "
                                           f"{tuple(out_dims)})", sig, ("batch-out",) + sig))
    if tagged:
        tail.append(LayerSpec("tagged-output", f"Tagged({rng.randint(1, 4)}, dtype=dtype)",
                              ("flat",), ("tagged",)))
        out_dims.append(None)
    shift = len(front)  # TiedLinear's references move with the layers in front
    layers = front + [replace(s, ref=None if s.ref is None else s.ref + shift) for s in body]
    layers += tail
    batch_dim: Any = 0
    if any(d != 0 for d in in_dims):
        same = len(set(in_dims)) == 1
        batch_dim = in_dims[0] if same and rng.random() < 0.5 else list(in_dims)
    default = batch_dim if isinstance(batch_dim, int) else next(
        d for d in batch_dim if d is not None)
    output_batch_dim: Any = None
    if any(d != default for d in out_dims) or (len(set(out_dims)) == 1 and rng.random() < 0.3
                                                 and batch_dim != 0):
        same = len(set(out_dims)) == 1
        output_batch_dim = out_dims[0] if same and rng.random() < 0.5 else list(out_dims)
    return layers, inputs, batch_dim, output_batch_dim


#: The share of configurations with skip connections; their pairs per configuration.
SKIP_ODDS, SKIP_PAIRS = 0.25, (1, 1, 1, 2, 2, 3)
SKIP_NAMES = ("a", "b", "c")


def _skips(seed: int, body: List[LayerSpec],
           sig: Tuple[Any, ...]) -> Tuple[List[LayerSpec], int]:
    """Now and then ``body`` (whose input signature is ``sig``) with skip connections: 1 to 3
    stash/pop pairs (gpipe.skip), each stash and its pop at random places a flat tensor flows
    (the pop after the stash, maybe right after it), now and then chained by a relay (pops
    one, stashes the next); a name used again, and now and then a first use, isolated into
    a Namespace of its own. Each skip layer keeps the signature, so the rest of the model
    stays as drawn; where the balance cuts decides whether a skip stays in a stage or
    crosses 1 or more. Returns the layers and the number of namespaces."""
    # Its own generator (see the module docstring): configurations without skips are as before.
    rng = random.Random(f"skips {seed}")
    if rng.random() >= SKIP_ODDS:
        return body, 0
    sigs = [sig] + [s.sig_out for s in body]
    slots = [i for i, g in enumerate(sigs) if g[0] == "flat"]
    if not slots:
        return body, 0
    events: List[List[LayerSpec]] = [[] for _ in sigs]  # inserted in front of body[i]
    defaults: set = set()   # names used in the default namespace
    namespaces = 0

    def name_for(avoid: str = "") -> Tuple[str, str]:
        """A name and its ``.isolate(...)`` suffix ('' for the default namespace)."""
        nonlocal namespaces
        name = rng.choice([n for n in SKIP_NAMES if n != avoid])
        if name in defaults or rng.random() < 0.25:
            namespaces += 1
            return name, f"ns[{namespaces - 1}]"
        defaults.add(name)
        return name, ""

    def frozen(how: str) -> bool:
        return how in ("input", "linear", "add", "cat") and rng.random() < 0.12

    pair = 0
    for _ in range(rng.choice(SKIP_PAIRS)):
        a = rng.choice(slots)
        d = sigs[a][1]
        how = rng.choices(["input", "tanh", "linear", "detached", "none"],
                          weights=[4, 3, 3, 1.5, 1.5])[0]
        ds = {"linear": rng.randint(1, 6), "none": None}.get(how, d)
        name, ns = name_for()
        events[a].append(LayerSpec("stash", f"Stash({name!r}, {how!r}, {d}, {ds}, dtype=dtype)"
                                   + (f".isolate({ns})" if ns else ""), sigs[a], sigs[a],
                                   frozen=frozen(how), stashes=(pair,)))
        later = [i for i in slots if i >= a]
        b = max(rng.choice(later), rng.choice(later))  # leaning late: more stages to cross
        while rng.random() < 0.2:  # a relay: pops this skip at b, stashes the next one
            d = sigs[b][1]
            how = rng.choice(["forward", "fresh"])
            out, out_ns = name_for(avoid=name)
            isolate = (f".isolate({ns}, only=[{name!r}])" if ns else "") + (
                f".isolate({out_ns}, only=[{out!r}])" if out_ns else "")
            events[b].append(LayerSpec("relay", f"Relay({name!r}, {out!r}, {how!r}, {d}, {ds}, "
                                                f"dtype=dtype){isolate}", sigs[b], sigs[b],
                                       frozen=ds is not None and rng.random() < 0.12,
                                       stashes=(pair + 1,), pops=(pair,)))
            pair, name, ns = pair + 1, out, out_ns
            ds = ds if how == "forward" else d
            b = rng.choice([i for i in slots if i >= b])
        d = sigs[b][1]
        ways = (["none"] if ds is None else ["add", "mul", "cat", "ignore"]
                + (["take"] if ds == d else []))
        how = rng.choice(ways)
        events[b].append(LayerSpec("pop", f"Pop({name!r}, {how!r}, {d}, {ds}, dtype=dtype)"
                                   + (f".isolate({ns})" if ns else ""), sigs[b], sigs[b],
                                   frozen=frozen(how), pops=(pair,)))
        pair += 1
    layers: List[LayerSpec] = []
    moved: Dict[int, int] = {}  # body index -> index in layers (TiedLinear's references)
    for i in range(len(sigs)):
        layers += events[i]
        if i < len(body):
            moved[i] = len(layers)
            layers.append(body[i])
    return [replace(s, ref=None if s.ref is None else moved[s.ref]) for s in layers], namespaces


#: The share of configurations given a weight tied across stages (see :func:`_ties`).
TIE_ODDS = 0.3


def _ties(seed: int, body: List[LayerSpec],
          sig: Tuple[Any, ...]) -> Tuple[List[LayerSpec], bool]:
    """Now and then ``body`` (whose input signature is ``sig``) with a Linear's weight used
    again further on: two TiedLinear layers of that weight, one transposed, inserted where a
    flat tensor as wide as one of the Linear's sides flows (leaning late), so the pair keeps the
    signature (d -> the other side -> d). Returns the layers and whether the option was drawn
    (then :func:`_tie_balance` puts a stage boundary between a TiedLinear and its Linear)."""
    # Its own generator (see the module docstring): configurations without it are as before.
    rng = random.Random(f"ties {seed}")
    if rng.random() >= TIE_ODDS:
        return body, False
    sigs = [sig] + [s.sig_out for s in body]
    linears = [i for i, s in enumerate(body) if s.kind == "linear"]
    trainable = [i for i in linears if not body[i].frozen]
    if not linears:
        return body, True  # a tie drawn by _pick_layer (none without a Linear) may still cross
    i = rng.choice(trainable or linears)
    slots = [p for p in range(i + 1, len(sigs)) if sigs[p][0] == "flat"
             and sigs[p][1] in body[i].dims]  # slot p: in front of body[p] (or at the end)
    p = max(rng.choice(slots), rng.choice(slots))
    a, b = body[i].dims  # Linear(a, b): weight (b, a); F.linear maps a -> b, x @ W maps b -> a
    d = sigs[p][1]
    first = d == b and (d != a or rng.random() < 0.5)  # transposed first: d (= b) -> a -> b
    mid = a if first else b
    pair = [LayerSpec("tied", f"TiedLinear(layers[{{ref}}], transpose={t})", ("flat", w_in),
                      ("flat", w_out), ref=i)
            for t, w_in, w_out in ((first, d, mid), (not first, mid, d))]
    shifted = [replace(s, ref=None if s.ref is None else s.ref + 2 * (s.ref >= p)) for s in body]
    return shifted[:p] + pair + shifted[p:], True


def _tie_balance(seed: int, cfg: Config) -> Config:
    """``cfg`` with a stage boundary between some TiedLinear and its Linear: as drawn where one
    crosses already; else one cut moved there (the number of stages kept, so virtual stages
    still divide them), or a single stage split there."""
    rng = random.Random(f"tie balance {seed}")
    ties = [(s.ref, i) for i, s in enumerate(cfg.layers) if s.kind == "tied" and s.ref is not None]
    if not ties or any(tie_spans(cfg)):
        return cfg
    ref, i = rng.choice(ties)
    c = rng.randint(ref + 1, i)  # a cut in front of layer c
    n = len(cfg.layers)
    cuts = [sum(cfg.balance[:j]) for j in range(1, len(cfg.balance))]
    if cuts:  # none lies in (ref, i]: move the nearest there
        cuts[min(range(len(cuts)), key=lambda k: abs(cuts[k] - c))] = c
        cuts.sort()
    else:
        cuts = [c]
    return replace(cfg, balance=[y - x for x, y in zip([0] + cuts, cuts + [n])])


def _skip_balance(seed: int, balance: List[int]) -> List[int]:
    """A skip configuration's balance: half the time as drawn, else over as many stages as
    the fuzzer runs (4, or one per layer), so that skips cross more than one boundary."""
    rng = random.Random(f"skip balance {seed}")
    n = sum(balance)
    if rng.random() < 0.5 or n < 2:
        return balance
    cuts = sorted(rng.sample(range(1, n), min(4, n) - 1))
    return [b - a for a, b in zip([0] + cuts, cuts + [n])]


def generate(seed: int) -> Any:
    """The configuration of ``seed`` (the same on every machine and run): a
    :class:`modules.ModuleConfig` for about a fifth of the seeds (:func:`modules.draws_module`),
    else a :class:`Config`."""
    if draws_module(seed):
        return generate_module(seed)
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
    first = sig
    for _ in range(rng.choice([1, 2, 3, 3, 4, 4, 5, 5, 6, 7, 8])):
        layers.append(_pick_layer(rng, sig, layers))
        sig = layers[-1].sig_out
    if rng.random() < 0.08:  # only external tensors (if any) stay trainable
        for s in layers:
            s.frozen = s.kind in ("linear", "layernorm", "split", "conv", "mix", "first-only",
                                  "join", "masked")
    layers, tied = _ties(seed, layers, first)
    layers, namespaces = _skips(seed, layers, first)
    layers, inputs, batch_dim, output_batch_dim = _batch_dims(seed, layers, inputs, sig)
    n = len(layers)
    k = rng.randint(1, min(4, n))
    cuts = sorted(rng.sample(range(1, n), k - 1))
    balance = [b - a for a, b in zip([0] + cuts, cuts + [n])]
    if namespaces or any(s.stashes for s in layers):
        balance = _skip_balance(seed, balance)
    float_grad = any(s.requires_grad for s in inputs)
    backward = rng.choices(BACKWARDS, weights=[45, 15, 15, 12, 13])[0]
    if backward in ("grad_inputs", "backward_inputs") and not float_grad:
        backward = "grad_params"
    cfg = Config(seed=seed, layers=layers, balance=balance, chunks=rng.randint(1, 6),
                 checkpoint=rng.choice(MODES),
                 dtype="float32" if rng.random() < 0.1 else "float64",
                 rows=rng.randint(1, 8), inputs=inputs, training=rng.random() < 0.8,
                 no_grad=rng.random() < 0.12, backward=backward, pre_grad=rng.random() < 0.25,
                 batch_dim=batch_dim, output_batch_dim=output_batch_dim, namespaces=namespaces)
    cfg = _train_step(seed, cfg)
    if tied:
        cfg = _tie_balance(seed, cfg)
    # One mode per stage for some configurations of several stages, by a generator of its own
    # (the other draws stay as they were before it existed).
    if len(cfg.balance) > 1 and random.Random(f"stage modes {seed}").random() < STAGE_MODES_ODDS:
        cfg = replace(cfg, stage_modes=True)
    if random.Random(f"offset inputs {seed}").random() < OFFSET_ODDS:
        cfg = replace(cfg, offset_inputs=True)
    cfg.features = features_of(cfg)
    return cfg


def _joined_at_0(cfg: Config) -> bool:
    """Whether every output of the Pipe is joined along dim 0 (train_step cuts the target
    along dim 0 and the loss is a mean over the output rows there)."""
    dims = cfg.output_batch_dim
    if dims is None:  # the default: batch_dim, or its first entry that is not None
        dims = cfg.batch_dim if isinstance(cfg.batch_dim, int) else next(
            d for d in cfg.batch_dim if d is not None)
    return all(d == 0 for d in (dims if isinstance(dims, (list, tuple)) else [dims]))


def _train_step(seed: int, cfg: Config) -> Config:
    """Now and then ``cfg`` as a train_step configuration: a schedule, for interleaved_1f1b
    maybe 2 or 3 virtual stages per device (a balance of v x W stages drawn anew), the plain
    ``backward`` and grad mode (train_step's reference is ``loss.backward()``). Only where the
    outputs are joined along dim 0 (not batch-out, not tagged-output)."""
    # Its own generator, drawn in full whatever the configuration: see the module docstring.
    rng = random.Random(f"train step {seed}")
    chosen = rng.random() < STEP_ODDS
    schedule = rng.choice(SCHEDULES)
    v = rng.choice([2, 3]) if rng.random() < VIRTUAL_ODDS else 1
    if not chosen or not _joined_at_0(cfg):
        return cfg
    # ZB-V (two stages per device in a V) takes half the zb_h1 draws that have an even number
    # of stages, by a generator of its own, so the other seeds draw as before it existed.
    if (schedule == "zb_h1" and len(cfg.balance) % 2 == 0
            and random.Random(f"zb_v {seed}").random() < 0.5):
        schedule = "zb_v"
        cfg = replace(cfg, virtual_stages=2)
    cfg = replace(cfg, step=schedule, backward="backward", no_grad=False)
    n = len(cfg.layers)
    if schedule == "interleaved_1f1b" and min(v, n) > 1:
        v = min(v, n)
        k = v * rng.randint(1, min(3, n // v))
        cuts = sorted(rng.sample(range(1, n), k - 1))
        cfg = replace(cfg, balance=[b - a for a, b in zip([0] + cuts, cuts + [n])],
                      virtual_stages=v)
    # A random table in place of the built-in schedule (any stages per device that divide
    # them, in a loop or two in a V), by a generator of its own as zb_v above.
    table = random.Random(f"table {seed}")
    if table.random() < TABLE_ODDS:
        stages = len(cfg.balance)
        v = table.choice([d for d in (1, 2, 3) if stages % d == 0])
        shape = "v" if v == 2 and table.random() < 0.5 else "loop"
        cfg = replace(cfg, step="table", table=shape, virtual_stages=v)
    return cfg


def random_table(seed: int, stages: int, rows: int, microbatches: int,
                 v_shaped: bool) -> List[List[str]]:
    """A valid schedule table (torch.distributed.pipelining's compute actions, one list per
    row) for ``stages`` stages on ``rows`` rows: stage s on row s mod rows, or in a V (row r:
    stages r and 2 rows - 1 - r). Each (stage, micro-batch) backward is whole (B) or split
    (I, then W) at random, and the rows' orders come from one random serial run of the
    tasks, each picked among those whose inputs are done: so no table deadlocks, and the
    orders range from GPipe-like to ones no built-in schedule makes (W's long after their
    I's, a stage's micro-batches out of order). Now and then an idle tick ('')."""
    rng = random.Random(f"table {seed} {stages} {rows} {microbatches} {v_shaped}")
    row_of = [(s if s < rows else 2 * rows - 1 - s) if v_shaped else s % rows
              for s in range(stages)]
    split = {(s, i): rng.random() < 0.5 for s in range(stages) for i in range(microbatches)}
    done: set = set()

    def ready(op: str, s: int, i: int) -> bool:
        if op == "F":
            return s == 0 or ("F", s - 1, i) in done
        if op == "W":
            return ("I", s, i) in done
        after = s + 1 == stages or ("I" if split[(s + 1, i)] else "B", s + 1, i) in done
        return ("F", s, i) in done and after

    pending = [(op, s, i) for s in range(stages) for i in range(microbatches)
               for op in (("F", "I", "W") if split[(s, i)] else ("F", "B"))]
    table: List[List[str]] = [[] for _ in range(rows)]
    while pending:
        op, s, i = rng.choice([t for t in pending if ready(*t)])
        pending.remove((op, s, i))
        done.add((op, s, i))
        if rng.random() < 0.05:
            table[row_of[s]].append("")
        table[row_of[s]].append(f"{s}{op}{i}")
    return table


def stage_modes(seed: int, stages: int) -> List[str]:
    """One checkpoint mode per stage, drawn from the seed."""
    rng = random.Random(f"stage modes {seed} {stages}")
    return [rng.choice(MODES) for _ in range(stages)]


# -- shrinking -------------------------------------------------------------------------------

def _smaller(cfg: Config) -> Iterable[Config]:
    """Simpler variants of ``cfg``, simplest first; each still a valid model."""
    if cfg.backward != "backward":
        yield replace(cfg, backward="backward")
    if cfg.stage_modes:
        yield replace(cfg, stage_modes=False)
    if cfg.offset_inputs:
        yield replace(cfg, offset_inputs=False)
    if cfg.table == "v":
        yield replace(cfg, table="loop")
    for flag in ("pre_grad", "no_grad"):
        if getattr(cfg, flag):
            yield replace(cfg, **{flag: False})
    for i, s in enumerate(cfg.layers):  # drop a layer that keeps the signature
        if (len(cfg.layers) > 1 and s.sig_in == s.sig_out and all(t.ref != i for t in cfg.layers)
                and not s.stashes and not s.pops):
            yield _without_layers(cfg, {i})
    for chain in _skip_chains(cfg):  # drop a skip: its stash, pop and relays together
        if len(chain) < len(cfg.layers):
            yield _without_layers(cfg, chain)
    for j in range(len(cfg.balance) - 1):  # merge two neighbouring stages
        yield _fit(replace(cfg, balance=cfg.balance[:j] + [cfg.balance[j] + cfg.balance[j + 1]]
                           + cfg.balance[j + 2:]))
    for v in range(1, cfg.virtual_stages):  # fewer stages per device, more devices
        if len(cfg.balance) % v == 0:
            yield replace(cfg, virtual_stages=v)
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


def _without_layers(cfg: Config, gone: set) -> Config:
    """``cfg`` less the layers ``gone`` (none referenced by another layer): references shift
    down, their stages lose them (a stage left empty goes)."""
    layers = [replace(s, ref=None if s.ref is None else s.ref - sum(g < s.ref for g in gone))
              for j, s in enumerate(cfg.layers) if j not in gone]
    balance, start = [], 0
    for b in cfg.balance:
        balance.append(b - sum(start <= g < start + b for g in gone))
        start += b
    return _fit(replace(cfg, layers=layers, balance=[b for b in balance if b > 0]))


def _skip_chains(cfg: Config) -> List[set]:
    """The skip layers by connected skip: a stash, the relays its skip passes, the last pop
    (layer indices), in the order of their first layer."""
    chains: List[set] = []
    for i, s in enumerate(cfg.layers):
        ids = set(s.stashes) | set(s.pops)
        if not ids:
            continue
        joined = [c for c in chains if any(ids & set(cfg.layers[j].stashes + cfg.layers[j].pops)
                                           for j in c)]
        merged = {i}.union(*joined)
        chains = [c for c in chains if c not in joined] + [merged]
    return sorted(chains, key=min)


def _fit(cfg: Config) -> Config:
    """``cfg`` with as many virtual stages per device as still divide its stages (at most as
    many as before): interleaved_1f1b needs v entries of the balance per device."""
    v = max(d for d in range(1, cfg.virtual_stages + 1) if len(cfg.balance) % d == 0)
    return replace(cfg, virtual_stages=v)


def shrink(cfg: Config, found: Mismatch, timeout: float,
           budget: int = 60) -> Tuple[Config, Mismatch]:
    """Greedily simplifies ``cfg`` while a mismatch of ``found``'s kind remains; returns the
    simplest configuration and its mismatch of that kind."""
    if isinstance(cfg, ModuleConfig):
        # Not shrunk: dropping a block of a module would rewrite its forward's source (edges,
        # ties and widths that depend on it); the seed's reproduction is printed as drawn.
        return cfg, found
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

