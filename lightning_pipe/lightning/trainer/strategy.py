"""``PipeStrategy``: trains a LightningModule's sequential body as a pipeline, one stage per process.

Follow one training batch on the driver (stage 0 of a replica), in Lightning's hook order::

    training_step ─► self.sequential_module(x)      a PipelinedSequential (lightning/body.py): the pipeline's
                        ├─ stage 0 here             forward, stages 1.. in their processes (transport/)
    backward      ─► pre_backward                   the pipeline's backward may start (Lightning's backward)
                  ─► loss.backward()                every stage's .grad filled by its local autograd; with
                                                    replicas, each stage's DDP averages its buckets during its
                                                    last backward (replicas.py, transport/parallel/ddp.py)
    optimizer_step ─► clip by the global norm       every stage's gradients (precision.py)
                   ─► the driver's optimizer.step   records the step and its hyper-parameters (optimizers.py)
                   ─► post_optimizer_step           every remote stage steps with them

Lightning sees only the drivers: ``world_size`` is the number of replicas, ``global_rank`` the replica
index, and the default process group of a driver holds exactly the drivers (transport/wire/session.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning_fabric.utilities.optimizer import _optimizers_to_device
from pytorch_lightning.core.optimizer import _init_optimizers_and_lr_schedulers
from pytorch_lightning.strategies import StrategyRegistry
from pytorch_lightning.trainer.states import TrainerFn
from torch import Tensor
from typing_extensions import override

from lightning_pipe import packages
from lightning_pipe.engine.deferred import deferred_init
from lightning_pipe.lightning import checkpoints, checks, ddp, observe, planned, settings
from lightning_pipe.lightning.body import PipelinedSequential
from lightning_pipe.lightning.build import build, deferred_recording
from lightning_pipe.lightning.layers import LayerSync
from lightning_pipe.lightning.optimizers import StageOptimizers, mix_in, raw
from lightning_pipe.lightning.precision import PipePrecision, loss_gradient, sum_tied
from lightning_pipe.lightning.replicas import Replicas
from lightning_pipe.lightning.trainer.checkpoints import PipelineCheckpoints
from lightning_pipe.lightning.trainer.processes import ReplicatedStages
from lightning_pipe.transport.wire.session import SESSION, abort_world

__all__ = ["PipeStrategy"]


class PipeStrategy(ReplicatedStages, PipelineCheckpoints):
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
            backward per stage over all its micro-batches; same gradients; GPipe's order alone allows it).
        rpc_timeout_sec: how long any RPC or wait for a stage may take before the step fails with an error
            naming the stage and process.
        module_name: the attribute of the LightningModule holding the ``nn.Sequential`` body.
        deferred_batch_norm: update BatchNorm running statistics once per batch, as without micro-batches.
        timeline: a path: record when each stage ran each micro-batch's forward and backward in training and
            write it there as a Chrome trace (replica 0, at the end of fit); ``python -m lightning_pipe
            timeline PATH out.png`` draws it and prints the bubble fraction.
        schedule: the order of a step's forwards and backwards: ``'gpipe'``, ``'1f1b'``, ``'zero-bubble'``,
            ``'interleaved-1f1b'``, ``'interleaved-zero-bubble'``, ``'looped-bfs'``, ``'zbv'`` or ``'dualpipev'``
            (pipelining's orders, docs/schedules.md), or a list of each process's actions (``[['0F0', ...], ...]``,
            pipelining's text form) or the path of a CSV file of them, checked before the first step. All but
            GPipe need the loss computed on the last stage (:func:`lightning_pipe.loss_on_last_stage` in
            ``training_step``).
        virtual_stages: stages per process (the interleaved schedules, looped BFS, the V shapes; default: the
            schedule's own, 2 for ``'zbv'`` and ``'dualpipev'``, 1 for the others): ``balance`` has processes x
            virtual_stages entries, and stage ``s`` runs in the pipeline's process ``s % processes``, or, for
            ``'zbv'`` and ``'dualpipev'``, in a V: stages ``r`` and ``2p - 1 - r`` in process ``r``.
        state_dict_type: ``'full'``: checkpoints are one file that loads into the plain model, written by the
            main process stage by stage; ``'sharded'``: a directory where each process writes its own stage
            (:func:`lightning_pipe.consolidate_checkpoint` makes the full file of it), as Lightning's
            ``FSDPStrategy`` names them.
        sharding_strategy: with replicas, what each process keeps of its stage, by Lightning's ``FSDPStrategy``
            names: ``'NO_SHARD'`` (the whole stage, averaged over the replicas by DDP), ``'SHARD_GRAD_OP'``
            (gradients and optimizer state sharded over the stage's replicas, parameters whole during a step),
            ``'FULL_SHARD'`` (parameters sharded too, gathered per micro-batch) or ``'HYBRID_SHARD'`` (FULL_SHARD
            within a node's replicas, replicated across nodes), by torch's FSDP2 (``fully_shard``) over each
            stage's replicas; see ``docs/large_models.md``.
        hybrid_shard_size: ``'HYBRID_SHARD'``: replicas per shard group (None: those on one node).
        data_plane: how stages hand each other activations and gradients: ``'auto'`` (point-to-point over gloo
            for CPU stages, each hand-off one message into a receive posted ahead; by RPC above 1.5 MiB and
            between GPUs, where RPC sends from GPU to GPU), ``'p2p'`` (point-to-point whatever the size; between GPU
            stages the tensors after their message over NCCL, each process on a GPU of its own) or ``'rpc'`` (every
            hand-off by RPC); see ``docs/design.md``, "The data plane".
        tensor_parallel_size: how many processes split each stage by tensor parallel (``t``; devices x nodes =
            stages x t x replicas, the t processes of a stage consecutive: one node). Each stage's layers are split
            by torch's tensor parallel (DTensor) over them; activations go between the matching tensor ranks of
            neighbouring stages; see ``docs/large_models.md``.
        tensor_parallel_plan: how each layer is split (with ``tensor_parallel_size > 1``): a dict from the body's
            module names (``*`` for one name part, as Hugging Face's plans) to torch ``ParallelStyle`` s or Hugging
            Face's style names (``'colwise'``, ``'rowwise'``, ``'colwise_rep'``, ``'sequence_parallel'``, ...), or
            a function ``(stage_module, tp_mesh) -> None``; None: the body's own (a ``to_sequential`` body of a
            Hugging Face model carries the model's plan).
        memory_per_device: what each process may hold (bytes, or ``'8GiB'``; default: a GPU's, or this machine's
            share) where ``balance``, ``microbatches``, ``schedule``, ``checkpoint``, ``tensor_parallel_size`` or
            ``sharding_strategy`` is ``'auto'``: chosen before any process starts by :func:`lightning_pipe.plan_layout`
            from ``example_input_array``, the fastest layout that fits, logged; ``docs/planning.md``.
        **kwargs: the rest goes to :class:`~pytorch_lightning.strategies.DDPStrategy` (``process_group_backend``,
            ``timeout``, ``cluster_environment``, ``ddp_comm_hook``, ``ddp_comm_state``, ``ddp_comm_wrapper``) and
            on to the ``DistributedDataParallel`` of every stage (``find_unused_parameters``, ``bucket_cap_mb``,
            ``static_graph``, ``gradient_as_bucket_view``, ``broadcast_buffers``, ...): with replicas, each stage
            is averaged with the same stage of every other replica by torch's DDP, built by
            :meth:`configure_ddp`. Unknown names are refused. ``find_unused_parameters`` defaults to True.
    """

    strategy_name = "pipe"

    def __init__(self, balance: list[int] | str | None = None, microbatches: int | str = 8,
                 checkpoint: str = "except_last",
                 balance_mode: str = "balance_by_size", pipelined_backward: bool = True,
                 rpc_timeout_sec: float = 60.0, module_name: str = "sequential_module",
                 deferred_batch_norm: bool = False, timeline: str | None = None,
                 schedule: str | list[list[str]] = "gpipe",
                 virtual_stages: int | None = None, state_dict_type: str = "full", sharding_strategy: str = "NO_SHARD",
                 hybrid_shard_size: int | None = None, data_plane: str = "auto", tensor_parallel_size: int | str = 1,
                 tensor_parallel_plan: dict[str, Any] | Callable[..., None] | None = None,
                 memory_per_device: int | str | None = None, accelerator: Any = None,
                 parallel_devices: list[torch.device] | None = None, cluster_environment: Any = None,
                 checkpoint_io: Any = None, precision_plugin: Any = None, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, **kwargs: Any) -> None:
        arguments = {k: v for k, v in locals().items() if k not in ("self", "kwargs", "__class__")} | kwargs
        given = {k: v for k, v in arguments.items() if k in settings.DEFAULTS}
        values = settings.pipeline_settings(PipeStrategy, type(self), given, kwargs)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, **kwargs)
        self.__dict__.update(values)
        self._body: PipelinedSequential | None = None  # the body this strategy runs, once set up
        self._stage_optimizers: StageOptimizers | None = None
        self._replicas = Replicas(1)
        self._lp_layers: LayerSync | None = None  # the driver's layer settings sent to their stages, once set up
        self._fitting = False
        self._arguments = arguments  # to be built again for the other Lightning package's Trainer (adopt)

    @property  # type: ignore[override]
    def accelerator(self) -> Any:
        """The Trainer's accelerator. Given one of the other Lightning package's, this strategy becomes that
        package's ``PipeStrategy`` first (:func:`lightning_pipe.packages.adopt`)."""
        return self._accelerator

    @accelerator.setter
    def accelerator(self, accelerator: Any) -> None:
        packages.adopt(self, accelerator, self._arguments)
        self._accelerator = accelerator

    # ------------------------------------------------------------------ what it refuses
    def check_settings(self, trainer: pl.Trainer | None = None) -> None:
        """Reject Trainer settings this strategy cannot honour (run where :meth:`check_model` runs)."""
        checks.check_settings(trainer, self._layer_sync is not None)
        ddp.check_settings(self._ddp_kwargs, trainer)
        # Not a check, but run where the checks run (as the job is launched, before fit looks for ckpt_path="last"):
        # what a dead job's saves left in the checkpoint folders, cleared, a checkpoint it was replacing put back.
        checkpoints.sweep_checkpoint_folders(trainer)

    def _sharding(self) -> Any:
        """How each stage is sharded over its replicas (None: DDP, ``NO_SHARD``)."""
        return settings.sharding_of(self)

    def plan_auto(self, module: pl.LightningModule, trainer: pl.Trainer | None) -> None:
        """Choose the arguments left to ``"auto"`` (before any process starts, in the launching process; the same in
        those it starts)."""
        planned.resolve(self, module, trainer)

    def check_model(self, module: pl.LightningModule) -> None:
        """Reject a LightningModule this strategy cannot split, with what to change (run before any process
        is started where Lightning starts them, and on every process otherwise)."""
        checks.check_model(module, self.module_name, self.balance, self.stages)

    # ------------------------------------------------------------------ setup: the pipeline
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._fitting = fitting
        if self.replicas == 1:
            # One pipeline sees every batch as the loader gives it, as one device does: no distributed sampler
            # (which would shuffle even a loader built with shuffle=False). With replicas, DDP's sampling stays.
            trainer._accelerator_connector.use_distributed_sampler = False
        self.accelerator.setup(trainer)
        recording = deferred_recording(self.lightning_module)  # a body built on meta: record the conversion too
        with recording.resume() if recording is not None else contextlib.nullcontext():
            self.precision_plugin.convert_module(self.model)
        planned.resolve_in_setup(self, self.lightning_module, trainer)  # torchrun, SLURM: now the processes have met
        self._attach(build(self, self.lightning_module))
        self.group_metrics(self.lightning_module)
        mix_in(self.precision_plugin, PipePrecision)
        self.precision_plugin._lp_unscale_shards()
        self.model_to_device()
        if fitting:
            self._replicas.start(self, self._body)  # DDP for every stage, as DDPStrategy wraps its model
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        """Modules made inside (``configure_model``, ``trainer.init_module()``) are built on the meta device
        and recorded (:func:`lightning_pipe.deferred_init`): at setup each process materialises its own stage
        alone, with the values a plain build gives under the same seed. ``empty_init=True`` skips
        ``torch.nn.init``'s initialisers (for weights loaded afterwards), as Lightning's strategies do."""
        with deferred_init(skip_initialisers=bool(empty_init)), self.precision_plugin.tensor_init_context():
            yield

    def setup_timeout(self) -> float:
        """How long setting a stage up may take, in seconds: the process group's timeout (materialising a
        large stage, meeting the other replicas)."""
        return self._timeout.total_seconds() if self._timeout is not None else default_pg_timeout.total_seconds()

    def _attach(self, body: PipelinedSequential) -> None:
        """Run ``body`` with this strategy: layers in step with the driver's, a pending remote step first."""
        self.balance, self._body = list(body.balance), body
        sync = LayerSync(lambda: checks.body_of(self.lightning_module, self.module_name), self.pipeline_processes)
        self._lp_layers = sync

        def before_forward() -> None:
            for optimizer in self.optimizers:  # a step taken outside Lightning's optimizer_step
                self.post_optimizer_step(raw(optimizer))
            sync()

        def on_backward() -> None:
            self._replicas.check_backward_path()
            sync.requires_grad()

        body.before_forward = before_forward
        body.on_backward = on_backward
        body.loss_scale = lambda: loss_gradient(self.lightning_module, self.precision_plugin)
        self._replicas.hosts, self._replicas.count = body.hosts, self.replicas
        self._stage_optimizers = StageOptimizers(body.hosts, body.stage_of, self.pipeline_processes, body.tied_sync,
                                                 lambda: body.sharded)
        self._stage_optimizers.before_update = body.pipeline.runner.averages.before_update
        self.record_timeline(self.timeline is not None)

    _pipeline = property(lambda self: self._body.pipeline if self._body is not None else None)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        assert self.lightning_module is not None and self._stage_optimizers is not None
        optimizers, schedulers = _init_optimizers_and_lr_schedulers(self.lightning_module)
        names = {id(p): n for n, p in self.lightning_module.named_parameters()}
        self._stage_optimizers.mirror(optimizers, names, getattr(self.precision_plugin, "scaler", None),
                                      str(self.precision_plugin.precision))
        # Assigned after the classes changed: Lightning wraps them in LightningOptimizers built from it.
        self.optimizers = optimizers
        self.lr_scheduler_configs = schedulers

    # ------------------------------------------------------------------ a training step, in Lightning's order
    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        """Lightning's backward starts: the pipeline's backward may run (with replicas, one that bypasses
        Lightning's is refused: nothing would average its gradients)."""
        super().pre_backward(closure_loss)
        self._replicas.in_backward += 1

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        """Lightning's backward is over (with replicas, every stage's DDP reduced during it; each stage's
        clipping and step wait for its own reduction)."""
        self._replicas.in_backward = max(0, self._replicas.in_backward - 1)
        super().post_backward(closure_loss)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        inner = closure

        def closure(*args: Any, **kwargs: Any) -> Any:  # before clipping and the step (each stage's replicas
            result = inner(*args, **kwargs)  # averaged by then): the sum of the gradients of tied parameters
            sum_tied(raw(optimizer))
            return result

        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.post_optimizer_step(raw(optimizer))
        return output

    def post_optimizer_step(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> None:
        """After each optimizer step (automatic or manual): every remote stage has stepped its part of
        ``optimizer`` with the driver's hyper-parameters (started with the driver's update), or raised here;
        none steps when the driver's step was skipped (a gradient scaler's overflow)."""
        if self._stage_optimizers is not None:
            self._stage_optimizers.step_remote(optimizer)

    @override
    def barrier(self, name: str | None = None) -> None:
        """Every process of the job meets, not only those Lightning sees: each driver has its remote stages meet
        the same stage of the other replicas (after all they were asked so far), then the drivers meet."""
        for future in self._body.hosts.start("barrier", timeout=0) if self._body and self._body.hosts else []:
            future.result()
        super().barrier(name)

    # ------------------------------------------------------------------ seeing the pipeline
    def record_timeline(self, on: bool = True) -> None:
        """Start (or stop) recording each stage's actions, as ``timeline=`` does (from ``on_fit_start`` on)."""
        observe.record_timeline(self._body, on)

    def write_timeline(self, path: str | None = None) -> None:
        """Write what the stages of replica 0 recorded (``timeline=...``) as a Chrome trace (main process)."""
        path = path or self.timeline
        if path is not None and self._body is not None and self.is_global_zero:
            observe.write_timeline(self._body, path, self.topology.pipeline(0))

    # ------------------------------------------------------------------ the end
    @override
    def teardown(self) -> None:
        if self.timeline is not None and self._fitting:
            self.write_timeline()
        if self._fitting:
            self._replicas.stop(self, self._body)
        super().teardown()  # unwraps the driver's DDP, as DDPStrategy's

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
packages.accept()
