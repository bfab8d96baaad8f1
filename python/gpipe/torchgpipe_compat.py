"""Checkpoints saved from torchgpipe: its state_dict keys read as a Pipe's."""
import re
from collections import OrderedDict
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["convert_torchgpipe_state_dict", "load_torchgpipe_state_dict"]

# torchgpipe 0.0.7 holds stage J as an nn.Sequential of the layers under their
# own names, in an nn.ModuleList called partitions: the Sequential's "2.weight"
# is saved as "partitions.J.2.weight" (J the stage, 2 the layer's name, not its
# place in the stage).
_KEY = re.compile(r"^partitions\.(?P<stage>[^.]+)\.(?P<name>[^.]+)(?P<rest>(\.[^.]+)+)$")

# torchgpipe's DeferredBatchNorm keeps its per-mini-batch sums as buffers; ours
# keeps them as plain attributes (zero between mini-batches either way).
_DEFERRED_SUMS = ("sum", "sum_squares")


def _convert_key(key: str, stages: Optional[List[Tuple[int, int]]],
                 balance: Optional[List[int]]) -> str:
    match = _KEY.match(key)
    if match is None or not match.group("stage").isdigit():
        raise ValueError(f"state_dict key {key!r} is not one torchgpipe saves "
                         f"(partitions.<stage>.<layer name>.<parameter>); pass the state_dict "
                         f"of a torchgpipe.GPipe as it was saved")
    stage, name = int(match.group("stage")), match.group("name")
    if stages is not None:
        if stage >= len(stages):
            raise ValueError(f"state_dict key {key!r} is in stage {stage}, but balance "
                             f"{balance} has {len(stages)} stage{'s' if len(stages) != 1 else ''}; "
                             f"pass the balance the torchgpipe model was saved with (its "
                             f".balance)")
        first, end = stages[stage]
        if name.isdigit() and not first <= int(name) < end:
            raise ValueError(f"state_dict key {key!r} puts layer {name} in stage {stage}, but "
                             f"balance {balance} gives stage {stage} layers {first} to {end - 1}; "
                             f"pass the balance the torchgpipe model was saved with (its "
                             f".balance)")
    return name + match.group("rest")


def convert_torchgpipe_state_dict(state_dict: Mapping[str, Any],
                                  balance: Optional[Iterable[int]] = None
                                  ) -> "OrderedDict[str, Any]":
    """A torchgpipe ``state_dict`` with its keys as the Sequential's (and so a
    Pipe's): ``"partitions.1.2.weight"`` becomes ``"2.weight"``.

    torchgpipe 0.0.7 saves stage J's layers under their own names in the
    Sequential, so the key names the layer whatever the balance: the result
    loads into a Pipe of any balance, or into the plain ``nn.Sequential``.
    Keys outside ``partitions`` pass through unchanged; the values are the
    same objects. The ``_metadata`` (versions, which BatchNorm's loading
    reads) is carried over under the new keys.

    Args:
        state_dict: what ``torchgpipe.GPipe.state_dict()`` returned (or
            ``torch.load`` read back).
        balance: the balance the torchgpipe model was saved with. Given, each
            key's stage must exist in it and, for a Sequential with numbered
            layers, hold that layer: a checkpoint of another model is refused.

    Raises:
        ValueError: a ``partitions`` key that is not ``partitions.<stage>.<layer
            name>.<parameter>``, or outside ``balance``; two keys that become
            one.
    """
    stages: Optional[List[Tuple[int, int]]] = None
    if balance is not None:
        balance = [int(b) for b in balance]
        stages, offset = [], 0
        for n in balance:
            stages.append((offset, offset + n))
            offset += n
    converted: "OrderedDict[str, Any]" = OrderedDict()
    source: Dict[str, str] = {}
    for key, value in state_dict.items():
        new = _convert_key(key, stages, balance) if key.startswith("partitions.") else key
        if new in converted:
            raise ValueError(f"state_dict keys {source[new]!r} and {key!r} both become {new!r} "
                             f"(the key would be there twice); pass the state_dict of one "
                             f"torchgpipe.GPipe, as it was saved")
        converted[new] = value
        source[new] = key
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        ours: "OrderedDict[str, Any]" = OrderedDict()
        for prefix, data in metadata.items():
            if prefix.startswith("partitions.") and prefix.count(".") >= 2:
                _, _, rest = prefix.split(".", 2)
                ours[rest] = data
            elif prefix != "partitions" and not prefix.startswith("partitions."):
                ours[prefix] = data
        converted._metadata = ours  # type: ignore[attr-defined]
    return converted


def load_torchgpipe_state_dict(module: nn.Module, state_dict: Mapping[str, Any],
                               strict: bool = True,
                               balance: Optional[Iterable[int]] = None) -> Any:
    """Loads a ``state_dict`` saved from ``torchgpipe.GPipe`` into ``module``,
    a :class:`gpipe.Pipe` (of any balance) or the plain ``nn.Sequential``.

    The keys are converted by :func:`convert_torchgpipe_state_dict`; the sums
    torchgpipe's DeferredBatchNorm saves as buffers (``sum``,
    ``sum_squares``, zero between mini-batches) are dropped where ``module``
    has a BatchNorm, since ours does not keep them as buffers. Then
    ``module.load_state_dict(converted, strict)``.

    Args:
        module: the Pipe (or Sequential) to load into.
        state_dict: what ``torchgpipe.GPipe.state_dict()`` returned.
        strict: as ``nn.Module.load_state_dict``: missing or unexpected keys
            raise RuntimeError.
        balance: the torchgpipe model's balance, to check the keys against
            (see :func:`convert_torchgpipe_state_dict`); None: not checked.

    Returns:
        What ``load_state_dict`` returns (``missing_keys``,
        ``unexpected_keys``).

    Example::

        pipe = gpipe.Pipe(model, balance=[2, 2], chunks=8)
        gpipe.load_torchgpipe_state_dict(pipe, torch.load("torchgpipe.pt"))
    """
    converted = convert_torchgpipe_state_dict(state_dict, balance)
    modules = dict(module.named_modules())
    for key in list(converted):
        owner, _, leaf = key.rpartition(".")
        if leaf in _DEFERRED_SUMS and isinstance(modules.get(owner), _BatchNorm) and \
                leaf not in modules[owner]._buffers:
            del converted[key]
    # load_state_dict copies into the layers' own tensors, each on its stage's
    # device: nothing moves.
    return module.load_state_dict(converted, strict=strict)
