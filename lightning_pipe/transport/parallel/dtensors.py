"""Stages split by tensor parallel in a process: their ("data", "tensor") mesh, and their replicas' averaging.

Each process of a job with ``tensor_parallel_size = t > 1`` makes, once, a ``DeviceMesh`` over its stage group
(stage ``j`` of every pipeline, numbered by pipeline: replica ``r``'s tensor rank ``k`` is ``r t + k``, see
:class:`~lightning_pipe.transport.topology.Topology`)::

    mesh of stage j:  [[pipeline 0, 1, ..., t-1],        dimension "tensor": the processes of one stage of a
                       [t, ..., 2t-1], ...]               replica, which split its layers
                                                          dimension "data": the same tensor rank of every replica

The stage's layers are split over ``mesh["tensor"]``
(:func:`~lightning_pipe.transport.parallel.tensor.parallelize_stage`); replicas average over ``mesh["data"]``: by
:class:`SplitReplicas` (an all-reduce of each gradient's local part after the stage's last backward: torch's DDP
does not take ``DTensor`` parameters), or, sharded (``sharding_strategy``), by FSDP2 over ``mesh["data"]`` applied
after tensor parallel, as torchtitan composes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_pipe.engine.stage import Stage
from lightning_pipe.transport.parallel.reduction import Reduction

__all__: list[str] = []

#: The meshes made in this process, by tensor size and device type: a cache (a mesh's groups are made by a collective
#: of the stage group, once), never read for what a stage is split over: that is the mesh handed to it.
_MADE: dict[tuple[int, str], Any] = {}


def make_mesh(tensor: int, device_type: str) -> Any:
    """This process's ``("data", "tensor")`` mesh over its stage group (the default process group), made on the first
    call (a collective of the stage group: every process of the stage, of every replica, calls it at once) and
    the same mesh given again to a later strategy (which must ask for the same size). Whoever splits a stage over its
    ``mesh["tensor"]`` hands the mesh on to what averages the stage over ``mesh["data"]``
    (:class:`~lightning_pipe.transport.parallel.averages.Averages`)."""
    from torch.distributed.device_mesh import DeviceMesh

    other = [made.size(1) for (size, _), made in _MADE.items() if size != tensor]
    if other:
        raise RuntimeError(f"this process's stages are split over {other[0]} tensor ranks already; a later "
                           f"strategy asked for tensor_parallel_size={tensor}: use one size in a script")
    if (tensor, device_type) not in _MADE:
        world = dist.get_world_size()
        if world % tensor:
            raise ValueError(f"tensor_parallel_size={tensor} does not divide this stage's {world} processes")
        mesh = torch.arange(world).view(world // tensor, tensor)
        _MADE[(tensor, device_type)] = DeviceMesh(device_type, mesh, mesh_dim_names=("data", "tensor"))
    return _MADE[(tensor, device_type)]


#: How many elements of each input :func:`check_same_inputs` compares, evenly spread (a different batch differs
#: almost everywhere; the whole of a large one would cost a copy of it).
SAMPLED = 4096


def _digest(tensors: list[Tensor], device: torch.device) -> Tensor:
    """A few integers that equal tensors give alike on every process: their count, shapes, and the bytes of
    up to :data:`SAMPLED` elements each, summed plainly and weighted by position (exact: no float sum's rounding,
    which could differ between machines)."""
    out = torch.zeros(4, dtype=torch.int64)
    for k, t in enumerate(tensors, start=1):
        flat = t.detach().reshape(-1)
        step = max(1, flat.numel() // SAMPLED)
        sample = flat[::step][:SAMPLED].contiguous().cpu().view(torch.uint8).to(torch.int64)
        weights = torch.arange(1, sample.numel() + 1, dtype=torch.int64).remainder_(251).add_(k)
        out += torch.tensor([1, hash(tuple(t.shape)) % (1 << 40), int(sample.sum()), int((sample * weights).sum())])
    return out.to(device)


def check_same_inputs(group: Any, tensors: list[Tensor], run: int) -> None:
    """Refuse, in every process of ``group`` (the tensor ranks of a stage-0 replica: the drivers that split its
    layers) at once, a run of the pipeline whose input tensors are not the same in all of them: each rank would
    compute its slices of another batch, and the layers would combine them into garbage, silently. A collective
    (an all-gather of a few integers per run)."""
    size = dist.get_world_size(group)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")
    mine = _digest(tensors, device)
    every = torch.empty(size * mine.numel(), dtype=mine.dtype, device=device)
    dist.all_gather_into_tensor(every, mine, group=group)
    rows = every.view(size, -1).cpu()
    differ = [k for k in range(1, size) if not torch.equal(rows[k], rows[0])]
    if differ:
        raise RuntimeError(
            f"the tensor ranks of this pipeline's first stage received different inputs in run {run} of the "
            f"pipeline (tensor rank 0's differ from those of tensor rank(s) {differ}): every tensor rank splits the "
            "same layers and must see the same batch, or training is garbage. The data is split by replica, not by "
            "process: fabric.world_size and fabric.global_rank (and the Trainer's world) count every tensor rank; "
            "let fabric.setup_dataloaders (or the Trainer) add its sampler, or shard by hand with "
            "strategy.distributed_sampler_kwargs (num_replicas: the replicas, rank: this replica's index)")


def is_split(t: Any) -> bool:
    """Whether ``t`` is a ``DTensor`` on the tensor dimension (a parameter split, or kept whole, by tensor parallel)."""
    return hasattr(t, "device_mesh") and "tensor" in (t.device_mesh.mesh_dim_names or ())


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class SplitReplicas(Reduction):
    """``stage`` (split by tensor parallel: ``DTensor`` parameters) averaged with the same stage, at the same tensor
    rank, of every other replica (``group``): once the step's backwards are over, each gradient's local part is
    all-reduced and divided by the replicas (one flat buffer per dtype), as DDP averages; its buffers follow
    replica 0's at each step's first forward (as DDP's ``broadcast_buffers``). A parameter without a gradient
    joins with zeros, and keeps none where the average is zero (no replica used it)."""

    def __init__(self, stage: Stage, group: dist.ProcessGroup, broadcast_buffers: bool = True) -> None:
        super().__init__(stage)
        self.group = group
        self.size = dist.get_world_size(group)
        self.broadcast_buffers = broadcast_buffers

    def sync_buffers(self, grad: bool, reduce: bool) -> None:
        """The stage's first forward of a step: its buffers take replica 0's."""
        if self.broadcast_buffers and self.size > 1:
            source = dist.get_global_rank(self.group, 0)
            for b in self.stage.partition.buffers():
                dist.broadcast(_local(b), src=source, group=self.group)

    def reduce_now(self, extra: Mapping[Tensor, Tensor] | None = None, run: int = -1) -> None:
        """Average the gradients the stage holds now (after adding ``extra[p]`` into each ``p.grad``), on the
        reduction thread."""
        params = [p for p in self.stage.partition.parameters() if p.requires_grad]
        extra = dict(extra or {})

        def job() -> None:
            with torch.no_grad():
                locals_: list[Tensor] = []
                for p in params:
                    if p in extra:
                        p.grad = extra[p] if p.grad is None else p.grad + extra[p]
                    locals_.append(_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p)))
                by_dtype: dict[torch.dtype, list[int]] = {}
                for i, g in enumerate(locals_):
                    by_dtype.setdefault(g.dtype, []).append(i)
                for dtype in sorted(by_dtype, key=str):  # the same order in every replica
                    index = by_dtype[dtype]
                    flat = torch.cat([locals_[i].reshape(-1) for i in index])
                    dist.all_reduce(flat, group=self.group)
                    flat.div_(self.size)
                    offset = 0
                    for i in index:
                        g, p = locals_[i], params[i]
                        g.copy_(flat[offset:offset + g.numel()].view_as(g))
                        offset += g.numel()
                        if p.grad is None and bool(g.any()):
                            p.grad = _like(p, g)
            self.local = False

        self.settle()
        self.pending = self.worker.submit(job)


def _like(param: Tensor, local: Tensor) -> Tensor:
    """A gradient for ``param`` whose local part is ``local`` (a ``DTensor`` laid out as ``param``, if it is one)."""
    if not hasattr(param, "device_mesh"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())
