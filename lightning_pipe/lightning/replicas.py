"""Replicas of the pipeline: each stage averaged with the same stage of every replica by torch's DDP, as DDP does.

While fitting with more than one replica, every stage's process wraps its partition in the
``DistributedDataParallel`` that ``PipeStrategy.configure_ddp`` builds, over a group of that stage's replicas
(:mod:`lightning_pipe.transport.parallel.ddp` drives it: buckets are all-reduced during the stage's last
backward of each step, overlapping the backward of the stages before it). The driver's own layers outside the
body (a head, a loss module with weights) are wrapped as Lightning's ``DDPStrategy`` wraps a model: a DDP over
the LightningModule that leaves the body out, which Lightning's forward redirection, ``no_sync`` and manual
backward drive as usual. While Lightning accumulates gradients it blocks the sync (``no_sync``) everywhere.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from pytorch_lightning.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_pipe.lightning import ddp
from lightning_pipe.lightning.body import PipelinedSequential
from lightning_pipe.transport.stages.remote import HostGroup

__all__: list[str] = []


class Replicas:
    """Averages the gradients of one pipeline's stages with the other replicas' (``count`` replicas)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.hosts: HostGroup | None = None
        self.blocked = 0  # inside block_backward_sync: gradients stay per replica (accumulation)
        self.in_backward = 0  # inside Lightning's backward (pre_backward to post_backward)
        self.active = False  # the stages' DDPs are built (while fitting)
        self.trainable: tuple[bool, ...] = ()  # the LightningModule's requires_grad flags the averaging follows

    def check_backward_path(self) -> None:
        """The pipeline's backward starts: refuse one outside Lightning's backward when there are replicas (a
        bare ``loss.backward()`` in manual optimization): Lightning's DDP would not average the driver's own
        layers then (it prepares their reduction in ``manual_backward``), and the replicas would drift apart."""
        if not self.in_backward and self.count > 1:
            raise RuntimeError(
                "the pipeline's backward ran outside Lightning's backward (loss.backward() instead of "
                f"self.manual_backward(loss)?): with {self.count} replicas its gradients would not be averaged "
                "over them, and the replicas would drift apart. Call self.manual_backward(loss)")

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside keep their gradients per replica (DDP's ``no_sync``)."""
        self.blocked += 1
        try:
            yield
        finally:
            self.blocked -= 1

    def reducing(self) -> bool:
        """Whether the pipeline's step starting now averages its gradients over the replicas."""
        return self.active and self.count > 1 and not self.blocked

    def start(self, strategy: Any, body: PipelinedSequential) -> None:
        """As fitting starts: every stage of this pipeline (here and in its processes) and the driver's layers
        outside the body get their DDP, built by ``strategy.configure_ddp``; every replica does the same at once
        (DDP's constructor is a collective of each stage's replicas)."""
        if self.count == 1:
            given = strategy._ddp_explicit
            if given:
                rank_zero_warn(f"PipeStrategy: {', '.join(given)} have no effect with one replica: nothing is "
                               "averaged, and no DistributedDataParallel wraps the stages")
            return
        assert body.hosts is not None
        ddp.check_backend(strategy._ddp_comm_hook, strategy._get_process_group_backend())
        # No RPC timeout: DDP's constructor waits for the same stage of the other replicas, which may be a slow
        # setup away; the process group's timeout bounds that wait.
        sharding = strategy._sharding()
        self.trainable = _flags(strategy.lightning_module)
        futures = body.hosts.start("replicate", ddp.stage_copy(strategy).configure_ddp, sharding, timeout=0)
        body.pipeline.runner.averages.replicate(strategy.configure_ddp, sharding)
        if sharding is not None:  # stage 0's parameters are shards now: where the driver's names lead to them
            body.sharded = True
            body.retie()
            if body.tied_sync is not None:
                body.tied_sync.params = {f"{body.name}.{name}": p for name, p in
                                         body.named_parameters(remove_duplicate=False) if not p.is_meta}
        _wait(futures, "building")
        self._wrap_outside(strategy, body)
        body.pipeline.reduce = self.reducing
        self.active = True

    def refresh(self, strategy: Any, body: PipelinedSequential, outside: bool = True) -> None:
        """As a training step starts, between steps: where what the pipeline trains changed since its averaging
        was built (``requires_grad`` of the body's parameters, remote stages' included, or of the driver's layers
        outside it), rebuild the DDPs that average it, in every process of every replica at once: torch's DDP
        never averages a parameter that did not require a gradient when it was built (Lightning's DDPStrategy
        leaves such a parameter training apart on each replica). Stages sharded by FSDP2 follow ``requires_grad``
        themselves. The replicas must change it at the same step: the drivers compare what they train at every
        step (one all-reduce of a digest), and a difference is refused before the step. ``outside`` False: called
        within the forward of the driver's DDP over the layers outside the body (Fabric's loop), which cannot be
        rebuilt there: a change of theirs is refused."""
        if not self.active or self.count == 1:
            return
        module = strategy.lightning_module
        flags = _flags(module)
        _agree(flags, strategy.root_device, strategy.global_rank)
        if flags == self.trainable:
            return
        if not outside and _outside_flags(strategy, body, flags) != _outside_flags(strategy, body, self.trainable):
            raise RuntimeError(
                "requires_grad of a layer outside the body changed while training with replicas: its "
                "DistributedDataParallel would go on averaging what it was built for. Keep the layers you freeze or "
                f"unfreeze in the body ({strategy.module_name}), or set requires_grad before fabric.setup")
        self.trainable = flags
        assert body.hosts is not None
        twin = ddp.rebuild_copy(strategy)  # no init_sync: the replicas are in step
        futures = body.hosts.start("refresh_replicas", twin.configure_ddp, timeout=0)
        body.pipeline.runner.averages.refresh(twin.configure_ddp)
        _wait(futures, "rebuilding")
        if not outside:
            return
        wrapped = strategy.model
        if isinstance(wrapped, DistributedDataParallel):
            wrapped.reducer._remove_autograd_hooks()
            strategy.model = module
        self._wrap_outside(strategy, body, twin)

    def _wrap_outside(self, strategy: Any, body: PipelinedSequential, twin: Any = None) -> None:
        """The driver's layers outside the body, in a DDP over the LightningModule that leaves the body to its
        stages' (as Lightning's DDPStrategy wraps a model), if any of them trains (built by ``twin``'s
        ``configure_ddp`` when given: a rebuild)."""
        module = strategy.lightning_module
        prefix = strategy.module_name + "."
        inner = {prefix + n for n, _ in itertools.chain(body.named_parameters(), body.named_buffers())}
        if not any(p.requires_grad for n, p in module.named_parameters() if n not in inner):
            return
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, sorted(inner))
        device_ids = strategy.determine_ddp_device_ids()
        strategy.model = (twin or strategy).configure_ddp(module, device_ids, None, None)

    def stop(self, strategy: Any, body: PipelinedSequential | None) -> None:
        """As fitting ends: the stages' DDPs go (Lightning's teardown unwraps the driver's)."""
        if not self.active or body is None or body.hosts is None:
            return
        self.active = False
        body.pipeline.reduce = lambda: False
        futures = body.hosts.start("replicate", None)
        body.pipeline.runner.averages.replicate(None)
        for future in futures:
            future.result()


