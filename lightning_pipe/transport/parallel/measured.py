"""What a collective costs between this machine's processes, measured before a job starts (for the planner): a
small all-reduce's time and a large one's bandwidth, over gloo between processes started for it."""

from __future__ import annotations

import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["collective_costs"]


def _measure(rank: int, world: int, path: str, nbytes: int, repeats: int, out: Any,
             extra: Callable[[int, int, Any], dict[str, float]] | None) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        small, large = torch.zeros(1), torch.zeros(nbytes // 4)
        runs = {"small": lambda: dist.all_reduce(small), "large": lambda: dist.all_reduce(large)}
        for run in runs.values():  # connections made, buffers touched
            run()
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(repeats):
            for name, run in runs.items():
                dist.barrier()
                tick = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - tick)
        found = {name: statistics.median(values) for name, values in times.items()}
        found.update(_layer_costs(world, nbytes, repeats))
        extras = extra(rank, world, dist.PrefixStore("extra/", store)) if extra is not None else {}
        if rank == 0:
            out.put((found, extras))
    finally:
        dist.destroy_process_group()


def _forward_backward(module: nn.Module, x: torch.Tensor, repeats: int) -> float:
    """The fewest seconds of ``module``'s forward and backward on ``x`` over ``repeats`` passes (after one to warm
    up), every process at once: what the machine does undisturbed (a median moved 0.7-1.7 ms between runs for
    tensor parallel's pair here, as other work came and went)."""
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        tick = time.perf_counter()
        module(x).sum().backward()
        times.append(time.perf_counter() - tick)
    return min(times[1:])


def _layer_costs(world: int, nbytes: int, repeats: int) -> dict[str, float]:
    """What FSDP2 adds to a layer of ``nbytes`` of weights per use (its gather before the forward and again before
    the backward, its copies and hooks, the gradient's reduce-scatter), per byte; and what tensor parallel adds to a
    colwise and rowwise pair of them per split layer and action (DTensor's dispatch, the output's all-reduce)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    k = max(world, int((nbytes // 4) ** 0.5) // world * world)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    x = torch.randn(8, k)
    plain = _forward_backward(nn.Linear(k, k, bias=False), x, repeats)
    sharded = nn.Linear(k, k, bias=False)
    fully_shard(sharded, mesh=mesh, reshard_after_forward=True)
    fsdp = _forward_backward(sharded, x, repeats)
    local = _forward_backward(nn.Sequential(nn.Linear(k, k // world), nn.Linear(k // world, k)), x, repeats)
    pair = nn.Sequential(nn.Linear(k, k), nn.Linear(k, k))
    parallelize_module(pair, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    split = _forward_backward(pair, x, repeats)
    return {"sharded_per_byte": max(0.0, fsdp - plain) / (2 * k * k * 4),
            "tensor_action": max(0.0, split - local) / 4}


def collective_costs(processes: int = 2, nbytes: int = 16 << 20, repeats: int = 5, timeout: float = 60.0,
                     extra: Callable[[int, int, Any], dict[str, float]] | None = None) -> dict[str, float]:
    """A collective's fixed cost (``collective``, seconds: an all-reduce of one number), an all-reduce's bandwidth
    (``collective_bandwidth``, bytes per second: an all-reduce of ``nbytes`` moves ``2 (p - 1) / p`` of them per
    process); what FSDP2 adds to a layer's use
    per byte of its weights (``sharded_per_byte``) and tensor parallel per split layer and action
    (``tensor_action``), between ``processes`` processes of this machine started for it (a few seconds: each imports
    torch). ``extra(rank, world, store)``: another measurement the same processes make (a function of a module, for
    them to import), whose process 0's findings join the rest."""
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    with tempfile.TemporaryDirectory(prefix="lp-collectives-") as folder:
        path = os.path.join(folder, "store")
        workers = [context.Process(target=_measure, args=(r, processes, path, nbytes, repeats, out, extra),
                                   daemon=True)
                   for r in range(processes)]
        for worker in workers:
            worker.start()
        try:
            found, extras = out.get(timeout=timeout)
        finally:
            for worker in workers:
                worker.join(timeout=10)
                if worker.is_alive():
                    worker.kill()
                    worker.join()
    moved = 2 * (processes - 1) / processes * nbytes
    return {"collective": found["small"], "collective_bandwidth": moved / max(1e-9, found["large"] - found["small"]),
            "sharded_per_byte": found["sharded_per_byte"], "tensor_action": found["tensor_action"], **extras}
