"""``Pipe``: an ``nn.Sequential`` split into partitions and trained with a pipeline schedule, in one process.

Follow one mini-batch::

    input ─► scatter into m micro-batches ─► stages on worker threads, schedule order ─► gather ─► output
                                                                                                  │
    input grad ◄─ gather ◄─ stages' local backward, reverse schedule order ◄─ scatter ◄─ output grad

The output is tied into autograd (:mod:`lightning_pipe.engine.autograd`), so ``loss.backward()`` drives the
pipeline's backward; each stage's parameters receive their ``.grad`` from the stage's own local autograd.
:func:`loss_on_last_stage` computes the loss where the output is born instead, micro-batch by micro-batch,
which lets schedules interleave forwards and backwards (``1f1b``, ``zero-bubble``, ``interleaved-1f1b``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipe.engine.autograd import pipeline_loss, run_pipeline
from lightning_pipe.engine.batchnorm import DeferredBatchNorm
from lightning_pipe.engine.loss import LossFn, check_extras, check_reduction
from lightning_pipe.engine.microbatch import TensorOrTensors
from lightning_pipe.engine.partition import (
    Device,
    check_balance,
    check_checkpoint,
    check_chunks,
    check_sequential,
    normalize_device,
    split_module,
)
from lightning_pipe.engine.pipeline import LocalPipeline
from lightning_pipe.engine.plan import Plan
from lightning_pipe.engine.schedule import (
    check_schedule,
    placement_of,
    schedule_from,
    schedule_plan,
    stages_per_process,
)
from lightning_pipe.engine.skip.layout import inspect_skip_layout
from lightning_pipe.engine.skip.skippable import verify_skippables
from lightning_pipe.engine.stage import Stage
from lightning_pipe.engine.tied import TiedCopies

__all__ = ["Pipe", "loss_on_last_stage"]


def loss_on_last_stage(body: nn.Module, input: Any, target: Any, loss_fn: LossFn, *, reduction: str = "mean",
                       extras: Mapping[str, str] | None = None) -> Any:
    """``loss_fn(body(input), target)``, computed where ``body``'s output is born.

    On a plain module (one device, no strategy) it is exactly that. On a pipelined body (a :class:`Pipe`, or
    ``PipeStrategy``'s), the last stage computes ``loss_fn`` on each micro-batch's output and slice of
    ``target``, only the losses travel back, and they are combined into the batch's loss
    (:mod:`lightning_pipe.engine.loss`: with ``reduction="mean"`` each weighted by its share of the samples,
    which equals the whole batch's loss for a loss that is a mean over samples; ``"sum"``: added up). Schedules
    that interleave forwards and backwards need it. ``loss_fn`` must be picklable where stages live in other
    processes (``PipeStrategy``): a module-level function, a ``functools.partial`` of one or an ``nn.Module``, not a
    lambda, a local function or a bound method of a LightningModule; one that does not pickle is refused at this
    call, before anything is sent. In one process (a :class:`Pipe`) any callable works.

    What ``loss_fn`` returns beside ``"loss"`` in a mapping comes back too, each micro-batch's combined into the
    batch's: per-sample tensors joined, integer scalars (counts) added up, floating scalars combined as ``extras``
    names them (``{"abs_error": "sum"}``; ``"mean"``: weighted by the micro-batches' shares of the samples) and as the
    loss where it does not.

    ::

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = loss_on_last_stage(self.sequential_module, x, y, token_cross_entropy)
            self.log("train_loss", loss)
            return loss
    """
    check_reduction(reduction)
    pipelined = getattr(body, "pipeline_loss", None)
    if pipelined is not None:
        return pipelined(input, target, loss_fn, reduction=reduction, extras=extras)  # (it checks ``extras``)
    check_extras(extras)
    return loss_fn(body(input), target)


def _refresh_tied(pipe: Pipe, prefix: str, keep_vars: bool) -> None:
    pipe.tied_names.refresh()


def _default_devices(n: int) -> list[torch.device]:
    if torch.cuda.is_available():
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [torch.device("cpu")] * n


class Pipe(nn.Module):
    """Wrap an ``nn.Sequential`` to train it with pipeline parallelism (GPipe by default).

    Args:
        module: the layers, in order, each a distinct module. Layers may share parameters (a head tied to its
            embedding): the first partition using one owns it, later ones hold a copy kept in step, their
            gradients summed into it (:mod:`lightning_pipe.engine.tied`); ``parameters()`` lists it once.
        balance: layers per partition, e.g. ``[2, 3]``; ``sum(balance) == len(module)``. See
            :mod:`lightning_pipe.engine.balance` to compute one.
        devices: one device per partition (``"cpu"``, ``"cuda:1"``, ``torch.device``); default: every CUDA
            device in order, or ``"cpu"`` for every partition without a GPU. The output is on the last.
        chunks: number of micro-batches a mini-batch is split into along dim 0 (fewer if it is smaller).
        checkpoint: ``'always'``, ``'except_last'`` (every micro-batch but the last) or ``'never'``:
            which micro-batches drop their activations in forward and recompute them in backward.
        deferred_batch_norm: update BatchNorm running statistics once per mini-batch, as the unsplit
            batch would.
        schedule: the order of the micro-batches' forwards and backwards (:mod:`lightning_pipe.engine.schedule`):
            ``'gpipe'``, ``'1f1b'``, ``'zero-bubble'``, ``'interleaved-1f1b'``, ``'interleaved-zero-bubble'``,
            ``'looped-bfs'``, ``'zbv'``, ``'dualpipev'``; all but GPipe need the loss on the last stage
            (:func:`loss_on_last_stage`).
        virtual_stages: partitions per device (the schedules of several stages per process; default: the schedule's
            own, 2 for ``'zbv'`` and ``'dualpipev'``, 1 for the others): partition ``s`` on
            ``devices[s % (len(balance) // virtual_stages)]``, or, for ``'zbv'`` and ``'dualpipev'`` (exactly 2), in
            a V: partitions ``r`` and ``2p - 1 - r`` on device ``r`` (the first and the last on the first device).

    Each partition runs on its own worker thread, so partitions overlap even on CPU. Output and
    gradients equal those of ``module`` (dropout draws per-micro-batch masks from its own generators,
    reproducibly; BatchNorm sees micro-batch statistics).
    """

    def __init__(self, module: nn.Sequential, balance: Sequence[int] | None = None, *,
                 devices: Sequence[Device] | None = None, chunks: int = 1,
                 checkpoint: str = "except_last", deferred_batch_norm: bool = False,
                 schedule: str | list[list[str]] | Plan = "gpipe",
                 virtual_stages: int | None = None) -> None:
        super().__init__()
        check_sequential(module)
        check_chunks(chunks)
        check_checkpoint(checkpoint)
        schedule = check_schedule(schedule_from(schedule, chunks))
        if virtual_stages is None:
            virtual_stages = stages_per_process(schedule)
        balance = check_balance(module, balance)
        verify_skippables(module)
        if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 1 \
                or len(balance) % virtual_stages:
            raise ValueError(f"virtual_stages must be a positive integer that divides the number of partitions "
                             f"(virtual_stages: {virtual_stages!r}, partitions: {len(balance)})")
        processes = len(balance) // virtual_stages
        schedule_plan(schedule, chunks, processes, virtual_stages)  # refuses what the schedule cannot run
        self.placement = placement_of(schedule, processes, virtual_stages)  # a V, or partition s on s % processes
        if devices is None:
            devices = _default_devices(processes)
        devices = [normalize_device(d) for d in devices]
        if processes > len(devices):
            raise IndexError(f"too few devices to hold given partitions (devices: {len(devices)}, "
                             f"partitions: {processes} x {virtual_stages} virtual stages)" if virtual_stages > 1 else
                             f"too few devices to hold given partitions (devices: {len(devices)}, "
                             f"partitions: {len(balance)})")
        if deferred_batch_norm:
            module = DeferredBatchNorm.convert(module)  # type: ignore[assignment]
        self.balance = balance
        self.devices = devices[:processes]  # partition s on devices[self._process(s)]
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.deferred_batch_norm = deferred_batch_norm
        self.schedule = schedule
        self.virtual_stages = virtual_stages
        parts = split_module(module, balance)
        self.tied_names = TiedCopies(parts)  # before the moves: a shared parameter would follow the last partition
        for s, part in enumerate(parts):
            part.to(self.devices[self._process(s)])
        self.partitions = nn.ModuleList(parts)
        self._pipeline: LocalPipeline | None = None
        if self.tied_names:
            self.register_state_dict_pre_hook(_refresh_tied)  # the copies' entries as their owners are

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
                         ) -> Iterator[tuple[str, nn.Parameter]]:
        """The layers' parameters, a parameter shared by several partitions once (its owner's; the later
        partitions' copies are kept in step by the pipe, not stepped by an optimizer)."""
        tied = getattr(self, "tied_names", None)
        copies = tied.copies() if tied else set()
        for name, p in super().named_parameters(prefix, recurse, remove_duplicate):
            if id(p) not in copies:
                yield name, p

    # ------------------------------------------------------------------ the Sequential interface
    def __len__(self) -> int:
        return sum(len(p) for p in self.partitions)

    def __getitem__(self, index: int | slice) -> nn.Module:
        """The layer at ``index``; a slice gives an ``nn.Sequential`` of those layers (the same objects, under
        their names in the pipe), as slicing an ``nn.Sequential`` does."""
        if isinstance(index, slice):
            named = [item for partition in self.partitions for item in partition.named_children()]
            return nn.Sequential(OrderedDict(named[index]))
        if not isinstance(index, int):
            raise TypeError(f"Pipe indices must be integers or slices (got: {type(index).__name__})")
        size = len(self)
        if not -size <= index < size:
            raise IndexError(f"index {index} is out of range for a pipe of {size} layers")
        index %= size
        for partition in self.partitions:
            if index < len(partition):
                return partition[index]
            index -= len(partition)
        raise AssertionError("unreachable")

    def __iter__(self) -> Iterator[nn.Module]:
        for partition in self.partitions:
            yield from partition

    # ------------------------------------------------------------------ placement is fixed
    def _moving(self, how: str) -> TypeError:
        return TypeError(f"a Pipe cannot be moved with {how}: its partitions are placed on "
                         f"{[str(d) for d in self.devices]}; pass devices=... when creating it")

    def to(self, *args: Any, **kwargs: Any) -> Pipe:
        """Change the dtype only: ``pipe.to(torch.float64)``. Moving to a device raises ``TypeError``."""
        # Told apart by the arguments themselves, as torchgpipe did: asking torch to parse them would turn
        # ``to(0)`` into an accelerator lookup, which fails first on a machine without one.
        first = args[0] if args else None
        if "device" in kwargs or "tensor" in kwargs or isinstance(first, (torch.device, int, str, Tensor)):
            raise self._moving(".to(device)")
        return super().to(*args, **kwargs)

    def cuda(self, device: Any = None) -> Pipe:
        """Not allowed: partitions stay on their devices."""
        raise self._moving(".cuda()")

    def cpu(self) -> Pipe:
        """Not allowed: partitions stay on their devices."""
        raise self._moving(".cpu()")

    def xpu(self, device: Any = None) -> Pipe:
        """Not allowed: partitions stay on their devices."""
        raise self._moving(".xpu()")

    def ipu(self, device: Any = None) -> Pipe:
        """Not allowed: partitions stay on their devices."""
        raise self._moving(".ipu()")

    def mtia(self, device: Any = None) -> Pipe:
        """Not allowed: partitions stay on their devices."""
        raise self._moving(".mtia()")

    def to_empty(self, *, device: Any, recurse: bool = True) -> Pipe:
        """Not allowed: partitions stay on their devices."""
        raise self._moving(".to_empty(device=...)")

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_pipeline"] = None  # worker threads are not copied; a copy starts its own
        return state

    def _process(self, partition: int) -> int:
        """The device (worker) of ``partition``: ``placement``'s, else ``partition % devices``."""
        return self.placement[partition] if self.placement else partition % len(self.devices)

    # ------------------------------------------------------------------ forward
    @property
    def pipeline(self) -> LocalPipeline:
        """The stages and their workers, built on first use."""
        if self._pipeline is None:
            layout = inspect_skip_layout(list(self.partitions))
            offsets = [sum(self.balance[:j]) for j in range(len(self.balance))]
            p = len(self.devices)
            stages = [
                Stage(j, part, self.devices[self._process(j)], offset=o, exports=layout.exports[j].keys(),
                      imports=layout.imports[j].keys())
                for j, (part, o) in enumerate(zip(self.partitions, offsets))
            ]
            self._pipeline = LocalPipeline(stages, layout, processes=p, placement=self.placement)
            if self.tied_names:
                self._pipeline.after_backward = self.tied_names.gather
        return self._pipeline

    def forward(self, input: TensorOrTensors) -> TensorOrTensors:  # type: ignore[override]
        """Run ``input`` (a tensor or a tuple of tensors, batch along dim 0) through the pipeline."""
        if self.schedule != "gpipe" and torch.is_grad_enabled() and (
                any(p.requires_grad for p in self.parameters()) or any(
                    t.requires_grad for t in (input if isinstance(input, (tuple, list)) else (input,)))):
            raise RuntimeError(
                f"Pipe(schedule={self.schedule!r}) runs backwards between forwards, so the loss must be computed "
                "on the last stage, micro-batch by micro-batch: call lightning_pipe.loss_on_last_stage(pipe, input, "
                "target, loss_fn) (or pipe.pipeline_loss(...)) instead of pipe(input), or use schedule='gpipe'. "
                "Without gradients (torch.no_grad(), evaluation) pipe(input) works with any schedule")
        if self.tied_names:
            self.tied_names.refresh()
        return run_pipeline(self.pipeline, input, chunks=self.chunks, checkpoint=self.checkpoint,
                            training=self.training, parameters=self.parameters())

    def pipeline_loss(self, input: TensorOrTensors, target: Any, loss_fn: LossFn, *, reduction: str = "mean",
                      extras: Mapping[str, str] | None = None) -> Any:
        """``loss_fn(self(input), target)`` with the loss computed on the last stage per micro-batch, the
        micro-batches in this pipe's schedule (see :func:`loss_on_last_stage`)."""
        if self.tied_names:
            self.tied_names.refresh()
        return pipeline_loss(self.pipeline, input, target, loss_fn, chunks=self.chunks, checkpoint=self.checkpoint,
                             training=self.training, parameters=self.parameters(), schedule=self.schedule,
                             reduction=reduction, extras=extras)
