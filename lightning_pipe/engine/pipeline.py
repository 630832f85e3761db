"""The local pipeline: stages on worker threads, fed micro-batches in schedule order.

Each stage's worker executes its actions in the order of :mod:`lightning_pipe.engine.schedule`; an action waits
only for the inputs it needs (the previous stage's output of the same micro-batch, the skips popped here),
so a stage starts micro-batch ``i`` as soon as it is ready, without waiting for a whole clock tick. Tensors
go from stage to stage through ``outputs``/``grads`` tables and are dropped as soon as they are consumed.

Errors come back as values: an action whose input failed is skipped, every action finishes, and the
first real error (in schedule order) is raised in the caller with its original traceback.
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from functools import partial
from typing import Any, Union

import torch
from torch import Tensor

from lightning_pipe.engine.microbatch import Batch
from lightning_pipe.engine.rng import LazySeed
from lightning_pipe.engine.schedule import Action, backward_plan, forward_plan, stage_order
from lightning_pipe.engine.skip.layout import SkipLayout
from lightning_pipe.engine.stage import Grads, Stage
from lightning_pipe.engine.worker import Inline, Worker, autocast_state

__all__: list[str] = []

_run_ids = itertools.count()


class _Skipped(Exception):
    """An action that did not run because one of its inputs failed."""


def _wait(future: Future[Any]) -> None:
    try:
        future.result()
    except BaseException:  # noqa: BLE001 - the failing action reports its own error
        raise _Skipped() from None


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
        if exc is not None and not isinstance(exc, _Skipped):
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
        for stage in stages:
            weakref.finalize(self, stage.release, self.id)


Executor = Union[Worker, Inline]  # noqa: UP007 - a runtime alias on Python 3.10


class LocalPipeline:
    """Stages of one process, each run by its own worker thread."""

    def __init__(self, stages: Sequence[Stage], layout: SkipLayout) -> None:
        self.stages = list(stages)
        self.layout = layout
        self.workers = [Worker(f"lightning_pipe.engine.stage{j}") for j in range(len(stages))]

    def _submit(self, executors: Sequence[Executor], futures: dict[tuple[int, int], Future[Any]],
                run: Run, plan: list[list[Action]], task: Callable[..., None],
                then: Callable[[Run, int], None] | None = None) -> None:
        """Queue ``task`` for every action of ``plan`` on its stage's executor and, after a stage's
        actions, ``then(run, stage)`` on it; wait for all of them."""
        for action in itertools.chain.from_iterable(plan):
            fn = partial(task, run, futures, action.microbatch, action.stage)
            futures[(action.microbatch, action.stage)] = executors[action.stage].submit(fn)
        last = [executors[j].submit(partial(then, run, j)) for j in range(len(executors))] if then else []
        try:
            drain([futures[(a.microbatch, a.stage)] for a in itertools.chain.from_iterable(plan)] + last)
        except BaseException:
            run.failed = True
            raise

    def forward(self, run: Run, microbatches: list[Batch], *, save: bool) -> list[Batch]:
        """Run every micro-batch through every stage; return the last stage's outputs."""
        m, n = len(microbatches), len(self.stages)
        outputs: dict[Any, Any] = {(i, -1): mb for i, mb in enumerate(microbatches)}
        futures: dict[tuple[int, int], Future[Any]] = {}

        def task(run: Run, futures: dict[tuple[int, int], Future[Any]], i: int, j: int) -> None:
            if run.failed:
                raise _Skipped()
            if j > 0:
                _wait(futures[(i, j - 1)])
            for src in self.layout.imports[j].values():
                _wait(futures[(i, src)])
            inputs = outputs.pop((i, j - 1))
            imports = {key: outputs.pop((i, key)) for key in self.layout.imports[j]}
            try:
                out, exports = self.stages[j].forward(
                    run.id, i, inputs, imports, seed=run.seed, save=save,
                    checkpoint=i < run.checkpoint_stop, last=i == m - 1)
            except BaseException:
                run.failed = True
                raise
            outputs[(i, j)] = out
            outputs.update({(i, key): t for key, t in exports.items()})

        self._submit(self.workers, futures, run, forward_plan(m, n), task)
        return [outputs.pop((i, n - 1)) for i in range(m)]

    def backward(self, run: Run, grad_outputs: list[Grads], *, pipelined: bool = True,
                 inline_device: torch.device | None = None) -> list[Grads]:
        """Backward of every micro-batch from the gradients of the last stage's outputs.

        Returns the gradients of the first stage's inputs per micro-batch. With ``pipelined=False`` each
        stage runs one backward over all its micro-batches. Stages on ``inline_device`` run on the calling
        thread (the autograd engine's thread for that CUDA device, which a worker must not wait for).
        Each stage after the first computes only the input gradients of its first backward before handing
        them on, and that backward's parameter gradients after its last, where its partition and device allow
        (:meth:`Stage.backward_inputs_first`).
        """
        m, n = len(grad_outputs), len(self.stages)
        grads: dict[Any, Any] = {(i, n): g for i, g in enumerate(grad_outputs)}
        executors: list[Executor] = [
            Inline() if inline_device is not None and s.device == inline_device else w
            for s, w in zip(self.stages, self.workers)
        ]
        futures: dict[tuple[int, int], Future[Any]] = {}
        if pipelined:
            plan = backward_plan(m, n)
        else:
            plan = [[Action(j, "B", -1)] for j in reversed(range(n))]
        # The stage before waits for each later stage's first backward: it gets its gradients before that
        # stage computes its parameters' gradients of that backward, left for after its other actions.
        first = {j: stage_order(plan, j)[0].microbatch for j in range(1, n)}
        later: dict[int, list[Callable[..., None]]] = {j: [] for j in range(n)}

        def finish(run: Run, j: int) -> None:
            for weights in later[j]:
                weights(not run.failed)
            if run.failed:
                raise _Skipped()

        def task(run: Run, futures: dict[tuple[int, int], Future[Any]], i: int, j: int) -> None:
            if run.failed:
                raise _Skipped()
            mbs = range(m) if i < 0 else (i,)
            for k in mbs:
                if j < n - 1:
                    _wait(futures[(-1 if i < 0 else k, j + 1)])
                for dst in set(self.layout.exports[j].values()):
                    _wait(futures[(-1 if i < 0 else k, dst)])
            items = [(k, grads.pop((k, j + 1)), {key: grads.pop((k, key)) for key in self.layout.exports[j]})
                     for k in mbs]
            try:
                if first.get(j) == i:
                    results, weights = self.stages[j].backward_inputs_first(run.id, items)
                    later[j].append(weights)
                else:
                    results = self.stages[j].backward(run.id, items)
            except BaseException:
                run.failed = True
                raise
            for k, (grad_inputs, grad_imports) in zip(mbs, results):
                grads[(k, j)] = grad_inputs
                grads.update({(k, key): g for key, g in grad_imports.items()})

        self._submit(executors, futures, run, plan, task, then=finish)
        return [grads.pop((i, 0)) for i in range(m)]


def scatter_grads(grads: Sequence[Tensor | None], sizes: Sequence[int]) -> list[Grads]:
    """Split output gradients along dim 0 into the micro-batch sizes of a run."""
    pieces = [g.split(list(sizes)) if g is not None else (None,) * len(sizes) for g in grads]
    return [tuple(p[i] for p in pieces) for i in range(len(sizes))]
