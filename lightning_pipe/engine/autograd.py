"""Tying a pipeline into autograd: its output, or the loss computed on its last stage, per step.

:func:`run_pipeline` returns the pipeline's output; its backward (``loss.backward()`` on a loss computed from
it) drives every stage's backward through :class:`_PipeFunction`: GPipe, the only schedule whose backwards can
wait for the caller's. :func:`pipeline_loss` has the last stage compute the loss per micro-batch instead, and
returns the batch's loss (:mod:`lightning_pipe.engine.loss`): with the loss there, the step runs whole in the
forward, every schedule alike (one message per process and step), its backwards from the gradient the loss is
expected to get, with gradients set aside (:mod:`lightning_pipe.engine.aside`); the loss's backward commits
them, scaled to the gradient that arrived::

    run_pipeline   forward: every F ──► output ─► (caller's loss) ─► backward: every B
    pipeline_loss  forward: every F and B, in the plan's order, losses on the last stage ──► loss
                   backward: commit on every stage

``pipeline`` is local (:class:`~lightning_pipe.engine.pipeline.LocalPipeline`, threads) or remote (processes):
anything with ``stages`` (what a run releases), ``num_stages``, ``processes``, ``pipelined``, ``forward``,
``backward``, ``execute`` and ``commit``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import get_gradient_edge

from lightning_pipe.engine.loss import LossFn, check_extras, combine, scatter_target, weights
from lightning_pipe.engine.microbatch import Batch, TensorOrTensors, gather, scatter
from lightning_pipe.engine.partition import checkpoint_stop
from lightning_pipe.engine.pipeline import Run, scatter_grads
from lightning_pipe.engine.schedule import Plan, forward_only, gpipe, schedule_plan

__all__ = ["pipeline_loss", "run_pipeline"]


def _check_backward(ctx: Any) -> None:
    """Refuse a backward that the pipeline cannot run as asked."""
    if ctx.run is None:
        raise RuntimeError("backward ran twice through the same pipe output; retain_graph is not supported "
                           "through a pipe (its stages free what they saved); run the forward again")
    if torch.is_grad_enabled():  # true in a backward only under create_graph=True
        raise RuntimeError(
            "a second-order gradient (create_graph=True, as a gradient penalty takes) cannot go through the "
            "pipeline: its stages run backward as local autograd, which is not differentiated again. Compute "
            "such a term on layers outside the pipelined body, or use a first-order regularizer")
    if ctx.run.parameters_need_grad and not _wanted(ctx.phony):
        raise RuntimeError(
            "torch.autograd.grad (or backward(inputs=...)) asked for some gradients only, but the pipeline's "
            "stages put the gradients of all their parameters in .grad as they run backward, which would change "
            "the next optimizer step. Through the pipeline, take gradients with loss.backward() (Lightning's "
            "backward); for gradients with respect to the input alone, freeze the body's parameters "
            "(requires_grad_(False)) before its forward and unfreeze them after")


def _input_grads(ctx: Any, grads: list[Any], scale: float = 1.0) -> list[Tensor | None]:
    """The gradients of the pipe's inputs, joined from the micro-batches' (times ``scale``): None where no
    micro-batch's reached the input, zeros for the rows of a micro-batch whose did not (one that does not use the
    input, as a branch taken by some rows alone: one device's gradient is zero there, not None)."""
    result: list[Tensor | None] = []
    for k, (device, needed, shape) in enumerate(zip(ctx.input_devices, ctx.needs, ctx.input_shapes)):
        parts = [g[k] for g in grads]
        given = next((p for p in parts if p is not None), None)
        if not needed or given is None:
            result.append(None)
            continue
        parts = [p if p is not None else given.new_zeros((rows, *shape[1:])) for p, rows in zip(parts, ctx.sizes)]
        joined = torch.cat(parts).to(device)
        result.append(joined if scale == 1.0 else joined * scale)
    return result


def _remember_inputs(ctx: Any, pipeline: Any, run: Run, phony: Tensor, inputs: tuple[Tensor, ...]) -> None:
    ctx.pipeline, ctx.run = pipeline, run
    ctx.phony = get_gradient_edge(phony).node  # backward tells by it whether parameters' gradients are wanted
    ctx.input_devices = [t.device for t in inputs]
    ctx.input_shapes = [t.shape for t in inputs]
    ctx.needs = [t.requires_grad for t in inputs]
    ctx.sizes = list(run.sizes)  # each micro-batch's rows (a micro-batch's gradient missing is its zeros)


