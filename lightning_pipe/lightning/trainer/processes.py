"""The Trainer's processes: ``DDPStrategy``'s hooks for pipelines (launching, joining, SLURM's requeue between
batches) and for their replicas (each stage's DDP, ``no_sync`` while Lightning accumulates)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from pytorch_lightning.strategies import DDPStrategy
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_pipe.lightning import ddp, observe, planned, requeue
from lightning_pipe.lightning.body import PipelinedSequential
from lightning_pipe.lightning.launcher import PipeLauncher
from lightning_pipe.lightning.processes import PipelineLayout
from lightning_pipe.lightning.replicas import Replicas


class PipelineProcesses(PipelineLayout, DDPStrategy):
    """The Trainer's ``DDPStrategy`` whose processes form pipelines (:class:`PipelineLayout`)."""

    #: What Fabric's connector reads of a strategy it is given before giving it an accelerator (which makes this
    #: strategy Fabric's ``PipeStrategy``: :func:`lightning_pipe.packages.adopt`).
    _precision: Any = None

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._launcher = PipeLauncher(self, self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_distributed(self) -> None:
        self.join()

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._requeue = requeue.DeferredRequeue()
        self._requeue.install(self.cluster_environment)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self._requeue is not None:
            self._requeue.at_batch_start(self, self.lightning_module.trainer)
        if batch_idx == 2 and getattr(self, "_predicted", None) and getattr(self, "_body", None) is not None:
            # Two steps taken (the optimizer's state is there): each process's peak against the plan's.
            planned.check_peaks(self, observe.memory(self._body))

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        # ``self.log(sync_dist=True)``: over the replicas (a replica's tensor ranks logged the same batch).
        return super().reduce(tensor, self.over_replicas(group), reduce_op)

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self._requeue is not None:
            requeuing, self._requeue = self._requeue, None
            requeuing.uninstall(self)


class ReplicatedStages(PipelineProcesses):
    """The processes of pipelines whose replicas are averaged stage by stage by torch's DDP (:class:`Replicas`):
    what ``PipeStrategy`` does of ``DDPStrategy``'s ``configure_ddp`` and ``block_backward_sync``."""

    _replicas: Replicas
    _fitting: bool
    _body: PipelinedSequential | None
    _lp_layers: Any  # the driver's layers' settings sent to their stages (lightning/layers.py's LayerSync)

    @property
    def init_sync(self) -> bool:
        """Whether every replica starts from replica 0's weights (DDP's ``init_sync``: while fitting, False leaves
        that to the script, as under DDPStrategy)."""
        return not self._fitting or self._ddp_kwargs.get("init_sync", True)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """A training step starts: the averaging follows what the replicas train now (:meth:`Replicas.refresh`)."""
        if self._body is not None and self._lp_layers is not None:
            self._lp_layers.requires_grad()  # the remote stages' flags first: they rebuild from them
            self._replicas.refresh(self, self._body)
        return super().training_step(*args, **kwargs)

    @override
    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Backwards inside keep their gradients per replica (DDP's ``no_sync``, while Lightning accumulates)."""
        with self._replicas.no_sync(), super().block_backward_sync():
            yield None

    @override
    def configure_ddp(self, module: nn.Module, device_ids: list[int] | None,  # type: ignore[override]
                      process_group: dist.ProcessGroup | None, stage: int | None) -> DistributedDataParallel:
        """Wrap ``module`` in the ``DistributedDataParallel`` that averages it over ``process_group``: stage
        ``stage``'s partition (an ``nn.Sequential`` of its layers, named by their index in the body) over that
        stage's replicas, called in the stage's process; or, with ``stage=None``, the LightningModule's layers
        outside the body (the body left to its stages) over the drivers. Override it to change one stage's
        DDP (a comm hook, buckets); it must wrap ``module`` itself::

            class MyStrategy(PipeStrategy):
                def configure_ddp(self, module, device_ids, process_group, stage):
                    ddp = super().configure_ddp(module, device_ids, process_group, stage)
                    if stage == 1:
                        ddp.register_comm_hook(process_group, my_hook)   # instead of ddp_comm_hook
                    return ddp

        In a stage's process it runs on a copy of this strategy holding its arguments and a subclass's own
        attributes (not the Trainer's accelerator, cluster environment, model or optimizers). The default
        passes every DDP argument and registers ``ddp_comm_hook`` (through ``ddp_comm_wrapper``), with its own
        copy of ``ddp_comm_state``."""
        return ddp.wrap(self, module, device_ids, process_group)

