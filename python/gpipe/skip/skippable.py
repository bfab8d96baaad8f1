"""The skip API users write: ``@skippable``, the ``stash`` and ``pop`` commands, and the
static check ``verify_skippables``."""
import sys
import types
from typing import (Any, Callable, ClassVar, Dict, FrozenSet, Generator, Iterable, Iterator, List,
                    Optional, Set, Tuple, Type, TypeVar, Union)

from torch import Tensor, nn

from gpipe.skip import tracker as _tracker
from gpipe.skip.namespace import Namespace

__all__ = ["Skippable", "skippable", "stash", "pop", "verify_skippables"]

TensorOrTensors = Union[Tensor, Tuple[Tensor, ...]]
T = TypeVar("T", bound="Skippable")


class stash:
    """The command a skippable layer's ``forward`` yields to stash a skip:
    ``yield stash('name', tensor)``. ``tensor`` may be None (a skip that
    carries nothing); the layer must declare the name in
    ``@skippable(stash=[...])``.

    Args:
        name: the skip's name.
        tensor: what the popping layer receives.
    """

    __slots__ = ("name", "tensor")
    #: The skip's name.
    name: str
    #: The tensor stashed (None: a skip that carries nothing).
    tensor: Optional[Tensor]

    def __init__(self, name: str, tensor: Optional[Tensor]) -> None:
        self.name = name
        self.tensor = tensor

    def __repr__(self) -> str:
        return f"stash({self.name!r}, ...)"


class pop:
    """The command a skippable layer's ``forward`` yields to pop a skip:
    ``skip = yield pop('name')`` gives the tensor (or None) an earlier layer
    stashed under that name; the layer must declare the name in
    ``@skippable(pop=[...])``.

    Args:
        name: the skip's name.
    """

    __slots__ = ("name",)
    #: The skip's name.
    name: str

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"pop({self.name!r})"


