"""``PipeStrategy`` for Lightning Fabric: a loop of the user's own (``fabric.setup``, ``fabric.backward``,
``optimizer.step()``) trains the body as a pipeline, built from the same pieces as the Trainer's strategy.

Follow one step of a Fabric loop on the driver (stage 0 of a replica)::

    model, opt = fabric.setup(model, opt)   the body split into stages (build.py), the optimizer mirrored on every
                                            stage (optimizers.py), with replicas each stage's DDP built (replicas.py)
    loss = loss_fn(model(x), y)             the pipeline's forward (body.py), or loss_on_last_stage(...)
    fabric.backward(loss)                   every stage's .grad filled; with replicas, averaged stage by stage
    fabric.clip_gradients(model, opt, ...)  by the global norm over every stage (precision.py)
    opt.step(); opt.zero_grad()             every remote stage steps with the driver's hyper-parameters, and zeroes
    fabric.save(path, {"model": model, ...})  one file of the plain model's state, written stage by stage

Stage workers never run the loop: ``fabric.launch()`` has them serve their stage until the drivers are done. The
module is ``nn.Sequential`` itself, or holds one under ``module_name`` (``sequential_module``), as the Trainer's.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
from lightning_fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning_fabric.strategies import DDPStrategy
from lightning_fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning_fabric.strategies.strategy import _BackwardSyncControl
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_pipe.engine.deferred import deferred_init
from lightning_pipe.engine.loss import CastOutput
from lightning_pipe.lightning import checks, ddp, observe, planned, settings
from lightning_pipe.lightning.body import PipelinedSequential
from lightning_pipe.lightning.build import build
from lightning_pipe.lightning.fabric import checkpoints
from lightning_pipe.lightning.launcher import Serving
from lightning_pipe.lightning.layers import LayerSync
from lightning_pipe.lightning.optimizers import StageOptimizers, raw
from lightning_pipe.lightning.precision import (
    PipePrecision,
    clip_by_global_norm,
    clip_by_value,
    output_casts,
    sum_tied,
    unscale_remote,
)
from lightning_pipe.lightning.processes import PipelineLayout
from lightning_pipe.lightning.replicas import Replicas

__all__ = ["PipeStrategy"]

#: Fabric's precision settings taken: their plugins cast and autocast as on one device (the driver's autocast
#: reaches every stage); "16-mixed"'s gradient scaler unscales every stage's gradients (:meth:`PipeStrategy.unscale`).
_PRECISIONS = ("32-true", "64-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true")


class FabricModel(nn.Module):
    """A bare ``nn.Sequential`` given to ``fabric.setup``, under the name the pipeline's build looks for."""

    def __init__(self, body: nn.Module, name: str) -> None:
        super().__init__()
        setattr(self, name, body)


class _Launcher(Serving, _SubprocessScriptLauncher):
    """Fabric's script launcher, except that stage workers serve their stage instead of running the script."""

    def __init__(self, strategy: Any, *args: Any) -> None:
        super().__init__(*args)
        self._strategy = strategy

    @override
    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return super().launch(self.serving(function), *args, **kwargs)


