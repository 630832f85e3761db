"""Where a pipeline's processes meet for their data plane: its gloo groups, the store they meet in, and each
stage process's step listener (:mod:`~lightning_pipe.transport.stages.steps`)."""

from __future__ import annotations

import datetime
import os
import uuid
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
import torch.distributed.rpc as rpc

from lightning_pipe.transport.stages import steps
from lightning_pipe.transport.stages.entries import RUNNERS
from lightning_pipe.transport.stages.runner import StageRunner
from lightning_pipe.transport.wire.dataplane import AUTO_MAX_BYTES, DATA_PLANES, DataPlane
from lightning_pipe.transport.wire.session import SESSION, plane_groups

__all__ = ["connect", "detach"]


def _store(address: tuple[str, int] | None, timeout: float) -> Any:
    if address is None:
        return SESSION.store
    host, port = address
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))


def _attach(key: str, token: str, names: Sequence[str], address: tuple[str, int] | None, max_bytes: int | None,
            shared: bool = False) -> None:
    """Join pipeline ``key``'s data plane here (an RPC entry point, called by the driver)."""
    runner = RUNNERS[key]
    rank = list(names).index(rpc.get_worker_info().name)
    groups = plane_groups(_store(address, runner.timeout), token, rank, len(names), runner.timeout, shared)
    runner.plane = DataPlane(key, groups, rank, names, runner.timeout, max_bytes)
    runner.plane.serve(names[0], lambda step: steps.serve(runner, step))  # the driver's steps, on the plane


def connect(runner: StageRunner, names: Sequence[str], mode: str) -> None:
    """Give pipeline ``runner.key`` (driven here; ``names``: its processes, this one first) a data plane in
    every process, as ``mode`` asks (see :data:`DATA_PLANES`; none for ``"rpc"``, one process, or GPU stages
    under ``"auto"``). The other processes' runners must be registered."""
    if mode not in DATA_PLANES:
        raise ValueError(f"data_plane must be one of {', '.join(map(repr, DATA_PLANES))} (got {mode!r})")
    if mode == "rpc" or len(names) < 2:
        return
    if runner.stage.device.type != "cpu":
        if mode == "p2p":
            raise ValueError(f"data_plane='p2p' carries CPU tensors (over gloo) and the stages are on "
                             f"{runner.stage.device}: use data_plane='auto' or 'rpc' (RPC sends GPU tensors from "
                             "GPU to GPU)")
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
    shared = mode == "auto"  # rings in shared memory between the processes of one machine, else gloo
    futures = [rpc.rpc_async(name, _attach, args=(runner.key, token, list(names), address, max_bytes, shared),
                             timeout=runner.timeout) for name in names[1:]]
    groups = plane_groups(store, token, 0, len(names), runner.timeout, shared)
    for future in futures:
        future.wait()
    runner.plane = DataPlane(runner.key, groups, 0, names, runner.timeout, max_bytes)
    runner.plane_store = store  # a store hosted here lives as long as the pipeline


def detach(key: str) -> None:
    """Close this process's data plane of pipeline ``key`` (an RPC entry point, called by the driver)."""
    runner = RUNNERS.get(key)
    if runner is not None and runner.plane is not None:
        runner.plane.close()
