"""Each stage sharded over its replicas by torch's FSDP2 (``fully_shard``), in place of the stage's DDP.

With ``sharding_strategy`` other than ``"NO_SHARD"``, every layer of a stage holding parameters becomes an FSDP2
unit over a ``DeviceMesh`` of that stage's group of replicas (the group its DDP would average over), and the
stage's partition the root. Each process then keeps its shard of the stage's parameters, of their gradients and
of the optimizer's state (built afterwards, over the sharded parameters). What a step does, per setting (``m``
micro-batches, per unit)::

    SHARD_GRAD_OP   forward 1   all-gather at the step's first forward; parameters stay whole for the step
                    backward    m backwards accumulate whole gradients locally (no communication), then one
                                reduce-scatter, on the stage's reduction thread once its last backward is
                                over (overlapping the earlier stages' backwards); parameters resharded
    FULL_SHARD      forward     all-gather before each micro-batch's forward (and its recomputation, if it
                                recomputes), resharded after it
                    backward    all-gather before each micro-batch's backward, its gradients reduce-scattered
                                and the parameters resharded right after it: one unit whole at a time (and the
                                one before it, prefetched)
    HYBRID_SHARD    FULL_SHARD within each shard group (a node's replicas), gradients then all-reduced across
                    the groups (the same shard on every node)

So SHARD_GRAD_OP trades memory (a stage's whole parameters and gradients during the step) for the least
communication (one all-gather and one reduce-scatter per step, as DDP's one all-reduce), and FULL_SHARD the
reverse (2m all-gathers, one more per recomputed micro-batch, and m reduce-scatters per step). Gradients are
reduced in every step, also while Lightning accumulates (``accumulate_grad_batches``): they stay sharded between
steps, and a sum of averages is the average of the sum.

The collectives are FSDP2's own, over the stage's group: every replica of a stage must run the same layers in
each forward and backward (as under FSDP: a layer skipped on one replica's batch leaves the others waiting until
the process group's timeout).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_pipe.engine.stage import Stage
from lightning_pipe.transport.parallel.reduction import Reduction

__all__: list[str] = []

#: The settings of ``sharding_strategy``, by Lightning's ``FSDPStrategy`` names.
SETTINGS = ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD")


@dataclass(frozen=True)
class Sharding:
    """How each stage is sharded over its replicas: ``setting`` (one of :data:`SETTINGS` but ``NO_SHARD``);
    for ``HYBRID_SHARD``, ``shard_size`` replicas per shard group (None: the replicas on one node);
    ``broadcast_buffers``: buffers follow replica 0's at each step's first forward (as DDP's)."""

    setting: str
    shard_size: int | None = None
    broadcast_buffers: bool = True

    def stage(self, stage: Stage, group: dist.ProcessGroup, split: Any = None) -> ShardedStage:
        """``stage`` sharded so over its replicas (``group``; ``split``: the ``("data", "tensor")`` mesh it is split
        over by tensor parallel, None if it is not)."""
        return ShardedStage(stage, group, self, split)

    @property
    def per_microbatch(self) -> bool:
        """Whether parameters are resharded (and gradients reduced) after each micro-batch."""
        return self.setting in ("FULL_SHARD", "HYBRID_SHARD")


def _fsdp() -> Any:
    from torch.distributed import fsdp

    return fsdp


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP2 unit (``fully_shard`` applied)."""
    return isinstance(module, _fsdp().FSDPModule)


def _device_type(stage: Stage) -> str:
    return stage.device.type


def mesh_for(group: dist.ProcessGroup, stage: Stage, sharding: Sharding, split: Any = None) -> Any:
    """The ``DeviceMesh`` of stage ``stage``'s replicas (``group``): one dimension, or for ``HYBRID_SHARD`` two,
    ``("replicate", "shard")``: rows of ``shard_size`` replicas (by default those on one node). A stage split by
    tensor parallel over ``split["tensor"]`` (``split``: its ``("data", "tensor")`` mesh) shards over
    ``split["data"]``."""
    from torch.distributed.device_mesh import DeviceMesh

    if split is not None:  # split by tensor parallel first: sharded over its mesh's data dimension
        if sharding.setting == "HYBRID_SHARD":
            raise ValueError("sharding_strategy='HYBRID_SHARD' with tensor_parallel_size > 1 is not supported: use "
                             "'FULL_SHARD' or 'SHARD_GRAD_OP' (sharded over every replica), or 'NO_SHARD'")
        return split["data"]
    if sharding.setting != "HYBRID_SHARD":
        return DeviceMesh.from_group(group, _device_type(stage))
    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if sharding.shard_size is None:
        hosts: list[Any] = [None] * size
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        nodes = list(dict.fromkeys(hosts))
        rows = [[r for r in range(size) if hosts[r] == node] for node in nodes]
        if len({len(row) for row in rows}) != 1:
            raise ValueError(f"HYBRID_SHARD needs as many replicas of stage {stage.index} on every node (found "
                             f"{[len(row) for row in rows]} on {nodes}); pass hybrid_shard_size=N (replicas per "
                             "shard group) to choose the groups")
    else:
        if size % sharding.shard_size:
            raise ValueError(f"hybrid_shard_size={sharding.shard_size} must divide the number of replicas ({size})")
        rows = [list(range(start, start + sharding.shard_size)) for start in range(0, size, sharding.shard_size)]
    columns = [list(column) for column in zip(*rows)]
    # Every process of the group creates every subgroup, in the same order (new_group is collective).
    shard = replicate = None
    for row in rows:
        made = dist.new_group([_global(group, r) for r in row])
        if rank in row:
            shard = made
    for column in columns:
        made = dist.new_group([_global(group, r) for r in column])
        if rank in column:
            replicate = made
    mesh = torch.tensor([[_global(group, r) for r in row] for row in rows])
    return DeviceMesh.from_group([replicate, shard], _device_type(stage), mesh=mesh,
                                 mesh_dim_names=("replicate", "shard"))


def _global(group: dist.ProcessGroup, rank: int) -> int:
    return dist.get_global_rank(group, rank)


@torch.no_grad()
def broadcast_buffers(module: nn.Module, group: dist.ProcessGroup) -> None:
    """``module``'s buffers take the values of the group's first process (as DDP's ``broadcast_buffers``; FSDP
    leaves buffers whole in every process)."""
    source = _global(group, 0)
    for t in module.buffers():
        if t.numel():
            dist.broadcast(t, src=source, group=group)


def _units(partition: nn.Module) -> list[nn.Module]:
    """The layers of ``partition`` that become FSDP units: those holding parameters."""
    return [layer for layer in partition.children() if next(layer.parameters(), None) is not None]


def shard(partition: nn.Module, mesh: Any, sharding: Sharding) -> None:
    """Apply ``fully_shard`` to every layer of ``partition`` holding parameters, then to the partition (the root)."""
    fsdp = _fsdp()
    reshard = sharding.per_microbatch
    units = _units(partition)
    owner: dict[int, int] = {}
    for k, layer in enumerate(units):
        for p in layer.parameters():
            if owner.setdefault(id(p), k) != k:
                raise ValueError(
                    f"sharding_strategy={sharding.setting!r} makes each layer of a stage an FSDP unit, and two layers "
                    f"of one stage share a parameter (shape {tuple(p.shape)}): FSDP cannot shard it in both. Put the "
                    "two layers in one (an nn.Sequential of both), or in different stages, or use "
                    "sharding_strategy='NO_SHARD'")
    for layer in units:
        fsdp.fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fsdp.fully_shard(partition, mesh=mesh, reshard_after_forward=reshard)
    if reshard and units:
        # Each backward prefetches the layer before within its micro-batch; FSDP's implicit order would reach
        # into the next micro-batch's layers, which the end of this backward reshards unused (measured: half an
        # all-gather more per layer and step).
        for later, earlier in zip(units[1:], units[:-1]):
            later.set_modules_to_backward_prefetch([earlier])
        for group in fsdp.fully_shard.state(units[0])._fsdp_param_groups:
            group._backward_prefetch = lambda: None


class ShardedStage(Reduction):
    """``stage`` sharded over its replicas (``group``) as ``sharding`` says (see the module's docstring): the
    same interface as :class:`~lightning_pipe.transport.parallel.ddp.ReplicatedStage`."""

    always = True

    def __init__(self, stage: Stage, group: dist.ProcessGroup, sharding: Sharding, split: Any = None) -> None:
        super().__init__(stage)
        self.sharding = sharding
        self.group = group
        partition = stage.partition
        if not is_sharded(partition):  # (every replica starts from replica 0's weights: the build broadcast them)
            shard(partition, mesh_for(group, stage, sharding, split), sharding)
        self.root = partition
        self.root.set_reduce_scatter_unused_params(True)  # every replica joins each reduce-scatter alike
        self._during_step()

    def _during_step(self) -> None:
        """The flags for the step's backwards: per micro-batch (FULL_SHARD) or none until the step's end."""
        each = self.sharding.per_microbatch
        self.root.set_requires_gradient_sync(each)
        self.root.set_reshard_after_backward(each)
        self.root.set_is_last_backward(each)

    def sync_buffers(self, grad: bool, reduce: bool) -> None:
        """The stage's first forward of a step: its buffers follow replica 0's (as DDP's ``broadcast_buffers``)."""
        if self.sharding.broadcast_buffers and next(self.root.buffers(), None) is not None:
            broadcast_buffers(self.root, self.group)

    def reduce_now(self, extra: Mapping[Tensor, Tensor] | None = None, run: int = -1) -> None:
        """The stage's backwards of the step are over: on the reduction thread, the gradients not reduced yet
        are reduce-scattered (all of them under SHARD_GRAD_OP) and every unit resharded."""
        if extra:
            raise RuntimeError("a sharded stage holds no gradients of its own to average later")
        recorder = self.stage.recorder

        def job() -> None:
            start = time.time()
            self.finish_backward()
            if recorder is not None:
                recorder.record(self.stage.index, "R", [-1], run, start)

        self.settle()
        self.pending = self.worker.submit(job)

    def finish_backward(self) -> None:
        """FSDP's post-backward for every unit, with gradients reduced and parameters resharded (what its autograd
        hooks do after a backward that syncs), then its end-of-backward callback (as torch.distributed.pipelining
        ends a step of an FSDP stage); per micro-batch, each backward did that already."""
        if self.sharding.per_microbatch:
            self.reshard()  # each backward reduced its gradients already
            return
        fsdp = _fsdp()
        self.root.set_requires_gradient_sync(True)
        self.root.set_reshard_after_backward(True)
        self.root.set_is_last_backward(True)
        try:
            state = fsdp.fully_shard.state(self.root)
            for unit in state._state_ctx.all_states:
                for group in unit._fsdp_param_groups:
                    group.post_backward()
            state._root_post_backward_final_callback()
        finally:
            self._during_step()

    def before_update(self) -> None:
        """The optimizer is about to change the shards: whole copies still held (SHARD_GRAD_OP's after a forward
        without backward, validation's) would be stale, and are dropped."""
        self.settle()
        self.reshard()

    def reshard(self) -> None:
        """Free every unit's whole parameters."""
        for module in self.root.modules():
            if is_sharded(module):
                module.reshard()


# ---------------------------------------------------------------------- gradients and weights of sharded stages
def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``DTensor`` (a shard of a tensor sharded over a stage's replicas)."""
    return hasattr(t, "device_mesh") and hasattr(t, "to_local")


def local(t: Tensor) -> Tensor:
    """This process's shard of ``t`` (``t`` itself unless a ``DTensor``)."""
    return t.to_local() if is_dtensor(t) else t


def _sharded_dims(t: Tensor) -> tuple[tuple[str, int], ...]:
    """The mesh dimensions over which ``t`` (a ``DTensor``) is sharded, by name (none for a plain tensor, or one
    kept whole on every process: a norm counts it once)."""
    if not is_dtensor(t):
        return ()
    mesh = t.device_mesh
    names = mesh.mesh_dim_names or tuple(str(d) for d in range(mesh.ndim))
    # (FSDP2 over a tensor-parallel parameter shards it ``_StridedShard``, which is_shard() does not count)
    return tuple((names[d], d) for d, placement in enumerate(t.placements)
                 if not placement.is_replicate() and not placement.is_partial())


def _by_sharding(tensors: Iterable[Tensor]) -> dict[tuple[tuple[str, int], ...], list[Tensor]]:
    """``tensors`` grouped by the mesh dimensions they are sharded over, in an order every process shares."""
    groups: dict[tuple[tuple[str, int], ...], list[Tensor]] = {}
    for t in tensors:
        groups.setdefault(_sharded_dims(t), []).append(t)
    return dict(sorted(groups.items()))


def settle(params: Iterable[Tensor]) -> list[Tensor]:
    """The gradients of ``params`` (those that have one), each ``DTensor`` still holding partial sums first summed
    over its mesh and put in place of the partial one: a parameter kept whole that layers use on slices of the
    sequence (``"sequence_parallel"``'s norms) gets a ``Partial`` gradient, each tensor rank holding its slices'
    part, and a norm, a clamp or an overflow check must see the gradient, not each rank's part of it (the global
    norm differed from rank to rank, and so did the clipping coefficient). A collective where any is partial: every
    process holding the stage calls it at once, with its parameters in the same order."""
    from torch.distributed.tensor import Replicate

    grads = []
    for p in params:
        g = p.grad
        if g is None:
            continue
        if is_dtensor(g) and any(placement.is_partial() for placement in g.placements):
            g = g.redistribute(g.device_mesh, [Replicate() if placement.is_partial() else placement
                                               for placement in g.placements])
            p.grad = g
        grads.append(g)
    return grads


def total_norm(grads: Sequence[Tensor], norm_type: float) -> float:
    """The ``norm_type`` norm of ``grads`` taken as one vector, sharded ones (``DTensor``) over all their shards:
    a collective of the shards' groups (every process holding a shard of the stage calls it at once). A ``DTensor``
    kept whole on some mesh dimension (a tensor-parallel bias) is counted once there."""
    import math

    inf = math.isinf(norm_type)
    # Each gradient's norm in its own precision (float32 at the least), as clip_grad_norm_ takes it, and their sum
    # in float64: float64 gradients are clipped by a float64 norm, as on one device (a float32 sum moved them 1e-10).
    value = torch.zeros((), dtype=torch.float64)
    for dims, group in _by_sharding(grads).items():
        parts = torch.stack([torch.linalg.vector_norm(local(g).detach(), norm_type).to(torch.float64) for g in group])
        combined = (parts.max() if inf else (parts ** norm_type).sum()).reshape(1)
        if dims:
            mesh = group[0].device_mesh
            combined = combined.to(mesh.device_type)
            for _, d in dims:
                dist.all_reduce(combined, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=mesh.get_group(d))
        combined = combined.cpu()[0]
        value = torch.maximum(value, combined) if inf else value + combined
    return float(value if inf else value ** (1.0 / norm_type))


def any_true(flag: bool, tensors: Iterable[Tensor]) -> bool:
    """``flag`` or'ed over every process holding a shard of ``tensors`` (a collective where any is a ``DTensor``)."""
    meshes = {}
    for t in tensors:
        if is_dtensor(t):
            meshes.setdefault(tuple(t.device_mesh.mesh_dim_names or ()), t.device_mesh)
    if not meshes:
        return flag
    value = torch.tensor([float(flag)])
    for _, mesh in sorted(meshes.items()):
        value = value.to(mesh.device_type)
        for d in range(mesh.ndim):
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=mesh.get_group(d))
    return bool(value.item())


def held(parameters: Iterable[Tensor], optimizers: Iterable[torch.optim.Optimizer] = ()) -> dict[str, float]:
    """How many elements of ``parameters`` this process holds (``parameters``: its shards of them), of how many
    (``whole``), and of its optimizers' state for them (``optimizer``); ``sum``, the sum of the values it holds
    (which part of the whole: shards of a group add up to it, replicated ones are equal)."""
    parameters = list(parameters)
    ids = {id(p) for p in parameters}
    state = sum(local(v).numel() for optimizer in optimizers for p, s in optimizer.state.items() if id(p) in ids
                for v in s.values() if isinstance(v, Tensor) and v.dim() > 0)
    return {"parameters": sum(local(p).numel() for p in parameters), "whole": sum(p.numel() for p in parameters),
            "optimizer": state, "sum": sum(float(local(p).detach().double().sum()) for p in parameters)}


def full(t: Tensor) -> Tensor:
    """``t`` whole: a ``DTensor`` gathered from its shards (a collective of its mesh), any other as it is."""
    return t.full_tensor() if is_dtensor(t) else t


def empty_like(param: Tensor, dtype: torch.dtype) -> Tensor:
    """An uninitialised ``DTensor`` of ``dtype`` held as the ``DTensor`` ``param`` is (its mesh, placements and
    this process's shard of it, on its device): what a shard of a checkpoint's entry is read into."""
    from torch.distributed.tensor import DTensor

    local = param.to_local()
    return DTensor.from_local(torch.empty(local.shape, dtype=dtype, device=local.device), param.device_mesh,
                              param.placements, run_check=False, shape=param.shape, stride=param.stride())


def like(param: Tensor, value: Tensor) -> Tensor:
    """``value`` (whole, the shape of ``param``) as ``param`` is held: its shard as a ``DTensor`` where ``param``
    is one, else itself (a ``DTensor`` already, read as its shard alone: itself)."""
    if not is_dtensor(param) or is_dtensor(value) or value.shape != param.shape:
        return value
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value.to(param.device_mesh.device_type), param.device_mesh, param.placements,
                             src_data_rank=None)
