"""gpipe.pipeline: cut any traceable nn.Module into stages at named submodules, as a Pipe.

The module's ``forward`` is traced into one graph (_pipeline_trace.py: torch.fx, where
submodules that hold no split point are called, not traced, or torch.export where fx
cannot trace), the split points are chosen when only their number is given
(_pipeline_split.py), the graph is cut where each split point's submodule is first
used, and every value that crosses a cut is routed: a tensor rides in the hand-off tuple
to the next stage that uses it, or as a skip straight to a later one, parameters and
buffers are fetched again where they are used (the same objects, so tied weights stay
tied), and values holding no tensor (sizes, ints) are recomputed in the stage that needs
them. The stages are ``torch.fx.GraphModule``s that hold the module's own submodules and
parameters under their own dotted names; the result is a :class:`gpipe.Pipe` over them,
called like the module (``pipe(idx, attention_mask=mask)``), whose ``state_dict()`` keys
are the module's. See docs/pipeline.md.
"""
import contextlib
import difflib
import inspect
import operator
from typing import (Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Set,
                    Tuple, Union)

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from gpipe.pipe import Pipe
from gpipe._pipeline_split import balanced_split_points
from gpipe._pipeline_trace import PipelineError, Traced, _factories_traced, trace
from gpipe.skip.tracker import pop_skip, stash_skip

__all__ = ["pipeline", "PipelineError"]


class _Stage(fx.GraphModule):
    """One stage: a GraphModule holding the module's own submodules and parameters under
    their dotted names. ``gpipe_skips`` lists the skips it stashes and pops (keys as
    ``@skippable`` layers give them, skip/layout.py). Unpickling retraces the generated
    code, with torch's factories traced as when it was made."""

    gpipe_skips: Optional[Tuple[List[Tuple[None, str]], List[Tuple[None, str]]]] = None

    #: Made from torch.export's graph (tracer="export").
    gpipe_exported = False

    def __reduce__(self) -> Any:
        if self.gpipe_exported:
            # Unpickling traces the stage's code again: torch.export's guards (a local
            # function) cannot be saved, and its parameter reads would come back as
            # constants, outside the state_dict.
            raise TypeError("a pipe whose stages torch.export made (pipe.tracer == 'export': "
                            "tracer='export', or the default 'auto' where torch.fx could not "
                            "trace) cannot be pickled (torch.save); save its state_dict() and "
                            "build the pipe again, or use tracer='fx' where fx can trace "
                            "(copy.deepcopy works with both)")
        rebuild, args = super().__reduce__()
        return (_unpickle_stage, (rebuild, args, self.gpipe_skips))


def _unpickle_stage(rebuild: Callable, args: Any, skips: Any = None) -> nn.Module:
    with _factories_traced():
        gm = rebuild(*args)
    stage = _Stage(gm, gm.graph, class_name=type(gm).__name__)
    stage.gpipe_skips = skips
    return stage


def _routes(ext: List[Set[fx.Node]], stage_of: Dict[fx.Node, int], index: Dict[fx.Node, int],
            n_stages: int) -> Tuple[List[List[fx.Node]], List[List[Tuple[str, fx.Node]]],
                                    List[List[Tuple[str, fx.Node]]]]:
    """How each tensor reaches the stages that use it (``ext[t]``): from where it is made
    to the first user, from there to the next user and so on; a hop to the next stage goes
    in the hand-off, a longer one is a skip (stashed in one stage, popped in the other:
    the engine sends it straight there). Returns the hand-offs (after stage k) and the
    skips each stage stashes and pops, as (name, value).

    A stage that would get an empty hand-off (it uses nothing of the stage before it, only
    values from further back) has every value carried through the stages in between
    instead, since a stage's input cannot be empty."""
    hand: List[List[fx.Node]] = [[] for _ in range(n_stages - 1)]
    stash: List[List[Tuple[str, fx.Node]]] = [[] for _ in range(n_stages)]
    pop: List[List[Tuple[str, fx.Node]]] = [[] for _ in range(n_stages)]
    crossing = sorted(set().union(*ext), key=index.__getitem__)
    for a in crossing:
        prev = stage_of[a]
        for t in (t for t in range(n_stages) if a in ext[t]):
            if t == prev + 1:
                hand[prev].append(a)
            else:
                name = f"{a.name}>{t}"
                stash[prev].append((name, a))
                pop[t].append((name, a))
            prev = t
    if all(hand):
        return hand, stash, pop
    carried = [sorted({a for t in range(k + 1, n_stages) for a in ext[t] if stage_of[a] <= k},
                      key=index.__getitem__) for k in range(n_stages - 1)]
    return carried, [[] for _ in range(n_stages)], [[] for _ in range(n_stages)]


