"""``Pipe``: an ``nn.Sequential`` split into partitions and trained with a GPipe schedule.

Follow one mini-batch::

    input ─► scatter into m micro-batches ─► stages on worker threads, schedule order ─► gather ─► output
                                                                                                  │
    input grad ◄─ gather ◄─ stages' local backward, reverse schedule order ◄─ scatter ◄─ output grad

The output is tied into autograd by :class:`_PipeFunction`, so ``loss.backward()`` drives the pipeline's
backward; each stage's parameters receive their ``.grad`` from the stage's own local autograd.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge

from lightning_pipe.engine.batchnorm import DeferredBatchNorm
from lightning_pipe.engine.microbatch import Batch, TensorOrTensors, gather, scatter
from lightning_pipe.engine.partition import (
    Device,
    check_balance,
    check_checkpoint,
    check_chunks,
    check_sequential,
    checkpoint_stop,
    normalize_device,
    split_module,
)
from lightning_pipe.engine.pipeline import LocalPipeline, Run, scatter_grads
from lightning_pipe.engine.skip.layout import inspect_skip_layout
from lightning_pipe.engine.skip.skippable import verify_skippables
from lightning_pipe.engine.stage import Stage

__all__ = ["Pipe", "run_pipeline"]


def _default_devices(n: int) -> list[torch.device]:
    if torch.cuda.is_available():
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [torch.device("cpu")] * n


class _PipeFunction(torch.autograd.Function):
    """Ties a pipeline into autograd: forward runs every stage, backward drives every stage's backward."""

    @staticmethod
    def forward(ctx: Any, pipeline: Any, run: Run, microbatches: list[Batch], phony: Tensor,
                *inputs: Tensor) -> Any:
        batches = pipeline.forward(run, microbatches, save=True)
        outputs = gather(batches)
        ctx.pipeline, ctx.run = pipeline, run
        ctx.phony = get_gradient_edge(phony).node  # backward tells by it whether parameters' gradients are wanted
        ctx.input_devices = [t.device for t in inputs]
        ctx.needs = [t.requires_grad for t in inputs]
        ctx.set_materialize_grads(False)
        # An output is differentiable where a micro-batch's is (the joined tensor, made without grad, cannot
        # tell); the mark must name the very tensors returned, not those they were detached from.
        differentiable = [any(t.requires_grad for t in column) for column in zip(*(b.tensors for b in batches))]
        results = tuple(t.detach() for t in outputs.tensors)
        ctx.mark_non_differentiable(*[r for r, d in zip(results, differentiable) if not d])
        run.atomic = outputs.atomic
        return results

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Tensor | None) -> Any:
        pipeline, run = ctx.pipeline, ctx.run
        if run is None:
            raise RuntimeError("backward ran twice through the same pipe output; retain_graph is not supported "
                               "through a pipe (its stages free what they saved); run the forward again")
        if torch.is_grad_enabled():  # true in a backward only under create_graph=True
            raise RuntimeError(
                "a second-order gradient (create_graph=True, as a gradient penalty takes) cannot go through the "
                "pipeline: its stages run backward as local autograd, which is not differentiated again. Compute "
                "such a term on layers outside the pipelined body, or use a first-order regularizer")
        if run.parameters_need_grad and not _wanted(ctx.phony):
            raise RuntimeError(
                "torch.autograd.grad (or backward(inputs=...)) asked for some gradients only, but the pipeline's "
                "stages put the gradients of all their parameters in .grad as they run backward, which would change "
                "the next optimizer step. Through the pipeline, take gradients with loss.backward() (Lightning's "
                "backward); for gradients with respect to the input alone, freeze the body's parameters "
                "(requires_grad_(False)) before its forward and unfreeze them after")
        ctx.pipeline = ctx.run = None  # free the run's saved state as soon as backward is done
        inline = next((g.device for g in grad_outputs if g is not None and g.is_cuda), None)
        grads = pipeline.backward(run, scatter_grads(grad_outputs, run.sizes), inline_device=inline)
        result: list[Tensor | None] = []
        for k, (device, needed) in enumerate(zip(ctx.input_devices, ctx.needs)):
            parts = [g[k] for g in grads]
            if not needed or any(p is None for p in parts):
                result.append(None)
            else:
                result.append(torch.cat(parts).to(device))  # type: ignore[arg-type]
        return (None, None, None, None, *result)


def _wanted(node: Any) -> bool:
    """Whether the running backward accumulates into the leaf of ``node`` (False under ``torch.autograd.grad``
    or ``backward(inputs=...)`` that leave it out)."""
    will_execute = getattr(torch._C, "_will_engine_execute_node", None)
    return True if will_execute is None else bool(will_execute(node))


