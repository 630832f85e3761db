"""The ``@skippable`` decorator and the ``stash``/``pop`` commands a skippable forward yields."""

from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator
from typing import Any, ClassVar

from torch import Tensor, nn

from lightning_pipe.engine.skip.namespace import DEFAULT, Namespace, SkipKey
from lightning_pipe.engine.skip.tracker import current_skip_tracker

__all__ = ["skippable", "stash", "pop", "verify_skippables", "Skippable"]


class stash:  # noqa: N801 - a command used as ``yield stash(name, tensor)``
    """The command to stash ``tensor`` under ``name`` for a later layer: ``yield stash('1to3', x)``."""

    __slots__ = ("name", "tensor")

    def __init__(self, name: str, tensor: Tensor | None) -> None:
        self.name = name
        self.tensor = tensor


class pop:  # noqa: N801 - a command used as ``x = yield pop(name)``
    """The command to take the tensor stashed under ``name``: ``skip = yield pop('1to3')``."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class Skippable(nn.Module):
    """A module whose forward may stash tensors for later layers and pop tensors from earlier ones.

    Made by :func:`skippable`; it wraps an instance of the decorated class as ``self.module``.
    """

    module_cls: ClassVar[type[nn.Module]]
    stashable_names: ClassVar[frozenset[str]]
    poppable_names: ClassVar[frozenset[str]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.module = self.module_cls(*args, **kwargs)
        self.namespaces: dict[str, Namespace] = {}

    def __repr__(self) -> str:
        return f"@skippable({self.module})"

    def namespaced(self, name: str) -> SkipKey:
        """The full key of ``name`` in this module's namespace for it."""
        return self.namespaces.get(name, DEFAULT), name

    def stashable(self) -> Iterator[SkipKey]:
        """The keys this module stashes."""
        return (self.namespaced(n) for n in sorted(self.stashable_names))

    def poppable(self) -> Iterator[SkipKey]:
        """The keys this module pops."""
        return (self.namespaced(n) for n in sorted(self.poppable_names))

    def isolate(self, ns: Namespace, *, only: Iterable[str] | None = None) -> Skippable:
        """Put this module's skip names (or just ``only`` of them) into namespace ``ns``; returns self."""
        declared = self.stashable_names | self.poppable_names
        names = set(declared if only is None else only)
        unknown = sorted(names - declared)
        if unknown:
            raise ValueError(
                f"cannot isolate names this module does not stash or pop (unknown: {unknown}, "
                f"declared: {sorted(declared)})"
            )
        for name in names:
            self.namespaces[name] = ns
        return self

    def forward(self, input: Any) -> Any:
        """Run the wrapped forward, serving its ``stash``/``pop`` commands from the thread's tracker.

        Every declared name must be stashed or popped in every forward, as torchgpipe required: a layer that
        leaves one out (a name misspelt in ``yield stash(...)``, a branch that skips its pop) raises
        ``RuntimeError`` naming it, rather than training a model other than the one declared.
        """
        result = self.module(input)
        stashed: set[str] = set()
        popped: set[str] = set()
        if isinstance(result, Generator):
            result = self._serve(result, stashed, popped)
        for verb, past, declared, done, how in (
                ("stash", "stashed", self.stashable_names, stashed,
                 "yield stash(name, tensor), or stash(name, None) where there is nothing to pass"),
                ("pop", "popped", self.poppable_names, popped, "x = yield pop(name), even where x goes unused")):
            missing = sorted(declared - done)
            if missing:
                raise RuntimeError(f"{type(self).__name__} did not {verb} {', '.join(map(repr, missing))} in this "
                                   f"forward, which it declares (@skippable({verb}={sorted(declared)})); every "
                                   f"declared name must be {past} in every forward: {how}")
        return result

    def _serve(self, forward: Generator[Any, Any, Any], stashed: set[str], popped: set[str]) -> Any:
        tracker = current_skip_tracker()
        send: Any = None
        try:
            while True:
                command = forward.send(send)
                send = None
                if isinstance(command, stash):
                    if command.name not in self.stashable_names:
                        raise RuntimeError(
                            f"{type(self).__name__} stashes '{command.name}' without declaring it "
                            f"(declared: @skippable(stash={sorted(self.stashable_names)}))"
                        )
                    tracker.save(self.namespaced(command.name), command.tensor)
                    stashed.add(command.name)
                elif isinstance(command, pop):
                    if command.name not in self.poppable_names:
                        raise RuntimeError(
                            f"{type(self).__name__} pops '{command.name}' without declaring it "
                            f"(declared: @skippable(pop={sorted(self.poppable_names)}))"
                        )
                    send = tracker.load(self.namespaced(command.name))
                    popped.add(command.name)
                else:
                    raise TypeError(
                        f"a skippable forward may only yield stash(...) or pop(...) (got: {type(command).__name__})"
                    )
        except StopIteration as stop:
            return stop.value


def skippable(stash: Iterable[str] = (), pop: Iterable[str] = ()) -> Any:
    """Class decorator: the module's forward may ``yield stash(name, x)`` and ``x = yield pop(name)``.

    ::

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

    Inside :class:`~lightning_pipe.Pipe` a stashed tensor goes straight to the partition that pops it,
    without passing through the partitions between; in a plain ``nn.Sequential`` it waits on the thread.
    """
    stashes, pops = frozenset(stash), frozenset(pop)

    def decorate(module_cls: type[nn.Module]) -> type[Skippable]:
        attrs = {
            "module_cls": module_cls,
            "stashable_names": stashes,
            "poppable_names": pops,
            "__doc__": module_cls.__doc__,
            "__module__": module_cls.__module__,
            "__qualname__": module_cls.__qualname__,
        }
        return type(module_cls.__name__, (Skippable,), attrs)

    return decorate


def verify_skippables(module: nn.Sequential) -> None:
    """Check that every stash in ``module`` has exactly one later pop and every pop one earlier stash.

    Raises ``TypeError`` naming every mismatch, e.g. ``'3' pops '1to3' but it is not stashed``.
    """
    stashed: dict[SkipKey, str] = {}
    popped: dict[SkipKey, str] = {}
    problems: list[str] = []
    layers = list(module._modules.items())  # every position: named_children() would list a repeated layer once
    for name, layer in layers:
        if not isinstance(layer, Skippable):
            continue
        for key in layer.poppable():
            if key in popped:
                problems.append(f"'{name}' pops '{key[1]}' which '{popped[key]}' already pops")
            elif key not in stashed:
                later = [n for n, m in layers if isinstance(m, Skippable) and key in m.stashable()]
                where = f" before '{later[0]}' stashes it" if later else " but it is not stashed"
                problems.append(f"'{name}' pops '{key[1]}'{where}")
            popped.setdefault(key, name)
        for key in layer.stashable():
            if key in stashed:
                problems.append(f"'{name}' stashes '{key[1]}' which '{stashed[key]}' already stashes")
            stashed.setdefault(key, name)
    for key, name in stashed.items():
        if key not in popped:
            problems.append(f"'{name}' stashes '{key[1]}' but it is not popped")
    if problems:
        raise TypeError("one or more pairs of stash and pop do not match:\n\n" +
                        "\n".join(f"- {p}" for p in problems))