def _leaves_have_tensor(value: Any) -> bool:
    return any(isinstance(v, Tensor) for v in pytree.tree_leaves(value))


def _record_values(module: nn.Module, graph: fx.Graph, inputs: List[Any]) -> Dict[fx.Node, Any]:
    """Runs the traced graph once on the example (RNG state and buffers restored after), to
    learn which nodes hold tensors."""
    values: Dict[fx.Node, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            values[n] = out
            return out

    # The graph runs on the module itself (no GraphModule made for it: its code would be
    # generated and compiled for this one run).
    saved = {name: b.detach().clone() for name, b in module.named_buffers()}
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            Recorder(module, graph=graph).run(*inputs)
    finally:
        with torch.no_grad():
            for name, b in module.named_buffers():
                b.copy_(saved[name])
    return values


def _owner(module: nn.Module, dotted: str) -> Tuple[nn.Module, str]:
    *path, field = dotted.split(".")
    for item in path:
        module = getattr(module, item)
    return module, field


class _Cut(NamedTuple):
    """A module cut into traced stages, and what calling it like the module takes."""

    stages: List[nn.Module]
    #: The forward's parameters that are the Pipe's inputs, in its input order.
    names: List[str]
    #: The forward's other parameters, fixed at their example (or default) values.
    fixed: Dict[str, Any]
    signature: inspect.Signature
    out_spec: Any
    #: Per output leaf: None (the last stage's next output) or (a constant,).
    out_constants: List[Any]
    #: The module's state_dict keys, in its order, and the stages holding each.
    key_order: List[str]
    key_stages: Dict[str, List[int]]
    #: The Pipe's options, ``batch_dim`` given by name turned into the inputs' order.
    options: Dict[str, Any]
    #: With torch.export, the training mode the graph was exported in (its ops keep it).
    exported_training: Optional[bool] = None
    #: Where the stages begin, in the order the forward uses them.
    split_points: List[str] = []
    #: The tracer that made the graph: "fx" or "export".
    tracer: str = "fx"
    #: The module's training mode, which the pipe starts in.
    training: bool = True
    #: Fixed arguments the examples did not give (``_IMPLIED``): a call may leave them out.
    implied: Tuple[str, ...] = ()


class _Pipelined:
    """What a pipe over the stages of a traced module adds to :class:`gpipe.Pipe` and
    :class:`gpipe.distributed.Pipe`: it takes the module's arguments, returns what the module
    returns, and its ``state_dict()`` keys are the module's."""

    input_names: List[str]
    _out_spec: Any

    def _pipelined(self, cut: _Cut) -> None:
        #: The forward's parameters the trace took as inputs, in the Pipe's input order.
        self.input_names = cut.names
        self._fixed = cut.fixed
        self._signature = cut.signature
        self._out_spec = cut.out_spec
        self._out_constants = cut.out_constants
        self._key_order = cut.key_order
        self._key_stages = cut.key_stages
        self._exported_training = cut.exported_training
        self._implied = cut.implied
        #: The submodules where stages 1, 2, ... begin (chosen by ``stages=K``, or the
        #: split points given), in the order the forward uses them.
        self.split_points = list(cut.split_points)
        #: The tracer that made the stages: "fx" or "export" ("auto" picks one).
        self.tracer = cut.tracer
        # The pipe and its stages start in the module's mode (the module's own submodules,
        # which the stages hold, keep theirs): an exported graph runs in that mode only.
        self.training = cut.training
        for stage in cut.stages:
            stage.training = cut.training
        self._register_state_dict_hook(_Pipelined._module_keys)  # type: ignore[attr-defined]
        self._register_load_state_dict_pre_hook(  # type: ignore[attr-defined]
            _Pipelined._stage_keys, with_module=True)
        self.register_load_state_dict_post_hook(  # type: ignore[attr-defined]
            _Pipelined._missing_as_module_keys)
        self._load_prefix = ""

    def __getstate__(self) -> Dict[str, Any]:
        # The output structure travels as pytree's JSON text (pickling a TreeSpec warns).
        state = super().__getstate__()  # type: ignore[misc]
        state["_out_spec"] = pytree.treespec_dumps(self._out_spec)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        state = dict(state)
        state["_out_spec"] = pytree.treespec_loads(state["_out_spec"])
        super().__setstate__(state)  # type: ignore[misc]

    def _local_stages(self) -> Optional[Set[int]]:
        """The stages this process holds (None: all of them)."""
        return None

    def _inputs(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Union[Tensor, Tuple[Tensor, ...]]:
        exported = getattr(self, "_exported_training", None)
        if exported is not None and exported != self.training:  # type: ignore[attr-defined]
            mode = "train" if exported else "eval"
            raise RuntimeError(f"this pipe's stages were made by torch.export (pipe.tracer == "
                               f"'export') from a module in "
                               f"{mode} mode, and an exported graph keeps that mode (dropout, "
                               f"BatchNorm's statistics) whatever pipe.train()/eval() say: "
                               f"call pipe.{mode}(), or call gpipe.pipeline again with the "
                               f"module in the mode you want (or use tracer='fx', which "
                               f"follows the mode)")
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"the pipelined module is called as its forward{self._signature}: "
                            f"{exc}") from None
        for n, p in self._signature.parameters.items():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and bound.arguments.get(n):
                raise TypeError(f"this pipeline takes the forward's named parameters only, but "
                                f"was called with {bound.arguments[n]!r} through "
                                f"{'**' if p.kind == p.VAR_KEYWORD else '*'}{n}")
        missing = [n for n in self.input_names if n not in bound.arguments]
        if missing:
            raise TypeError(f"this pipeline was traced with the tensor arguments "
                            f"{self.input_names} but was called without {missing}; pass them, "
                            f"or call gpipe.pipeline again with examples of the arguments you "
                            f"want to pass")
        implied = getattr(self, "_implied", ())
        for name, fixed in self._fixed.items():
            if name in implied and name not in bound.arguments:
                continue  # passed as traced
            value = bound.arguments.get(name, self._signature.parameters[name].default)
            same = value is fixed
            if not same and not isinstance(value, Tensor) and not isinstance(fixed, Tensor):
                try:
                    same = bool(value == fixed)
                except Exception:
                    same = False
            if not same:
                why = ("gpipe.pipeline passes it when the examples do not" if name in implied
                       else "fixed: not a tensor in the examples")
                raise TypeError(f"this pipeline was traced with {name}={fixed!r} ({why}) but was "
                                f"called with {name}={value!r}; call gpipe.pipeline again with "
                                f"that value, or with a tensor example to make it an input")
        values = [bound.arguments[n] for n in self.input_names]
        return values[0] if len(values) == 1 else tuple(values)

    def _outputs(self, out: Any) -> Any:
        flat = list(out) if isinstance(out, tuple) else [out]
        it = iter(flat)
        leaves = [next(it) if c is None else c[0] for c in self._out_constants]
        return pytree.tree_unflatten(leaves, self._out_spec)

    @contextlib.contextmanager
    def _stage_names(self) -> Iterator[None]:
        """Meanwhile ``state_dict()`` and ``load_state_dict`` use the stages' names
        ('<stage>.<key>', as ``named_parameters()``), which torch.distributed.checkpoint's
        state_dict functions need."""
        self._raw_keys = True
        try:
            yield
        finally:
            self._raw_keys = False

    def _module_key(self, key: str) -> str:
        """'<stage>.<key>' -> '<key>' (other keys as they are)."""
        stage, _, rest = key.partition(".")
        return rest if stage.isdigit() and rest in self._key_stages else key

    def _stage_keys_of(self, key: str) -> List[str]:
        """'<key>' -> '<stage>.<key>' for each stage here holding it ([key] for other keys)."""
        if key not in self._key_stages:
            return [key]
        local = self._local_stages()
        return [f"{k}.{key}" for k in self._key_stages[key] if local is None or k in local]

    @staticmethod
    def _module_keys(self: "_Pipelined", state_dict: Dict[str, Any], prefix: str,
                     local_metadata: Any) -> None:
        """state_dict hook: '<stage>.<key>' -> '<key>', in the module's key order."""
        if getattr(self, "_raw_keys", False):
            return
        mine = {}
        for key in [k for k in state_dict if k.startswith(prefix)]:
            rest = self._module_key(key[len(prefix):])
            if rest != key[len(prefix):]:
                mine[rest] = state_dict.pop(key)
        for rest in self._key_order:
            if rest in mine:
                state_dict[prefix + rest] = mine.pop(rest)
        for rest, value in mine.items():
            state_dict[prefix + rest] = value

    @staticmethod
    def _stage_keys(self: "_Pipelined", state_dict: Dict[str, Any], prefix: str,
                    *_: Any) -> None:
        """load_state_dict pre-hook: '<key>' -> '<stage>.<key>' for each stage holding it
        here; a key only other ranks' stages hold is theirs to load, and dropped."""
        self._load_prefix = prefix
        if getattr(self, "_raw_keys", False):
            return
        for key in [k for k in state_dict if k.startswith(prefix)]:
            rest = key[len(prefix):]
            if rest in self._key_stages:
                value = state_dict.pop(key)
                for stage_key in self._stage_keys_of(rest):
                    state_dict[prefix + stage_key] = value

    @staticmethod
    def _missing_as_module_keys(self: "_Pipelined", incompatible: Any) -> None:
        """load_state_dict post-hook: missing keys named as the module names them."""
        if getattr(self, "_raw_keys", False):
            return
        named = []
        for key in incompatible.missing_keys:
            if key.startswith(self._load_prefix):
                key = self._load_prefix + self._module_key(key[len(self._load_prefix):])
            if key not in named:
                named.append(key)
        incompatible.missing_keys[:] = named


class _PipelinedPipe(_Pipelined, Pipe):
    """A :class:`gpipe.Pipe` over the stages of a traced module, called like that module
    (``pipe(*args, **kwargs)``), with the module's ``state_dict()`` keys."""

    def __init__(self, cut: _Cut) -> None:
        Pipe.__init__(self, nn.Sequential(*cut.stages), balance=[1] * len(cut.stages),
                      **cut.options)
        self._pipelined(cut)

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """Runs the pipeline on the module's own arguments (positional or keyword, as its
        forward takes them) and returns what the module's forward returns."""
        return self._outputs(super().forward(self._inputs(args, kwargs)))

    def train_step(self, input: Any, target: Any,  # type: ignore[override]
                   loss_fn: Callable[[Any, Any], Tensor],
                   kwargs: Optional[Dict[str, Any]] = None) -> Tensor:
        """:meth:`gpipe.Pipe.train_step` with the module's arguments: ``input`` is its one
        positional tensor or a tuple of its positional arguments, ``kwargs`` its keyword
        arguments; ``loss_fn`` gets one micro-batch's output as the module returns it."""
        args = input if isinstance(input, tuple) else (input,)
        packed = self._inputs(args, kwargs or {})
        return super().train_step(packed, target,
                                  lambda out, tgt: loss_fn(self._outputs(out), tgt))


def pipeline(module: nn.Module, split_points: Optional[Sequence[str]] = None,
             example_args: Any = (), example_kwargs: Optional[Dict[str, Any]] = None, *,
             stages: Optional[int] = None, balance_by: str = "params", tracer: str = "auto",
             **pipe_options: Any) -> Pipe:
    """Cuts ``module`` into stages that begin at ``split_points`` and returns a
    :class:`gpipe.Pipe` over them, called like ``module``.

    Args:
        module: any ``nn.Module`` whose forward torch.fx or torch.export can trace (see
            ``tracer``).
        split_points: names of submodules (``module.named_modules()`` names, e.g.
            ``["blocks.2", "blocks.4"]``) at whose first use a stage begins, as
            torch.distributed.pipelining's ``SplitPoint.BEGINNING``: K names give K+1
            stages. The stages' order is the order the forward uses them in.
        example_args: the forward's positional arguments (a tuple, or one tensor), used to
            choose which parameters become the Pipe's inputs and which values are tensors.
            Their sizes are not fixed: any batch size works later.
        example_kwargs: the forward's keyword arguments, as ``example_args``.
        stages: instead of ``split_points``, the number of stages: the submodules the
            forward calls, looked for down into its ``nn.ModuleList``s and
            ``nn.Sequential``s (``tok``, ``blocks.0``, ... ``lm_head``; a Hugging Face
            causal LM's ``model.embed_tokens``, ``model.layers.0`` ... ``model.norm``,
            ``lm_head``), are balanced by ``balance_by`` (:func:`gpipe.balance.balance_cost`,
            the exact min-max split) and the stages begin at the chosen ones, which
            ``pipe.split_points`` lists.
        balance_by: with ``stages``, each submodule's cost: ``"params"`` (default), its
            parameter count (a tied parameter counts once, at its first use), or
            ``"time"``, its forward and backward time on the examples (the fastest of 3
            runs after a warm-up, where the module is; parameters, grads, buffers and the
            RNG state are restored after).
        tracer: ``"auto"`` (default): torch.fx, and where fx cannot trace the forward,
            torch.export (``pipe.tracer`` says which made the stages); ``"fx"``: torch.fx
            only, entering only the submodules that hold a split point; ``"export"``:
            torch.export only, with the batch dim of every input dynamic
            (``torch.export.Dim``), entering every submodule; its stages run aten ops, hold
            the exported module's parameters (the module's own objects) under the module's
            names, and keep the training mode the module had. Non-tensor arguments are fixed
            at their example values with either.
        **pipe_options: :class:`gpipe.Pipe`'s own options (``chunks``, ``devices``,
            ``checkpoint``, ``schedule``, ``batch_dim``, ...), except ``balance`` (one stage
            per layer). ``batch_dim`` may also be a dict from the forward's parameter names
            to a dim or None (a value not cut, e.g. ``{"attention_mask": None}``); unnamed
            inputs are cut along dim 0.

    The Pipe's inputs are the forward's parameters given as tensors in the examples, in the
    order of the forward's signature (a list ``batch_dim`` follows that order); parameters
    not given keep their defaults, and non-tensor arguments given are fixed at their example
    values (the trace specialises on them). Call the pipe with the same set of arguments.

    With torch.fx, only submodules that contain a split point (and the module itself) are
    traced; every other submodule is called as written, so its own control flow needs no
    tracing. ``pipe.split_points`` lists where the stages begin, ``pipe.tracer`` which
    tracer made them.

    Raises:
        PipelineError: the forward cannot be traced (the message names each tracer tried,
            the source line each stopped at, and each fix), or a value crossing a cut cannot
            be routed.
        ValueError: a split point that is not a submodule, or is never used; ``balance``
            given.
    """
    return _PipelinedPipe(_cut(module, split_points, example_args, example_kwargs, stages,
                               balance_by, tracer, pipe_options, Pipe, "gpipe.pipeline"))


def _cut(module: nn.Module, split_points: Optional[Sequence[str]], example_args: Any,
         example_kwargs: Optional[Dict[str, Any]], stages: Optional[int], balance_by: str,
         tracer: str, pipe_options: Dict[str, Any], pipe_cls: type, caller: str) -> _Cut:
    """What :func:`pipeline` and :func:`gpipe.distributed.pipeline` share: ``module`` traced
    and cut into stages, with what calling the pipe like the module takes; ``pipe_options``
    are checked against ``pipe_cls``'s."""
    _check_options(pipe_options, pipe_cls, caller)
    if stages is not None:
        if split_points is not None:
            raise ValueError(f"pass split_points or stages, not both (got split_points="
                             f"{split_points!r}, stages={stages!r})")
        split_points = balanced_split_points(module, stages, balance_by, example_args,
                                             example_kwargs)
    elif split_points is None:
        raise ValueError("pass split_points (submodule names where stages begin) or stages "
                         "(a number of stages to balance by parameter count)")
    split_points = _checked_split_points(module, split_points)
    signature, bound, names, concrete, implied = _bind(module, example_args, example_kwargs)
    try:
        traced = trace(module, split_points, signature, bound, names, concrete, pipe_options,
                       tracer)
    except PipelineError:
        # Split points chosen inside a submodule no tracer follows: the submodules the
        # module's own forward calls instead (under fx they stay untraced), if that traces.
        fallback = None if stages is None else _shallow(
            module, stages, balance_by, example_args, example_kwargs, split_points,
            lambda sp: trace(module, sp, signature, bound, names, concrete, pipe_options,
                             tracer))
        if fallback is None:
            raise
        split_points, traced = fallback
    graph = traced.graph
    values = _record_values(traced.root, graph, [bound.arguments[n] for n in names])
    nodes = [n for n in graph.nodes if n.op != "output"]
    index = {n: i for i, n in enumerate(nodes)}
    begins = _begins(module, split_points, nodes, index)
    stage_of = _stage_of(nodes, index, values, [b for b, _ in begins])
    n_stages = len(begins) + 1
    ext, remat, out_nodes, out_spec, out_constants = _needs(graph, traced.tracer, nodes, values,
                                                            stage_of, n_stages)
    hand, skips_out, skips_in = _routes(ext, stage_of, index, n_stages)
    modules = [_stage(traced, k, n_stages, nodes, index, stage_of, remat[k],
                      traced.order if k == 0 else hand[k - 1], skips_in[k], skips_out[k],
                      out_nodes if k == n_stages - 1 else hand[k]) for k in range(n_stages)]
    key_order, key_stages = _state_keys(module, traced.root, modules)
    return _Cut(modules, names, concrete, signature, out_spec, out_constants, key_order,
                key_stages, _options(pipe_options, names),
                module.training if traced.tracer == "export" else None,
                [sp for _, sp in begins], traced.tracer, module.training,
                tuple(implied))


def _shallow(module: nn.Module, stages: int, balance_by: str, example_args: Any,
             example_kwargs: Optional[Dict[str, Any]], deep: List[str],
             trace_at: Callable[[List[str]], Traced]) -> Optional[Tuple[List[str], Traced]]:
    """Split points balanced over the submodules the root's forward calls, and the graph
    traced for them; None where they are the ``deep`` ones, too few, or do not trace."""
    try:
        shallow = balanced_split_points(module, stages, balance_by, example_args,
                                        example_kwargs, deep=False)
        if shallow == deep:
            return None
        return shallow, trace_at(shallow)
    except (PipelineError, ValueError):
        return None


def _check_options(pipe_options: Dict[str, Any], pipe_cls: type, caller: str) -> None:
    pipe_name = f"{pipe_cls.__module__}.{pipe_cls.__qualname__}".replace("gpipe.pipe.", "gpipe.")
    known = set(inspect.signature(pipe_cls.__init__).parameters) - {"self", "module"}
    unknown = sorted(set(pipe_options) - known)
    if unknown:
        raise TypeError(f"{caller} got {unknown}, which are not {pipe_name} options "
                        f"({sorted(known - {'balance'})}); the module's own keyword arguments "
                        f"go in example_kwargs, e.g. example_kwargs={{{unknown[0]!r}: ...}}")
    if "balance" in pipe_options:
        raise ValueError(f"{caller} makes one stage per split, so balance="
                         f"{pipe_options['balance']!r} does not apply; choose the stages with "
                         f"split_points")


def _checked_split_points(module: nn.Module, split_points: Any) -> List[str]:
    if isinstance(split_points, str):
        split_points = [split_points]
    split_points = list(split_points)
    modules = dict(module.named_modules())
    for sp in split_points:
        if not isinstance(sp, str) or sp not in modules or sp == "":
            close = difflib.get_close_matches(str(sp), [n for n in modules if n], n=3)
            raise ValueError(f"split point {sp!r} is not a submodule of "
                             f"{type(module).__name__}; pass names from module.named_modules()"
                             + (f", e.g. {close}" if close else ""))
    if len(set(split_points)) != len(split_points):
        raise ValueError(f"split_points {split_points} names a submodule twice; give each once")
    return split_points


def _bind(module: nn.Module, example_args: Any, example_kwargs: Optional[Dict[str, Any]]
          ) -> Tuple[inspect.Signature, inspect.BoundArguments, List[str], Dict[str, Any],
                     List[str]]:
    """The examples bound to the forward's signature: which parameters are the Pipe's inputs
    (tensors given), in signature order, the others' fixed values, and which of those the
    pipe passes itself (``_IMPLIED``, not given)."""
    example_args = example_args if isinstance(example_args, tuple) else (example_args,)
    signature = inspect.signature(module.forward)
    bound = signature.bind(*example_args, **dict(example_kwargs or {}))
    for p in signature.parameters.values():
        # *args and **kwargs are allowed (Hugging Face's forwards take **kwargs), left empty.
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and bound.arguments.get(p.name):
            star = "**" if p.kind == p.VAR_KEYWORD else "*"
            raise PipelineError(f"{type(module).__name__}.forward takes {star}{p.name} and the "
                                f"examples pass {bound.arguments[p.name]!r} through it: "
                                f"gpipe.pipeline needs named parameters to map arguments to the "
                                f"Pipe's inputs; pass only the forward's named parameters")
    names: List[str] = []
    concrete: Dict[str, Any] = {}
    implied: List[str] = []
    for name, p in signature.parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if name in bound.arguments and isinstance(bound.arguments[name], Tensor):
            names.append(name)
        elif name in bound.arguments:
            concrete[name] = bound.arguments[name]
        elif name in _IMPLIED:
            # Given to the trace as if passed (bound.arguments: torch.export takes it too).
            concrete[name] = bound.arguments[name] = _IMPLIED[name]
            implied.append(name)
        else:
            concrete[name] = p.default
    if not names:
        raise ValueError("example_args and example_kwargs give no tensor; the Pipe needs at "
                         "least one tensor input to cut into micro-batches")
    return signature, bound, names, concrete, implied


#: Arguments a pipe passes when the examples do not give them: ``use_cache=False`` (a
#: Hugging Face forward returns a cache object otherwise, which holds no tensor to cut).
_IMPLIED = {"use_cache": False}


def _begins(module: nn.Module, split_points: List[str], nodes: List[fx.Node],
            index: Dict[fx.Node, int]) -> List[Tuple[int, str]]:
    """Where each stage begins: the first node run by its split point's submodule (a call,
    or a node traced inside it); a parameter read from outside (a tie) does not count,
    unless that is all the forward does with it. Sorted: (node index, split point)."""
    def inside(node: fx.Node, sp: str, reads: bool = False) -> bool:
        stack = node.meta.get("nn_module_stack") or {}
        paths = [v[0] if isinstance(v, tuple) else v for v in stack.values()]
        if node.op == "call_module" or (reads and node.op == "get_attr"):
            paths.append(node.target)
        return any(p == sp or str(p).startswith(sp + ".") for p in paths)

    begins = []
    for sp in split_points:
        first = next((n for n in nodes if inside(n, sp)), None)
        if first is None:
            first = next((n for n in nodes if inside(n, sp, reads=True)), None)
        if first is None:
            raise ValueError(f"split point {sp!r} is never used by {type(module).__name__}."
                             f"forward on the example, so no stage can begin there; pass a "
                             f"submodule the forward calls")
        begins.append((index[first], sp))
    begins.sort()
    if (begins and begins[0][0] == 0) or any(a[0] == b[0] for a, b in zip(begins, begins[1:])):
        raise ValueError(f"split points {[sp for _, sp in begins]} leave an empty stage; "
                         f"choose submodules used at different points of the forward")
    return begins


def _stage_of(nodes: List[fx.Node], index: Dict[fx.Node, int], values: Dict[fx.Node, Any],
              begins: List[int]) -> Dict[fx.Node, int]:
    """The stage each node runs in: the last one begun at or before it."""
    stage_of: Dict[fx.Node, int] = {}
    s = 0
    for n in nodes:
        while s < len(begins) and index[n] >= begins[s]:
            s += 1
        stage_of[n] = 0 if n.op == "placeholder" else s
    # A getitem or getattr of a value holding several tensors (a module returning a tuple,
    # or a ModelOutput) runs where that value is made, so only single tensors cross.
    for n in nodes:
        if (n.op == "call_function" and n.target in (operator.getitem, getattr)
                and isinstance(n.args[0], fx.Node) and not isinstance(values.get(n.args[0]), Tensor)
                and _leaves_have_tensor(values.get(n.args[0]))):
            stage_of[n] = stage_of[n.args[0]]
    return stage_of


def _needs(graph: fx.Graph, tracer: str, nodes: List[fx.Node], values: Dict[fx.Node, Any],
           stage_of: Dict[fx.Node, int], n_stages: int) -> Tuple[Any, ...]:
    """Per stage, the values made elsewhere and routed in (ext) and those recomputed there
    (remat); the output nodes, the output structure and its constants."""
    def recomputed(n: fx.Node) -> bool:
        return n.op == "get_attr" or (n.op != "placeholder" and not _leaves_have_tensor(values.get(n)))

    ext: List[Set[fx.Node]] = [set() for _ in range(n_stages)]
    remat: List[Set[fx.Node]] = [set() for _ in range(n_stages)]

    def need(a: fx.Node, t: int, user: str) -> None:
        if a.op == "get_attr":  # fetched in every stage that uses it, and only there
            remat[t].add(a)
            return
        if stage_of[a] == t or a in remat[t] or a in ext[t]:
            return
        if recomputed(a):
            remat[t].add(a)
            for b in a.all_input_nodes:
                need(b, t, a.name)
        elif isinstance(values.get(a), Tensor):
            ext[t].add(a)
        else:
            raise PipelineError(
                f"{a.name} ({a.format_node()}) holds {type(values.get(a)).__name__} of "
                f"tensors and is used by {user} in another stage; only tensors cross stages: "
                f"move the split point, or return/use its tensors one by one")

    for n in nodes:
        for a in n.all_input_nodes:
            need(a, stage_of[n], n.name)
    output = next(n for n in graph.nodes if n.op == "output")
    out_flat, out_spec = pytree.tree_flatten(output.args[0])
    info = getattr(graph._codegen, "pytree_info", None)  # torch.export: flat outputs, a spec
    if tracer == "export" and info is not None and info.out_spec is not None:
        out_flat, out_spec = list(output.args[0]), info.out_spec
    elif "gpipe_out_spec" in output.meta:  # fx: the leaves (_Tracer.create_args_for_root)
        out_flat, out_spec = list(output.args[0]), output.meta["gpipe_out_spec"]
    # A traced value that was None on the example (a ModelOutput's unset field read from
    # a submodule's output under fx) is returned as the constant None.
    out_flat = [None if isinstance(x, fx.Node) and x in values and values[x] is None else x
                for x in out_flat]
    out_nodes = [x for x in out_flat if isinstance(x, fx.Node)]
    for x in out_nodes:
        if not isinstance(values.get(x), Tensor):
            raise PipelineError(f"the forward returns {x.name}, a {type(values.get(x)).__name__}"
                                f", not a tensor; a Pipe's outputs are tensors: return tensors "
                                f"(in a tuple, list, dict of them)")
        need(x, n_stages - 1, "the output")
    # None: the last stage's next output; (value,): a constant the forward returns.
    out_constants = [None if isinstance(x, fx.Node) else (x,) for x in out_flat]
    return ext, remat, out_nodes, out_spec, out_constants


def _stage(traced: Traced, k: int, n_stages: int, nodes: List[fx.Node],
           index: Dict[fx.Node, int], stage_of: Dict[fx.Node, int], remat: Set[fx.Node],
           incoming: List[fx.Node], skips_in: List[Tuple[str, fx.Node]],
           skips_out: List[Tuple[str, fx.Node]], outgoing: List[fx.Node]) -> nn.Module:
    """Stage ``k``'s GraphModule: its input unpacked, its skips popped, its nodes and the
    values it recomputes, its skips stashed, its outputs."""
    g = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    if len(incoming) == 1:
        env[incoming[0]] = g.placeholder("input")
    else:
        x = g.placeholder("input")
        for i, a in enumerate(incoming):
            env[a] = g.call_function(operator.getitem, (x, i))
    anchor = next(iter(g.nodes))  # the input (see pop_skip)
    for name, a in skips_in:
        env[a] = g.call_function(pop_skip, (name, anchor))
    # A parameter is read only where used: torch.export reads them all at the start,
    # and a stage holding parameters it does not use would tie them across devices.
    body = sorted((n for n in nodes if n.op != "placeholder"
                   and ((stage_of[n] == k and n.op != "get_attr") or n in remat)),
                  key=index.__getitem__)
    for n in body:
        env[n] = g.node_copy(n, lambda a: env[a])
    for name, a in skips_out:
        g.call_function(stash_skip, (name, env[a]))
    result = [env[a] for a in outgoing]
    g.output(result[0] if len(result) == 1 else tuple(result))
    gm = _Stage(traced.root, g, class_name=f"Stage{k}")
    gm.gpipe_exported = traced.tracer == "export"
    if skips_out or skips_in:
        gm.gpipe_skips = ([(None, name) for name, _ in skips_out],
                          [(None, name) for name, _ in skips_in])
    _keep_persistence(traced.root, gm)
    return gm


def _state_keys(module: nn.Module, root: nn.Module, stages: List[nn.Module]
                ) -> Tuple[List[str], Dict[str, List[int]]]:
    """The module's state_dict keys in its order, and the stages holding each; parameters
    and buffers no stage uses are attached to the first stage (they are the module's)."""
    key_order = list(module.state_dict().keys())
    held = {key for st in stages for key in st.state_dict().keys()}
    for key in key_order:
        if key not in held:
            _attach(root, stages[0], key)
    key_stages: Dict[str, List[int]] = {}
    for k, st in enumerate(stages):
        for key in st.state_dict().keys():
            key_stages.setdefault(key, []).append(k)
    return key_order, key_stages


def _options(pipe_options: Dict[str, Any], names: List[str]) -> Dict[str, Any]:
    """The Pipe's options, ``batch_dim`` given by name turned into the inputs' order."""
    options = dict(pipe_options)
    bd = options.get("batch_dim", 0)
    if isinstance(bd, dict):
        unknown = set(bd) - set(names)
        if unknown:
            raise ValueError(f"batch_dim names {sorted(unknown)}, which are not the Pipe's "
                             f"inputs {names}; name forward parameters given as tensors")
        dims = [bd.get(n, 0) for n in names]
        options["batch_dim"] = dims if len(dims) > 1 else dims[0]
    return options


def _keep_persistence(module: nn.Module, gm: nn.Module) -> None:
    """fx registers every copied buffer as persistent; keep the module's choice."""
    for name, _ in list(gm.named_buffers()):
        owner, field = _owner(module, name)
        if field in owner._non_persistent_buffers_set:
            holder, _ = _owner(gm, name)
            holder._non_persistent_buffers_set.add(field)


def _attach(module: nn.Module, stage: nn.Module, key: str) -> None:
    """Registers the module's ``key`` (a parameter, buffer or extra state no stage uses) on
    ``stage`` under the same name, creating holder modules on the way."""
    *path, field = key.split(".")
    src, dst = module, stage
    for item in path:
        src = getattr(src, item)
        nxt = getattr(dst, item, None)
        if nxt is src:
            return  # the stage holds the module itself
        if nxt is None:
            nxt = nn.Module()
            dst.add_module(item, nxt)
        dst = nxt
    if field in src._parameters:
        dst.register_parameter(field, src._parameters[field])
    elif field in src._buffers:
        dst.register_buffer(field, src._buffers[field])
