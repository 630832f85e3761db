"""The stage side of ``PipeStrategy``: a process hosting one partition, its optimizers and its gradients.

A stage worker never runs the Lightning loop. Its driver configures it over RPC (the partition arrives
with the driver's weights), then drives it: pipeline actions through the partition's
:class:`~lightning_pipe.transport.stages.runner.StageRunner`, and, once per step, the calls below
(optimizer steps with the driver's hyper-parameters, zeroing, gradient norms for global clipping, averaging over
replicas, state for checkpoints).
"""

from __future__ import annotations

import pickle
import types
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch import Tensor, nn

from lightning_pipe.engine.deferred import Program, materialize, named_tensors
from lightning_pipe.engine.stage import Stage
from lightning_pipe.engine.timeline import Event, Recorder
from lightning_pipe.transport.parallel import building, dtensors, fsdp, tensor
from lightning_pipe.transport.stages import optim, resident
from lightning_pipe.transport.stages.entries import register, unregister
from lightning_pipe.transport.stages.runner import StageRunner
from lightning_pipe.transport.stages.setup import StageSetup
from lightning_pipe.transport.stages.stagestate import StageState, broadcast_from_replica0
from lightning_pipe.transport.stages.tied import TiedCopies
from lightning_pipe.transport.wire.messages import where
from lightning_pipe.transport.wire.session import SESSION

__all__: list[str] = []

_HOSTS: dict[str, StageHost] = {}

#: A module's mode in :func:`layer_modes`: training, and (BatchNorm) not tracking running statistics.
_TRAINING, _UNTRACKED = 1, 2


def layer_modes(layers: Sequence[nn.Module]) -> bytes:
    """The mode of every module of ``layers`` (in ``modules()`` order), as the driver has set it: whether it
    is training (``layer.eval()`` on one layer), and for a BatchNorm whether it tracks running statistics
    (``BaseFinetuning.freeze(..., train_bn=False)`` turns that off)."""
    return bytes((_TRAINING if m.training else 0) |
                 (_UNTRACKED if isinstance(m, nn.modules.batchnorm._BatchNorm) and not m.track_running_stats else 0)
                 for layer in layers for m in layer.modules())


