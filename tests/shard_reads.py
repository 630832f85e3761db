"""A shard read from a checkpoint saved whole, in each of 2 processes (for tests/test_sharding.py; a module of its own,
so that the processes import no Lightning)."""

from __future__ import annotations

from typing import Any

import torch


def bytes_read() -> int:
    """What this process has read so far by read(2) and its kin (the kernel's count: /proc/self/io's rchar)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def resume_a_shard(rank: int, world: int, directory: str, port: int) -> dict[str, Any]:
    """This replica's shard of a checkpoint saved whole, read as a stage host reads its weights, and as the main
    process reads its weights and optimizer state; the bytes each read took, and whether each got its rows."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_pipe.lightning import sharded
    from lightning_pipe.transport.parallel import fsdp, shards

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        whole = saved_weight()
        param = torch.nn.Parameter(distribute_tensor(torch.zeros_like(whole), mesh, [Shard(0)], src_data_rank=None))
        info = sharded.read_meta(directory)["lightning_pipe"]
        sharded.local_tensors(info, ["bias"])  # DCP's modules imported, a first read: not counted below
        rows = whole.chunk(world)[rank]
        found: dict[str, Any] = {}

        before = bytes_read()
        target = distribute_tensor(torch.empty_like(whole), mesh, [Shard(0)], src_data_rank=None)
        shards.read_into(directory, {"weight": target})  # a stage host's weights
        found["stage host's weights"] = (bytes_read() - before, torch.equal(target.to_local(), rows))

        before = bytes_read()
        read = sharded.local_tensors(info, ["weight"], {"weight": param.detach()})  # the main process's
        found["main process's weights"] = (bytes_read() - before, torch.equal(read["weight"].to_local(), rows))

        optimizer = torch.optim.AdamW([param])
        optimizer._lp_names = ["weight"]  # type: ignore[attr-defined]
        before = bytes_read()
        state = sharded.local_optimizer_state(info, 0, {"param_groups": optimizer.state_dict()["param_groups"]},
                                              optimizer)["state"][0]
        found["main process's AdamW state"] = (bytes_read() - before, fsdp.is_dtensor(state["exp_avg"])
                                               and torch.equal(state["exp_avg"].to_local(), 2 * rows)
                                               and torch.equal(state["exp_avg_sq"].to_local(), 3 * rows)
                                               and float(state["step"]) == 5.0)
        return found
    finally:
        dist.destroy_process_group()


def saved_weight() -> torch.Tensor:
    """A 16 MiB weight, each element its own value."""
    return torch.arange(2048 * 2048, dtype=torch.float32).reshape(2048, 2048)
