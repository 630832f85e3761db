"""``PipeStrategy``: trains a LightningModule's sequential body as a pipeline, one stage per process.

Follow one training batch on the driver (stage 0 of a replica)::

    training_step ─► self.sequential_module(x)         a PipelinedSequential: the pipeline's forward
                        ├─ stage 0 here, stages 1.. in their processes (lightning_pipe.remote)
    loss.backward() ─► the pipeline's backward          every stage's .grad filled by local autograd
    optimizer_step ─► average over replicas             drivers here, stage workers by RPC (same time)
                   ─► clip by the global norm           every stage's gradients (precision plugin)
                   ─► optimizer.step()                  the driver's, then every stage's mirror with the
                                                        driver's hyper-parameters (lightning_pipe.optim)

Lightning sees only the drivers: ``world_size`` is the number of replicas, ``global_rank`` the replica
index, and the default process group of a driver holds exactly the drivers (lightning_pipe.launcher).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import os
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from lightning_fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning_fabric.utilities.optimizer import _optimizers_to_device
from lightning_fabric.utilities.seed import reset_seed
from lightning_utilities.core.rank_zero import rank_zero_only
from pytorch_lightning.core.optimizer import _init_optimizers_and_lr_schedulers
from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.model_helpers import is_overridden
from pytorch_lightning.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from typing_extensions import override

from lightning_pipe import host, optim
from lightning_pipe.balance import balance_by_size, balance_by_time
from lightning_pipe.batchnorm import DeferredBatchNorm
from lightning_pipe.dataparallel import average_gradients
from lightning_pipe.launcher import SESSION, PipeLauncher, abort_world, start_session, worker_name
from lightning_pipe.partitioned import PipelinedSequential, is_placeholder
from lightning_pipe.pipe import check_balance, check_checkpoint, check_chunks, check_sequential, split_module
from lightning_pipe.remote import RemotePipeline, StageRunner
from lightning_pipe.skip.layout import inspect_skip_layout
from lightning_pipe.skip.skippable import verify_skippables
from lightning_pipe.stage import Stage
from lightning_pipe.timeline import Recorder, write_chrome_trace
from lightning_pipe.topology import Topology

__all__ = ["PipeStrategy"]

log = logging.getLogger("lightning_pipe")

BALANCE_MODES = ("balance_by_size", "balance_by_time")
_pipeline_ids = itertools.count()


class _MirroredOptimizer:
    """Mixed into the driver's optimizers: ``step`` and ``zero_grad`` act on every stage."""

    _lp_hosts: host.HostGroup
    _lp_index: int

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        # The stages step at the same time as the driver: told once the gradients are final (after the
        # closure's backward and clipping, when there is a closure), waited for after the driver's own step.
        stepping: list[Any] = []

        def start() -> None:
            stepping.extend(self._lp_hosts.start("step", self._lp_index, optim.hyperparameters(self)))  # type: ignore[arg-type]

        evaluations = [0]

        def closure_then_start() -> Any:
            evaluations[0] += 1
            if evaluations[0] > 1:
                raise RuntimeError(
                    f"{type(self).__name__}.step evaluated its closure a second time in one step (as LBFGS and "
                    "sharpness-aware optimizers such as SAM do): the stages in other processes stepped after the "
                    "first evaluation and cannot follow a second one. Use an optimizer that evaluates the closure "
                    "once per step (SGD, Adam, AdamW, ...)")
            result = closure()  # type: ignore[misc]
            if not stepping:
                start()
            return result

        if closure is None:
            start()
            loss = super().step()  # type: ignore[misc]
        else:
            loss = super().step(closure_then_start)  # type: ignore[misc]
            if not stepping:  # an optimizer that did not evaluate the closure
                start()
        for future in stepping:
            future.result()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)  # type: ignore[misc]
        self._lp_hosts.call("zero_grad", self._lp_index, set_to_none)


