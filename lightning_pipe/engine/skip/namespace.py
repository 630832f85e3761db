"""Namespaces that keep the skip names of different module instances apart."""

from __future__ import annotations

import uuid
from typing import Any

__all__ = ["Namespace"]


class Namespace:
    """A scope for skip names, so that several instances of one skippable class can be used in one model.

    ::

        ns1, ns2 = Namespace(), Namespace()
        model = nn.Sequential(Stash().isolate(ns1), Stash().isolate(ns2), Pop().isolate(ns1), ...)

    Namespaces compare by identity of their id, which survives pickling (across processes too).
    """

    __slots__ = ("id",)

    def __init__(self, id: str | None = None) -> None:
        self.id = id or uuid.uuid4().hex

    def __repr__(self) -> str:
        return f"<Namespace '{self.id[:8]}'>"

    def __hash__(self) -> int:
        return hash(self.id)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Namespace) and other.id == self.id

    def __lt__(self, other: Namespace) -> bool:
        return self.id < other.id

    def __getstate__(self) -> str:
        return self.id

    def __setstate__(self, state: str) -> None:
        self.id = state


#: The namespace of names that were not isolated.
DEFAULT = Namespace("default")

#: A skip's full name: its namespace and its name.
SkipKey = tuple[Namespace, str]
