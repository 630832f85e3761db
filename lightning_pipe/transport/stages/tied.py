"""Parameters tied across stages, in a process that owns a copy: the owners' group and the sum of their gradients.

A parameter shared by layers of different pipeline processes (an embedding and the head tied to it) has one copy
in each process that holds one of those layers, its *owners*; the copies start equal. After each step's
backward, every owner adds its gradient to the others' (:meth:`TiedCopies.sum_gradients`, an all-reduce over a
process group of the owners, made once at setup), so every copy takes the same optimizer step and stays equal.
The first owner (the lowest stage) alone counts the parameter in the global gradient norm (:meth:`counted`).

Under tensor parallel each owner's copy is a ``DTensor`` split over its stage's tensor ranks, and the owners are
matching tensor ranks of their stages (one pipeline each). Where the owners hold the copies alike (the same
placements over meshes of the same shape: a vocabulary-split embedding and a vocabulary-split head, as Hugging
Face's plans split them) each sums its own slices; otherwise each gathers its gradient whole (a collective of its
stage's tensor ranks, which all sum at once), the whole ones are summed, and each keeps its slice of the sum::

    process 0: wte ─┐                        stage 0's copy and the last stage's copy: each has the gradient of
                    ├─ all_reduce(SUM) ─►    its own uses; after the sum, both have the gradient of every use,
    process 2: lm_head ─┘                    as the single parameter of the unpipelined model does
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_pipe.transport.parallel import fsdp
from lightning_pipe.transport.wire.session import SESSION

__all__: list[str] = []


@dataclass(frozen=True)
class TiedParameter:
    """One parameter tied across processes of a pipeline: its name in each owning process (the LightningModule's
    names, ``names[0]`` the first owner's), the global ranks of those processes and their indices in the
    pipeline, in the same order."""

    names: tuple[str, ...]
    ranks: tuple[int, ...]
    processes: tuple[int, ...]


class TiedCopies:
    """This process's copies of the parameters in ``tied`` (those it owns), and a process group per set of owners.

    ``key`` (the pipeline's) keeps the groups of different pipelines apart in the world store. Every owner
    builds its groups at setup, concurrently with the others (a group's creation waits for all its members).
    """

    def __init__(self, key: str, tied: Sequence[TiedParameter], rank: int) -> None:
        self.mine = [(t, t.names[t.ranks.index(rank)]) for t in tied if rank in t.ranks]
        self.twins = {name for t, name in self.mine if name != t.names[0]}  # copies not counted in the norm
        self.groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self.alike: dict[str, bool] = {}  # by this process's name: whether every owner holds its copy as this one
        for ranks in sorted({t.ranks for t, _ in self.mine}):
            if SESSION.store is None:
                raise RuntimeError("parameters tied across processes need the pipeline job's session (its world "
                                   "store), which this process has not joined")
            store = dist.PrefixStore(f"lightning_pipe/tied/{key}/{'-'.join(map(str, ranks))}", SESSION.store)
            self.groups[ranks] = dist.ProcessGroupGloo(store, ranks.index(rank), len(ranks), SESSION.pg_timeout)

    def counted(self, name: str) -> bool:
        """Whether parameter ``name``'s gradient counts in a global norm here (not a second owner's copy)."""
        return name not in self.twins

    @torch.no_grad()
    def sum_gradients(self, params: Mapping[str, Tensor]) -> None:
        """Add every owner's gradient of each tied parameter to every other's (``params``: this process's, by
        name). A copy without a gradient counts as zeros, and where no copy has one, none gets one (as the
        plain model's parameter, unused, has none); one whose parameter is frozen is left alone (a tied parameter
        is frozen on every owner at once). On a GPU the sum goes through host memory (gloo)."""
        for tied, name in self.mine:
            p = params[name]
            if not p.requires_grad:
                continue
            group = self.groups[tied.ranks]
            used = torch.tensor([float(p.grad is not None)])
            group.allreduce([used], dist.AllreduceOptions()).wait()
            if not used.item():
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if fsdp.is_dtensor(p.grad) and tuple(p.grad.placements) != tuple(p.placements):  # type: ignore[attr-defined]
                # Held as the parameter is (a vocabulary-split embedding's gradient comes out replicated): what the
                # optimizer would make of it anyway, and what lets the owners' slices meet.
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)  # type: ignore[attr-defined]
            if name not in self.alike:
                self.alike[name] = _held_alike(p, group)
            # Held alike (the same slice of each owner's copy here: sharded over the replicas, or split by the same
            # plan), the slices add up; otherwise the gradient whole, then this copy's slice of the sum.
            alike = self.alike[name]
            grad = (fsdp.local(p.grad) if alike else fsdp.full(p.grad)).detach()
            flat = grad.to("cpu", copy=grad.device.type != "cpu")
            group.allreduce([flat], dist.AllreduceOptions()).wait()
            if not alike:
                fsdp.local(p.grad).copy_(fsdp.local(fsdp.like(p.grad, flat.to(grad.device))))
            elif flat.data_ptr() != grad.data_ptr():
                grad.copy_(flat)


#: The longest layout :func:`_layout` writes.
_LAYOUT = 32


def _layout(t: Tensor) -> Tensor:
    """How ``t`` is held, as integers equal on two processes exactly when their copies are held alike: its shape,
    and for a ``DTensor`` its mesh's shape and each placement (kind, dim, split factor of a strided shard)."""
    codes = [t.dim(), *t.shape]
    if fsdp.is_dtensor(t):
        for size, placement in zip(t.device_mesh.shape, t.placements):  # type: ignore[attr-defined]
            kind = 1 if placement.is_replicate() else 2 if placement.is_partial() else 3
            codes += [size, kind, getattr(placement, "dim", -1), getattr(placement, "split_factor", 1)]
    if len(codes) > _LAYOUT:
        raise ValueError(f"a parameter tied across stages has a layout of {len(codes)} entries (at most {_LAYOUT})")
    return torch.tensor(codes + [-2] * (_LAYOUT - len(codes)), dtype=torch.int64)


def _held_alike(p: Tensor, group: dist.ProcessGroup) -> bool:
    """Whether every owner in ``group`` holds its copy of the tied parameter as this process holds ``p`` (a
    collective of the owners)."""
    low, high = _layout(p), _layout(p)
    for value, op in ((low, dist.ReduceOp.MIN), (high, dist.ReduceOp.MAX)):
        options = dist.AllreduceOptions()
        options.reduceOp = op
        group.allreduce([value], options).wait()
    return bool(torch.equal(low, high))