class _PipeFunction(torch.autograd.Function):
    """Ties a pipeline into autograd: forward runs every stage, backward drives every stage's backward."""

    @staticmethod
    def forward(ctx: Any, pipeline: Any, run: Run, microbatches: list[Batch], phony: Tensor,
                *inputs: Tensor) -> Any:
        batches = pipeline.forward(run, microbatches, save=True)
        outputs = gather(batches)
        _remember_inputs(ctx, pipeline, run, phony, inputs)
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
        _check_backward(ctx)
        pipeline, run = ctx.pipeline, ctx.run
        ctx.pipeline = ctx.run = None  # free the run's saved state as soon as backward is done
        inline = next((g.device for g in grad_outputs if g is not None and g.is_cuda), None)
        grads = pipeline.backward(run, scatter_grads(grad_outputs, run.sizes), inline_device=inline)
        return (None, None, None, None, *_input_grads(ctx, grads))


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


class _LossFunction(torch.autograd.Function):
    """Ties the batch's loss, computed on the last stage per micro-batch, into autograd (see the module's
    docstring): the forward runs the whole plan, its backwards from the gradient the loss is expected to get
    (``run.loss_scale``), with every stage's gradients set aside; the backward commits them, scaled to the
    gradient that arrived, and hands the input's gradients on."""

    @staticmethod
    def forward(ctx: Any, pipeline: Any, run: Run, plan: Plan, microbatches: list[Batch], phony: Tensor,
                *inputs: Tensor) -> Tensor:
        _remember_inputs(ctx, pipeline, run, phony, inputs)
        step = pipeline.execute(run, plan, inputs=microbatches)
        ctx.grads = step.input_grads
        total = combine(step.losses, run.weights, run.sizes, run.extra_reductions)
        run.extras = total.extras
        return total.value

    @staticmethod
    def backward(ctx: Any, grad: Tensor | None) -> Any:
        _check_backward(ctx)
        pipeline, run = ctx.pipeline, ctx.run
        ctx.pipeline = ctx.run = None  # free the run's saved state as soon as backward is done
        scale = (0.0 if grad is None else float(grad)) / run.loss_scale
        pipeline.commit(run, scale)
        return (None, None, None, None, None, *_input_grads(ctx, ctx.grads, scale))


def pipeline_loss(pipeline: Any, input: TensorOrTensors, target: Any, loss_fn: LossFn, *, chunks: int,
                  checkpoint: str, training: bool, parameters: Iterator[Tensor], schedule: str = "gpipe",
                  reduction: str = "mean", loss_scale: float = 1.0, extras: Mapping[str, str] | None = None) -> Any:
    """The batch's loss, ``loss_fn`` computed on ``pipeline``'s last stage per micro-batch of ``input`` and
    ``target`` (:mod:`lightning_pipe.engine.loss`), the micro-batches run in the order of ``schedule``.

    Returns what ``loss_fn`` returns on the whole batch: the loss, or a mapping with it under ``"loss"`` and
    the extras combined (a floating scalar one as ``extras`` names it, ``"mean"`` or ``"sum"``). With grad enabled,
    the loss is tied into autograd: its backward runs (or, where the schedule ran the backwards already, commits)
    every stage's backward. ``loss_scale``: the gradient the loss's backward is expected to bring, which a schedule
    running its backwards ahead assumes (a gradient scaler's scale, 1 / accumulation); another one arriving is exact
    too (gradients are scaled to it), only less safe from overflow in float16.
    """
    batch = Batch.of(input, "input of the pipe")
    microbatches = scatter(batch, chunks)
    sizes = [mb.tensors[0].size(0) for mb in microbatches]
    parameters_need_grad = torch.is_grad_enabled() and any(p.requires_grad for p in parameters)
    save = torch.is_grad_enabled() and (any(t.requires_grad for t in batch.tensors) or parameters_need_grad)
    run = Run(pipeline.stages, sizes, checkpoint_stop(checkpoint, len(sizes), training), training)
    run.parameters_need_grad = parameters_need_grad
    run.loss, run.targets, run.weights = loss_fn, scatter_target(target, sizes), weights(sizes, reduction)
    run.loss_scale = float(loss_scale)
    check_extras(extras)
    run.extra_reductions = extras
    m, p = len(sizes), pipeline.processes
    v = pipeline.num_stages // p
    if not save:
        step = pipeline.execute(run, forward_only(m, p, v, pipeline.placement), inputs=microbatches, save=False)
        total = combine(step.losses, run.weights, sizes, extras)
        return total.value if total.extras is None else {"loss": total.value, **total.extras}
    try:
        plan = gpipe(m, p, pipelined=pipeline.pipelined) if schedule == "gpipe" else schedule_plan(schedule, m, p, v)
    except ValueError as exc:
        if m >= chunks:
            raise
        raise ValueError(f"a batch of {sum(sizes)} samples splits into {m} micro-batches, fewer than chunks={chunks}: "
                         f"{exc}. Feed batches of at least {chunks} samples (a short last batch: "
                         "DataLoader(drop_last=True))") from None
    phony = torch.empty(0, requires_grad=True)
    value = _LossFunction.apply(pipeline, run, plan, microbatches, phony, *batch.tensors)
    return value if run.extras is None else {"loss": value, **run.extras}
