"""Namespaces that keep skips of the same name apart (``Skippable.isolate``)."""
import abc
import functools
import uuid
from typing import Any

__all__ = ["Namespace"]


@functools.total_ordering
class Namespace(metaclass=abc.ABCMeta):
    """A namespace for skip names: two skippable layers using the same name
    talk to each other only when they are isolated into the same namespace
    (or both left in the default one, ``None``).

    A namespace is its random UUID: copies (``copy.copy``, pickling) compare
    equal to the original. Namespaces are ordered (by UUID, an arbitrary but
    fixed order) so keys holding them can be sorted. ``None``, the default
    namespace, counts as a ``Namespace`` for ``isinstance``.
    """

    __slots__ = ("id",)
    #: The namespace's identity: copies share it.
    id: uuid.UUID

    def __init__(self) -> None:
        self.id = uuid.uuid4()

    def __repr__(self) -> str:
        return f"<Namespace '{self.id}'>"

    def __hash__(self) -> int:
        return hash(self.id)

    def __eq__(self, other: Any) -> bool:
        # None is registered as a Namespace but has no id: test the real type.
        return type(other) is type(self) and self.id == other.id

    def __lt__(self, other: Any) -> bool:
        # Against anything else (None, the default namespace) never less, as
        # torchgpipe: sorting keys that mix None and namespaces must not raise.
        if type(other) is not type(self):
            return False
        return self.id < other.id


# None is the default namespace: isinstance(None, Namespace) holds, so
# annotations and checks need no Optional around it.
Namespace.register(type(None))
