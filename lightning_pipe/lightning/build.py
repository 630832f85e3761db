"""How ``PipeStrategy`` turns a LightningModule's body into a pipeline across its processes, on the driver.

The balance is given or inferred (from ``example_input_array``, by time or size), every replica starts from
replica 0's weights, each remote stage's process is configured with its partition, and the LightningModule's
body becomes a :class:`~lightning_pipe.lightning.body.PipelinedSequential` whose forward runs the pipeline.
A later Trainer of the same module takes over the pipeline built here (the same processes).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import weakref
from dataclasses import replace
from typing import Any, Protocol

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn

from lightning_pipe.engine.balance import balance_by_size, balance_by_time
from lightning_pipe.engine.batchnorm import DeferredBatchNorm
from lightning_pipe.engine.deferred import Recording, materialize, named_tensors, recording_of
from lightning_pipe.engine.partition import check_balance, split_module
from lightning_pipe.engine.planning import body_and_input
from lightning_pipe.engine.skip.layout import inspect_skip_layout
from lightning_pipe.engine.stage import Stage
from lightning_pipe.lightning.body import PipelinedSequential
from lightning_pipe.lightning.checks import body_of, warn_batch_norm
from lightning_pipe.lightning.tied import TiedSync, check_outside_ties, find_tied, keep_ties, stage_ties
from lightning_pipe.transport.parallel import building, dtensors, fsdp, tensor
from lightning_pipe.transport.stages import host
from lightning_pipe.transport.stages.driver import RemotePipeline
from lightning_pipe.transport.stages.remote import HostGroup
from lightning_pipe.transport.stages.rendezvous import connect
from lightning_pipe.transport.stages.runner import StageRunner
from lightning_pipe.transport.stages.setup import StageSetup, TensorSplit
from lightning_pipe.transport.stages.stagestate import broadcast_from_replica0
from lightning_pipe.transport.stages.tied import TiedCopies
from lightning_pipe.transport.wire.session import worker_name

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

    def setup_timeout(self) -> float: ...

log = logging.getLogger("lightning_pipe")
_pipeline_ids = itertools.count()


def release_run(pipeline: RemotePipeline, hosts: HostGroup) -> None:
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
    recording = deferred_recording(module)  # built on the meta device: each process materialises its own
    warn_batch_norm(body, strategy.microbatches, strategy.module_name)
    if strategy.deferred_batch_norm:
        with recording.resume() if recording is not None else contextlib.nullcontext():
            DeferredBatchNorm.convert(body)
    if strategy.balance is None and recording is not None:
        raise ValueError(
            f"{type(module).__name__}.{strategy.module_name} was built on the meta device (in configure_model, "
            "under trainer.init_module() or lightning_pipe.deferred_init()), where no layer can be timed or "
            f"measured to infer a balance: pass balance=[...] with {strategy.stages} entries summing to {len(body)}")
    balance = strategy.balance if strategy.balance is not None else _infer_balance(strategy, module, body)
    check_balance(body, balance)
    topology, rank = strategy.topology, strategy.rank
    index = topology.pipeline_of(rank)
    key = f"r{index}p{next(_pipeline_ids)}"
    ranks = topology.pipeline(index)
    p = strategy.pipeline_processes  # stage s in process ranks[strategy.process_of(s)]
    parts = split_module(body, balance)
    n = len(parts)
    where = [strategy.process_of(s) for s in range(n)]
    held = [[s for s in range(n) if where[s] == r] for r in range(p)]  # each process's stages, in order
    peers = [worker_name(ranks[where[s]]) for s in range(n)] + [worker_name(rank)]
    layout = inspect_skip_layout(parts)
    offsets = list(itertools.accumulate([0] + balance[:-1]))
    prefix = strategy.module_name + "."
    timeout = strategy.rpc_timeout_sec
    devices = strategy.parallel_devices
    tied = find_tied(parts, where, ranks, prefix)
    check_outside_ties(module, prefix, parts, where)
    # Two stages of one process holding one parameter (a V's first and last) would each set its gradient aside.
    shared = stage_ties(parts, prefix) if p != n else []
    if shared:
        raise ValueError(
            f"{type(module).__name__}.{strategy.module_name} has parameters shared by layers of different stages "
            f"({', '.join(shared[0])}), which a schedule of several stages per process (virtual_stages={n // p}) "
            "cannot split: use one stage per process (virtual_stages=1), or keep the layers that share them in "
            "one stage")
    split = tensor_split(strategy, module, body, parts)
    programs = {s: recording.program(named_tensors(parts[s])) for s in range(n) if where[s]} if recording else {}
    setup_timeout = timeout + (strategy.setup_timeout() if strategy.world_size > 1 or recording else 0)
    setup = StageSetup("cpu", peers, layout, timeout, prefix, record=strategy.timeline is not None, tied=tied,
                       init_sync=getattr(strategy, "init_sync", True), split=split, setup_timeout=setup_timeout)
    futures = [host.configure_async(worker_name(ranks[r]), key, {s: (parts[s], offsets[s]) for s in held[r]},
                                    replace(setup, device=str(devices[ranks[r] % strategy.num_processes]
                                                              if devices else "cpu")),
                                    {s: programs[s] for s in held[r] if s in programs})
               for r in range(1, p)]
    # This process's copies of the tied parameters join their owners' group while the others set up theirs.
    local_tied = TiedCopies(key, tied, rank) if tied else None
    remote = {name for s in range(n) if where[s] for name, _ in parts[s].named_children()}
    # Materialising, and sharding over the replicas, replace the local parameters: the remote layers follow.
    retie = keep_ties(body, remote)
    cut_own = getattr(strategy, "init_sync", True)
    built = None  # built on the meta device and split: each local layer made, then split, before the next
    mesh = None  # the ("data", "tensor") mesh this process's stages are split over, if they are
    if recording is not None and split is not None:
        own = {name for s in held[0] for name, _ in parts[s].named_children()}
        _materialize_local(module, strategy.module_name, remote | own, recording)  # the module's other tensors
        mesh = dtensors.make_mesh(split.size, strategy.root_device.type)
        stages = [(parts[s], recording.program({name: t for name, t in named_tensors(parts[s]).items() if t.is_meta}))
                  for s in held[0]]
        built = building.materialize_split(stages, split.plan, mesh["tensor"], device=strategy.root_device,
                                         src_data_rank=None if cut_own else 0,  # every replica from replica 0's:
                                         before_split=broadcast_from_replica0 if cut_own else None)
        retie()
        _broadcast_state(strategy, module, strategy.module_name, remote | own)  # the rest of replica 0's
    else:
        if recording is not None:
            _materialize_local(module, strategy.module_name, remote, recording)
            retie()
        _broadcast_state(strategy, module, strategy.module_name, remote)  # every replica starts from replica 0's
        if split is not None:  # this process's stages split over their tensor ranks, as the remote ones split theirs
            mesh = dtensors.make_mesh(split.size, strategy.root_device.type)
            for s in held[0]:
                tensor.parallelize_stage(parts[s].to(strategy.root_device), split.plan, mesh["tensor"],
                                         src_data_rank=None if cut_own else 0)
            retie()
    local_params = {prefix + name: param for s in held[0] for name, param in parts[s].named_parameters()}
    for r, future in enumerate(futures, start=1):
        try:
            future.wait()
        except Exception as exc:
            exc.add_note(f"while setting up stages {held[r]} in process '{worker_name(ranks[r])}'")
            raise
    if recording is not None:
        recording.release()  # every stage is materialised: the recording has served
    stages = [Stage(s, parts[s], strategy.root_device, offset=offsets[s], exports=layout.exports[s].keys(),
                    imports=layout.imports[s].keys()) for s in held[0]]
    pipeline = RemotePipeline(StageRunner(key, stages, peers, layout, timeout), processes=p,
                              placement=strategy.placement)
    connect(pipeline.runner, [worker_name(r) for r in ranks], strategy.data_plane)
    hosts = HostGroup(key, [worker_name(r) for r in ranks[1:]], timeout)
    stage_of = {name: s for s, part in enumerate(parts) for name, _ in part.named_children()}
    pipelined = PipelinedSequential(body, stage_of, pipeline, chunks=strategy.microbatches,
                                    checkpoint=strategy.checkpoint, hosts=hosts, balance=balance,
                                    name=strategy.module_name, processes=p, schedule=strategy.schedule,
                                    process_of=where)
    pipeline.pipelined = strategy.pipelined_backward
    pipeline.runner.modes_from_driver = True  # stage 0's layers are the body's: their modes are set
    pipeline.runner.averages.mesh = mesh  # the replicas average over its data dimension
    pipelined.tied = tied
    pipelined.tied_sync = TiedSync(hosts, local_tied, local_params, tied) if local_tied is not None else None
    pipelined.retie = retie
    pipelined.sharded = split is not None  # DTensors: every pipeline of a replica takes part in each save
    pipelined.tensor_group = mesh["tensor"].get_group() if mesh is not None else None
    pipelined.built = built
    setattr(module, strategy.module_name, pipelined)
    # When the model is freed (a script training one model after another), so is what its stages hold.
    weakref.finalize(pipelined, release_run, pipeline, hosts).atexit = False
    log.info("[rank %d] pipeline %s: balance %s on ranks %s", rank, key, balance, ranks)
    return pipelined


def tensor_split(strategy: PipeStrategy, module: pl.LightningModule, body: nn.Sequential, parts: list[nn.Sequential]
                 ) -> TensorSplit | None:
    """How every stage is split over its ``t = tensor_parallel_size`` processes (None: not split):
    ``tensor_parallel_plan``, or the body's own (``tensor_parallel_plan`` of a ``to_sequential`` body),
    checked against the body cut into ``parts``
    (:func:`~lightning_pipe.transport.parallel.tensor.check_stage_boundaries`)."""
    t = getattr(strategy, "tensor_parallel_size", 1)
    if t == 1:
        return None
    plan = getattr(strategy, "tensor_parallel_plan", None)
    if plan is None:
        plan = getattr(body, "tensor_parallel_plan", None)
    if plan is None:
        raise ValueError(
            f"tensor_parallel_size={t} needs a plan saying how to split each layer of {type(module).__name__}."
            f"{strategy.module_name}: pass tensor_parallel_plan={{'<layer name or pattern>': 'colwise' | 'rowwise' | "
            "..., ...}} or a function (stage_module, tp_mesh) -> None (a Hugging Face model's body made by "
            "lightning_pipe.models.to_sequential carries the model's own plan)")
    tensor.check_stage_boundaries(parts, plan, t)
    if getattr(strategy, "schedule", None) == "zero-bubble":
        rank_zero_warn(
            f"schedule='zero-bubble' with tensor_parallel_size={t}: each stage's backward runs whole, its input "
            "gradients and its parameters' together (the split into I and W runs where the stage's layers have no "
            "hooks, and tensor parallel's layers have them), so the step trains the same weights with 1F1B's bubble, "
            "not zero-bubble's. Use schedule='1f1b' to say so, or zero-bubble without tensor parallel")
    return TensorSplit(t, plan)


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
        try:
            _, sample = body_and_input(module, module.example_input_array, strategy.module_name)
        except ValueError as exc:
            raise ValueError(f"{exc}; pass balance=[...] explicitly") from None
        if strategy.balance_mode == "balance_by_time":
            balance = balance_by_time(strategy.stages, body, sample, device=strategy.root_device)
        else:
            balance = balance_by_size(strategy.stages, body, sample, chunks=strategy.microbatches,
                                      device=strategy.root_device)
        rank_zero_info(f"PipeStrategy: inferred balance {balance} ({strategy.balance_mode}); pass balance=... "
                       "to fix it")
    return strategy.broadcast(balance)


def deferred_recording(module: nn.Module) -> Recording | None:
    """The recording of a LightningModule built on the meta device (``configure_model``,
    ``trainer.init_module()``, ``lightning_pipe.deferred_init()``), or None if it was built for real (a body
    pipelined already holds its remote layers on meta: those are left out). A module with meta tensors that no
    live recording made cannot be materialised: refused, saying how to build it."""
    pipelined = [m for m in module.modules() if isinstance(m, PipelinedSequential)]
    placed = {id(t) for body in pipelined for t in named_tensors(body).values()}
    meta = [(name, t) for name, t in named_tensors(module).items() if t.is_meta and id(t) not in placed]
    if not meta:
        return None
    recordings = {id(r): r for r in (recording_of(t) for _, t in meta) if r is not None}
    strays = [name for name, t in meta if recording_of(t) is None]
    if strays or len(recordings) != 1:
        raise ValueError(
            f"{type(module).__name__} holds tensors on the meta device that {'no' if strays else 'more than one'} "
            f"deferred build recorded ({', '.join(strays[:3] or [n for n, _ in meta[:3]])}...): their values "
            "cannot be made. Build the whole model in configure_model, under trainer.init_module(), or under one "
            "lightning_pipe.deferred_init() block, or build it for real")
    return next(iter(recordings.values()))


def _local_tensors(module: nn.Module, module_name: str, remote: set[str]) -> dict[str, Tensor]:
    """``module``'s tensors by name, without those of the body's layers ``remote`` (held by other processes)."""
    skip = tuple(f"{module_name}.{name}." for name in remote)
    return {name: t for name, t in named_tensors(module).items() if not name.startswith(skip)}


def _materialize_local(module: nn.Module, module_name: str, remote: set[str], recording: Recording) -> None:
    """Materialise what this process holds: everything but the remote layers, as the recorded build made it."""
    local = {name: t for name, t in _local_tensors(module, module_name, remote).items() if t.is_meta}
    materialize(module, recording.program(local).run())


def _broadcast_state(strategy: PipeStrategy, module: nn.Module, module_name: str, remote: set[str]) -> None:
    """Replica 0's driver's weights and buffers to every driver (the remote stages take theirs from replica 0's
    same stage as they are configured)."""
    if strategy.world_size == 1 or not getattr(strategy, "init_sync", True):
        return
    with torch.no_grad():
        for tensor in _local_tensors(module, module_name, remote).values():
            if fsdp.is_dtensor(tensor):
                continue  # a stage sharded over the replicas already: each holds its own shard
            buffer = tensor.detach().to(strategy.root_device)
            dist.broadcast(buffer, src=0)
            tensor.copy_(buffer)
