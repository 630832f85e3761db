"""Parameters shared by several partitions of one ``Pipe`` (a head tied to its embedding): a copy in each later
partition, in step with the first partition's, their gradients summed into it.

Each stage runs its own local autograd on its own thread and manages its own parameters' ``.grad`` (a schedule
that runs backwards ahead of its caller's sets them aside per stage, :mod:`lightning_pipe.engine.aside`), so two
stages must never hold the same ``Parameter``. As ``PipeStrategy`` does across processes, the first partition
that uses a shared parameter owns it; every later partition using it gets a copy of its own (on its device)::

    forward   copy ◄── owner's values and requires_grad        (refresh: before every forward)
    backward  owner.grad += copy.grad; copy.grad = None         (gather: once the pipeline's backward is done)

The copies are the partitions' own parameters to the stages, and nobody else's: ``Pipe.parameters()`` (what an
optimizer steps, clips or zeroes) lists the owner alone, as the plain module lists a tied parameter once.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

__all__: list[str] = []

#: Where a parameter is: the module holding it and its name there.
Location = tuple[nn.Module, str]


def _untie_modules(partitions: Sequence[nn.Module]) -> None:
    """A module used by several partitions (a head that calls the embedding module itself) is, in each later
    partition, a shallow copy of it: its own module object holding the same parameters, which
    :class:`TiedCopies` can then replace there without touching the earlier partition's."""
    earlier: set[int] = set()
    for partition in partitions:
        stack = [partition]
        while stack:
            parent = stack.pop()
            for name, child in parent._modules.items():
                if child is not None and id(child) in earlier:
                    parent._modules[name] = child = _shallow(child)
                if child is not None:
                    stack.append(child)
        earlier.update(id(m) for m in partition.modules())


def _shallow(module: nn.Module) -> nn.Module:
    """``module`` and its submodules as new module objects holding the same parameters and buffers."""
    twin = copy.copy(module)
    twin._parameters = dict(module._parameters)
    twin._buffers = dict(module._buffers)
    twin._modules = {name: None if child is None else _shallow(child) for name, child in module._modules.items()}
    return twin


class TiedCopies:
    """The shared parameters of ``partitions`` (each an ``nn.Module`` of consecutive layers), untied at
    construction: each later partition that uses one gets a copy, replacing it at every place it is used there."""

    def __init__(self, partitions: Sequence[nn.Module]) -> None:
        _untie_modules(partitions)
        users: dict[int, dict[int, list[Location]]] = {}  # parameter -> partition -> its places there
        for j, partition in enumerate(partitions):
            for module in partition.modules():
                for name, p in module._parameters.items():
                    if p is not None:
                        users.setdefault(id(p), {}).setdefault(j, []).append((module, name))
        #: (the owner's place, one place of the copy per later partition)
        self.ties: list[tuple[Location, list[Location]]] = []
        for places in users.values():
            if len(places) < 2:
                continue
            first, *later = sorted(places)
            owner = places[first][0]
            shared = getattr(*owner)
            copies = []
            for j in later:
                twin = nn.Parameter(shared.detach().clone(), requires_grad=shared.requires_grad)
                for module, name in places[j]:
                    module._parameters[name] = twin
                copies.append(places[j][0])
            self.ties.append((owner, copies))

    def __bool__(self) -> bool:
        return bool(self.ties)

    def copies(self) -> set[int]:
        """The ids of the copies (looked up where they are: moving a module may replace its parameters)."""
        return {id(getattr(*place)) for _, places in self.ties for place in places}

    @torch.no_grad()
    def refresh(self) -> None:
        """Every copy takes its owner's values and ``requires_grad`` (after whatever changed the owner: an
        optimizer step, a load, freezing)."""
        for owner_place, places in self.ties:
            owner = getattr(*owner_place)
            for place in places:
                twin = getattr(*place)
                twin.copy_(owner)
                twin.requires_grad_(owner.requires_grad)

    @torch.no_grad()
    def gather(self) -> None:
        """Add each copy's gradient into its owner's (on the owner's device), and clear the copy's."""
        for owner_place, places in self.ties:
            owner = getattr(*owner_place)
            for place in places:
                twin = getattr(*place)
                if twin.grad is None:
                    continue
                grad = twin.grad.to(owner.device, owner.dtype)
                twin.grad = None
                if not owner.requires_grad:
                    continue
                if owner.grad is None:
                    owner.grad = grad  # the copy's own tensor (or its move): the copy no longer holds it
                else:
                    owner.grad.add_(grad)
