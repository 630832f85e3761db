"""How ``PipeStrategy`` turns a LightningModule's body into a pipeline across its processes, on the driver.

The balance is given or inferred (from ``example_input_array``, by time or size), every replica starts from
replica 0's weights, each remote stage's process is configured with its partition, and the LightningModule's
body becomes a :class:`~lightning_pipe.lightning.body.PipelinedSequential` whose forward runs the pipeline.
A later Trainer of the same module takes over the pipeline built here (the same processes).
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Mapping
from typing import Any, Protocol

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_pipe.engine.balance import balance_by_size, balance_by_time
from lightning_pipe.engine.batchnorm import DeferredBatchNorm
from lightning_pipe.engine.partition import check_balance, split_module
from lightning_pipe.engine.skip.layout import inspect_skip_layout
from lightning_pipe.engine.stage import Stage
from lightning_pipe.lightning.body import PipelinedSequential
from lightning_pipe.lightning.checks import body_of
from lightning_pipe.transport import host
from lightning_pipe.transport.driver import RemotePipeline
from lightning_pipe.transport.runner import StageRunner
from lightning_pipe.transport.session import worker_name

__all__: list[str] = []


class PipeStrategy(Protocol):
    """What building a pipeline reads of the strategy (``PipeStrategy`` has it all)."""

    module_name: str
    balance: list[int] | None
    pipelined_backward: bool
    balance_mode: str
    microbatches: int
    checkpoint: str
    deferred_batch_norm: bool
    rpc_timeout_sec: float
    timeline: str | None
    parallel_devices: list[torch.device] | None
    num_processes: int
    stages: int
    pipeline_processes: int
    schedule: str
    topology: Any
    rank: int
    root_device: torch.device
    is_global_zero: bool
    world_size: int

    def check_model(self, module: pl.LightningModule) -> None: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

log = logging.getLogger("lightning_pipe")
_pipeline_ids = itertools.count()


def _release(pipeline: RemotePipeline, hosts: host.HostGroup) -> None:
    """Free a pipeline whose model is gone: the remote stages and this process's stage 0 threads."""
    hosts.drop()
    pipeline.close()


def build(strategy: PipeStrategy, module: pl.LightningModule) -> PipelinedSequential:
    """Split ``module``'s body into the strategy's stages, or take over the pipeline an earlier Trainer built
    for it; the body is replaced by the returned :class:`PipelinedSequential`."""
    body = body_of(module, strategy.module_name)
    if isinstance(body, PipelinedSequential):
        return _adopt(strategy, module, body)
    strategy.check_model(module)
    if strategy.deferred_batch_norm:
        DeferredBatchNorm.convert(body)
    balance = strategy.balance if strategy.balance is not None else _infer_balance(strategy, module, body)
    check_balance(body, balance)
    _broadcast_state(strategy, module)  # every replica starts from replica 0's weights
    topology, rank = strategy.topology, strategy.rank
    replica = topology.replica_of(rank)
    key = f"r{replica}p{next(_pipeline_ids)}"
    ranks = topology.pipeline(replica)
    p = strategy.pipeline_processes  # stage s in process ranks[s % p]
    parts = split_module(body, balance)
    n = len(parts)
    peers = [worker_name(ranks[s % p]) for s in range(n)] + [worker_name(rank)]
    layout = inspect_skip_layout(parts)
    offsets = list(itertools.accumulate([0] + balance[:-1]))
    prefix = strategy.module_name + "."
    timeout = strategy.rpc_timeout_sec
    devices = strategy.parallel_devices
    futures = [host.configure_async(worker_name(ranks[r]), key, {s: (parts[s], offsets[s]) for s in range(r, n, p)},
                                    str(devices[ranks[r] % strategy.num_processes] if devices else "cpu"),
                                    peers, layout, timeout, prefix, strategy.timeline is not None)
               for r in range(1, p)]
    for r, future in enumerate(futures, start=1):
        try:
            future.wait()
        except Exception as exc:
            exc.add_note(f"while setting up stages {list(range(r, n, p))} in process '{worker_name(ranks[r])}'")
            raise
    stages = [Stage(s, parts[s], strategy.root_device, offset=offsets[s], exports=layout.exports[s].keys(),
                    imports=layout.imports[s].keys()) for s in range(0, n, p)]
    pipeline = RemotePipeline(StageRunner(key, stages, peers, layout, timeout), processes=p)
    hosts = host.HostGroup(key, [worker_name(r) for r in ranks[1:]], timeout)
    stage_of = {name: s for s, part in enumerate(parts) for name, _ in part.named_children()}
    pipelined = PipelinedSequential(body, stage_of, pipeline, chunks=strategy.microbatches,
                                    checkpoint=strategy.checkpoint, hosts=hosts, balance=balance,
                                    name=strategy.module_name, processes=p, schedule=strategy.schedule)
    pipeline.pipelined = strategy.pipelined_backward
    pipeline.runner.modes_from_driver = True  # stage 0's layers are the body's: their modes are set
    setattr(module, strategy.module_name, pipelined)
    # When the model is freed (a script training one model after another), so is what its stages hold.
    weakref.finalize(pipelined, _release, pipeline, hosts).atexit = False
    log.info("[rank %d] pipeline %s: balance %s on ranks %s", rank, key, balance, ranks)
    return pipelined


