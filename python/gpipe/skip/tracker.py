"""Where skip tensors wait between their stash and their pop: one tracker per thread, and
the per-stage runner that gives each call of a stage its own."""
import contextlib
import threading
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

import torch.fx as fx
from torch import Tensor, nn

from gpipe.skip.namespace import Namespace

__all__ = ["SkipTracker", "StageRunner", "current_skip_tracker", "use_skip_tracker", "pop_skip",
           "stash_skip"]

Key = Tuple[Namespace, str]


class SkipTracker:
    """Holds the skip tensors stashed and not yet popped, by (namespace,
    name). Skippable layers save to and load from the tracker of their
    thread (``current_skip_tracker()``).

    ``batch`` (the stashing or popping layer's output or input) is unused
    here: the signature is torchgpipe's, for trackers that tie the skip to
    the micro-batch."""

    def __init__(self) -> None:
        #: Stashed, not yet popped: (namespace, name) -> tensor (None for a None skip).
        self.tensors: Dict[Key, Optional[Tensor]] = {}
        #: Always empty: gpipe moves skips between stages itself (no portals);
        #: kept for code written against torchgpipe's tracker that looks at it.
        self.portals: Dict[Key, Any] = {}

    def save(self, batch: Any, ns: Namespace, name: str, tensor: Optional[Tensor]) -> None:
        """Keeps ``tensor`` under ``(ns, name)`` until it is loaded (a second
        save replaces the first)."""
        self.tensors[(ns, name)] = tensor

    def load(self, batch: Any, ns: Namespace, name: str) -> Optional[Tensor]:
        """Takes the tensor saved under ``(ns, name)`` out of the tracker;
        KeyError when there is none."""
        return self.tensors.pop((ns, name))


class _Local(threading.local):
    def __init__(self) -> None:
        self.tracker: Optional[SkipTracker] = None


_local = _Local()


@contextlib.contextmanager
def use_skip_tracker(skip_tracker: SkipTracker) -> Iterator[None]:
    """Makes ``skip_tracker`` the current thread's tracker inside the
    ``with`` block; the previous one comes back afterwards, also on error."""
    previous = _local.tracker
    _local.tracker = skip_tracker
    try:
        yield
    finally:
        _local.tracker = previous


def current_skip_tracker() -> SkipTracker:
    """The current thread's tracker: the one ``use_skip_tracker`` installed,
    else the thread's default one (made on first use, kept for the thread's
    life, as torchgpipe's: a plain model of skippables needs no setup)."""
    tracker = _local.tracker
    if tracker is None:
        tracker = _local.tracker = SkipTracker()
    return tracker


def pop_skip(name: str, anchor: Any = None) -> Optional[Tensor]:
    """Takes the skip ``name`` (default namespace) from the current thread's tracker: where
    a stage made by :func:`gpipe.pipeline` receives a value from an earlier stage that the
    stages in between do not use. ``anchor`` (the stage's input) is unused, except that
    when it is a torch.fx Proxy (the stage's code traced again, as unpickling does) the call
    records itself instead of running."""
    if isinstance(anchor, fx.Proxy):
        return anchor.tracer.create_proxy("call_function", pop_skip, (name, anchor), {})
    return current_skip_tracker().load(None, None, name)


def stash_skip(name: str, tensor: Optional[Tensor]) -> None:
    """Gives ``tensor`` to the current thread's tracker as the skip ``name`` (default
    namespace): where a stage made by :func:`gpipe.pipeline` sends a value to a later stage
    that is not the next. A torch.fx Proxy records the call instead (as :func:`pop_skip`)."""
    if isinstance(tensor, fx.Proxy):
        tensor.tracer.create_proxy("call_function", stash_skip, (name, tensor), {})
        return
    current_skip_tracker().save(None, None, name, tensor)


class StageRunner:
    """Runs one pipeline stage's layers with the skips that cross stage
    boundaries passed in and out explicitly.

    ``runner(input, skips)`` takes the stage's input and one tensor (or None)
    per ``incoming`` key, in order, and returns ``(output, outgoing)``: the
    last layer's output and one tensor (or None) per ``outgoing`` key. Each
    call gets a fresh tracker holding just the incoming skips, so calls on
    different threads, and a recomputation of the same call, never see each
    other's skips, and nothing outlives the call.

    Args:
        layers: the stage's layers, in order.
        incoming: keys (namespace, name) of the skips popped in this stage
            but stashed in an earlier one.
        outgoing: keys of the skips stashed in this stage and popped in a
            later one.
        stage: the stage's index (for error messages).
        first_layer_index: the index of ``layers[0]`` in the whole model (for
            error messages).
    """

    def __init__(self, layers: Sequence[nn.Module], incoming: Sequence[Key],
                 outgoing: Sequence[Key], stage: int, first_layer_index: int) -> None:
        self.layers = list(layers)
        self.incoming = [tuple(k) for k in incoming]
        self.outgoing = [tuple(k) for k in outgoing]
        self.stage = stage
        self.first_layer_index = first_layer_index

    def __call__(self, input: Any, skips: Sequence[Optional[Tensor]] = ()
                 ) -> Tuple[Any, Tuple[Optional[Tensor], ...]]:
        """Runs the layers on ``input`` with the ``incoming`` skips; returns
        the output and the ``outgoing`` skips."""
        if len(skips) != len(self.incoming):
            raise ValueError(f"stage {self.stage} takes {len(self.incoming)} incoming skip(s) "
                             f"{[name for _, name in self.incoming]}, got {len(skips)}; pass "
                             f"one tensor (or None) per incoming key, in order")
        tracker = SkipTracker()
        tracker.tensors.update(zip(self.incoming, skips))
        x = input
        try:
            with use_skip_tracker(tracker):
                for layer in self.layers:
                    x = layer(x)
            for key in self.outgoing:
                if key not in tracker.tensors:
                    raise self._error(key, stashed=False)
            for key in self.incoming:
                if key in tracker.tensors:
                    raise self._error(key, stashed=True)
            return x, tuple(tracker.tensors.pop(key) for key in self.outgoing)
        finally:
            # Nothing outlives the call, not even through a traceback's frames.
            tracker.tensors.clear()

    def _declared_by(self, key: Key, stashable: bool) -> str:
        """Which layers of this stage declare ``key``, for an error message."""
        from gpipe.skip.skippable import Skippable  # skippable imports this module
        found = [f"layer {self.first_layer_index + i} ({type(layer).__name__})"
                 for i, layer in enumerate(self.layers) if isinstance(layer, Skippable)
                 and key in (layer.stashable() if stashable else layer.poppable())]
        if found:
            return "declared by " + ", ".join(found)
        return f"no layer of stage {self.stage} declares it"

    def _error(self, key: Key, stashed: bool) -> RuntimeError:
        ns, name = key
        where = "" if ns is None else f" (namespace {ns!r})"
        if not stashed:
            return RuntimeError(
                f"stage {self.stage} must send skip '{name}'{where} on to a later stage, but it "
                f"was not stashed ({self._declared_by(key, True)} as stashable); stash it in "
                f"this stage with `yield stash('{name}', tensor)` in a layer declared "
                f"@skippable(stash=['{name}']), or recompute the routes (skip_routes) for this "
                f"balance")
        return RuntimeError(
            f"stage {self.stage} received skip '{name}'{where} from an earlier stage, but it "
            f"was not popped ({self._declared_by(key, False)} as poppable); pop it in this stage "
            f"with `yield pop('{name}')` in a layer declared @skippable(pop=['{name}']), or "
            f"recompute the routes (skip_routes) for this balance")
