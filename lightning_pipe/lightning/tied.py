"""Parameters tied across stages, on the driver: found in the body, stepped identically, counted and saved once.

A parameter shared by layers that land in different processes (GPT-2's ``wte`` and ``lm_head``) is found by
identity when the body is split (:func:`find_tied`). Each owning process holds its own copy (shipped with its
layers; equal at the start). Every owner's optimizer part steps its copy with the same hyper-parameters
(:func:`add_twins`); before each step's clipping and update, the owners sum their gradients
(:class:`TiedSync`, once per step however many backwards accumulated), so the copies take the same step and
stay equal. The global gradient norm counts the parameter once (its first owner's copy), and the checkpoint
holds one tensor under each of the plain model's names for it, which loads into every owner.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from lightning_pipe.transport.stages import optim
from lightning_pipe.transport.stages.tied import TiedCopies, TiedParameter

__all__: list[str] = []


def _held_apart(parts: Sequence[nn.Sequential], prefix: str, holder: Callable[[int], int]) -> list[dict[int, str]]:
    """The parameters held by layers of more than one holder (``holder(s)``: stage ``s``'s), each as its first name
    under each holder (``prefix`` + its name in the body), in the order of the stages."""
    owners: dict[int, dict[int, str]] = {}  # parameter id -> holder -> its first name there
    for s, part in enumerate(parts):
        for name, layer in part.named_children():
            for pname, p in layer.named_parameters():
                owners.setdefault(id(p), {}).setdefault(holder(s), f"{prefix}{name}.{pname}")
    return [named for named in owners.values() if len(named) > 1]


def find_tied(parts: Sequence[nn.Sequential], process_of: Sequence[int], ranks: Sequence[int], prefix: str
              ) -> list[TiedParameter]:
    """The parameters held by layers of more than one process (stage ``s`` in process ``process_of[s]``, global
    rank ``ranks[process_of[s]]``), each named in every owning process as that process's ``named_parameters``
    names it (``prefix`` + its name in the body), the first owner (lowest stage) first."""
    return [TiedParameter(tuple(named.values()), tuple(ranks[j] for j in named), tuple(named))
            for named in _held_apart(parts, prefix, process_of.__getitem__)]


def stage_ties(parts: Sequence[nn.Sequential], prefix: str) -> list[tuple[str, ...]]:
    """The parameters held by layers of more than one stage, each as its names (``prefix`` + its name in the body)
    in the stages that hold it, the first stage's first: in one process or not."""
    return [tuple(named.values()) for named in _held_apart(parts, prefix, lambda s: s)]


def check_outside_ties(module: nn.Module, prefix: str, parts: Sequence[nn.Sequential], process_of: Sequence[int]
                       ) -> None:
    """Refuse a parameter that a layer outside the body (on the driver) shares with a layer of a stage in another
    process: the two copies would train apart (the driver's on its own gradient, the stage's on its), where on one
    device they are one parameter."""
    outside: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if not name.startswith(prefix):
            outside.setdefault(id(p), name)
    for s, part in enumerate(parts):
        if process_of[s] == 0:
            continue
        for name, p in part.named_parameters():
            if id(p) in outside:
                raise ValueError(
                    f"{type(module).__name__}.{outside[id(p)]} is the same parameter as {prefix}{name}, which stage "
                    f"{s} holds in another process: outside the body it stays on the driver, and the two copies "
                    "would train apart. Keep the layers that share it together: both in the body (parameters tied "
                    "across stages are kept equal), or the body's layer in stage 0 (balance), or both outside the "
                    "body")


def keep_ties(body: nn.Sequential, remote: set[str]) -> Callable[[], None]:
    """Note which parameter slots of the ``remote`` layers of ``body`` (by child name) hold a parameter of a
    local layer; the function returned puts the local layers' parameters back in those slots, once something
    (materialising a body built on the meta device) has replaced them in the local layers alone."""
    first: dict[int, tuple[nn.Module, str]] = {}
    for name, layer in body.named_children():
        if name not in remote:
            for m in layer.modules():
                for pname, p in m._parameters.items():
                    if p is not None:
                        first.setdefault(id(p), (m, pname))
    slots = [(m, pname, first[id(p)]) for name, layer in body.named_children() if name in remote
             for m in layer.modules() for pname, p in m._parameters.items() if p is not None and id(p) in first]

    def retie() -> None:
        for m, pname, (holder, held) in slots:
            m._parameters[pname] = holder._parameters[held]

    return retie


def add_twins(specs: list[optim.OptimizerSpec | None], optimizer: Any, names: Mapping[int, str],
              tied: Sequence[TiedParameter]) -> None:
    """Put each tied parameter's other copies in their processes' parts of ``optimizer`` (``specs``, one per
    process), in the group of the parameter itself, so that every copy steps with the same hyper-parameters."""
    group_of = {names[id(p)]: g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    template = next(spec for spec in specs if spec is not None)
    for t in tied:
        g = group_of.get(t.names[0])
        if g is None:
            continue  # not in this optimizer
        for process, name in zip(t.processes[1:], t.names[1:]):
            spec = specs[process]
            if spec is None:
                spec = specs[process] = optim.OptimizerSpec(template.cls, copy.deepcopy(template.defaults),
                                                            [{**copy.deepcopy(group), "names": []}
                                                             for group in template.groups])
            spec.groups[g]["names"].append(name)


def twin_states(states: Mapping[str, Any], tied: Sequence[TiedParameter]) -> dict[int, dict[str, Any]]:
    """The optimizer state of each tied parameter's other copies, by process: its first owner's (``states``,
    by name), for a checkpoint's state, which holds it once, to load into every copy."""
    out: dict[int, dict[str, Any]] = {}
    for t in tied:
        if t.names[0] in states:
            for process, name in zip(t.processes[1:], t.names[1:]):
                out.setdefault(process, {})[name] = copy.deepcopy(states[t.names[0]])
    return out


class TiedSync:
    """Sums the gradients of the parameters tied across the processes of one pipeline, once per step.

    ``pending()`` marks a backward (the pipeline's output gradient arrived); calling the object then sums, on
    every owner at once: the remote ones through ``hosts``, this process's copies (``local``, by name) here.
    """

    def __init__(self, hosts: Any, local: TiedCopies, params: Mapping[str, Tensor], tied: Sequence[TiedParameter]
                 ) -> None:
        self.hosts = hosts
        self.local = local
        self.params = dict(params)
        self.tied = list(tied)
        self.remote = sorted({j for t in tied for j in t.processes if j != 0})
        self._pending = False

    def pending(self) -> None:
        """A backward ran: the next :meth:`__call__` sums."""
        self._pending = bool(self.tied)

    def __call__(self) -> None:
        """Sum the owners' gradients, if a backward ran since the last sum (before clipping and the step)."""
        if not self._pending:
            return
        self._pending = False
        # No RPC timeout: each owner waits in a collective for the others; the process group's timeout bounds it.
        futures = [self.hosts.start_stage(j, "sum_tied_gradients", timeout=0) for j in self.remote]
        self.local.sum_gradients(self.params)
        for future in futures:
            future.result()
