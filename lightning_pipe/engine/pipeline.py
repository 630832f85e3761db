"""The local pipeline: stages on worker threads, each worker running its share of a plan in order.

Each worker (a "process" of the plan: stage ``s`` runs on worker ``s % processes``) runs its actions of a
:class:`~lightning_pipe.engine.schedule.Plan` in order (:func:`~lightning_pipe.engine.share.run_share`, the same
interpreter a stage's process runs); an action waits only for the inputs it needs (the previous stage's output of
the same micro-batch, the skips popped here, the next stage's input gradients), so a stage starts an action as
soon as it is ready, without waiting for a whole clock tick. Tensors go from stage to stage through one
in-process channel (:class:`~lightning_pipe.engine.share.LocalChannel`), dropped as soon as they are taken.

Errors come back as values: once a share fails, the others skip what is left of theirs, every share finishes,
and the first real error (in worker order) is raised in the caller with its original traceback.
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from functools import partial
from typing import Any, NamedTuple, Union

import torch
from torch import Tensor

from lightning_pipe.engine.loss import LossFn, MicroLoss
from lightning_pipe.engine.microbatch import Batch
from lightning_pipe.engine.rng import LazySeed
from lightning_pipe.engine.schedule import Plan, forward_only, gpipe
from lightning_pipe.engine.share import Handoff, LocalChannel, ShareHooks, ShareStep, Skipped, aborting, run_share
from lightning_pipe.engine.skip.layout import SkipLayout
from lightning_pipe.engine.stage import Grads, Stage
from lightning_pipe.engine.worker import Inline, Worker, autocast_state

__all__: list[str] = []

_run_ids = itertools.count()


def drain(futures: Sequence[Future[Any]], *, grace: float | None = None, ready: Future[Any] | None = None,
          describe: Callable[[int], str] | None = None, alive: Callable[[], float] | None = None) -> None:
    """Wait for every future; raise the first real error among them (not a skip), in their order.

    With ``grace``, nothing waits unboundedly: once any future fails, the others get at most ``grace``
    more seconds; once ``ready`` is done (the caller has what it needs), so do the rest, counted from the
    last sign of progress (a future finishing, or the ``time.monotonic()`` that ``alive()`` returns), after
    which those still running are reported as not answering.
    """
    if grace is None:
        wait(futures)
    else:
        pending = set(futures)
        since: float | None = None  # the last sign of progress once ``ready`` is done
        while pending:
            timeout = None
            if ready is not None and ready.done():
                since = max(since or time.monotonic(), alive() if alive is not None else 0.0)
                timeout = max(0.0, since + grace - time.monotonic())
            done, pending = wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)
            if any(f.exception() is not None for f in done):
                wait(pending, timeout=grace)  # the others were told to stop: they get ``grace``
                break
            if done:
                since = time.monotonic() if since is not None else None
            elif timeout is not None and (alive is None or alive() <= since):
                break  # no progress within ``grace`` although the caller has what it needs
    first: BaseException | None = None
    for future in futures:
        if not future.done():
            continue  # still running after a failure: the failure says what went wrong
        exc = future.exception()
        if exc is not None and not isinstance(exc, Skipped):
            first = first or exc
    if first is not None:
        raise first
    silent = [k for k, f in enumerate(futures) if not f.done()]
    if silent:
        names = ", ".join(describe(k) if describe else f"task {k}" for k in silent)
        raise TimeoutError(f"no answer within {grace:.1f} s from {names} although the rest of the step is "
                           "done: its process is stuck (rpc_timeout_sec bounds this wait)")


class Run:
    """One forward through the pipeline and, later, its backward.

    ``checkpoint_stop``: micro-batches below it are checkpointed. When the run is garbage collected
    (its output freed), whatever stages still keep for it is released.
    """

    def __init__(self, stages: Sequence[Any], sizes: Sequence[int], checkpoint_stop: int,
                 training: bool = True) -> None:
        self.id = next(_run_ids)
        self.training = training  # the mode remote stages must be in (local ones follow their module)
        self.autocast = autocast_state()  # what remote stages must run under (local ones capture it)
        self.anomaly = torch.is_anomaly_enabled()  # autograd's anomaly detection, a per-process switch
        self.dtype = torch.get_default_dtype()  # what tensors created without a dtype get (64-true sets it)
        self.sizes = list(sizes)
        self.checkpoint_stop = checkpoint_stop
        self.seed = LazySeed()
        self.failed = False
        self.parameters_need_grad = True  # whether backward puts gradients in the stages' parameters' .grad
        self.atomic = True  # whether the output is one tensor (False: a tuple)
        # The loss on the last stage: its function, each micro-batch's target and weight in the batch's loss,
        # and the gradient of the batch's loss that a step running its backwards ahead assumes.
        self.loss: LossFn | None = None
        self.targets: list[Any] = []
        self.weights: list[float] = []
        self.loss_scale = 1.0
        self.extra_reductions: Mapping[str, str] | None = None  # how its scalar extras combine (``engine/loss.py``)
        for stage in stages:
            weakref.finalize(self, stage.release, self.id)


Executor = Union[Worker, Inline]  # noqa: UP007 - a runtime alias on Python 3.10


class Step(NamedTuple):
    """What running (part of) a plan gave back: the last stage's outputs or losses per micro-batch (forward
    actions), and the gradients of the first stage's inputs per micro-batch (backward actions)."""

    outputs: list[Batch] | None
    losses: list[MicroLoss] | None
    input_grads: list[Grads] | None


