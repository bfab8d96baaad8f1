"""_pipeline_trace.py — one graph of a module's forward for gpipe.pipeline: torch.fx, torch.export, or fx then export ("auto").

``trace`` returns the graph the cut works on (python/gpipe/pipeline.py): with torch.fx, the
forward as written, entering only the submodules that hold a split point; with torch.export,
aten ops through every submodule, the batch dim of every cut input dynamic. ``"auto"`` (the
default) tries torch.fx first, which is fast and keeps the module's own submodules, and
where fx cannot trace (Hugging Face's mask code branches on sizes) torch.export; when both
fail, one error names both attempts, the line each stopped at, and each fix.
"""
import contextlib
import dis
import inspect
import linecache
import operator
import os
import traceback
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

#: The tracers gpipe.pipeline takes.
TRACERS = ("auto", "fx", "export")


class PipelineError(RuntimeError):
    """gpipe.pipeline could not cut the module: the message names the construct (with its
    source line where known) and the fallback."""


class _Stop(NamedTuple):
    """Where one tracer stopped, for the message that names every attempt."""

    tracer: str  # "torch.fx" or "torch.export"
    where: str  # " at FILE:LINE in Class.forward: `code`", or ""
    error: str  # "TypeError: ..."
    fix: str  # what to change for this tracer
    message: str  # the whole message when this was the only attempt


#: Why a traced forward stops, whichever tracer.
_CONTROL_FLOW = ("Python control flow on tensor values (if, while, bool(), .item(), iterating a "
                 "tensor) cannot be traced into a graph")
_FX_FIX = ("move that code into a submodule that contains no split point (gpipe.pipeline calls "
           "such a submodule without tracing it; keep the region inside one stage)")
_EXPORT_FIX = ("make that code depend on sizes rather than on tensor values (torch.export "
               "follows sizes, not values; torch.cond for a branch on values)")
_SEQUENTIAL = "write the model as an nn.Sequential and use gpipe.Pipe directly"


def _is_ancestor(name: str, of: str) -> bool:
    """Whether submodule ``name`` strictly contains ``of`` ('' is the root)."""
    return name == "" or of.startswith(name + ".")


