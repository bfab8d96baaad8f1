"""_pipeline_split.py — where gpipe.pipeline's stages begin when given only their number (``stages=K``).

The candidates are the submodules the forward calls, looked for down into the module's
``nn.ModuleList``s and ``nn.Sequential``s: a transformer keeps its blocks in one ModuleList
(``model.layers``), often inside a submodule (``model``), so the candidates of a Hugging Face
causal LM are ``model.embed_tokens``, ``model.rotary_emb``, ``model.layers.0`` ...
``model.layers.N``, ``model.norm`` and ``lm_head``. They are found by running the module once
on the examples with hooks on them (no tracer: whichever later traces the cut, the calls are
the forward's own), and balanced by parameter count or profiled time with the exact min-max
partition (:func:`gpipe.balance.balance_cost`).
"""
import contextlib
import inspect
import itertools
import time
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from gpipe.balance import _sync, _untouched, balance_cost

#: Containers whose items may begin a stage.
_CONTAINERS = (nn.ModuleList, nn.Sequential)


def candidates(module: nn.Module, deep: bool = True) -> Tuple[Set[str], Set[str]]:
    """The submodules that may begin a stage, and the modules entered to reach them: the
    root, each outermost ModuleList/Sequential (one not inside another's item) and every
    module above one. The candidates are the children of the entered modules that are not
    entered themselves (the items of the containers among them). Not ``deep``: the root
    and its own ModuleLists only (the submodules the root's forward itself calls)."""
    containers = []
    for name, m in module.named_modules():
        if not deep:
            if name and "." not in name and isinstance(m, nn.ModuleList):
                containers.append(name)
        elif name and isinstance(m, _CONTAINERS) and not any(
                name.startswith(c + ".") for c in containers):
            containers.append(name)
    entered = {""}
    for name in containers:
        parts = name.split(".")
        entered.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    found = set()
    for name in entered:
        for child, _ in module.get_submodule(name).named_children():
            full = f"{name}.{child}" if name else child
            if full not in entered:
                found.add(full)
    return found, entered


def calls(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any],
          keep_inputs: bool, deep: bool = True
          ) -> Tuple[List[str], Dict[str, List[Tuple[Any, Any]]]]:
    """The candidates the forward calls on the examples, in the order of their first call
    (a candidate called inside another one does not count), and, with ``keep_inputs``, a
    copy of the arguments of every call of each. The module runs once without grad, where it
    is; its parameters, buffers, training mode and the RNG state are left as they were."""
    found, _ = candidates(module, deep)
    order: List[str] = []
    inputs: Dict[str, List[Tuple[Any, Any]]] = {}
    depth = [0]

    def before(name: str) -> Any:
        def hook(m: nn.Module, a: Any, k: Any) -> None:
            if depth[0] == 0:
                if name not in inputs:
                    order.append(name)
                    inputs[name] = []
                if keep_inputs:
                    inputs[name].append(pytree.tree_map(_copy, (a, k)))
            depth[0] += 1
        return hook

    def after(m: nn.Module, a: Any, k: Any, out: Any) -> None:
        depth[0] -= 1

    modules = dict(module.named_modules())
    with contextlib.ExitStack() as stack:
        for name in sorted(found):
            sub = modules[name]
            stack.callback(sub.register_forward_pre_hook(before(name), with_kwargs=True).remove)
            stack.callback(sub.register_forward_hook(after, with_kwargs=True,
                                                     always_call=True).remove)
        stack.enter_context(_untouched(module))
        stack.enter_context(torch.random.fork_rng(devices=[]))
        stack.enter_context(torch.no_grad())
        module(*args, **kwargs)
    return order, inputs


def _copy(v: Any) -> Any:
    return v.detach().clone() if isinstance(v, Tensor) else v


def balanced_split_points(module: nn.Module, stages: Any, balance_by: str, example_args: Any,
                          example_kwargs: Optional[Dict[str, Any]],
                          deep: bool = True) -> List[str]:
    """Split points for ``stages`` stages over the submodules the forward calls (see
    :func:`candidates`), balanced by parameter count or profiled time."""
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be an int of at least 1, got {stages!r}")
    if balance_by not in ("params", "time"):
        raise ValueError(f"balance_by must be 'params' or 'time', got {balance_by!r}")
    args = example_args if isinstance(example_args, tuple) else (example_args,)
    kwargs = dict(example_kwargs or {})
    inspect.signature(module.forward).bind(*args, **kwargs)  # a TypeError naming the mismatch
    order, inputs = calls(module, args, kwargs, balance_by == "time", deep)
    if len(order) < stages:
        raise ValueError(f"stages={stages} but {type(module).__name__}.forward calls only "
                         f"{len(order)} submodules to begin stages at ({order}; looking into its "
                         f"ModuleLists and Sequentials); pass at most {len(order)}, or "
                         f"split_points inside them")
    if balance_by == "time":
        costs = _profiled_costs(module, order, inputs)
    else:
        seen: Set[int] = set()
        costs = []
        for name in order:
            params = [p for p in module.get_submodule(name).parameters() if id(p) not in seen]
            seen.update(id(p) for p in params)
            costs.append(sum(p.numel() for p in params))
    counts = balance_cost(costs, stages)
    starts = list(itertools.accumulate(counts))[:-1]
    return [order[i] for i in starts]


def _profiled_costs(module: nn.Module, order: List[str],
                    inputs: Dict[str, List[Tuple[Any, Any]]], repeat: int = 3) -> List[float]:
    """Each submodule's forward and backward time on the examples (every call of it, the
    fastest of ``repeat`` runs after a warm-up), the module left as it was."""
    costs = []

    def fresh(v: Any) -> Any:  # a graph input of its own for each run, as a stage gets
        if isinstance(v, Tensor) and (v.is_floating_point() or v.is_complex()):
            return v.detach().clone().requires_grad_()
        return v

    with _untouched(module), torch.random.fork_rng(devices=[]):
        for name in order:
            sub = module.get_submodule(name)
            total = 0.0
            for a, k in inputs[name]:
                best = float("inf")
                for run in range(repeat + 1):
                    a_run, k_run = pytree.tree_map(fresh, (a, k))
                    begin = time.perf_counter()
                    out = sub(*a_run, **k_run)
                    roots = [t for t in pytree.tree_leaves(out)
                             if isinstance(t, Tensor) and t.requires_grad]
                    if roots:
                        torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
                    for device in {t.device for t in roots}:
                        _sync(device)
                    if run > 0:
                        best = min(best, time.perf_counter() - begin)
                total += best
            costs.append(total)
    return costs