class _PipePrecision:
    """Mixed into the precision plugin: gradients are averaged over the replicas before ``on_after_backward``,
    and gradient clipping and fp16 loss scaling see every stage's gradients, not just stage 0's."""

    def post_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:
        # Right after backward, before the on_after_backward hooks: DDP has the gradients averaged by then.
        strategy = module.trainer.strategy
        if isinstance(strategy, PipeStrategy):
            strategy._after_backward()
        return super().post_backward(tensor, module)  # type: ignore[misc]

    def _after_closure(self, model: Any, optimizer: Any) -> None:
        # Called after backward and the driver's unscaling, before clipping and scaler.step: remote stages
        # unscale too, and an overflow on any stage must skip the step everywhere and lower the scale.
        scaler = getattr(self, "scaler", None)
        hosts = getattr(optimizer, "_lp_hosts", None)
        if scaler is not None and hosts is not None and scaler.is_enabled():
            found = scaler._per_optimizer_states[id(optimizer)].get("found_inf_per_device")
            if found is not None:  # the driver unscaled (this was not a skipped backward)
                overflow = hosts.call("unscale_grads", optimizer._lp_index, 1.0 / float(scaler.get_scale()))
                if any(overflow):
                    device = next(iter(found), torch.device("cpu"))
                    found[device] = found.get(device, torch.zeros((), device=device)) + 1.0
        super()._after_closure(model, optimizer)  # type: ignore[misc]

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        hosts = getattr(optimizer, "_lp_hosts", None)
        if hosts is None:
            return super().clip_grad_by_norm(optimizer, clip_val)  # type: ignore[misc]
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        norms = [float(torch.linalg.vector_norm(g.detach(), 2.0)) for g in grads]
        norms += hosts.call("grad_norm", optimizer._lp_index, 2.0)  # type: ignore[attr-defined]
        total = math.sqrt(sum(n * n for n in norms))
        coefficient = clip_val / (total + 1e-6)  # as torch.nn.utils.clip_grad_norm_
        if coefficient < 1.0:
            for g in grads:
                g.detach().mul_(coefficient)
            hosts.call("scale_grads", optimizer._lp_index, coefficient)  # type: ignore[attr-defined]
        return None

    def clip_grad_by_value(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        hosts = getattr(optimizer, "_lp_hosts", None)
        if hosts is None:
            return super().clip_grad_by_value(optimizer, clip_val)  # type: ignore[misc]
        params = [p for p in self.main_params(optimizer) if not is_placeholder(p)]  # type: ignore[attr-defined]
        torch.nn.utils.clip_grad_value_(params, clip_val)
        hosts.call("clamp_grads", optimizer._lp_index, clip_val)  # type: ignore[attr-defined]
        return None


def _mix_in(obj: Any, mixin: type) -> None:
    """Give ``obj`` a class that puts ``mixin`` before its own (as Lightning does for LightningOptimizer)."""
    cls = type(obj)
    if not isinstance(obj, mixin):
        # The names stay the original's: Lightning keys checkpoint entries by the qualified name (the precision
        # plugin's scaler state is saved under "MixedPrecision", and must load back under that key), and
        # LearningRateMonitor its metrics by the class name ("lr-SGD", as on one device).
        names = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
        obj.__class__ = type(cls.__name__, (mixin, cls), names)


def _mirror(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer`` step and zero every stage.

    An LR scheduler wraps ``optimizer.step`` on the instance, bound to the class's function at that time;
    that wrapper would bypass the mirrored ``step`` and leave remote stages unstepped, so it is replaced by
    one that keeps the scheduler's bookkeeping and calls the mirrored ``step``.
    """
    _mix_in(optimizer, _MirroredOptimizer)
    if "step" not in vars(optimizer):
        return
    owner = weakref.ref(optimizer)
    mirrored = type(optimizer).step

    @functools.wraps(mirrored)
    def step(*args: Any, **kwargs: Any) -> Any:
        opt = owner()
        assert opt is not None
        opt._opt_called = True  # type: ignore[attr-defined] - what the scheduler's wrapper records
        return mirrored(opt, *args, **kwargs)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = step  # type: ignore[method-assign]


def _release(pipeline: RemotePipeline, hosts: host.HostGroup) -> None:
    """Free a pipeline whose model is gone: the remote stages and this process's stage 0 threads."""
    hosts.drop()
    pipeline.close()


class PipeStrategy(DDPStrategy):
    """Pipeline parallelism for a LightningModule whose layers live in an ``nn.Sequential`` body.

    ::

        class Model(LightningModule):
            def __init__(self):
                super().__init__()
                self.sequential_module = nn.Sequential(...)

        Trainer(accelerator="gpu", devices=4, strategy=PipeStrategy(balance=[2, 2], microbatches=8))

    Each stage of the body runs in its own process on its own device; with more processes than stages the
    pipeline is replicated and gradients are averaged (data parallel x pipeline parallel).

    Args:
        balance: layers per stage; its length is the number of stages, which must divide devices x nodes
            (the quotient is the number of replicas). ``None``: one stage per device of a node, the split
            found by ``balance_mode`` from the module's ``example_input_array``.
        microbatches: micro-batches each batch is split into (along dim 0).
        checkpoint: ``'always'``, ``'except_last'`` or ``'never'``: which micro-batches recompute their
            activations in backward instead of storing them.
        balance_mode: ``'balance_by_size'`` (memory) or ``'balance_by_time'`` (compute), for ``balance=None``.
        pipelined_backward: run backward micro-batch by micro-batch, stages overlapping (``False``: one
            backward per stage over all its micro-batches; same gradients).
        rpc_timeout_sec: how long any RPC or wait for a stage may take before the step fails with an error
            naming the stage and process.
        module_name: the attribute of the LightningModule holding the ``nn.Sequential`` body.
        deferred_batch_norm: update BatchNorm running statistics once per batch, as without micro-batches.
        timeline: a path: record when each stage ran each micro-batch's forward and backward in training and
            write it there as a Chrome trace (replica 0, at the end of fit); ``python -m lightning_pipe
            timeline PATH out.png`` draws it and prints the bubble fraction.
        **kwargs: the rest goes to :class:`~pytorch_lightning.strategies.DDPStrategy` (``process_group_backend``,
            ``timeout``, ``cluster_environment``, ...). Models are not wrapped in DDP: each stage averages its
            own gradients.
    """

    strategy_name = "pipe"

    def __init__(self, balance: list[int] | None = None, microbatches: int = 8, checkpoint: str = "except_last",
                 balance_mode: str = "balance_by_size", pipelined_backward: bool = True,
                 rpc_timeout_sec: float = 60.0, module_name: str = "sequential_module",
                 deferred_batch_norm: bool = False, timeline: str | None = None, accelerator: Any = None,
                 parallel_devices: list[torch.device] | None = None, cluster_environment: Any = None,
                 checkpoint_io: Any = None, precision_plugin: Any = None, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, **kwargs: Any) -> None:
        if balance is not None:
            if not isinstance(balance, (list, tuple)) or not balance or any(
                    isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in balance):
                raise ValueError(f"balance must be a list of positive integers, one per stage (balance: {balance!r})")
            balance = list(balance)
        check_chunks(microbatches, "microbatches")
        check_checkpoint(checkpoint)
        if balance_mode not in BALANCE_MODES:
            raise ValueError(f"balance_mode must be one of {', '.join(map(repr, BALANCE_MODES))} "
                             f"(got: {balance_mode!r})")
        if not isinstance(rpc_timeout_sec, (int, float)) or not rpc_timeout_sec > 0:
            raise ValueError(f"rpc_timeout_sec must be a positive number of seconds (got: {rpc_timeout_sec!r})")
        if not isinstance(module_name, str) or not module_name.isidentifier():
            raise ValueError(f"module_name must be the name of an attribute (got: {module_name!r})")
        if kwargs.get("start_method", "popen") != "popen":
            raise ValueError(f"PipeStrategy starts processes as scripts (start_method='popen'); got "
                             f"start_method={kwargs['start_method']!r}")
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, **kwargs)
        self.balance = balance
        self.microbatches = microbatches
        self.checkpoint = checkpoint
        self.balance_mode = balance_mode
        self.pipelined_backward = pipelined_backward
        self.rpc_timeout_sec = float(rpc_timeout_sec)
        self.module_name = module_name
        self.deferred_batch_norm = deferred_batch_norm
        self.timeline = timeline
        self._topology: Topology | None = None
        self._rank = -1
        self._pipeline: RemotePipeline | None = None
        self._hosts: host.HostGroup | None = None
        self._owner: dict[str, int] = {}
        self._requires_grad: list[tuple[bool, ...]] = []
        self._modes: list[tuple[bool, bytes] | None] = []  # per stage, as last sent (see _sync_layers)
        self._fitting = False
        self._sync_blocked = 0  # inside block_backward_sync: gradients stay per replica (accumulation)
        self._unaveraged = False  # a backward ran since the gradients were last averaged
        self._in_backward = 0  # inside Lightning's backward (automatic, or manual_backward)

    # ------------------------------------------------------------------ what Lightning sees: the drivers
    @property
    def topology(self) -> Topology:
        """The layout of processes into replicas and stages."""
        if self._topology is None:
            raise RuntimeError("the process layout is not known before the Trainer sets the strategy up")
        return self._topology

    @property
    def stages(self) -> int:
        """The number of pipeline stages."""
        return len(self.balance) if self.balance is not None else self.num_processes

    @property
    def is_driver(self) -> bool:
        """Whether this process drives a pipeline (runs the Lightning loop and holds stage 0)."""
        return self.topology.is_driver(self._rank)

    @property
    @override
    def global_rank(self) -> int:
        if self._topology is None:
            return super().global_rank
        return self._topology.replica_of(self._rank)

    @property
    @override
    def world_size(self) -> int:
        if self._topology is None:
            return super().world_size
        return self._topology.replicas

    @property
    @override
    def is_global_zero(self) -> bool:
        if self._topology is None:
            return super().is_global_zero
        return self._rank == 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.topology.replicas, "rank": self.topology.replica_of(self._rank)}

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the weights of remote stages are loaded into their processes, which setup configures

    @override
    def set_world_ranks(self) -> None:
        # The cluster environment keeps the view of all processes (the launcher and torchrun/SLURM use it);
        # Lightning's properties above show only the drivers.
        assert self.cluster_environment is not None
        self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        self._rank = self.cluster_environment.global_rank()
        self._topology = Topology(self.cluster_environment.world_size(), self.stages)
        topology = self._topology
        rank_zero_only.rank = topology.replica_of(self._rank) if topology.is_driver(self._rank) else self._rank

    # ------------------------------------------------------------------ processes
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._launcher = PipeLauncher(self, self.cluster_environment, self.num_processes, self.num_nodes)

    def share_cores(self) -> None:
        """On CPU, give each of this node's processes its share of the cores, unless OMP_NUM_THREADS is set.

        As torchrun does: processes that each start a thread pool as large as the machine fight for its
        cores (seen: steps 5x slower with 2 processes on 2 cores).
        """
        if self.root_device.type != "cpu":
            return
        if "OMP_NUM_THREADS" not in os.environ:
            os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.num_processes))
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

    def start_session(self) -> None:
        """Join this process's stage group and RPC (once per process)."""
        self.set_world_ranks()
        self.share_cores()
        assert self.cluster_environment is not None
        # Every node has the same devices (as Lightning assumes): process r uses device r % num_processes, on
        # node r // num_processes. Processes on other nodes get None: RPC maps GPUs within a machine only.
        devices = [torch.device(self.parallel_devices[r % self.num_processes])
                   if r // self.num_processes == self.node_rank else None
                   for r in range(self.topology.world)] if self.parallel_devices else None
        start_session(self.topology, self._rank, self.cluster_environment.main_address,
                      self.cluster_environment.main_port, backend=self._get_process_group_backend(),
                      pg_timeout=self._timeout or default_pg_timeout, rpc_timeout=self.rpc_timeout_sec,
                      devices=devices)

    @override
    def setup_distributed(self) -> None:
        reset_seed()
        self._process_group_backend = self._get_process_group_backend()
        self.start_session()

    # ------------------------------------------------------------------ partitioning
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self._fitting = trainer.state.fn == TrainerFn.FITTING
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self._partition(self.lightning_module)
        _mix_in(self.precision_plugin, _PipePrecision)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _body(self, module: pl.LightningModule) -> nn.Module:
        body = getattr(module, self.module_name, None)
        if body is None:
            raise AttributeError(
                f"{type(module).__name__} has no attribute '{self.module_name}': PipeStrategy partitions the "
                f"nn.Sequential held there. Put the layers in self.{self.module_name} = nn.Sequential(...), or "
                "pass PipeStrategy(module_name=...) naming the attribute that holds them")
        return body

    def check_settings(self, trainer: pl.Trainer | None = None) -> None:
        """Reject Trainer settings this strategy cannot honour (run where :meth:`check_model` runs)."""
        if self._layer_sync is not None:
            raise ValueError(
                "Trainer(sync_batchnorm=True) is not supported by PipeStrategy: BatchNorm layers of a stage would "
                "synchronise every micro-batch, not the batch. Use PipeStrategy(deferred_batch_norm=True), which "
                "gives each replica the statistics of its whole batch, and leave sync_batchnorm off")
        from pytorch_lightning import callbacks as pl_callbacks
        from pytorch_lightning.callbacks import BackboneFinetuning, ModelPruning, StochasticWeightAveraging

        # WeightAveraging (EMAWeightAveraging) exists from Lightning 2.6 on.
        weight_averaging = getattr(pl_callbacks, "WeightAveraging", StochasticWeightAveraging)
        for callback in getattr(trainer, "callbacks", []):
            if isinstance(callback, BackboneFinetuning):
                raise ValueError(
                    "the BackboneFinetuning callback is not supported by PipeStrategy: it adds a parameter group "
                    "to the optimizer during training, which the stages in other processes cannot follow. Put "
                    "every parameter in the optimizer from the start and freeze or unfreeze layers by "
                    "requires_grad (BaseFinetuning.freeze and make_trainable in your own callback), which reaches "
                    "every stage")
            if isinstance(callback, (StochasticWeightAveraging, weight_averaging, ModelPruning)):
                raise ValueError(
                    f"the {type(callback).__name__} callback is not supported by PipeStrategy: it changes the "
                    "weights of the driver's copy of the model, where only stage 0's layers are (the other "
                    "stages' live in their own processes), so it would fail or leave them unchanged. Remove it "
                    "from Trainer(callbacks=...)" + (" and average saved checkpoints' weights instead"
                                                     if isinstance(callback, (StochasticWeightAveraging,
                                                                              weight_averaging)) else ""))

    def check_model(self, module: pl.LightningModule) -> None:
        """Reject a LightningModule this strategy cannot split, with what to change (run before any process
        is started where Lightning starts them, and on every process otherwise).

        A body built in ``configure_model`` is checked when it exists, at setup."""
        if getattr(module, self.module_name, None) is None and is_overridden("configure_model", module):
            return
        body = self._body(module)
        if isinstance(body, PipelinedSequential):
            return
        check_sequential(body, f"{type(module).__name__}.{self.module_name}")
        verify_skippables(body)
        if self.balance is not None:
            check_balance(body, self.balance)
        elif module.example_input_array is None:
            raise ValueError(
                f"PipeStrategy(balance=None) infers the split from {type(module).__name__}.example_input_array, "
                "which is not set: set self.example_input_array to one batch of inputs in __init__, or pass "
                f"balance=[...] with {self.stages} entries summing to {len(body)}")
        elif len(body) < self.stages:
            raise ValueError(f"too few layers to split into one stage per device (layers: {len(body)}, "
                             f"stages: {self.stages}); pass balance=[...] and fewer devices")

    def _partition(self, module: pl.LightningModule) -> None:
        body = self._body(module)
        if isinstance(body, PipelinedSequential):
            self._adopt(module, body)  # already split (a later fit/validate/test/predict of the same module)
            return
        self.check_model(module)
        if self.deferred_batch_norm:
            DeferredBatchNorm.convert(body)
        balance = self.balance if self.balance is not None else self._infer_balance(module, body)
        check_balance(body, balance)
        self._broadcast_state(module)  # every replica starts from replica 0's weights
        topology, rank = self.topology, self._rank
        replica = topology.replica_of(rank)
        key = f"r{replica}p{next(_pipeline_ids)}"
        ranks = topology.pipeline(replica)
        peers = [worker_name(r) for r in ranks] + [worker_name(rank)]
        parts = split_module(body, balance)
        layout = inspect_skip_layout(parts)
        offsets = list(itertools.accumulate([0] + balance[:-1]))
        prefix = self.module_name + "."
        futures = []
        for j in range(1, len(parts)):
            device = self.parallel_devices[ranks[j] % self.num_processes] if self.parallel_devices else "cpu"
            futures.append(rpc.rpc_async(peers[j], host.configure, timeout=self.rpc_timeout_sec, args=(
                key, j, parts[j], offsets[j], str(device), peers, layout, self.rpc_timeout_sec, prefix,
                self.timeline is not None)))
        for j, future in enumerate(futures, start=1):
            try:
                future.wait()
            except Exception as exc:
                exc.add_note(f"while setting up stage {j} in process '{peers[j]}'")
                raise
        stage = Stage(0, parts[0], self.root_device, exports=layout.exports[0].keys(),
                      imports=layout.imports[0].keys())
        self._pipeline = RemotePipeline(StageRunner(key, stage, peers, layout, self.rpc_timeout_sec))
        self._pipeline.pipelined = self.pipelined_backward
        self._hosts = host.HostGroup(key, peers[1:len(parts)], self.rpc_timeout_sec)
        self._owner = {name: j for j, part in enumerate(parts) for name, _ in part.named_children()}
        pipelined = PipelinedSequential(body, self._owner, self._pipeline, chunks=self.microbatches,
                                        checkpoint=self.checkpoint, hosts=self._hosts, balance=balance,
                                        name=self.module_name)
        setattr(module, self.module_name, pipelined)
        # When the model is freed (a script training one model after another), so is what its stages hold.
        weakref.finalize(pipelined, _release, self._pipeline, self._hosts).atexit = False
        self._attach(pipelined)
        log.info("[rank %d] pipeline %s: balance %s on ranks %s", rank, key, balance, ranks)

    def _adopt(self, module: pl.LightningModule, body: PipelinedSequential) -> None:
        """Take over the pipeline a previous Trainer's strategy built for this module (same processes)."""
        if body.hosts is self._hosts:
            return  # this strategy's own pipeline
        if len(body.balance) != self.stages or (self.balance is not None and self.balance != body.balance):
            raise ValueError(
                f"{type(module).__name__}.{self.module_name} is already split into stages {body.balance} by an "
                f"earlier Trainer, and this PipeStrategy asks for {self.balance or f'{self.stages} stages'}; a "
                "split cannot change within one script: pass the same balance (or devices) to every Trainer")
        self.balance = list(body.balance)
        self._pipeline, self._hosts, self._owner = body.pipeline, body.hosts, body.owner
        body.chunks, body.checkpoint = self.microbatches, self.checkpoint
        self._attach(body)

    def _attach(self, body: PipelinedSequential) -> None:
        """Make the split ``body`` run with this strategy's settings."""
        assert self._pipeline is not None and self._hosts is not None
        self._pipeline.pipelined = self.pipelined_backward
        body.before_forward = self._sync_layers
        body.on_backward = self._check_backward_path
        self._requires_grad = self._requires_grad_flags()
        self._modes = [None] * self.stages  # sent before the first forward
        self._pipeline.runner.modes_from_driver = True  # stage 0's layers are the body's: their modes are set
        recording = self.timeline is not None
        stage = self._pipeline.runner.stage
        if recording != (stage.recorder is not None):
            stage.recorder = Recorder() if recording else None
            self._hosts.call("set_recording", recording)

    def _infer_balance(self, module: pl.LightningModule, body: nn.Sequential) -> list[int]:
        balance: list[int] | None = None
        if self.is_global_zero:
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
                                 f"self.{self.module_name}; pass balance=[...] explicitly")
            if self.balance_mode == "balance_by_time":
                balance = balance_by_time(self.stages, body, captured[0], device=self.root_device)
            else:
                balance = balance_by_size(self.stages, body, captured[0], chunks=self.microbatches,
                                          device=self.root_device)
            rank_zero_info(f"PipeStrategy: inferred balance {balance} ({self.balance_mode}); pass balance=... "
                           "to fix it")
        return self.broadcast(balance)

    def _broadcast_state(self, module: nn.Module) -> None:
        if self.world_size == 1:
            return
        with torch.no_grad():
            for tensor in itertools.chain(module.parameters(), module.buffers()):
                buffer = tensor.detach().to(self.root_device)
                dist.broadcast(buffer, src=0)
                tensor.copy_(buffer)

    def _requires_grad_flags(self) -> list[tuple[bool, ...]]:
        body = self._body(self.lightning_module)
        flags: list[list[bool]] = [[] for _ in range(self.stages)]
        for name, child in body.named_children():
            flags[self._owner[name]].extend(p.requires_grad for p in child.parameters())
        return [tuple(f) for f in flags]

    def _sync_layers(self) -> None:
        """What the driver sets on its copies of remote stages' layers reaches their processes before each
        forward: freezing or unfreezing (``requires_grad``), and each module's mode (``layer.eval()`` on one
        layer, BatchNorm frozen by ``BaseFinetuning.freeze``), as the body's training flag does."""
        if self._hosts is None:
            return
        body = self._body(self.lightning_module)
        layers: list[list[nn.Module]] = [[] for _ in range(self.stages)]
        for name, child in body.named_children():
            layers[self._owner[name]].append(child)
        for j in range(1, self.stages):
            modes = (body.training, host.layer_modes(layers[j]))
            if modes != self._modes[j]:
                self._hosts.call_stage(j, "set_modes", *modes)
                self._modes[j] = modes
        self._sync_requires_grad()

    def _sync_requires_grad(self) -> None:
        """Freezing or unfreezing layers of remote stages on the driver reaches their processes."""
        flags = self._requires_grad_flags()
        if flags == self._requires_grad:
            return
        body = self._body(self.lightning_module)
        for j in range(1, self.stages):
            if flags[j] != self._requires_grad[j]:
                named = {f"{self.module_name}.{n}": p.requires_grad for n, p in body.named_parameters()
                         if self._owner[n.split(".", 1)[0]] == j}
                self._hosts.call_stage(j, "set_requires_grad", named)
        self._requires_grad = flags

    def _stage_of(self, name: str) -> int:
        """The stage that holds LightningModule parameter ``name`` (everything outside the body: 0)."""
        prefix = self.module_name + "."
        if not name.startswith(prefix):
            return 0
        return self._owner.get(name[len(prefix):].split(".", 1)[0], 0)

    # ------------------------------------------------------------------ optimizers
    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        assert self.lightning_module is not None and self._hosts is not None
        optimizers, schedulers = _init_optimizers_and_lr_schedulers(self.lightning_module)
        names = {id(p): n for n, p in self.lightning_module.named_parameters()}
        per_stage: list[list[optim.OptimizerSpec | None]] = [[] for _ in range(self.stages)]
        scaler = getattr(self.precision_plugin, "scaler", None)
        for k, optimizer in enumerate(optimizers):
            if scaler is not None and getattr(optimizer, "_step_supports_amp_scaling", False):
                # Such an optimizer unscales and skips inside its own step, where the other stages' gradients
                # and overflows cannot reach.
                raise ValueError(f"{type(optimizer).__name__}(fused=True) cannot be used with a gradient scaler "
                                 f"(precision={self.precision_plugin.precision!r}) across pipeline stages: build "
                                 "it with fused=False (the default), or use precision='bf16-mixed'")
            optimizer._lp_names = optim.flat_names(optimizer, names)  # type: ignore[attr-defined]
            for j, spec in enumerate(optim.specs_for_stages(optimizer, names, self._stage_of, self.stages)):
                per_stage[j].append(spec)
            optim.drop_placeholder_state(optimizer)
            optimizer._lp_hosts = self._hosts  # type: ignore[attr-defined]
            optimizer._lp_index = k  # type: ignore[attr-defined]
            _mirror(optimizer)
        futures = [rpc.rpc_async(peer, host.call, args=(self._hosts.key, "build_optimizers", per_stage[j]),
                                 timeout=self.rpc_timeout_sec)
                   for j, peer in enumerate(self._hosts.peers, start=1)]
        for future in futures:
            future.wait()
        # Assigned after the classes changed: Lightning wraps them in LightningOptimizers built from it.
        self.optimizers = optimizers
        self.lr_scheduler_configs = schedulers

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        raw = getattr(optimizer, "_optimizer", optimizer)

        if not self.lightning_module.automatic_optimization:
            return super().optimizer_step(optimizer, closure, model, **kwargs)  # averaged at each backward

        def closure_then_average() -> Any:
            # Inside the precision plugin's closure, before clipping and the step: the closure's backward has
            # averaged the gradients, unless it was skipped after backwards that accumulated without averaging.
            result = closure()
            if self._unaveraged:
                self._average_gradients(raw)
                self._unaveraged = False
            return result

        return super().optimizer_step(optimizer, closure_then_average, model, **kwargs)

    @override
    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Backwards inside keep their gradients per replica (Lightning blocks the sync while it accumulates
        gradients, as DDP's ``no_sync``); the first backward outside averages everything accumulated."""
        self._sync_blocked += 1
        try:
            yield None
        finally:
            self._sync_blocked -= 1

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        self._in_backward += 1
        try:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        finally:
            self._in_backward -= 1

    def _check_backward_path(self) -> None:
        """The pipeline's backward started: refuse one that bypasses Lightning's backward when there are
        replicas, whose gradients would then never be averaged (DDP's hooks would have averaged them)."""
        if not self._in_backward and self.world_size > 1:
            raise RuntimeError(
                "the pipeline's backward ran outside Lightning's backward (loss.backward() instead of "
                f"self.manual_backward(loss)?): with {self.world_size} replicas its gradients would not be averaged "
                "over them, and the replicas would drift apart. Call self.manual_backward(loss)")

    def _after_backward(self) -> None:
        """Average every optimizer's gradients over the replicas, unless sync is blocked. Called after each
        backward, before ``on_after_backward``: hooks, clipping and steps, manual ones included, see the
        averaged gradients, as under DDP. Averaging again after a further backward averages only the new
        part: the mean of equal values is that value."""
        self._unaveraged = True
        if self._sync_blocked:
            return
        for optimizer in self.optimizers:
            self._average_gradients(getattr(optimizer, "_optimizer", optimizer))
        self._unaveraged = False

    def _average_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        if self.world_size == 1 or self._hosts is None:
            return
        # No RPC timeout: each stage waits in a collective for the same stage of the other replicas, which
        # may be a slow callback away; the process group's timeout bounds that wait.
        futures = self._hosts.start("average_gradients", getattr(optimizer, "_lp_index", 0), timeout=0)
        average_gradients([p for g in optimizer.param_groups for p in g["params"] if not p.is_meta])
        for future in futures:
            future.result()

    def memory_per_process(self) -> list[dict[str, int]]:
        """Per process of this driver's pipeline, stage by stage: resident memory (bytes) and what the
        pipeline keeps between steps (saved micro-batches, undelivered messages, seeds: all 0 when idle)."""
        if self._pipeline is None or self._hosts is None:
            raise RuntimeError("the pipeline is built when the Trainer sets the strategy up (fit, validate, ...)")
        return [host.process_memory(self._pipeline.runner), *self._hosts.call("memory")]

    # ------------------------------------------------------------------ the whole model in one place
    @contextlib.contextmanager
    def gathered(self) -> Iterator[pl.LightningModule]:
        """On the main process, the LightningModule holding the whole unpipelined body, every stage's
        current weights included (remote layers are rebuilt on CPU); the pipeline is back afterwards.

        ::

            with trainer.strategy.gathered() as model:
                torch.save(model, "whole.pt")      # or export, push, inspect ...

        Only the main process may enter it (the other stages' weights are fetched from its pipeline).
        """
        if not self.is_global_zero:
            raise RuntimeError("PipeStrategy.gathered() gathers the model on the main process only (global "
                               f"rank 0); this is replica {self.global_rank}: guard it with trainer.is_global_zero")
        module = self.lightning_module
        body = self._body(module)
        if not isinstance(body, PipelinedSequential) or self._hosts is None:
            yield module
            return
        remote: dict[str, nn.Module] = {}
        for part in self._hosts.call("layers"):
            remote.update(part)
        layers = [(name, layer if self._owner[name] == 0 else remote[name]) for name, layer in body.named_children()]
        setattr(module, self.module_name, nn.Sequential(OrderedDict(layers)))
        try:
            yield module
        finally:
            setattr(module, self.module_name, body)

    def rpc_save_model(self, trainer: pl.Trainer, save_model_fn: Callable[[pl.Trainer, str], Any],
                       filepath: str) -> None:
        """Have the main process gather every stage and call ``save_model_fn(trainer, filepath)`` with the
        whole unpipelined model in ``trainer.lightning_module`` (the other processes do nothing).

        ``trainer.save_checkpoint`` needs no such help: its checkpoints are consolidated already.
        """
        if self.is_global_zero:
            with self.gathered():
                save_model_fn(trainer, filepath)
        self.barrier("rpc_save_model")

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        # The body's state_dict fetches the remote stages' entries: only the process that writes needs them.
        body = self._body(self.lightning_module)
        if self.is_global_zero or not isinstance(body, PipelinedSequential):
            return self.lightning_module.state_dict()
        body.local_only = True
        try:
            return self.lightning_module.state_dict()
        finally:
            body.local_only = False

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        raw = getattr(optimizer, "_optimizer", optimizer)
        state = raw.state_dict()
        if self._hosts is None or not self.is_global_zero or not hasattr(raw, "_lp_index"):
            return state
        remote: dict[str, Any] = {}
        for part in self._hosts.call("optimizer_state", raw._lp_index):
            remote.update(part)
        return optim.merge(state, raw._lp_names, remote, lambda name: self._stage_of(name) == 0)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any | None = None) -> None:
        if not self.is_global_zero:
            return
        path = os.fspath(filepath)
        if "://" in path:  # a remote filesystem: no rename to rely on
            self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        # Written beside the target, then renamed over it: a crash mid-write leaves the previous file intact.
        temporary = f"{path}.tmp{os.getpid()}"
        try:
            self.checkpoint_io.save_checkpoint(checkpoint, temporary, storage_options=storage_options)
            os.replace(temporary, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(temporary)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        # The body's load_state_dict hands the remote layers' entries to their stages.
        self.lightning_module.load_state_dict(checkpoint["state_dict"], strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            raw = getattr(optimizer, "_optimizer", optimizer)
            own, remote = optim.split(state, raw._lp_names, self._stage_of)
            raw.load_state_dict(own)
            _optimizers_to_device([raw], self.root_device)
            assert self._hosts is not None
            # Every stage loads, also one the checkpoint has no state for (saved before any step, as the
            # learning-rate finder's is): what it built since must go, as it does from the driver's.
            for j in range(1, self.stages):
                self._hosts.call_stage(j, "load_optimizer_state", raw._lp_index, remote.get(j, {}))

    def record_timeline(self, on: bool = True) -> None:
        """Start (or stop) recording when each stage of this driver's pipeline runs each micro-batch, from
        now on, as ``timeline=`` does from the start of fit; :meth:`write_timeline` writes it. Call it once
        the pipeline is set up (from ``on_fit_start`` on)."""
        if self._pipeline is None or self._hosts is None:
            raise RuntimeError("record_timeline() needs the pipeline, which PipeStrategy sets up when fit, "
                               "validate, test or predict starts; call it from on_fit_start or later")
        stage = self._pipeline.runner.stage
        if not on:
            stage.recorder = None
        elif stage.recorder is None:
            stage.recorder = Recorder()
        self._hosts.call("set_recording", on)

    def write_timeline(self, path: str | None = None) -> None:
        """Write what the stages of replica 0 recorded (``timeline=...``) as a Chrome trace (main process)."""
        path = path or self.timeline
        if path is None or self._pipeline is None or self._hosts is None or not self.is_global_zero:
            return
        stage = self._pipeline.runner.stage
        events = stage.recorder.events() if stage.recorder is not None else []
        for part in self._hosts.call("timeline_events"):
            events += part
        write_chrome_trace(events, path, ranks=self.topology.pipeline(0))

    @override
    def teardown(self) -> None:
        if self.timeline is not None and self._fitting:
            self.write_timeline()
        super().teardown()

    # ------------------------------------------------------------------ no DDP wrapper
    @override
    def configure_ddp(self) -> None:
        pass  # each stage averages its own gradients (optimizer_step); nothing wraps the model

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        if SESSION.topology is not None:
            # Every other process exits (an interrupt included: under torchrun or SLURM nobody else ends
            # them), and this one leaves RPC without the graceful shutdown barrier that waits for all.
            abort_world(f"{type(exception).__name__}: {exception}", exception)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("pipe", cls, description="Pipeline parallelism over torch.distributed.rpc",
                                   override=True)


PipeStrategy.register_strategies(StrategyRegistry)