def _adopt(strategy: PipeStrategy, module: pl.LightningModule, body: PipelinedSequential) -> PipelinedSequential:
    """Take over the pipeline a previous Trainer's strategy built for this module (same processes)."""
    if len(body.balance) != strategy.stages or (strategy.balance is not None and strategy.balance != body.balance):
        raise ValueError(
            f"{type(module).__name__}.{strategy.module_name} is already split into stages {body.balance} by an "
            f"earlier Trainer, and this PipeStrategy asks for {strategy.balance or f'{strategy.stages} stages'}; a "
            "split cannot change within one script: pass the same balance (or devices) to every Trainer")
    if body.processes != strategy.pipeline_processes:
        raise ValueError(
            f"{type(module).__name__}.{strategy.module_name} is already split over {body.processes} processes per "
            f"pipeline by an earlier Trainer, and this PipeStrategy asks for {strategy.pipeline_processes} "
            "(virtual_stages changed?); a split cannot change within one script")
    body.chunks, body.checkpoint, body.schedule = strategy.microbatches, strategy.checkpoint, strategy.schedule
    body.pipeline.pipelined = strategy.pipelined_backward
    return body


def _infer_balance(strategy: PipeStrategy, module: pl.LightningModule, body: nn.Sequential) -> list[int]:
    """The balance found by ``balance_mode`` on replica 0 from ``example_input_array``, given to every replica."""
    balance: list[int] | None = None
    if strategy.is_global_zero:
        example = module.example_input_array
        captured: list[Any] = []
        handle = body.register_forward_pre_hook(lambda _, args: captured.append(args[0]))
        was_training = module.training
        try:
            module.eval()
            with torch.no_grad():
                if isinstance(example, Mapping):
                    module(**example)
                elif isinstance(example, tuple):
                    module(*example)
                else:
                    module(example)
        finally:
            handle.remove()
            module.train(was_training)
        if not captured:
            raise ValueError(f"{type(module).__name__}.forward(example_input_array) did not call "
                             f"self.{strategy.module_name}; pass balance=[...] explicitly")
        if strategy.balance_mode == "balance_by_time":
            balance = balance_by_time(strategy.stages, body, captured[0], device=strategy.root_device)
        else:
            balance = balance_by_size(strategy.stages, body, captured[0], chunks=strategy.microbatches,
                                      device=strategy.root_device)
        rank_zero_info(f"PipeStrategy: inferred balance {balance} ({strategy.balance_mode}); pass balance=... "
                       "to fix it")
    return strategy.broadcast(balance)


def _broadcast_state(strategy: PipeStrategy, module: nn.Module) -> None:
    if strategy.world_size == 1 or not getattr(strategy, "init_sync", True):
        return
    with torch.no_grad():
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            buffer = tensor.detach().to(strategy.root_device)
            dist.broadcast(buffer, src=0)
            tensor.copy_(buffer)
