"""Where a pipeline's processes meet for their data plane: its gloo groups (or rings), its lanes for GPU tensors, the
store they meet in, and each stage process's step listener (:mod:`~lightning_pipe.transport.stages.steps`)."""

from __future__ import annotations

import datetime
import os
import socket
import time
import uuid
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from lightning_pipe.transport.stages import steps
from lightning_pipe.transport.stages.entries import RUNNERS, is_registered
from lightning_pipe.transport.stages.runner import StageRunner
from lightning_pipe.transport.wire.dataplane import AUTO_MAX_BYTES, DATA_PLANES, DataPlane
from lightning_pipe.transport.wire.lane import LANES, lane_groups
from lightning_pipe.transport.wire.session import SESSION, plane_groups

__all__ = ["connect", "detach", "wait_registered"]


def _store(address: tuple[str, int] | None, timeout: float) -> Any:
    if address is None:
        return SESSION.store
    host, port = address
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))


def _whereabouts(key: str) -> tuple[str, str, str]:
    """This process's machine, its stages' device as the machine knows it (a GPU's UUID: the same index names
    another GPU under another ``CUDA_VISIBLE_DEVICES``) and as this process names it (an RPC entry point)."""
    device = RUNNERS[key].stage.device
    known = str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else str(device)
    return socket.gethostname(), known, str(device)


def _join(runner: StageRunner, store: Any, token: str, rank: int, names: Sequence[str], max_bytes: int | None,
          shared: bool, lane: str | None) -> DataPlane:
    """This process's data plane of ``runner``'s pipeline (its groups, then its lanes: a collective)."""
    groups = plane_groups(store, token, rank, len(names), runner.timeout, shared)
    lanes = None if lane is None else lane_groups(store, token, rank, len(names), runner.timeout, lane,
                                                  runner.stage.device)
    return DataPlane(runner.key, groups, rank, names, runner.timeout, max_bytes, lane=lanes)


def _attach(key: str, token: str, names: Sequence[str], address: tuple[str, int] | None, max_bytes: int | None,
            shared: bool = False, lane: str | None = None) -> None:
    """Join pipeline ``key``'s data plane here (an RPC entry point, called by the driver)."""
    runner = RUNNERS[key]
    rank = list(names).index(rpc.get_worker_info().name)
    runner.plane = _join(runner, _store(address, runner.timeout), token, rank, names, max_bytes, shared, lane)
    runner.plane.serve(names[0], lambda step: steps.serve(runner, step))  # the driver's steps, on the plane


def _gpu_lane(runner: StageRunner, names: Sequence[str]) -> str | None:
    """``"nccl"`` where every process of the pipeline has a GPU of its own; else None, said in a warning (NCCL
    refuses two processes on one GPU: the hand-offs go by RPC, GPU to GPU)."""
    found = [_whereabouts(runner.key)] + [rpc.rpc_sync(name, _whereabouts, args=(runner.key,), timeout=runner.timeout)
                                          for name in names[1:]]
    gpus = [(host, known) for host, known, _ in found]
    shared = sorted({f"{named} on {host}" for host, known, named in found if gpus.count((host, known)) > 1})
    if shared:
        warnings.warn(f"data_plane='p2p' hands GPU tensors off over NCCL, which takes one process per GPU, and "
                      f"pipeline '{runner.key}' has several processes on {', '.join(shared)}: its hand-offs go by RPC "
                      "instead (GPU to GPU); give each process a GPU of its own for NCCL", stacklevel=3)
        return None
    return "nccl"


def connect(runner: StageRunner, names: Sequence[str], mode: str, lane: str | None = None) -> None:
    """Give pipeline ``runner.key`` (driven here; ``names``: its processes, this one first) a data plane in
    every process, as ``mode`` asks (see :data:`DATA_PLANES`; none for ``"rpc"``, one process, or GPU stages
    under ``"auto"``). GPU stages under ``"p2p"`` hand their tensors off over NCCL beside the messages
    (:mod:`~lightning_pipe.transport.wire.lane`) where each process has a GPU of its own. ``lane="gloo"`` sends CPU
    stages' tensors so too (the lane's code on CPU: tests, comparisons). The other processes' runners must be
    registered."""
    if mode not in DATA_PLANES:
        raise ValueError(f"data_plane must be one of {', '.join(map(repr, DATA_PLANES))} (got {mode!r})")
    if lane not in (None, *LANES):
        raise ValueError(f"lane must be one of {', '.join(map(repr, LANES))} or None (got {lane!r})")
    if mode == "rpc" or len(names) < 2:
        return
    gpu = runner.stage.device.type != "cpu"
    if lane is not None and (lane == "nccl") != gpu:  # NCCL's lane carries GPU tensors, gloo's CPU ones
        raise ValueError(f"lane={lane!r} carries {'CPU' if lane == 'gloo' else 'GPU'} tensors and the stages are on "
                         f"{runner.stage.device}: leave lane=None (GPU stages under data_plane='p2p' take NCCL)")
    if gpu:
        if mode == "auto" and lane is None:  # RPC, GPU to GPU: NCCL's lane is asked for until measured on GPUs
            return
        lane = _gpu_lane(runner, names)
        if lane is None:
            return
    max_bytes = AUTO_MAX_BYTES if mode == "auto" else None
    token = f"{runner.key}-{uuid.uuid4().hex}"
    address: tuple[str, int] | None = None
    store = SESSION.store
    if store is None:  # without PipeStrategy's session: a store of the plane's own, hosted here
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=runner.timeout))
        address = (host, store.port)
    shared = mode == "auto" or gpu  # rings in shared memory between the processes of one machine, else gloo
    futures = [rpc.rpc_async(name, _attach, args=(runner.key, token, list(names), address, max_bytes, shared, lane),
                             timeout=runner.timeout) for name in names[1:]]
    plane = _join(runner, store, token, 0, names, max_bytes, shared, lane)
    for future in futures:
        future.wait()
    runner.plane = plane
    runner.plane_store = store  # a store hosted here lives as long as the pipeline


def detach(key: str) -> None:
    """Close this process's data plane of pipeline ``key`` (an RPC entry point, called by the driver)."""
    runner = RUNNERS.get(key)
    if runner is not None and runner.plane is not None:
        runner.plane.close()


def wait_registered(peers: Sequence[str], key: str, timeout: float) -> None:
    """Wait until every process in ``peers`` hosts its stage of pipeline ``key``."""
    deadline = time.monotonic() + timeout
    for peer in peers:
        while not rpc.rpc_sync(peer, is_registered, args=(key,), timeout=timeout):
            if time.monotonic() > deadline:
                raise TimeoutError(f"process '{peer}' did not set up its stage of pipeline '{key}' within "
                                   f"{timeout:.0f} s")
            time.sleep(0.01)