class StageHost(StageState):
    """This process's stages of pipeline ``key`` (``parts``: stage index -> (partition, index of its first
    layer in the body); several under an interleaved schedule), with what training them needs.

    ``prefix`` turns the layers' parameter names (``"3.weight"``) into the LightningModule's
    (``"sequential_module.3.weight"``), the names every message uses.
    """

    def __init__(self, key: str, parts: Mapping[int, tuple[nn.Sequential, int]], setup: StageSetup,
                 programs: Mapping[int, Program] | None = None) -> None:
        self.key = key
        self.prefix = prefix = setup.prefix
        device, layout, split, init_sync = torch.device(setup.device), setup.layout, setup.split, setup.init_sync
        #: Built on the meta device and split (tensor parallel): how much it held at most while it was built
        #: (:func:`~lightning_pipe.transport.parallel.building.materialize_split`); None otherwise.
        self.built: dict[str, int] | None = None
        mesh = None  # the ("data", "tensor") mesh the stages are split over, if they are
        if programs and split is not None:  # each layer materialised, then split, before the next one is made
            mesh = dtensors.make_mesh(split.size, device.type)
            self.built = building.materialize_split([(parts[s][0], programs[s]) for s in sorted(programs)], split.plan,
                                                  mesh["tensor"], device=device,
                                                  src_data_rank=None if init_sync else 0,
                                                  before_split=broadcast_from_replica0 if init_sync else None)
        elif programs:  # layers built on the meta device: materialised here alone
            for s, program in programs.items():
                materialize(parts[s][0], program.run())
        self.stages = [Stage(s, part.to(device), device, offset=offset, exports=layout.exports[s].keys(),
                             imports=layout.imports[s].keys()) for s, (part, offset) in sorted(parts.items())]
        self.stage = self.stages[0]
        self.process = self.stage.index  # its first stage names this process's file in a sharded checkpoint
        # Every layer of this process, by its name in the body, in order: what optimizers, state and modes see.
        self.partition = nn.Sequential(OrderedDict(
            (name, layer) for stage in self.stages for name, layer in stage.partition.named_children()))
        for stage in self.stages:
            stage.recorder = Recorder() if setup.record else None
        self.runner = StageRunner(key, self.stages, setup.peers, layout, setup.timeout)
        self.runner.host = self
        self.runner.averages.mesh = mesh
        self.params = {prefix + n: p for n, p in self.partition.named_parameters()}
        self.tied = TiedCopies(key, setup.tied, SESSION.rank)  # parameters shared with layers of other processes
        self.optimizers: dict[int, tuple[torch.optim.Optimizer, list[str]]] = {}
        self.counts = {"steps": 0, "barriers": 0}  # what this process did, for :meth:`stats`
        self.materialized = sorted(self.prefix + name for s in (programs or {})
                                   for name in named_tensors(parts[s][0]))
        register(self.runner)

    # ------------------------------------------------------------------ optimizers
    def build_optimizers(self, specs: Sequence[optim.OptimizerSpec | None]) -> None:
        """Build this stage's part of each of the driver's optimizers (``None``: no parameter here)."""
        self.optimizers = {}
        for k, spec in enumerate(specs):
            if spec is not None:
                names = [n for g in spec.groups for n in g["names"]]
                self.optimizers[k] = (optim.build(spec, self.params), names)

    def step(self, k: int, hyperparameters: list[dict[str, Any]]) -> None:
        """Step optimizer ``k`` with the driver's current hyper-parameters."""
        if k in self.optimizers:
            optimizer, _ = self.optimizers[k]
            optim.apply_hyperparameters(optimizer, hyperparameters)
            self.runner.averages.before_update()
            optimizer.step()
            self.counts["steps"] += 1

    def zero_grad(self, k: int | None, set_to_none: bool = True) -> None:
        """Zero the gradients of optimizer ``k``'s parameters (``None``: of every parameter)."""
        if k is None:
            self.runner.averages.before_update()  # (a sharded stage's module holds its shards again)
            self.partition.zero_grad(set_to_none=set_to_none)
        elif k in self.optimizers:
            self.optimizers[k][0].zero_grad(set_to_none=set_to_none)

    def _grads(self, k: int, counted_only: bool = False) -> list[Tensor]:
        if k not in self.optimizers:
            return []
        params = [p for g in self.optimizers[k][0].param_groups for p in g["params"]]
        fsdp.settle(params)  # (partial sums summed: the gradients themselves)
        return [p.grad for p, name in zip(params, self.optimizers[k][1])
                if p.grad is not None and (not counted_only or self.tied.counted(name))]

    def sum_tied_gradients(self) -> None:
        """Add the other owners' gradients of the parameters tied across processes to this process's copies."""
        self.tied.sum_gradients(self.params)

    def grad_norm(self, k: int, norm_type: float) -> float:
        """The ``norm_type`` norm of optimizer ``k``'s gradients here (for the global norm; a tied parameter
        counted by its first owner only); of all their shards where the stage is sharded over its replicas."""
        if k not in self.optimizers:
            return 0.0
        return fsdp.total_norm(self._grads(k, counted_only=True), norm_type)

    def grad_norms(self, norm_type: float) -> dict[str, Tensor]:
        """The ``norm_type`` norm of each parameter's gradient here, by name, on CPU (parameters without a
        gradient left out), computed as Lightning's ``grad_norm`` computes it (of the whole gradient where it is
        sharded over the stage's replicas)."""
        return {n: fsdp.full(p.grad.detach().norm(norm_type)).cpu() for n, p in self.params.items()
                if p.grad is not None and self.tied.counted(n)}

    def scale_grads(self, k: int, coefficient: float) -> None:
        """Multiply optimizer ``k``'s gradients by ``coefficient`` (global-norm clipping)."""
        for g in self._grads(k):
            fsdp.local(g).detach().mul_(coefficient)

    def unscale_grads(self, k: int, inv_scale: float) -> bool:
        """Undo loss scaling on optimizer ``k``'s gradients; return whether any is not finite (fp16 AMP), on any
        shard of them where the stage is sharded over its replicas."""
        found = False
        grads = self._grads(k)
        for g in grads:
            g = fsdp.local(g).detach()
            g.mul_(inv_scale)
            found = found or not bool(torch.isfinite(g).all())
        return fsdp.any_true(found, grads)

    def clamp_grads(self, k: int, value: float) -> None:
        """Clamp optimizer ``k``'s gradients to ``[-value, value]``."""
        for g in self._grads(k):
            fsdp.local(g).detach().clamp_(-value, value)

    def replicate(self, configure: Any, sharding: Any = None) -> None:
        """Average this process's stages with the same stages of every other replica through the
        ``DistributedDataParallel`` that ``configure(module, device_ids, process_group, stage)`` builds over
        each stage's partition (None: stop); see :mod:`lightning_pipe.transport.parallel.ddp`. Given
        ``sharding`` (:class:`~lightning_pipe.transport.parallel.fsdp.Sharding`), shard each stage over its replicas
        instead (:mod:`lightning_pipe.transport.parallel.fsdp`): its parameters become ``DTensor`` shards."""
        self.runner.averages.replicate(configure, sharding)
        self.params = {self.prefix + n: p for n, p in self.partition.named_parameters()}

    def split(self, size: int, plan: Any, cut_own: bool = True) -> None:
        """Split this process's stages over the ``size`` processes of each (tensor parallel; a collective of the
        stage group) by ``plan`` (:func:`~lightning_pipe.transport.parallel.tensor.parallelize_stage`): their split
        parameters become ``DTensor`` s. ``cut_own``: every process holds the same weights already (each cuts its
        own shards); else tensor rank 0's are sent to the others."""
        mesh = dtensors.make_mesh(size, self.stage.device.type)
        for stage in self.stages:
            tensor.parallelize_stage(stage.partition, plan, mesh["tensor"], src_data_rank=None if cut_own else 0)
        self.runner.averages.mesh = mesh  # the replicas average over its data dimension
        self.params = {self.prefix + n: p for n, p in self.partition.named_parameters()}

    def refresh_replicas(self, configure: Any) -> list[int]:
        """Rebuild the DDP of this process's stages whose trainable set changed (see
        :meth:`~lightning_pipe.transport.parallel.averages.Averages.refresh`); the stages rebuilt."""
        return self.runner.averages.refresh(configure)

    def barrier(self) -> None:
        """Meet the same stage of every other replica (its default process group), once the actions queued on
        this stage so far are done."""
        self.runner.worker.submit(lambda: None).result()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        self.counts["barriers"] += 1

    def stats(self) -> dict[str, Any]:
        """How many optimizer steps this stage took and barriers it passed, which tensors it materialised
        from the driver's recording of a deferred build (by the LightningModule's names), how much of its
        stage it holds (``held``: see :func:`~lightning_pipe.transport.parallel.fsdp.held`) and how many messages
        its data plane sent and received (``plane``; None where every hand-off goes by RPC), how many CPU threads
        it computes with (``threads``), and, built on the meta device and split, the most it held while it was built
        (``built``, see :func:`~lightning_pipe.transport.parallel.building.materialize_split`; else None), and how
        its calls came (``calls``: ``"step on the plane"``, ``"zero_grad riding"``, ``"stats by RPC"``: counts)."""
        optimizers = [optimizer for optimizer, _ in self.optimizers.values()]
        plane = self.runner.plane  # what its data plane carried (None: every hand-off by RPC)
        return {**self.counts, "materialized": self.materialized,
                "held": fsdp.held(self.partition.parameters(), optimizers),
                "plane": None if plane is None else {"sent": plane.sent, "received": plane.received,
                                                      "links": plane.links},
                "threads": torch.get_num_threads(), "built": self.built, "calls": dict(self.runner.calls)}

    def memory(self) -> dict[str, int]:
        """This process's resident memory and what the pipeline keeps between steps (all 0 when idle)."""
        return process_memory(self.runner)

    def set_recording(self, on: bool) -> None:
        """Start (keeping what is recorded already) or stop recording this stage's timeline."""
        for stage in self.stages:
            if not on:
                stage.recorder = None
            elif stage.recorder is None:
                stage.recorder = Recorder()

    def timeline_events(self) -> list[Event]:
        """What this stage recorded for the timeline (empty unless recording)."""
        return [e for stage in self.stages if stage.recorder is not None for e in stage.recorder.events()]

    def set_requires_grad(self, flags: Mapping[str, bool]) -> None:
        """Follow the driver's ``requires_grad`` of this stage's parameters (frozen layers)."""
        for name, flag in flags.items():
            if name in self.params:  # (a parameter tied between two of its layers: under the first's name)
                self.params[name].requires_grad_(flag)

    def set_modes(self, training: bool, modes: bytes) -> None:
        """Set every module of the partition to the mode of the driver's copy (see :func:`layer_modes`);
        from now on the run's training flag no longer overrides them."""
        modules = [m for layer in self.partition.children() for m in layer.modules()]
        if len(modules) != len(modes):
            raise RuntimeError(f"the process of stage {self.stage.index} holds {len(modules)} modules but the driver's "
                               f"copy of its layers has {len(modes)}: the layers were changed in one process only")
        self.partition.training = training
        for stage in self.stages:
            stage.partition.training = training
        for module, mode in zip(modules, modes):
            module.training = bool(mode & _TRAINING)
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.track_running_stats = not mode & _UNTRACKED
        self.runner.modes_from_driver = True

    def zero_named(self, names: Sequence[str], set_to_none: bool = True) -> None:
        """Zero the gradients of the parameters ``names`` as ``nn.Module.zero_grad`` does."""
        for name in names:
            p = self.params.get(name)
            if p is None or p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()

    def close(self) -> None:
        """Stop serving this pipeline here."""
        unregister(self.key)
        self.runner.stop()