def _wait(futures: list[Any], doing: str) -> None:
    """Wait for each remote stage's process (futures in process order from 1), an error noting which."""
    for j, future in enumerate(futures, start=1):
        try:
            future.result()
        except Exception as exc:
            exc.add_note(f"while {doing} the DistributedDataParallel of stage {j}'s process")
            raise


def _flags(module: nn.Module) -> tuple[bool, ...]:
    """``requires_grad`` of each of ``module``'s parameters (remote layers' placeholders included)."""
    return tuple(p.requires_grad for p in module.parameters())


def _outside_flags(strategy: Any, body: PipelinedSequential, flags: tuple[bool, ...]) -> tuple[bool, ...]:
    """Of ``flags`` (:func:`_flags` of the strategy's module), those of parameters outside the body."""
    inner = {id(p) for p in body.parameters()}
    return tuple(f for f, p in zip(flags, strategy.lightning_module.parameters()) if id(p) not in inner)


def _agree(flags: tuple[bool, ...], device: torch.device, replica: int) -> None:
    """Refuse, on every driver, a step where the replicas train different parameters (``flags`` differ): one
    all-reduce of a digest of them over the drivers (the default group)."""
    value = int.from_bytes(hashlib.blake2b(bytes(flags), digest_size=7).digest(), "little")
    seen = torch.tensor([value, -value], dtype=torch.int64, device=device)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    if int(seen[0]) != value or int(seen[1]) != -value:
        raise RuntimeError(
            f"the replicas do not train the same parameters in this step (replica {replica} trains "
            f"{sum(flags)} of {len(flags)} parameter tensors; another replica's requires_grad differs): each would "
            "step apart from the others. Change requires_grad on every replica at the same step (in a hook every "
            "replica runs, such as on_train_batch_start, from values every replica shares)")
