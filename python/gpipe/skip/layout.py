"""Which skips cross stage boundaries, given how a model is cut into stages."""
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

from torch import nn

from gpipe.skip.namespace import Namespace
from gpipe.skip.skippable import Skippable
from gpipe.skip.tracker import StageRunner

__all__ = ["Route", "skip_routes", "has_skippables", "stage_runners"]


Key = Tuple[Namespace, str]


class Route(NamedTuple):
    """A skip stashed in one stage and popped in a later one."""

    #: (namespace, name) of the skip.
    key: Tuple[Namespace, str]
    #: The stage whose layer stashes it.
    stash_stage: int
    #: The stage whose layer pops it (greater than stash_stage).
    pop_stage: int


def _declared(layer: nn.Module) -> Optional[Tuple[Iterable[Key], Iterable[Key]]]:
    """The keys ``layer`` stashes and pops, or None when it declares no skips: a
    ``@skippable`` layer, or a stage made by :func:`gpipe.pipeline`, which lists its keys in
    ``gpipe_skips`` (stashed, popped)."""
    if isinstance(layer, Skippable):
        return layer.stashable(), layer.poppable()
    return getattr(layer, "gpipe_skips", None)


def skip_routes(partitions: Iterable[Iterable[nn.Module]]) -> List[Route]:
    """The skips that leave their stage: stashed by a layer of one stage and
    popped by a layer of a later one, sorted by (pop stage, stash stage,
    index of the stashing layer in the whole model, name).

    Only the stages' own layers count (a skippable nested inside another
    layer is not seen, as in torchgpipe), ``@skippable`` layers and the
    stages :func:`gpipe.pipeline` makes (their ``gpipe_skips``). Skips stashed and popped in the
    same stage, and skips with no matching stash or pop (which
    ``verify_skippables`` reports), give no route.

    Args:
        partitions: the stages, each the list of its layers, in model order.
    """
    stashed_by: Dict[Tuple[Namespace, str], Tuple[int, int]] = {}  # key -> (stage, layer index)
    found: List[Tuple[int, int, int, str, Route]] = []
    index = 0
    for stage, layers in enumerate(partitions):
        for layer in layers:
            declared = _declared(layer)
            if declared is not None:
                stashes, pops = declared
                for key in stashes:
                    stashed_by[key] = (stage, index)
                for key in pops:
                    if key not in stashed_by:
                        continue
                    stash_stage, stash_index = stashed_by.pop(key)
                    if stash_stage < stage:
                        found.append((stage, stash_stage, stash_index, key[1],
                                      Route(key, stash_stage, stage)))
            index += 1
    found.sort(key=lambda f: f[:4])
    return [f[4] for f in found]


def has_skippables(module_or_partitions: Union[nn.Module, Iterable[Iterable[nn.Module]]]) -> bool:
    """Whether a model (itself or one of its direct children) or a list of
    stages (any of their layers) has a ``@skippable`` layer.

    Args:
        module_or_partitions: an ``nn.Module`` (usually the Sequential), or
            the stages, each an iterable of layers.
    """
    if isinstance(module_or_partitions, nn.Module):
        return _declared(module_or_partitions) is not None or any(
            _declared(layer) is not None for layer in module_or_partitions.children())
    return any(_declared(layer) is not None
               for layers in module_or_partitions for layer in layers)


def stage_runners(partitions: Sequence[Sequence[nn.Module]], parts: Sequence[Any],
                  owned: Optional[Sequence[int]] = None
                  ) -> Tuple[List[Any], List[Tuple[int, int]]]:
    """What the engine runs for the stages ``owned`` (all of ``partitions`` by
    default), given ``parts``, one per owned stage (its layers, or a compiled
    module in a list), and the skip routes as (stashing stage, popping stage)
    pairs. Without skippable layers the parts are returned as they are and
    there are no routes; with them, each part runs through a
    :class:`~gpipe.skip.tracker.StageRunner` taking the skips arriving at its
    stage and giving those leaving, in route order (the engine sends them
    straight from stage to stage, also between ranks)."""
    if owned is None:
        owned = range(len(partitions))
    if not has_skippables(partitions):
        return list(parts), []
    routes = skip_routes(partitions)
    starts = [0]
    for stage in partitions:
        starts.append(starts[-1] + len(stage))
    runners = [StageRunner(part, incoming=[r.key for r in routes if r.pop_stage == s],
                           outgoing=[r.key for r in routes if r.stash_stage == s],
                           stage=s, first_layer_index=starts[s])
               for part, s in zip(parts, owned)]
    return runners, [(r.stash_stage, r.pop_stage) for r in routes]