class LocalPipeline:
    """Stages of one process on worker threads: stage ``s`` on worker ``s % processes``, or ``placement[s]``."""

    def __init__(self, stages: Sequence[Stage], layout: SkipLayout, processes: int | None = None,
                 placement: tuple[int, ...] = ()) -> None:
        self.stages = list(stages)
        self.layout = layout
        self.processes = processes or len(self.stages)
        self.placement = placement  # stage s on worker placement[s] (empty: s % processes), as a Plan's
        self.workers = [Worker(f"lightning_pipe.stage{r}") for r in range(self.processes)]
        self.pipelined = True  # backward micro-batch by micro-batch (False: one backward per stage)
        #: Called once a step's gradients are all in the stages' ``.grad`` (after :meth:`backward` or
        #: :meth:`commit`): ``Pipe`` sums the copies of shared parameters there (:mod:`lightning_pipe.engine.tied`).
        self.after_backward: Callable[[], None] | None = None

    @property
    def num_stages(self) -> int:
        """How many stages (partitions) the pipeline has."""
        return len(self.stages)

    # ------------------------------------------------------------------ the plan's parts
    def forward(self, run: Run, microbatches: list[Batch], *, save: bool) -> list[Batch]:
        """Every forward (GPipe's first half, or evaluation); return the last stage's outputs."""
        plan = forward_only(len(microbatches), self.processes, len(self.stages) // self.processes, self.placement)
        return self.execute(run, plan, inputs=microbatches, save=save).outputs  # type: ignore[return-value]

    def backward(self, run: Run, grad_outputs: list[Grads], *, pipelined: bool | None = None,
                 inline_device: torch.device | None = None) -> list[Grads]:
        """GPipe's second half: every backward, from the gradients of the last stage's outputs; returns the
        gradients of the first stage's inputs per micro-batch. ``pipelined=False``: one backward per stage
        over all its micro-batches (default: :attr:`pipelined`). Stages on ``inline_device`` run on the calling
        thread (the autograd engine's thread for that CUDA device, which a worker must not wait for)."""
        plan = gpipe(len(grad_outputs), self.processes, pipelined=self.pipelined if pipelined is None else pipelined)
        backward = Plan(plan.schedule, plan.microbatches, plan.stages, plan.processes,
                        tuple(plan.split(r)[1] for r in range(plan.processes)))
        grads = self.execute(run, backward, output_grads=grad_outputs, inline_device=inline_device).input_grads
        if self.after_backward is not None:
            self.after_backward()
        return grads  # type: ignore[return-value]

    def commit(self, run: Run, scale: float) -> None:
        """Add what ``run``'s backwards made, times ``scale``, into every stage's gradients (a plan that ran
        its backwards ahead of its caller's backward: :mod:`lightning_pipe.engine.aside`)."""
        for stage in self.stages:
            stage.aside.commit(run.id, scale)
        if self.after_backward is not None:
            self.after_backward()

    # ------------------------------------------------------------------ running a plan
    def execute(self, run: Run, plan: Plan, *, inputs: list[Batch] | None = None,
                output_grads: list[Grads] | None = None, save: bool = True,
                inline_device: torch.device | None = None) -> Step:
        """Run ``plan``'s actions: forwards of ``inputs`` (with ``run.loss``, the last stage returns losses),
        backwards from ``output_grads`` (or, with ``run.loss``, from each loss's weight times
        ``run.loss_scale``). Backwards that start from the loss run ahead of the caller's backward: every stage
        sets the gradients they make aside, for :meth:`commit`. Each worker runs its share of the plan
        (:func:`~lightning_pipe.engine.share.run_share`) over one in-process channel."""
        m, n = plan.microbatches, len(self.stages)
        check_placement(plan, self.placement, self.processes)
        aside = ahead(run, plan, output_grads)
        acts = [a for actions in plan.actions for a in actions]
        if inputs is None and any(a.kind == "F" and a.stage == 0 for a in acts):
            raise ValueError(f"the plan of schedule {plan.schedule!r} runs forwards of stage 0: give its micro-batches "
                             "(inputs)")
        if output_grads is None and run.loss is None and any(a.kind in "BI" and a.stage == n - 1 for a in acts):
            raise ValueError(f"the plan of schedule {plan.schedule!r} runs backwards of the last stage: give the "
                             "gradients of its outputs (output_grads), or compute the loss there (run.loss)")
        channel = LocalChannel(n)
        for i, g in enumerate(output_grads or ()):
            channel.give(Handoff("B", i, n - 1, n), g)
        if run.loss is not None:
            for i, target in enumerate(run.targets):
                channel.give(Handoff("T", i, n - 1, "target"), target)
        step = ShareStep(run.id, m, save, run.checkpoint_stop, run.seed, run.loss, aside, run.weights, run.loss_scale)
        stages = dict(enumerate(self.stages))
        hooks = _Stopping(run)

        def fail() -> None:
            run.failed = True

        def share(r: int) -> None:
            mine = plan.stages_of(r)
            if aside:
                for s in mine:
                    self.stages[s].aside.defer(run.id)
            try:
                if run.failed:
                    raise Skipped()
                with aborting(channel, fail):
                    run_share(stages, n, self.layout, step, plan.actions[r], channel, hooks, inputs)
            finally:
                if aside:
                    for s in mine:
                        self.stages[s].aside.keep(run.id)

        executors: list[Executor] = [
            Inline() if inline_device is not None and self.stages[r].device == inline_device else w
            for r, w in enumerate(self.workers)]
        ordered = [r for r in range(self.processes) if isinstance(executors[r], Worker)] + \
            [r for r in range(self.processes) if isinstance(executors[r], Inline)]  # inline ones wait: last
        futures = [executors[r].submit(partial(share, r)) for r in ordered]
        try:
            drain(futures)
        except BaseException:
            run.failed = True
            raise
        forwards = any(a.kind == "F" for a in plan.actions[plan.process_of(n - 1)])
        backwards = any(a.kind in "BI" for a in plan.actions[0])
        return Step([channel.outputs[i] for i in range(m)] if forwards and run.loss is None else None,
                    [channel.outputs[i] for i in range(m)] if forwards and run.loss is not None else None,
                    [channel.input_grads[i] for i in range(m)] if backwards else None)


class _Stopping(ShareHooks):
    """A local share stops at its next action once another share failed."""

    def __init__(self, run: Run) -> None:
        self.run = run

    def after_action(self) -> None:
        if self.run.failed:
            raise Skipped()


def check_placement(plan: Plan, placement: tuple[int, ...], processes: int) -> None:
    """Refuse ``plan`` where it puts the stages elsewhere than the pipeline that runs it holds them."""
    if plan.processes == processes and (plan.placement or ()) == (placement or ()):
        return
    held = Plan("", 0, plan.stages, processes, (), placement)
    raise ValueError(f"the plan of schedule {plan.schedule!r} places its {plan.stages} stages on processes "
                     f"{[plan.process_of(s) for s in range(plan.stages)]}, and this pipeline holds them on "
                     f"{[held.process_of(s) for s in range(plan.stages)]}: build the pipeline with the schedule it "
                     "runs")


def ahead(run: Run, plan: Plan, output_grads: Any) -> bool:
    """Whether ``plan``'s backwards run ahead of the caller's backward: they start from a loss computed on the
    last stage (no output gradients given), so their gradients are set aside until the caller commits them."""
    return run.loss is not None and output_grads is None and any(a.kind in "BI" for r in plan.actions for a in r)


def scatter_grads(grads: Sequence[Tensor | None], sizes: Sequence[int]) -> list[Grads]:
    """Split output gradients along dim 0 into the micro-batch sizes of a run."""
    pieces = [g.split(list(sizes)) if g is not None else (None,) * len(sizes) for g in grads]
    return [tuple(p[i] for p in pieces) for i in range(len(sizes))]
