"""A gradient on the 2 x 2 mesh of ``HYBRID_SHARD``, in each of 4 processes (for tests/test_sharding.py; a module of
its own, so that the processes import no Lightning)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_pipe.transport.parallel.fsdp import Sharding, any_true, mesh_for, total_norm


def two_by_two_mesh(rank: int, world: int, path: str) -> tuple[float, bool, list[int], list[int]]:
    """In process ``rank`` of 4 (gloo, met in the file ``path``): the 2 x 2 mesh ``HYBRID_SHARD`` builds with
    ``hybrid_shard_size=2``, a gradient sharded over it as FSDP2 holds HSDP's (6 x 2, in rows of 3), its norm as
    clipping takes it, whether an overflow in the second shard is seen, and this process's shard and replicate
    groups."""
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        stage = SimpleNamespace(device=torch.device("cpu"), index=1)
        mesh = mesh_for(dist.group.WORLD, stage, Sharding("HYBRID_SHARD", 2))
        whole = torch.arange(12.0).reshape(6, 2)
        shard = whole.chunk(2)[rank % 2]  # a row of replicas {0, 1} or {2, 3}: the shard of its place in the row
        grad = DTensor.from_local(shard, mesh, [Replicate(), Shard(0)])  # as FSDP2 holds HSDP's gradients
        norm = total_norm([grad], 2.0)
        overflow = any_true(rank % 2 == 1, [grad])  # an inf in the second shard (both its replicas see it)
        return norm, overflow, mesh["shard"].mesh.tolist(), mesh["replicate"].mesh.tolist()
    finally:
        dist.destroy_process_group()