def run_pipeline(pipeline: Any, input: TensorOrTensors, *, chunks: int, checkpoint: str, training: bool,
                 parameters: Iterator[Tensor]) -> TensorOrTensors:
    """Scatter ``input`` into micro-batches, run them through ``pipeline`` and gather the output.

    With grad enabled and anything to differentiate, the output is tied into autograd so that its
    backward drives the pipeline's backward. ``pipeline`` is local (threads) or remote (processes).
    """
    batch = Batch.of(input, "input of the pipe")
    microbatches = scatter(batch, chunks)
    sizes = [mb.tensors[0].size(0) for mb in microbatches]
    parameters_need_grad = torch.is_grad_enabled() and any(p.requires_grad for p in parameters)
    save = torch.is_grad_enabled() and (any(t.requires_grad for t in batch.tensors) or parameters_need_grad)
    run = Run(pipeline.stages, sizes, checkpoint_stop(checkpoint, len(sizes), training), training)
    run.parameters_need_grad = parameters_need_grad
    if not save:
        return gather(pipeline.forward(run, microbatches, save=False)).value
    phony = torch.empty(0, requires_grad=True)
    outputs = _PipeFunction.apply(pipeline, run, microbatches, phony, *batch.tensors)
    return Batch(tuple(outputs), run.atomic).value


class Pipe(nn.Module):
    """Wrap an ``nn.Sequential`` to train it with GPipe pipeline parallelism.

    Args:
        module: the layers, in order. Children must be distinct and share no parameters.
        balance: layers per partition, e.g. ``[2, 3]``; ``sum(balance) == len(module)``. See
            :mod:`lightning_pipe.engine.balance` to compute one.
        devices: one device per partition (``"cpu"``, ``"cuda:1"``, ``torch.device``); default: every CUDA
            device in order, or ``"cpu"`` for every partition without a GPU. The output is on the last.
        chunks: number of micro-batches a mini-batch is split into along dim 0 (fewer if it is smaller).
        checkpoint: ``'always'``, ``'except_last'`` (every micro-batch but the last) or ``'never'``:
            which micro-batches drop their activations in forward and recompute them in backward.
        deferred_batch_norm: update BatchNorm running statistics once per mini-batch, as the unsplit
            batch would.

    Each partition runs on its own worker thread, so partitions overlap even on CPU. Output and
    gradients equal those of ``module`` (dropout draws per-micro-batch masks from its own generators,
    reproducibly; BatchNorm sees micro-batch statistics).
    """

    def __init__(self, module: nn.Sequential, balance: Sequence[int] | None = None, *,
                 devices: Sequence[Device] | None = None, chunks: int = 1,
                 checkpoint: str = "except_last", deferred_batch_norm: bool = False) -> None:
        super().__init__()
        check_sequential(module)
        check_chunks(chunks)
        check_checkpoint(checkpoint)
        balance = check_balance(module, balance)
        verify_skippables(module)
        if devices is None:
            devices = _default_devices(len(balance))
        devices = [normalize_device(d) for d in devices]
        if len(balance) > len(devices):
            raise IndexError(f"too few devices to hold given partitions (devices: {len(devices)}, "
                             f"partitions: {len(balance)})")
        if deferred_batch_norm:
            module = DeferredBatchNorm.convert(module)  # type: ignore[assignment]
        self.balance = balance
        self.devices = devices[: len(balance)]
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.deferred_batch_norm = deferred_batch_norm
        parts = split_module(module, balance)
        for part, device in zip(parts, self.devices):
            part.to(device)
        self.partitions = nn.ModuleList(parts)
        self._pipeline: LocalPipeline | None = None

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

    # ------------------------------------------------------------------ forward
    @property
    def pipeline(self) -> LocalPipeline:
        """The stages and their workers, built on first use."""
        if self._pipeline is None:
            layout = inspect_skip_layout(list(self.partitions))
            offsets = [sum(self.balance[:j]) for j in range(len(self.balance))]
            stages = [
                Stage(j, p, d, offset=o, exports=layout.exports[j].keys(), imports=layout.imports[j].keys())
                for j, (p, d, o) in enumerate(zip(self.partitions, self.devices, offsets))
            ]
            self._pipeline = LocalPipeline(stages, layout)
        return self._pipeline

    def forward(self, input: TensorOrTensors) -> TensorOrTensors:  # type: ignore[override]
        """Run ``input`` (a tensor or a tuple of tensors, batch along dim 0) through the pipeline."""
        return run_pipeline(self.pipeline, input, chunks=self.chunks, checkpoint=self.checkpoint,
                            training=self.training, parameters=self.parameters())