class _Tracer(fx.Tracer):
    """Traces only the modules that contain a split point; every other submodule is one
    call_module node (a leaf), run as written: its own control flow is never traced."""

    def __init__(self, split_points: Sequence[str]) -> None:
        super().__init__()
        self.split_points = list(split_points)
        #: The pytree structure of what the forward returned (the graph returns its leaves).
        self.out_spec: Any = None

    def create_args_for_root(self, root_fn: Callable, is_module: bool,
                             concrete_args: Any = None) -> Tuple[Callable, List[Any]]:
        """One placeholder per named parameter of the forward, in signature order, and the
        forward called by keyword. fx's own version patches the code object of the forward
        it is given, which for a decorated forward (``functools.wraps``, as Hugging Face's)
        is the wrapper's ``(self, *args, **kwargs)``. The graph returns the pytree leaves of
        the result, so that a registered container (a ``ModelOutput``) keeps its type: fx
        would record a dict subclass as a plain dict."""
        if not is_module:
            return super().create_args_for_root(root_fn, is_module, concrete_args)
        target = inspect.unwrap(root_fn)
        sig = inspect.signature(target)
        params = [p for p in list(sig.parameters.values())[1:]  # without self
                  if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        values = [self._proxy_placeholder(p.name, concrete_args, sig, target) for p in params]

        def forward(root: nn.Module, *args: Any) -> List[Any]:
            pos = [a for p, a in zip(params, args) if p.kind == p.POSITIONAL_ONLY]
            kw = {p.name: a for p, a in zip(params, args) if p.kind != p.POSITIONAL_ONLY}
            leaves, self.out_spec = pytree.tree_flatten(root_fn(root, *pos, **kw))
            return leaves

        return forward, [self.root, *values]

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return not any(_is_ancestor(qualname, sp) for sp in self.split_points)

    def to_bool(self, obj: fx.Proxy) -> bool:
        """``assert t <= block_size`` on a traced value becomes a ``torch._assert`` node
        (fx's own ``trace_asserts`` does not know Python 3.11's bytecode); any other
        ``bool()`` of a traced value is refused as fx refuses it."""
        frame = inspect.currentframe()
        caller = frame.f_back.f_back if frame and frame.f_back else None  # Proxy.__bool__'s
        if caller is not None:
            insts = list(dis.get_instructions(caller.f_code))
            at = next((i for i, inst in enumerate(insts) if inst.offset == caller.f_lasti), None)
            if at is not None and insts[at].opname == "TO_BOOL":  # Python 3.13 (untested)
                at += 1
            if (at is not None and at + 1 < len(insts)
                    and insts[at].opname.startswith("POP_JUMP") and "IF_TRUE" in insts[at].opname
                    and (insts[at + 1].opname == "LOAD_ASSERTION_ERROR"
                         or insts[at + 1].argval == "AssertionError")):
                where = f"{caller.f_code.co_filename}:{caller.f_lineno}"
                self.create_proxy("call_function", torch._assert,
                                  (obj, f"assertion failed at {where}"), {})
                return True
        return super().to_bool(obj)


def _user_frame(tb: Any) -> Tuple[Optional[traceback.FrameSummary], Any]:
    """The innermost frame of the traceback outside torch (where the user's code failed),
    and its ``self`` (the module whose forward it is), if any."""
    torch_dir = os.path.dirname(torch.__file__)
    here = os.path.abspath(__file__)
    found, owner = None, None
    while tb is not None:
        frame = tb.tb_frame
        path = os.path.abspath(frame.f_code.co_filename)
        generated = frame.f_code.co_filename.startswith("<")  # "<string>": exec'd code
        if not path.startswith(torch_dir) and path != here and not generated:
            found = traceback.FrameSummary(frame.f_code.co_filename, tb.tb_lineno,
                                           frame.f_code.co_name)
            owner = frame.f_locals.get("self")
        tb = tb.tb_next
    return found, owner


#: torch factories whose sizes may be traced values (``torch.ones(t, t)`` with ``t`` from
#: ``x.size()``): torch.fx records them only when a tensor argument is a Proxy, so
#: :func:`_trace` diverts them to the graph while it traces.
_FACTORIES = ("ones", "zeros", "empty", "full", "rand", "randn", "randint", "eye", "arange",
              "tril_indices", "triu_indices")


def _traced_factory(fn: Callable) -> Callable:
    def factory(*args: Any, **kwargs: Any) -> Any:
        for a in pytree.tree_leaves((args, kwargs)):
            if isinstance(a, fx.Proxy):
                return a.tracer.create_proxy("call_function", fn, args, kwargs)
        return fn(*args, **kwargs)
    factory.__wrapped__ = fn  # type: ignore[attr-defined]
    return factory


@contextlib.contextmanager
def _factories_traced() -> Iterator[None]:
    """While tracing, torch's factories record themselves when given traced sizes. Other
    threads see the patch too, but it changes only calls given a Proxy."""
    originals = {name: getattr(torch, name) for name in _FACTORIES}
    try:
        for name, fn in originals.items():
            setattr(torch, name, _traced_factory(fn))
        yield
    finally:
        for name, fn in originals.items():
            setattr(torch, name, fn)


class Traced(NamedTuple):
    """A module's forward as one graph, and what the stages are cut from."""

    #: What the stages take their submodules and parameters from: the module (fx) or the
    #: unlifted exported module, which holds the module's own parameters (export).
    root: nn.Module
    graph: fx.Graph
    #: The placeholders of the pipe's inputs, in their order.
    order: List[fx.Node]
    #: The tracer that made the graph: "fx" or "export".
    tracer: str


def trace(module: nn.Module, split_points: Sequence[str], signature: inspect.Signature,
          bound: inspect.BoundArguments, names: List[str], concrete: Dict[str, Any],
          pipe_options: Dict[str, Any], tracer: str) -> Traced:
    """The graph of ``module``'s forward on the examples ``bound`` by ``tracer``: "fx",
    "export", or "auto" (fx, and where fx cannot trace, export). ``names`` are the forward's
    parameters given as tensors (the pipe's inputs), ``concrete`` the others' values."""
    if tracer not in TRACERS:
        raise ValueError(f"tracer must be one of {list(TRACERS)}, got {tracer!r}; 'auto' (the "
                         f"default) tries torch.fx, then torch.export")
    if tracer == "export":
        refusal = _export_refusal(pipe_options)
        if refusal:
            raise ValueError(f"{refusal}; use tracer='fx' (its stages keep the module's "
                             f"BatchNorms)")
        return _export(module, bound, names, pipe_options)
    try:
        return _fx(module, split_points, signature, names, concrete)
    except PipelineError as fx_error:
        if tracer == "fx" or _stop_of(fx_error) is None:
            raise
        first = fx_error
    refusal = _export_refusal(pipe_options)
    if refusal:
        raise PipelineError(f"{_stop_of(first).message}; torch.export was not tried: "
                            f"{refusal}") from first
    try:
        return _export(module, bound, names, pipe_options)
    except PipelineError as export_error:
        if _stop_of(export_error) is None:
            raise
        raise _both_failed(module, _stop_of(first), _stop_of(export_error)) from export_error


def _export_refusal(pipe_options: Dict[str, Any]) -> str:
    """Why torch.export cannot serve these options ('' when it can)."""
    if pipe_options.get("deferred_batch_norm"):
        return ("deferred_batch_norm=True needs BatchNorm modules to convert, and torch.export "
                "turns them into aten ops")
    return ""


def _both_failed(module: nn.Module, fx_stop: _Stop, export_stop: _Stop) -> PipelineError:
    return _stopped(
        f"gpipe.pipeline could not trace {type(module).__name__} with torch.fx nor with "
        f"torch.export (tracer='auto' tries both, in that order). torch.fx stopped"
        f"{fx_stop.where}: {fx_stop.error}. torch.export stopped{export_stop.where}: "
        f"{export_stop.error}. {_CONTROL_FLOW}. For torch.fx, {fx_stop.fix}; for torch.export "
        f"(tracer='export'), {export_stop.fix}; or {_SEQUENTIAL}", None)


def _stopped(message: str, stop: Optional[_Stop]) -> PipelineError:
    """A PipelineError that knows where its tracer stopped (``stop``), for ``trace``."""
    error = PipelineError(message)
    error.gpipe_stop = stop  # type: ignore[attr-defined]
    return error


def _stop_of(error: PipelineError) -> Optional[_Stop]:
    return getattr(error, "gpipe_stop", None)


def _where(module: nn.Module, exc: BaseException, split_points: Sequence[str] = ()) -> str:
    """' at FILE:LINE in Class.forward: `code`' of the innermost frame of ``exc`` outside
    torch, with why that module was traced when it holds split points."""
    frame, owner = _user_frame(exc.__traceback__)
    if frame is None:
        return ""
    line = linecache.getline(frame.filename, frame.lineno).strip()
    func, why = frame.name, ""
    if isinstance(owner, nn.Module):
        func = f"{type(owner).__name__}.{func}"
        name = next((n for n, m in module.named_modules() if m is owner), None)
        inner = [sp for sp in split_points if name and _is_ancestor(name, sp)]
        if inner:
            why = f" ({name!r} is traced because it contains the split point(s) {inner})"
    return f" at {frame.filename}:{frame.lineno} in {func}: `{line}`{why}"


def _fx_stop(message: str, where: str, error: str, fix: str) -> PipelineError:
    return _stopped(message, _Stop("torch.fx", where, error, fix, message))


def _fx(module: nn.Module, split_points: Sequence[str], signature: inspect.Signature,
        names: List[str], concrete: Dict[str, Any]) -> Traced:
    """torch.fx's graph, the fixed (non-tensor) parameters' placeholders dropped."""
    graph = _trace(module, split_points, concrete)
    # Drop the specialised parameters: fx keeps a placeholder for each (in signature order)
    # and checks on it (``eq`` then ``_assert``); the values are baked into the graph.
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    params = [n for n, p in signature.parameters.items()
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if len(placeholders) != len(params):
        text = (f"the trace of {type(module).__name__}.forward has {len(placeholders)} inputs "
                f"for {len(params)} parameters; gpipe.pipeline cannot tell which is which")
        raise _fx_stop(text, "", text, "use tracer='export'")
    checks = (operator.eq, torch._assert, getattr(fx._symbolic_trace, "_assert_is_none", None))
    order: List[fx.Node] = []
    position = {n: i for i, n in enumerate(graph.nodes)}
    for name, node in zip(params, placeholders):
        if name in names:
            order.append(node)
            continue
        doomed, todo = [], [node]
        while todo:
            n = todo.pop()
            doomed.append(n)
            for user in n.users:
                if user.op != "call_function" or user.target not in checks:
                    fix = "pass it as a tensor, or use it only in Python control flow"
                    text = (f"argument {name!r} was fixed at its example value "
                            f"({concrete[name]!r}) but {user.format_node()} uses it; {fix}")
                    raise _fx_stop(text, "", f"{name!r} is used as a value", fix)
                todo.append(user)
        for n in sorted(set(doomed), key=lambda n: -position[n]):
            graph.erase_node(n)
    return Traced(module, graph, order, "fx")


def _trace(module: nn.Module, split_points: Sequence[str],
           concrete: Dict[str, Any]) -> fx.Graph:
    tracer = _Tracer(split_points)
    try:
        with _factories_traced():
            graph = tracer.trace(module, concrete_args=concrete or None)
        output = next(n for n in graph.nodes if n.op == "output")
        output.meta["gpipe_out_spec"] = tracer.out_spec
        return graph
    except Exception as exc:  # fx raises TraceError, TypeError, RuntimeError... from user code
        where = _where(module, exc, split_points)
        error = f"{type(exc).__name__}: {exc}"
        raise _fx_stop(
            f"gpipe.pipeline could not trace {type(module).__name__} with torch.fx{where}: "
            f"{error}. {_CONTROL_FLOW}; {_FX_FIX}, or use tracer='export' (tried by the default, "
            f"tracer='auto'), which follows code that branches on sizes, or {_SEQUENTIAL}",
            where, error, _FX_FIX) from exc


def _export(module: nn.Module, bound: inspect.BoundArguments, names: List[str],
            pipe_options: Dict[str, Any]) -> Traced:
    """torch.export's graph of ``module`` (parameters as get_attr nodes of the unlifted
    module, which holds the module's own parameters), with the batch dim of every input
    dynamic, and the placeholders in ``names`` order. Non-tensor arguments are constants of
    the graph (their placeholders unused)."""
    bd = pipe_options.get("batch_dim", 0)
    if isinstance(bd, dict):
        dims = [bd.get(n, 0) for n in names]
    elif isinstance(bd, (list, tuple)):
        dims = list(bd)
    else:
        dims = [bd] * len(names)
    if len(dims) != len(names):
        raise ValueError(f"batch_dim {bd!r} has {len(dims)} entries for the inputs {names}")
    batch = torch.export.Dim("batch")
    shapes: Dict[str, Any] = {n: None for n in bound.arguments}
    shapes.update({n: (None if d is None else {d % bound.arguments[n].dim(): batch})
                   for n, d in zip(names, dims)})
    try:
        ep = torch.export.export(module, tuple(bound.args), dict(bound.kwargs),
                                 dynamic_shapes=shapes)
    except Exception as exc:
        where = _where(module, exc)
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        text = (f"gpipe.pipeline could not export {type(module).__name__} with torch.export"
                f"{where}: {error}. Python control flow on tensor values cannot be exported "
                f"into a graph; use tracer='fx', which calls the submodules that hold no split "
                f"point without tracing them, with that code moved into such a submodule, or "
                f"{_SEQUENTIAL}")
        raise _stopped(text, _Stop("torch.export", where, error, _EXPORT_FIX, text)) from exc
    gm = ep.module()
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    missing = [n for n in names if n not in placeholders]
    if missing:
        raise PipelineError(f"torch.export's graph has no input named {missing} (it has "
                            f"{list(placeholders)}); use tracer='fx'")
    for name, p in placeholders.items():
        if name not in names:  # export's input guards take the fixed value itself
            for user in [u for u in p.users if u.op == "call_module" and u.target == "_guards_fn"]:
                user.args = tuple(bound.arguments[name] if a is p else a for a in user.args)
    used = [n for n, p in placeholders.items() if n not in names and p.users]
    if used:
        raise PipelineError(f"torch.export's graph uses the non-tensor arguments {used}, which "
                            f"are fixed at their example values; pass them as tensors, or use "
                            f"tracer='fx'")
    for name, p in placeholders.items():
        if name not in names:
            gm.graph.erase_node(p)
    return Traced(gm, gm.graph, [placeholders[n] for n in names], "export")
