"""What a collective costs between this machine's processes, measured before a job starts (for the planner): a
small all-reduce's time and a large one's bandwidth, FSDP2's and tensor parallel's costs, over gloo between processes
started for it."""

from __future__ import annotations

import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["collective_costs"]

#: A colwise and rowwise pair of Linear layers on a batch: (tokens, width, hidden).
Shape = tuple[int, int, int]


def _measure(rank: int, world: int, path: str, nbytes: int, repeats: int, out: Any,
             extra: Callable[[int, int, Any], dict[str, float]] | None, pairs: Sequence[Shape]) -> None:
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
        found.update(_tensor_costs(world, pairs, repeats))
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


def _side(nbytes: int, world: int) -> int:
    """The side of a square float32 layer of about ``nbytes``, a multiple of ``world`` (split evenly over it)."""
    return max(world, int((nbytes // 4) ** 0.5) // world * world)


def _layer_costs(world: int, nbytes: int, repeats: int) -> dict[str, float]:
    """What FSDP2 adds to a layer of ``nbytes`` of weights per use (its gather before the forward and again before
    the backward, its copies and hooks, the gradient's reduce-scatter), per byte."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    k = _side(nbytes, world)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    x = torch.randn(8, k)
    plain = _forward_backward(nn.Linear(k, k, bias=False), x, repeats)
    sharded = nn.Linear(k, k, bias=False)
    fully_shard(sharded, mesh=mesh, reshard_after_forward=True)
    fsdp = _forward_backward(sharded, x, repeats)
    return {"sharded_per_byte": max(0.0, fsdp - plain) / (2 * k * k * 4)}


def _pair_cost(mesh: Any, world: int, shape: Shape, repeats: int) -> float:
    """Seconds tensor parallel adds per split module and action to a colwise and rowwise pair of ``shape`` against
    its local halves, at the machine's fastest (as the body is measured): the medians' difference (the two run in
    turn, at the same moments of the machine), over 4, times the halves' fastest over their median. The medians, not
    the fastest: a collective right after compute waits longer than between idle processes (on a 2-vCPU VM an
    all-reduce of 64 KiB-1 MiB after 10 ms of compute: about 4 ms at the median, 0.4-0.9 ms at the fastest), and
    every step pays it, not its fastest pass alone."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tokens, width, hidden = shape
    hidden = max(world, hidden // world * world)
    torch.manual_seed(0)
    # Its input needs a gradient, as a split layer's inside a body does: the colwise layer's input gradient is the
    # backward's collective (an input without one measured half the cost: the forward's alone).
    x = torch.randn(tokens, width, requires_grad=True)
    local = nn.Sequential(nn.Linear(width, hidden // world), nn.Linear(hidden // world, width))
    pair = nn.Sequential(nn.Linear(width, hidden), nn.Linear(hidden, width))
    parallelize_module(pair, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    times: dict[int, list[float]] = {0: [], 1: []}
    for step in range(max(repeats, 7) + 1):
        for k, module in enumerate((local, pair)):
            dist.barrier()
            tick = time.perf_counter()
            module(x).sum().backward()
            if step:  # the first: to warm up
                times[k].append(time.perf_counter() - tick)
    typical = statistics.median(times[0])
    return max(0.0, statistics.median(times[1]) - typical) / 4 * min(times[0]) / typical


def _tensor_costs(world: int, pairs: Sequence[Shape], repeats: int) -> dict[str, float]:
    """What tensor parallel adds per split module and action (DTensor's dispatch, the collective and its wait behind
    the compute before it), fixed (``tensor_action``) and per byte of the pair's input (``tensor_per_byte``): a line
    through the costs of ``pairs`` by their input's bytes (the one pair's cost, fixed, where they are one size)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    found = sorted((tokens * width * 4, _pair_cost(mesh, world, (tokens, width, hidden), repeats))
                   for tokens, width, hidden in pairs)
    (small, at_small), (large, at_large) = found[0], found[-1]
    per_byte = max(0.0, (at_large - at_small) / (large - small)) if large > small else 0.0
    return {"tensor_action": max(0.0, at_small - per_byte * small), "tensor_per_byte": per_byte}


def collective_costs(processes: int = 2, nbytes: int = 16 << 20, repeats: int = 5, timeout: float = 60.0,
                     extra: Callable[[int, int, Any], dict[str, float]] | None = None,
                     tensor_pairs: Sequence[Shape] = ()) -> dict[str, float]:
    """A collective's fixed cost (``collective``, seconds: an all-reduce of one number), an all-reduce's bandwidth
    (``collective_bandwidth``, bytes per second: an all-reduce of ``nbytes`` moves ``2 (p - 1) / p`` of them per
    process); what FSDP2 adds to a layer's use per byte of its weights (``sharded_per_byte``); what tensor parallel
    adds per split module and action (``tensor_action``, and ``tensor_per_byte`` of the module's input), measured on
    a colwise and rowwise pair of each of ``tensor_pairs``' shapes ``(tokens, width, hidden)`` (as
    :func:`~lightning_pipe.engine.planning.tensor_probes` gives them for a body; where none, pairs of ``nbytes``
    layers on 8 and 32 rows); between ``processes`` processes of this machine started for it (a few seconds: each
    imports torch). ``extra(rank, world, store)``: another measurement the same processes make (a function of a
    module, for them to import), whose process 0's findings join the rest."""
    if not tensor_pairs:
        k = _side(nbytes, processes)
        tensor_pairs = [(8, k, k), (32, k, k)]
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    with tempfile.TemporaryDirectory(prefix="lp-collectives-") as folder:
        path = os.path.join(folder, "store")
        workers = [context.Process(target=_measure, daemon=True,
                                   args=(r, processes, path, nbytes, repeats, out, extra, list(tensor_pairs)))
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
            "sharded_per_byte": found["sharded_per_byte"], "tensor_action": found["tensor_action"],
            "tensor_per_byte": found["tensor_per_byte"], **extras}
