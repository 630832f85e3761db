"""A stage: one partition on one device, running the forward and backward of its micro-batches.

The stage keeps, per micro-batch, what backward needs: its inputs (leaves that require grad) and either
its outputs (autograd graph kept) or, for a checkpointed micro-batch, nothing more (the graph is rebuilt by
recomputation). Backward receives the outputs' gradients, runs local autograd, and returns the inputs'
gradients for the stage before it::

        grad of outputs ──► [ autograd over this partition ] ──► grad of inputs ──► previous stage
                                      │
                                      └─► parameters' .grad (found there by this stage's optimizer)

A stage knows nothing of where its neighbours are: the pipeline moves tensors between stages, whether
they are a thread or a process away.

In-place operations on a partition's input. What a stage receives may share storage with what another
stage saved (a handed-on output is the previous stage's tensor, detached), and a checkpointed micro-batch
recomputes from the very inputs it saved, so nothing may change them. A partition holding a module set to
work in place (``inplace=True``, as ``nn.ReLU`` and ``nn.Dropout`` have; decided once per stage) gives its
layers copies of the inputs of every forward that backward needs. Without such a module no copy is made;
an in-place operation on the input in custom code is then caught by the inputs' version counters: after
each layer of a checkpointed forward, and again before recomputation, which would otherwise give silently
wrong gradients.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from contextlib import AbstractContextManager as ContextManager
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipe.engine.aside import GradientsAside
from lightning_pipe.engine.backward_split import finish_nothing, input_gradients_first, twice_safe
from lightning_pipe.engine.batchnorm import DeferredBatchNorm
from lightning_pipe.engine.checkpoint import checkpointing, recomputing
from lightning_pipe.engine.loss import LossFn, MicroLoss, compute, detach, to_device
from lightning_pipe.engine.microbatch import Batch
from lightning_pipe.engine.partition import StageWatch, versions, watching_layers
from lightning_pipe.engine.rng import StageRandom, draws_no_random, mix_seed
from lightning_pipe.engine.skip.namespace import SkipKey
from lightning_pipe.engine.skip.tracker import SkipTracker, use_skip_tracker
from lightning_pipe.engine.timeline import Recorder
from lightning_pipe.engine.worker import capture_context

__all__: list[str] = []

#: Gradients that flow backward: one per tensor, None where the tensor got none.
Grads = tuple[Tensor | None, ...]

#: Runs one autograd call of a stage for whoever reduces its parameters' gradients as they come (the stage's last
#: backward of a step, under data parallelism): ``finisher(call, outputs, upstream, after)`` runs ``call()`` (a
#: backward from ``outputs``), returns as soon as the leaves ``upstream`` (whose gradients go to the previous
#: stage) have their gradients, or ``call`` is over, and runs ``after()`` once ``call`` is over, on any thread.
Finisher = Callable[[Callable[[], None], Sequence[Tensor], Sequence[Tensor], Callable[[], None]], None]


@dataclass
class _Saved:
    inputs: tuple[Tensor, ...]
    imports: dict[SkipKey, Tensor]
    atomic: bool
    seed: Callable[[], int]
    context: Callable[[], ContextManager[None]]  # autocast state of the forward, for recomputation
    outputs: tuple[Tensor, ...] | None  # None: checkpointed, recompute in backward
    exports: dict[SkipKey, Tensor | None] | None
    versions: tuple[int, ...] = ()  # of inputs and imports after a checkpointed forward: unchanged till recomputed
    empty: tuple[SkipKey, ...] = ()  # imported skips stashed as None (they stay None, and get no gradient)
    loss: LossFn | None = None  # the last stage's loss function: its output for backward is the loss
    target: Any = None


def move_to(t: Tensor, device: torch.device) -> Tensor:
    """``t`` on ``device``, asynchronously only towards a GPU (a non-blocking copy into host memory is early)."""
    return t.to(device, non_blocking=device.type == "cuda")


def _leaf(t: Tensor, device: torch.device, requires_grad: bool) -> Tensor:
    t = move_to(t.detach(), device)
    if requires_grad and (t.is_floating_point() or t.is_complex()):
        t.requires_grad_(True)
    return t


def _has_inplace(partition: nn.Module) -> bool:
    """Whether any module of ``partition`` is set to modify its input in place (``inplace=True``)."""
    return any(getattr(m, "inplace", False) is True for m in partition.modules())


def settled(t: Tensor) -> Tensor:
    """``t`` with its values: the result of an asynchronous collective (torch's ``AsyncCollectiveTensor``, what a
    tensor-parallel layer's all-reduce or all-gather leaves) waited for, since its memory is written only when the
    collective completes; any other tensor as it is. Unwaited, torch also keeps the collective registered (and its
    tensor alive) until the process ends."""
    wait = getattr(t, "trigger_wait", None)
    return wait() if wait is not None else t


def _handoff(t: Tensor) -> Tensor:
    """What a stage hands on: detached, carrying only whether it requires grad."""
    return t.detach().requires_grad_(t.requires_grad)


class Stage:
    """Partition ``index`` of a pipeline, placed on ``device``.

    ``exports`` are the skip keys stashed here and popped by a later stage; ``imports`` those popped here
    and stashed by an earlier one. The partition is called as a module, so hooks registered on it run; a
    :class:`~lightning_pipe.engine.partition.Partition` (what the cut makes) lets the stage watch each layer.
    """

    def __init__(self, index: int, partition: nn.Sequential, device: torch.device, *, offset: int = 0,
                 exports: Sequence[SkipKey] = (), imports: Sequence[SkipKey] = ()) -> None:
        self.index = index
        self.partition = partition
        self.device = device
        self.offset = offset  # index of this partition's first layer in the whole sequence
        self.exports = frozenset(exports)
        self.imports = frozenset(imports)
        self._saved: dict[tuple[Hashable, int], _Saved] = {}
        self._lock = threading.Lock()
        self.recorder: Recorder | None = None  # set to record when each micro-batch ran (a timeline)
        self.inplace = _has_inplace(partition)  # whether its layers get copies of inputs backward needs
        self.aside = GradientsAside(partition)  # a step's gradients made before its caller's backward
        self.produced = 0  # autograd calls that accumulated into the parameters' gradients (B, or a W computed)

    # ------------------------------------------------------------------ running the layers
    def _given(self, leaves: tuple[Tensor, ...], imports: Mapping[SkipKey, Tensor], keep: bool
               ) -> tuple[tuple[Tensor, ...], dict[SkipKey, Tensor]]:
        """What the layers receive: the inputs and imports themselves or, with ``keep`` in a partition that
        has an in-place module, copies (autograd refuses in-place operations on leaves that require grad;
        recomputation needs the inputs as they were)."""
        if not (keep and self.inplace):
            return leaves, dict(imports)
        return tuple(t.clone() for t in leaves), {k: t.clone() for k, t in imports.items()}

    def _where(self, k: int, name: str, layer: nn.Module) -> str:
        return f"layer {self.offset + k} ('{name}': {type(layer).__name__}) on {self.device}"

    def _run(self, value: Any, imports: Mapping[SkipKey, Tensor | None], seed: Callable[[], int],
             microbatch: int, watch: Sequence[Tensor] = ()) -> tuple[Batch, dict[SkipKey, Tensor | None]]:
        """Call the partition on ``value``; raise as soon as a layer modifies a tensor of ``watch`` in place."""
        tracker = SkipTracker(imports, self.exports)
        layers = StageWatch(self, microbatch, watch)
        # Asked at every forward: a hook registered since the last one may draw random numbers.
        random = nullcontext() if draws_no_random(self.partition) else \
            StageRandom(lambda: mix_seed(seed(), self.index, microbatch))
        with use_skip_tracker(tracker), random, watching_layers(self.partition, layers):
            try:
                value = self.partition(value)  # as a module: hooks registered on the partition run
            except BaseException as exc:
                layers.located(exc, f"raised in partition {self.index} on {self.device}")
                raise
        layers.passed(-1, "", self.partition)  # a hook of the partition, or a partition that is no Partition
        missing = sorted(key[1] for key in self.exports - tracker.exported.keys())
        if missing:
            raise RuntimeError(f"partition {self.index} did not stash {missing} in this forward; a skippable "
                               "layer must stash every name a later partition pops, in every forward")
        return Batch.of(value, f"output of partition {self.index}"), tracker.exported

    def forward(self, run: Hashable, microbatch: int, inputs: Batch, imports: Mapping[SkipKey, Tensor | None], *,
                seed: Callable[[], int], save: bool, checkpoint: bool, last: bool, loss: LossFn | None = None,
                target: Any = None) -> tuple[Batch | MicroLoss, dict[SkipKey, Tensor | None]]:
        """Run the partition on one micro-batch; with ``save``, keep what backward needs.

        Returned tensors are detached and say by ``requires_grad`` whether a gradient flows back to them.
        ``last`` marks the last micro-batch of the mini-batch (deferred BatchNorm commits then). With ``loss``
        (the last stage), ``loss(output, target)`` is computed here and returned instead of the output, and a
        backward starts from it: its gradient is the loss's weight in the batch's loss.
        """
        start = time.time()
        leaves = tuple(_leaf(t, self.device, save and t.requires_grad) for t in inputs.tensors)
        got = {k: _leaf(t, self.device, save and t.requires_grad) for k, t in imports.items() if t is not None}
        empty = tuple(k for k, t in imports.items() if t is None)  # ``yield stash(name, None)`` pops as None
        # A checkpointed micro-batch recomputes from its saved inputs: they must come out as they went in.
        watch = (*leaves, *got.values()) if save and checkpoint else ()
        context = checkpointing() if save and checkpoint else nullcontext()
        with context, torch.set_grad_enabled(save and not checkpoint):
            given, given_imports = self._given(leaves, got, save)  # copies, if any, are part of the graph
            outputs, exports = self._run(Batch(given, inputs.atomic).value, {**given_imports, **dict.fromkeys(empty)},
                                         seed, microbatch, watch)
            if loss is not None:
                target = to_device(target, self.device)
                value, extras = compute(loss, outputs.value, target)
                outputs = Batch((value,), True)
        if save:
            kept = None if checkpoint else outputs.tensors
            with self._lock:
                self._saved[(run, microbatch)] = _Saved(leaves, got, inputs.atomic, seed, capture_context(), kept,
                                                        None if checkpoint else exports, versions(watch), empty,
                                                        loss, target)
        if save and self.recorder is not None:
            self.recorder.record(self.index, "F", [microbatch], run, start)  # type: ignore[arg-type]
        if last and self.partition.training:
            for module in self.partition.modules():
                if isinstance(module, DeferredBatchNorm):
                    module.commit()
        if save and checkpoint:
            # Run without grad, the outputs cannot tell whether they depend on anything that needs a
            # gradient; they do if any input or parameter does (backward skips those that turn out not to),
            # except an input handed on as it is (an attention mask), which needs one only if it did.
            needs = any(t.requires_grad for t in (*leaves, *got.values())) or \
                any(p.requires_grad for p in self.partition.parameters())
            through = {id(g): t.requires_grad
                       for g, t in zip((*given, *given_imports.values()), (*leaves, *got.values()))}
            mark = lambda t: t.detach().requires_grad_(  # noqa: E731
                through.get(id(t), needs) and (t.is_floating_point() or t.is_complex()))
        else:
            mark = _handoff
        if loss is not None:
            return detach(value, extras), {}
        return (outputs.with_tensors([mark(t) for t in outputs.tensors]),
                {k: None if t is None else mark(t) for k, t in exports.items()})

    def _recompute(self, saved: _Saved, microbatch: int) -> tuple[tuple[Tensor, ...], dict[SkipKey, Tensor | None]]:
        if versions((*saved.inputs, *saved.imports.values())) != saved.versions:
            raise RuntimeError(
                f"the inputs that partition {self.index} saved to recompute micro-batch {microbatch} were "
                "modified in place after its forward (by code that changed the pipe's input or output, or a "
                "tensor handed on between partitions, before backward); recomputation would give wrong "
                "gradients. Leave them unchanged until backward, change a copy, or use checkpoint='never'"
            )
        with saved.context(), recomputing(), torch.enable_grad():
            given, given_imports = self._given(saved.inputs, saved.imports, True)
            imports = {**given_imports, **dict.fromkeys(saved.empty)}
            outputs, exports = self._run(Batch(given, saved.atomic).value, imports, saved.seed, microbatch)
            if saved.loss is not None:
                return (compute(saved.loss, outputs.value, saved.target)[0],), {}
        for t in (*outputs.tensors, *exports.values()):  # only a graph to run backward through: never read
            settled(t)
        return outputs.tensors, exports

    def backward(self, run: Hashable, items: Sequence[tuple[int, Grads, Mapping[SkipKey, Tensor | None]]],
                 finisher: Finisher | None = None) -> list[tuple[Grads, dict[SkipKey, Tensor | None]]]:
        """Backward of micro-batches ``(microbatch, output grads, export grads)`` in one autograd call (through
        ``finisher``, if given: see :data:`Finisher`).

        Returns, per item, the gradients of its inputs and of its imported skips.
        """
        results, _ = self._backward_recorded(run, items, inputs_first=False, finisher=finisher)
        return results

    def backward_inputs_first(self, run: Hashable, items: Sequence[tuple[int, Grads, Mapping[SkipKey, Tensor | None]]],
                              finisher: Finisher | None = None
                              ) -> tuple[list[tuple[Grads, dict[SkipKey, Tensor | None]]], Callable[..., None]]:
        """Like :meth:`backward`, but only the gradients that go upstream (of the inputs and imported skips)
        are computed now; the returned function computes the parameters' gradients, to be called once, later
        (the micro-batches' graph is kept until then; called with False, after a failure, it drops them).
        The stage before can start its backward meanwhile: on the pipeline's critical path, the first
        backward of each later stage takes the time of its input gradients alone (about half of it for a
        stack of linear layers) instead of the whole backward, and zero-bubble schedules fill their bubbles
        with the parameters' part. The second call computes only the parameters' branches of the graph, from
        the gradients the first call captured (:func:`~lightning_pipe.engine.backward_split.input_gradients_first`):
        the two together cost what one backward costs.

        Module hooks could see a layer's backward split in two, so it applies only where that is certain to
        change nothing but the time (:func:`twice_safe`). And on CPU only: on a GPU, the second call's kernels,
        queued on the stage's stream before the last hand-off of the step is copied from it, would delay
        that copy by as long (there, zero-bubble runs each ``I`` as a whole backward and its ``W`` does nothing).
        Elsewhere this is :meth:`backward`, with nothing left to do later.

        ``finisher`` runs the autograd call that accumulates the parameters' gradients if it is this one (a whole
        backward); otherwise the returned function takes it: ``finish(True, finisher)``.
        """
        if self.device.type != "cpu" or not twice_safe(self.partition):
            return self.backward(run, items, finisher), finish_nothing
        results, finish = self._backward_recorded(run, items, inputs_first=True, finisher=finisher)
        return results, finish

    def _backward_recorded(self, run: Hashable, items: Sequence[tuple[int, Grads, Mapping[SkipKey, Tensor | None]]],
                           inputs_first: bool, finisher: Finisher | None = None
                           ) -> tuple[list[tuple[Grads, dict[SkipKey, Tensor | None]]], Callable[..., None]]:
        # Recomputation must leave no trace in module state (BatchNorm running statistics): buffers are
        # restored once autograd is done with them (restoring earlier would trip its version checks), through
        # ``.data``, which bumps no version: a graph of another micro-batch, not recomputed, saved them too
        # (BatchNorm saves its running statistics, and its kernel updates them bumping none), and its backward
        # may come after this one (1F1B with checkpoint="except_last": the last micro-batch's).
        start = time.time()
        with self._lock:
            recomputes = any(getattr(self._saved.get((run, i)), "outputs", ()) is None for i, _, _ in items)
        buffers = [b.detach().clone() for b in self.partition.buffers()] if recomputes else []
        microbatches = [i for i, _, _ in items]

        def restore() -> None:
            if buffers:
                with torch.no_grad():
                    for b, old in zip(self.partition.buffers(), buffers):
                        b.data.copy_(old)

        handed = [False]  # whether a finisher runs ``restore`` once its autograd call is over

        def through(call: Callable[[], None], outputs: Sequence[Tensor], upstream: Sequence[Tensor],
                    finisher: Finisher | None) -> None:
            self.produced += 1
            if finisher is None:
                call()
            else:
                handed[0] = True
                finisher(call, outputs, upstream, restore)

        try:
            results, weights = self._backward(run, items, inputs_first, finisher, through)
        except BaseException:
            if not handed[0]:
                restore()
            raise
        if weights is None and not handed[0]:
            restore()
        if self.recorder is not None:
            self.recorder.record(self.index, "B", microbatches, run, start)  # type: ignore[arg-type]
        if weights is None:
            return results, finish_nothing
        pending = [weights]

        def finish(compute: bool = True, finisher: Finisher | None = None) -> None:
            if not pending:
                return
            started = time.time()
            try:
                outputs, weights = pending.pop()
                if compute:
                    through(weights, outputs, (), finisher)
            finally:
                if not handed[0]:
                    restore()
            if not compute:
                return
            if self.recorder is not None:
                self.recorder.record(self.index, "W", microbatches, run, started)  # type: ignore[arg-type]

        return results, finish

    def _backward(self, run: Hashable, items: Sequence[tuple[int, Grads, Mapping[SkipKey, Tensor | None]]],
                  inputs_first: bool, finisher: Finisher | None,
                  through: Callable[[Callable[[], None], Sequence[Tensor], Sequence[Tensor], Finisher | None], None]
                  ) -> tuple[list[tuple[Grads, dict[SkipKey, Tensor | None]]],
                             tuple[Sequence[Tensor], Callable[[], None]] | None]:
        tensors: list[Tensor] = []
        grads: list[Tensor] = []
        saved_items = []
        for microbatch, grad_outputs, grad_exports in items:
            with self._lock:
                saved = self._saved.pop((run, microbatch), None)
            if saved is None:
                raise RuntimeError(
                    f"partition {self.index} has no saved forward for micro-batch {microbatch}: backward ran "
                    "twice through the same pipe output, or after the forward was freed (retain_graph is not "
                    "supported through a pipe; run the forward again)"
                )
            saved_items.append(saved)
            if saved.outputs is None:
                outputs, exports = self._recompute(saved, microbatch)
            else:
                outputs, exports = saved.outputs, saved.exports or {}
            pairs = list(zip(outputs, grad_outputs)) + [(exports[k], g) for k, g in grad_exports.items()
                                                        if exports[k] is not None]
            for t, g in pairs:
                if g is not None and t.requires_grad:
                    tensors.append(t)
                    # A number: the gradient of a loss computed here (its weight in the batch's loss).
                    grads.append(torch.full_like(t, g) if isinstance(g, float) else move_to(g, t.device))
        weights = None
        upstream = [t for s in saved_items for t in (*s.inputs, *s.imports.values()) if t.requires_grad]
        if tensors and inputs_first and upstream:
            # The gradients that go upstream now; every other leaf's (the parameters') when ``weights`` is called.
            found, later = input_gradients_first(tensors, grads, upstream)
            for t, g in zip(upstream, found):
                t.grad = g
            weights = None if later is None else (tensors, later)
        elif tensors:
            through(lambda: torch.autograd.backward(tensors, grads), tensors, upstream, finisher)
        return [
            (tuple(t.grad if t.requires_grad else None for t in s.inputs),
             {**{k: t.grad if t.requires_grad else None for k, t in s.imports.items()}, **dict.fromkeys(s.empty)})
            for s in saved_items
        ], weights

    def saved_count(self) -> int:
        """How many micro-batches' activations this stage keeps (of every run) for backwards to come."""
        return len(self._saved)

    def has_saved(self, run: Hashable) -> bool:
        """Whether anything is still kept for ``run`` (a backward to come)."""
        with self._lock:
            return any(key[0] == run for key in self._saved)

    def release(self, run: Hashable) -> None:
        """Drop whatever is still saved for ``run`` (its output was freed without backward), and gradients it
        made that were never committed."""
        with self._lock:
            for key in [k for k in self._saved if k[0] == run]:
                del self._saved[key]
        self.aside.release(run)