class Skippable(nn.Module):
    """The base of every class ``@skippable`` makes: it holds an instance of
    the decorated class as ``.module`` (so parameters are ``module.weight``
    and so on, as in torchgpipe) and runs its ``forward``, serving the
    ``stash`` and ``pop`` commands it yields through the thread's skip
    tracker. Not meant to be subclassed by hand: decorate with
    ``@skippable``.
    """

    #: The decorated class; ``.module`` is an instance of it.
    module_cls: ClassVar[Type[nn.Module]]
    #: The names declared in ``@skippable(stash=...)``.
    stashable_names: ClassVar[FrozenSet[str]]
    #: The names declared in ``@skippable(pop=...)``.
    poppable_names: ClassVar[FrozenSet[str]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.module = self.module_cls(*args, **kwargs)
        # Skip name -> namespace; names not in it are in the default one (None).
        self.namespaces: Dict[str, Namespace] = {}

    def __repr__(self) -> str:
        return f"@skippable({self.module})"

    def namespaced(self, name: str) -> Tuple[Namespace, str]:
        """The key ``(namespace, name)`` the skip ``name`` travels under."""
        return (self.namespaces.get(name), name)

    def stashable(self) -> Iterator[Tuple[Namespace, str]]:
        """The keys this layer stashes, in name order."""
        return (self.namespaced(name) for name in sorted(self.stashable_names))

    def poppable(self) -> Iterator[Tuple[Namespace, str]]:
        """The keys this layer pops, in name order."""
        return (self.namespaced(name) for name in sorted(self.poppable_names))

    def isolate(self: T, ns: Namespace, *, only: Optional[Iterable[str]] = None) -> T:
        """Moves this layer's skips (all, or just the names in ``only``) into
        the namespace ``ns``, so that one model can use a name more than once:
        a stash and a pop match only within the same namespace::

            ns1, ns2 = Namespace(), Namespace()
            model = nn.Sequential(Stash().isolate(ns1), Stash().isolate(ns2),
                                  Pop().isolate(ns2), Pop().isolate(ns1))

        Args:
            ns: the namespace.
            only: the names to move (default: every name this layer declares).

        Returns:
            this layer, so calls chain.
        """
        names = self.stashable_names | self.poppable_names if only is None else set(only)
        for name in names:
            self.namespaces[name] = ns
        return self

    def forward(self, input: TensorOrTensors) -> TensorOrTensors:  # type: ignore[override]
        """Runs the wrapped module's ``forward`` on ``input``, popping the
        declared skips from and stashing them to the current thread's tracker.

        Raises:
            RuntimeError: a skip popped but never stashed; a name stashed or
                popped but not declared; a declared name not stashed or not
                popped.
            TypeError: ``forward`` yielded something other than ``stash`` or
                ``pop``.
        """
        # Looked up through the module on every call, so a tracker swapped in
        # there (or by use_skip_tracker) is the one used.
        tracker = _tracker.current_skip_tracker()
        cls = type(self).__name__
        # Every declared pop is taken from the tracker up front, as torchgpipe does.
        poppable: Dict[str, Optional[Tensor]] = {}
        for ns, name in self.poppable():
            try:
                poppable[name] = tracker.load(input, ns, name)
            except KeyError:
                raise RuntimeError(
                    f"'{name}' has not been stashed (popped by {cls}); stash it in an earlier "
                    f"layer with `yield stash('{name}', tensor)` under @skippable(stash=['{name}'])"
                    + ("" if ns is None else ", isolated into the same namespace")) from None
        stashed: Dict[str, Optional[Tensor]] = {}
        output = self.module(input)
        if isinstance(output, types.GeneratorType):
            output = self._serve(output, stashed, poppable)

        missing = sorted(self.stashable_names - stashed.keys())
        if missing:
            names = ", ".join(f"'{n}'" for n in missing)
            raise RuntimeError(f"{names} must be stashed but have not (in {cls}.forward); yield "
                               f"stash(name, tensor) for each on every call (stash(name, None) "
                               f"for nothing), or leave them out of @skippable(stash=...)")
        if poppable:
            names = ", ".join(f"'{n}'" for n in sorted(poppable))
            raise RuntimeError(f"{names} must be popped but have not (in {cls}.forward); yield "
                               f"pop(name) for each on every call, or leave them out of "
                               f"@skippable(pop=...)")
        for ns, name in self.stashable():
            tracker.save(output, ns, name, stashed[name])
        return output

    def _serve(self, generator: Generator[Any, Optional[Tensor], TensorOrTensors],
               stashed: Dict[str, Optional[Tensor]],
               poppable: Dict[str, Optional[Tensor]]) -> TensorOrTensors:
        """Drives ``forward``'s generator: answers each command, returns what it returns."""
        cls = type(self).__name__
        reply: Optional[Tensor] = None
        try:
            while True:
                command = generator.send(reply)
                reply = None
                if isinstance(command, stash):
                    if command.name not in self.stashable_names:
                        raise RuntimeError(
                            f"'{command.name}' has not been declared as stashable (in {cls}); "
                            f"add it: @skippable(stash=['{command.name}'])")
                    stashed[command.name] = command.tensor
                elif isinstance(command, pop):
                    if command.name not in self.poppable_names:
                        raise RuntimeError(
                            f"'{command.name}' has not been declared as poppable (in {cls}); "
                            f"add it: @skippable(pop=['{command.name}'])")
                    if command.name not in poppable:
                        raise RuntimeError(f"'{command.name}' has been popped already (in "
                                           f"{cls}); pop each skip once per call")
                    reply = poppable.pop(command.name)
                else:
                    raise TypeError(f"{command!r} is not a command from @skippable; yield "
                                    f"stash(name, tensor) or pop(name) from {cls}.forward")
        except StopIteration as stop:
            return stop.value
        finally:
            generator.close()


def _reachable(cls: type) -> bool:
    """Whether pickle finds ``cls`` by its module and qualified name."""
    obj: Any = sys.modules.get(cls.__module__)
    for part in cls.__qualname__.split("."):
        obj = getattr(obj, part, None)
    return obj is cls


def skippable(stash: Iterable[str] = (),
              pop: Iterable[str] = ()) -> Callable[[Type[nn.Module]], Type[Skippable]]:
    """Class decorator for a layer with skip connections: its ``forward``
    may ``yield stash(name, tensor)`` and ``tensor = yield pop(name)`` for
    the names declared here. It works alike in a plain ``nn.Sequential`` and
    in a ``gpipe.Pipe`` (where a skip goes straight from the stashing stage
    to the popping one)::

        @skippable(stash=['1to3'])
        class Layer1(nn.Module):
            def forward(self, input):
                yield stash('1to3', input)
                return f1(input)

        @skippable(pop=['1to3'])
        class Layer3(nn.Module):
            def forward(self, input):
                skip = yield pop('1to3')
                return f3(input) + skip

        model = nn.Sequential(Layer1(), Layer2(), Layer3())

    Each name must be stashed by exactly one layer and popped by exactly one
    later layer (``verify_skippables`` checks it; use ``Namespace`` and
    ``isolate`` to reuse a name). The decorator returns a new class, a
    ``Skippable`` with the decorated class's name, that builds an instance of
    the decorated class as ``.module``; a model of module-level decorated
    classes pickles and deep-copies.

    Args:
        stash: the names this layer stashes.
        pop: the names this layer pops.
    """
    stashable_names = frozenset(stash)
    poppable_names = frozenset(pop)

    def wrap(module_cls: Type[nn.Module]) -> Type[Skippable]:
        qualname = module_cls.__qualname__
        if not _reachable(module_cls) and "<locals>" not in qualname:
            # The decorated name will be bound to the new class, so pickle
            # could not find the wrapped one by its own name: it lives on as
            # the new class's module_cls, so that is where pickle looks.
            module_cls.__qualname__ = f"{qualname}.module_cls"
        attrs = {"module_cls": module_cls, "stashable_names": stashable_names,
                 "poppable_names": poppable_names, "__module__": module_cls.__module__,
                 "__qualname__": qualname, "__doc__": module_cls.__doc__}
        return type(module_cls.__name__, (Skippable,), attrs)

    return wrap


def verify_skippables(module: nn.Sequential) -> None:
    """Checks that every skip in ``module``'s layers (its direct children)
    has exactly one stash and one later pop, per namespace. Failures, for
    Layer1 stashing '1to3' and Layer3 popping it::

        nn.Sequential(Layer1(), Layer2())                      # never popped
        nn.Sequential(Layer2(), Layer3())                      # popped, never stashed
        nn.Sequential(Layer1(), Layer2(), Layer3(), Layer3())  # popped twice
        nn.Sequential(Layer1(), Layer1(), Layer2(), Layer3())  # stashed twice

    Args:
        module: the model, a Sequential of layers.

    Raises:
        TypeError: listing every mismatch, with the layers' names in
            ``module`` (torchgpipe's messages).
    """
    problems: List[str] = []
    stashed: Set[Tuple[Namespace, str]] = set()
    popped: Set[Tuple[Namespace, str]] = set()
    unpopped_order: List[Tuple[Namespace, str]] = []
    for layer_name, layer in module.named_children():
        if not isinstance(layer, Skippable):
            continue
        both = layer.stashable_names & layer.poppable_names
        problems += [f"'{layer_name}' declared '{name}' both as stashable and as poppable"
                     for name in sorted(both)]
        for key in layer.stashable():
            if key[1] in both:
                continue
            if key in stashed:
                problems.append(f"'{layer_name}' redeclared '{key[1]}' as stashable but not "
                                f"isolated by namespace")
            else:
                stashed.add(key)
                unpopped_order.append(key)
        for key in layer.poppable():
            if key[1] in both:
                continue
            if key in popped:
                problems.append(f"'{layer_name}' redeclared '{key[1]}' as poppable but not "
                                f"isolated by namespace")
            elif key not in stashed:
                problems.append(f"'{layer_name}' declared '{key[1]}' as poppable but it was not "
                                f"stashed")
            else:
                popped.add(key)
    problems += [f"no module declared '{name}' as poppable but stashed"
                 for key in unpopped_order if key not in popped for name in [key[1]]]
    if problems:
        raise TypeError("one or more pairs of stash and pop do not match:\n\n"
                        + "\n".join(f"* {p}" for p in problems))