def process_memory(runner: StageRunner) -> dict[str, int]:
    """This process's resident memory and the pipeline's bookkeeping for ``runner``'s stages
    (:func:`~lightning_pipe.transport.stages.resident.process_memory`)."""
    return resident.process_memory(runner, len(_HOSTS))


def configure(key: str, parts: Mapping[int, tuple[nn.Sequential, int]] | bytes, setup: StageSetup) -> None:
    """Host stages ``parts`` (stage -> (partition, offset)) of pipeline ``key`` here as ``setup`` says (an RPC entry
    point, called by the driver). Partitions built on the meta device arrive pickled with their programs, ``(parts,
    programs)`` (RPC carries no meta tensor), and are materialised here (:mod:`lightning_pipe.engine.deferred`).
    Every replica's stage then takes replica 0's weights (unless ``setup.init_sync`` is False), and, with
    ``setup.split``, is split over its tensor ranks once it holds them."""
    programs: Mapping[int, Program] | None = None
    if isinstance(parts, bytes):
        parts, programs = pickle.loads(parts)
    from lightning_pipe.engine.partition import normalize_device

    if torch.device(setup.device).type == "cuda":
        torch.cuda.set_device(torch.device(setup.device))  # collectives (NCCL) use the current device
    setup = replace(setup, device=str(normalize_device(setup.device)))  # "cuda" is cuda:N, as its tensors say
    old = _HOSTS.pop(key, None)
    if old is not None:
        old.close()
    host = _HOSTS[key] = StageHost(key, parts, setup, programs)
    if host.built is not None:
        return  # materialised layer by layer, each taking replica 0's weights, then split
    if setup.init_sync:
        host.broadcast_state()
    if setup.split is not None:
        host.split(*setup.split, cut_own=setup.init_sync)