class _NoSync(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: every stage keeps its gradients to its replica (DDP's ``no_sync``)."""

    def __init__(self, strategy: PipeStrategy) -> None:
        self.strategy = strategy

    @override
    @contextlib.contextmanager
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> Iterator[None]:
        if not enabled:
            yield
            return
        with self.strategy._replicas.no_sync(), (module.no_sync() if isinstance(module, DistributedDataParallel)
                                                 else contextlib.nullcontext()):
            yield


class PipeStrategy(PipelineLayout, DDPStrategy):
    """Pipeline parallelism for a Fabric loop: the module's ``nn.Sequential`` body (the module itself, or
    ``module.sequential_module``) runs one stage per process; with more processes than stages the pipeline is
    replicated and each stage averaged over its replicas. Takes the arguments of the Trainer's ``PipeStrategy``
    (``lightning_pipe.PipeStrategy`` given to ``Fabric`` becomes this class; docs/fabric.md)."""

    strategy_name = "pipe"

    def __init__(self, balance: list[int] | None = None, microbatches: int = 8, checkpoint: str = "except_last",
                 balance_mode: str = "balance_by_size", pipelined_backward: bool = True,
                 rpc_timeout_sec: float = 60.0, module_name: str = "sequential_module",
                 deferred_batch_norm: bool = False, timeline: str | None = None,
                 schedule: str | list[list[str]] = "gpipe",
                 virtual_stages: int | None = None, state_dict_type: str = "full", sharding_strategy: str = "NO_SHARD",
                 hybrid_shard_size: int | None = None, data_plane: str = "auto", tensor_parallel_size: int = 1,
                 tensor_parallel_plan: dict[str, Any] | Callable[..., None] | None = None,
                 memory_per_device: int | str | None = None, accelerator: Any = None,
                 parallel_devices: list[torch.device] | None = None, cluster_environment: Any = None,
                 checkpoint_io: Any = None, precision: Any = None, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, **kwargs: Any) -> None:
        given = {k: v for k, v in locals().items() if k in settings.DEFAULTS}
        values = settings.pipeline_settings(PipeStrategy, type(self), given, kwargs)
        planned.refuse_after_launch(values["_auto"], "Fabric starts its processes at fabric.launch()",
                                    "fabric.setup, as it builds the pipeline")
        self._ddp_comm_hook = kwargs.pop("ddp_comm_hook", None)
        self._ddp_comm_state = kwargs.pop("ddp_comm_state", None)
        self._ddp_comm_wrapper = kwargs.pop("ddp_comm_wrapper", None)
        kwargs.pop("model_averaging_period", None)  # (refused by pipeline_settings unless None)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io, precision=precision,
                         process_group_backend=process_group_backend, timeout=timeout,
                         start_method=kwargs.pop("start_method", "popen"), **kwargs)
        self.__dict__.update(values)
        self._backward_sync_control = _NoSync(self)
        self._body: PipelinedSequential | None = None
        self._module: nn.Module | None = None  # the module set up (its body pipelined), once it is
        self.model: nn.Module | None = None  # what Fabric runs forward: the module, or DDP over its outside layers
        self._stage_optimizers: StageOptimizers | None = None
        self._replicas = Replicas(1)
        self._lp_layers: LayerSync | None = None
        self._mirrored: list[torch.optim.Optimizer] = []  # the optimizers set up with the module

    @DDPStrategy.precision.setter  # type: ignore[attr-defined,untyped-decorator]
    def precision(self, precision: Any) -> None:
        """Fabric's precision plugin, refused (as the Fabric is made) where it cannot work across stages."""
        name = getattr(precision, "precision", None)
        if name is not None and str(name) not in _PRECISIONS:
            raise ValueError(f"PipeStrategy under Fabric does not take precision={name!r} (a plugin of its own, or "
                             f"one that changes the model's layers): use one of {_PRECISIONS}")
        self._precision = precision

    # ------------------------------------------------------------------ processes
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._launcher = _Launcher(self, self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def _set_world_ranks(self) -> None:
        self.set_world_ranks()

    @override
    def _setup_distributed(self) -> None:
        self.join()

    @property
    def lightning_module(self) -> nn.Module | None:
        """The module set up by ``fabric.setup`` (its body pipelined), as the Trainer's strategy names it."""
        return self._module

    @property
    def init_sync(self) -> bool:
        """Whether every replica starts from replica 0's weights (DDP's ``init_sync``)."""
        return bool(self._ddp_kwargs.get("init_sync", True))

    def determine_ddp_device_ids(self) -> list[int] | None:
        """The device of the driver's DDP over the layers outside the body (None on CPU)."""
        return self._determine_ddp_device_ids()

    def configure_ddp(self, module: nn.Module, device_ids: list[int] | None, process_group: Any,
                      stage: int | None) -> DistributedDataParallel:
        """Wrap ``module`` in the ``DistributedDataParallel`` that averages it over ``process_group``: a stage's
        partition over that stage's replicas, or (``stage=None``) the module's layers outside the body over the
        drivers; as the Trainer's ``PipeStrategy.configure_ddp``."""
        return ddp.wrap(self, module, device_ids, process_group)

    def _sharding(self) -> Any:
        return settings.sharding_of(self)

    def check_model(self, module: nn.Module) -> None:
        """Reject a module this strategy cannot split, with what to change."""
        checks.body_of(module, self.module_name)  # (an error that says where to put the layers)
        checks.check_model(module, self.module_name, self.balance, self.stages)  # type: ignore[arg-type]

    def setup_timeout(self) -> float:
        """How long setting a stage up may take, in seconds: the process group's timeout."""
        return self._timeout.total_seconds() if self._timeout is not None else default_pg_timeout.total_seconds()

    # ------------------------------------------------------------------ setup
    @override
    def module_init_context(self, empty_init: bool | None = None) -> contextlib.AbstractContextManager:
        """``fabric.init_module()``: modules made inside are built on the meta device and recorded; each process
        materialises its own stage alone at ``fabric.setup``, with the values a plain build gives."""
        stack = contextlib.ExitStack()
        stack.enter_context(deferred_init(skip_initialisers=bool(empty_init)))
        stack.enter_context(self.precision.module_init_context())
        return stack

    @override
    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[torch.optim.Optimizer],
                                    scheduler: Any = None) -> tuple[nn.Module, list[torch.optim.Optimizer], Any]:
        prefix = f"{self.module_name}." if isinstance(module, nn.Sequential) else ""  # (held under that name)
        names = {id(p): prefix + n for n, p in module.named_parameters()}
        module = self.setup_module(module, optimizers)
        assert self._stage_optimizers is not None and self._module is not None
        after = dict(self._module.named_parameters())
        for optimizer in optimizers:  # built before the split: its remote parameters are the driver's placeholders now
            for group in optimizer.param_groups:
                group["params"] = [after.get(names.get(id(p), ""), p) for p in group["params"]]
        self._stage_optimizers.mirror(optimizers, {id(p): n for n, p in after.items()},
                                      getattr(self.precision, "scaler", None), str(self.precision.precision))
        self._mirrored = list(optimizers)
        return module, optimizers, scheduler

    @override
    def setup_module(self, module: nn.Module, optimizers: list[torch.optim.Optimizer] | None = None) -> nn.Module:
        if self._module is not None:
            raise RuntimeError("PipeStrategy under Fabric sets up one model: its stages hold the processes of the job "
                               "(call fabric.setup once, with the model and its optimizers)")
        bare = isinstance(module, nn.Sequential)
        root = FabricModel(module, self.module_name) if bare else module
        planned.resolve_in_fabric(self, root, optimizers or [])  # what was left to "auto", as the model is here
        body = build(self, root)
        self._attach(root, body)
        self.group_metrics(root)
        root.to(self.root_device)  # the driver's part (the remote layers' placeholders stay on meta)
        pipelined = body.pipeline_loss
        casts = output_casts(self.precision) if bare else {}

        def pipeline_loss(input: Any, target: Any, loss_fn: Any, **kwargs: Any) -> Any:
            """``loss_on_last_stage`` called outside the module's forward: in the precision's autocast all the same;
            of the bare ``nn.Sequential`` given to ``fabric.setup`` (``loss_on_last_stage(model, ...)``), what Fabric's
            module does around a forward, the input converted and the output cast (on the last stage, before the
            loss): the loss of one device's ``loss_fn(model(x), y)``."""
            if bare:
                input = self.precision.convert_input(input)
                loss_fn = CastOutput(loss_fn, casts) if casts else loss_fn
            with self.precision.forward_context():
                return pipelined(input, target, loss_fn, **kwargs)

        body.pipeline_loss = pipeline_loss  # type: ignore[method-assign]
        if bare:  # loss_on_last_stage(model, ...) finds the pipeline through the module Fabric was given, and
            module.pipeline_loss = pipeline_loss  # type: ignore[assignment]
            body.speak_for(module)  # Fabric's wrapper reads and loads the state through that module
        self.model = body if bare else root
        self._replicas.start(self, body)  # DDP or FSDP2 for every stage (DDP for the outside layers) with replicas
        PipePrecision._lp_unscale_shards(self.precision)  # type: ignore[arg-type] - a scaler unscales shards too
        return self.model

    @override
    def module_to_device(self, module: nn.Module) -> None:
        """Before the split, nothing moves: each stage goes to its own device as it is set up, and a module built
        on the meta device is materialised stage by stage; afterwards, the driver's part (stage 0's layers and the
        layers outside the body) moves to its device."""
        if self._body is not None:
            module.to(self.root_device)

    @override
    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        raise RuntimeError("PipeStrategy under Fabric sets up the model and its optimizers together: "
                           "model, optimizer = fabric.setup(model, optimizer)")

    def _attach(self, root: nn.Module, body: PipelinedSequential) -> None:
        """Run ``body`` with this strategy: layers in step with the driver's, a pending remote step first, and
        with replicas, the averaging following what trains."""
        self._module, self._body = root, body
        sync = LayerSync(lambda: checks.body_of(root, self.module_name), self.pipeline_processes)
        self._lp_layers = sync

        def before_forward() -> None:
            for optimizer in self._mirrored:  # a step taken on the optimizer itself, not through Fabric's
                self._stage_optimizers.step_remote(optimizer)  # type: ignore[union-attr]
            sync()
            if torch.is_grad_enabled():
                self._replicas.refresh(self, body, outside=False)

        def on_backward() -> None:
            self._replicas.check_backward_path()
            sync.requires_grad()

        body.before_forward = before_forward
        body.on_backward = on_backward
        # What the loss's gradient will be, for the backwards a schedule runs before fabric.backward: the scale of a
        # gradient scaler (16-mixed) where there is one (the loop's own division is committed with it).
        body.loss_scale = lambda: float(self.precision.scaler.get_scale()) if getattr(  # type: ignore[attr-defined]
            self.precision, "scaler", None) is not None and self.precision.scaler.is_enabled() else 1.0
        self._replicas.hosts, self._replicas.count = body.hosts, self.replicas
        self._stage_optimizers = StageOptimizers(body.hosts, body.stage_of, self.pipeline_processes, body.tied_sync,
                                                 lambda: body.sharded)
        self._stage_optimizers.before_update = body.pipeline.runner.averages.before_update
        observe.record_timeline(body, self.timeline is not None)

    # ------------------------------------------------------------------ a step
    @override
    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        self._replicas.in_backward += 1
        try:
            super().backward(tensor, module, *args, **kwargs)
        finally:
            self._replicas.in_backward -= 1

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Under a gradient scaler (``16-mixed``), unscale ``optimizer``'s gradients on every stage, once per step
        (before clipping, or before the step): an overflow on any stage skips the step everywhere."""
        scaler = getattr(self.precision, "scaler", None)
        if scaler is None or not scaler.is_enabled():
            return
        from torch.amp.grad_scaler import OptState

        if scaler._per_optimizer_states[id(optimizer)]["stage"] is not OptState.UNSCALED:
            scaler.unscale_(optimizer)
            unscale_remote(scaler, optimizer)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        optimizer = raw(optimizer)
        sum_tied(optimizer)  # before the update, if clipping did not already
        self.unscale(optimizer)  # every stage's, before the scaler decides whether to step
        output = super().optimizer_step(optimizer, **kwargs)
        if self._stage_optimizers is not None:
            self._stage_optimizers.step_remote(optimizer)
            planned.check_after_steps(self, lambda: observe.memory(self._body))
        return output

    @override
    def clip_gradients_norm(self, module: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float | int,
                            norm_type: float | int = 2.0, error_if_nonfinite: bool = True) -> Tensor:
        optimizer = raw(optimizer)
        if getattr(optimizer, "_lp_hosts", None) is None:
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)
        self.unscale(optimizer)
        return clip_by_global_norm(optimizer, float(max_norm), float(norm_type), error_if_nonfinite)

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: torch.optim.Optimizer, clip_val: float | int) -> None:
        optimizer = raw(optimizer)
        if getattr(optimizer, "_lp_hosts", None) is None:
            return super().clip_gradients_value(module, optimizer, clip_val)
        self.unscale(optimizer)
        clip_by_value(optimizer, float(clip_val))
        return None

    @override
    def all_reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """Over the replicas (:meth:`replica_group`: a replica's tensor ranks hold the same values), as given else."""
        return super().all_reduce(tensor, self.over_replicas(group), reduce_op)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        """Every process of the job meets: each driver has its stages meet theirs, then the drivers meet."""
        body = self._body
        for future in body.hosts.start("barrier", timeout=0) if body is not None and body.hosts else []:
            future.result()
        super().barrier(*args, **kwargs)

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        """One file, by the main process, of ``state`` with each module's state the plain module's and each
        optimizer's the plain model's optimizer's, written stage by stage (the other replicas write nothing); under
        ``state_dict_type="sharded"``, a directory each process writes its own entries into."""
        if self._body is None or self._stage_optimizers is None:
            return super().save_checkpoint(path, state, storage_options, filter)
        checkpoints.save(self, str(path), state, storage_options, filter)
        return None

    @override
    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Load a file :meth:`save_checkpoint` wrote (or any of the plain model's) into ``state``: each module's
        entries reach their stages, each optimizer's state its stages' parts; or a sharded directory (this strategy's
        or the Trainer's), each process reading its own entries."""
        if self._body is None or self._stage_optimizers is None or not isinstance(state, dict) or not state:
            return super().load_checkpoint(path, state, strict, weights_only)  # (load_raw: a module or optimizer)
        return checkpoints.load(self, os.fspath(path), state, strict, weights_only)

    # ------------------------------------------------------------------ the end
    @override
    def teardown(self) -> None:
        if self._body is not None:
            self._replicas.stop(self, self._body)
        super().teardown()