def configure_async(peer: str, key: str, parts: Mapping[int, tuple[nn.Sequential, int]], setup: StageSetup,
                    programs: Mapping[int, Program] | None = None) -> torch.futures.Future:
    """Have process ``peer`` host stages ``parts`` of pipeline ``key`` as ``setup`` says (see :func:`configure`);
    ``programs``: how to materialise partitions built on the meta device. The call may take ``setup.setup_timeout``
    (default ``setup.timeout``)."""
    try:
        sent: Any = pickle.dumps((dict(parts), dict(programs))) if programs else parts
        return rpc.rpc_async(peer, configure, timeout=setup.setup_timeout or setup.timeout, args=(key, sent, setup))
    except (AttributeError, TypeError, pickle.PicklingError) as exc:
        if "pickle" not in str(exc):
            raise
        raise TypeError(
            f"stage {', '.join(map(str, parts))} cannot be sent to {where(peer)}: {exc}{_unpicklable(parts)}. A "
            "stage's layers travel to its process by pickle, with everything they hold: hold a module (nn.Identity()) "
            "or a function defined at a module's top level instead of a lambda or a local function") from exc


def _unpicklable(parts: Mapping[int, tuple[nn.Sequential, int]]) -> str:
    """The first lambda or local function a layer of ``parts`` holds as an attribute, as `` (where: what)``."""
    for s, (part, _) in parts.items():
        for name, module in part.named_modules():
            for attr, value in vars(module).items():
                if isinstance(value, types.FunctionType) and "<" in value.__qualname__:
                    return f" (stage {s}'s {name}.{attr}: {value.__qualname__})"
    return ""


def drop(key: str) -> None:
    """Stop hosting pipeline ``key`` here: its weights, optimizer state and threads go (an RPC entry point,
    called when the driver's model is freed)."""
    host = _HOSTS.pop(key, None)
    if host is not None:
        host.close()


def call(key: str, method: str, *args: Any, commits: Sequence[tuple[Any, ...]] = ()) -> Any:
    """Call ``method`` of this process's host of pipeline ``key`` (an RPC entry point), once ``commits`` (what came
    with the call: the last steps' commits, calls not sent alone; see :meth:`StageRunner.ride`) are applied."""
    host = _HOSTS.get(key)
    if host is None:
        raise RuntimeError(f"this process hosts no stage of pipeline '{key}'")
    return host.runner.call_host(method, args, commits, "by RPC")
