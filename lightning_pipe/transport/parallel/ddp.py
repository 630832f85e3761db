"""Each stage's replicas averaged by torch's ``DistributedDataParallel``, over that stage's data-parallel group.

A stage runs local autograd once per micro-batch (or per action of its schedule), never DDP's forward. So, as
``torch.distributed.pipelining`` does, DDP's reducer is driven directly: every backward of a step but the
stage's last one accumulates locally (the reducer is not prepared: DDP's ``no_sync``), and the reducer is
prepared just before the last, so that each bucket is all-reduced (through the comm hook, if any) as soon as
that backward has produced its gradients, while the earlier stages are still in their backward::

    stage 1   B3 B2 B1 [B0 ─────]                       prepared: buckets go out as B0 fills them
                         ├ bucket 1 ══════╗  all-reduce with stage 1 of every other replica
                         └ bucket 0 ═════════╗
    stage 0        B3 B2 B1 B0 [B0 ...]     ║ (stage 0 still computing: the reduction is hidden)
                   ◄── the pipeline's backward ──►

The last backward runs on the stage's reduction thread, which then waits for the buckets (DDP's
``finalize_backward``); the stage hands its input gradients upstream as soon as they are computed, without
waiting for the reduction. Everything that reads or changes the stage's gradients afterwards (clipping, the
optimizer step, zeroing, the next step) first waits for this stage's reduction alone (:meth:`settle`).

With ``static_graph``, the reducer is prepared before the step's first backward instead: DDP counts each
parameter's gradient hooks over the whole step (one per micro-batch) and reduces a parameter at its last.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from lightning_pipe.engine.stage import Stage
from lightning_pipe.transport.parallel.reduction import Reduction

__all__: list[str] = []

#: Reduce during the last backward (True), or only once it is over (False: what a design without overlap would
#: show; ``benchmarks/bench_ddp.py`` measures both).
OVERLAP = True

_GROUPS: dict[int, dist.ProcessGroup] = {}


def stage_group(stage: int, mesh: Any = None) -> dist.ProcessGroup:
    """This process's group for averaging stage ``stage`` with the same stage of the other replicas: all the
    processes of its default group (which are that stage's replicas), made once per process and stage. Its own
    group, not the default one: the reductions run on a thread of their own, concurrently with what else uses
    the default group (Lightning's collectives on the drivers, barriers). Split by tensor parallel over
    ``mesh["tensor"]`` (``mesh``: its ``("data", "tensor")`` mesh), the default group holds every tensor rank:
    the replicas are the mesh's data dimension."""
    if mesh is not None:
        return mesh.get_group("data")
    if stage not in _GROUPS:
        _GROUPS[stage] = dist.new_group(list(range(dist.get_world_size())))
    return _GROUPS[stage]


class _Into(torch.autograd.Function):
    """Adds given gradients into parameters' ``.grad`` through their gradient accumulators, as a backward does,
    so that DDP's hooks see them."""

    @staticmethod
    def forward(ctx: Any, grads: Sequence[Tensor], *params: Tensor) -> Tensor:
        ctx.grads = grads
        return torch.empty(0, device=params[0].device)

    @staticmethod
    def backward(ctx: Any, _: Tensor) -> Any:
        grads, ctx.grads = ctx.grads, None
        return (None, *grads)


class LastBackward:
    """The stage's last backward of a step, run through DDP's reducer (a
    :data:`~lightning_pipe.engine.stage.Finisher`, used at most once)."""

    def __init__(self, replicas: ReplicatedStage, run: int) -> None:
        self.replicas = replicas
        self.run = run
        self.used = False

    def __call__(self, call: Callable[[], None], outputs: Sequence[Tensor], upstream: Sequence[Tensor],
                 after: Callable[[], None]) -> None:
        if self.used:
            raise RuntimeError(f"stage {self.replicas.stage.index} ran a second last backward in one step")
        self.used = True
        self.replicas.last_backward(call, outputs, upstream, after, self.run)


class ReplicatedStage(Reduction):
    """``stage``'s gradients averaged with the same stage of every other replica by ``ddp`` (a
    ``DistributedDataParallel`` over ``stage.partition``, built by ``PipeStrategy.configure_ddp``)."""

    def __init__(self, stage: Stage, ddp: DistributedDataParallel) -> None:
        if ddp.module is not stage.partition:
            raise ValueError(f"configure_ddp must wrap the module it is given (stage {stage.index}'s partition), "
                             f"got a DistributedDataParallel over a {type(ddp.module).__name__}")
        super().__init__(stage)
        self.ddp = ddp
        self.reducer = ddp.reducer
        self.static = bool(ddp.static_graph)
        self.grad_views = bool(ddp.gradient_as_bucket_view)
        self.find_unused = bool(ddp.find_unused_parameters) and not self.static
        self.reductions = 0  # reductions finished (static_graph: the first flushes at its end)
        self._prepared = False  # static_graph: prepared at the step's first backward
        self._unreached: list[Tensor] = []  # trainable parameters without a gradient when the reduction started

    # ------------------------------------------------------------------ a step
    def sync_buffers(self, grad: bool, reduce: bool) -> None:
        """The stage's first forward of a step: its buffers follow replica 0's where DDP's forward would have
        them follow (``broadcast_buffers``: after a forward that reduced), then the step counts as DDP's."""
        if self.ddp.will_sync_module_buffers():
            self.ddp._sync_buffers()
        self.ddp.require_forward_param_sync = grad and reduce

    def prepare_step(self) -> None:
        """The stage's first backward of a step that reduces: with ``static_graph``, the reducer counts from here."""
        if self.static and not self._prepared:
            self._prepare(())

    def last(self, run: int) -> LastBackward | None:
        """What runs the stage's last backward of reducing step ``run`` (None: reduce once it is over)."""
        return LastBackward(self, run) if OVERLAP else None

    def _prepare(self, outputs: Sequence[Tensor]) -> None:
        if self._prepared:
            return
        self.reducer._rebuild_buckets()  # a collective the first time buckets are rebuilt in gradient order
        # Without a gradient until now: where the average comes back exactly zero, no replica used the parameter
        # (an idle replica's zeros count as used to DDP), and it keeps none, as DDP leaves a parameter no rank used.
        self._unreached = [p for p in self.stage.partition.parameters()
                           if p.requires_grad and p.grad is None] if self.find_unused else []
        self.reducer.prepare_for_forward()
        self.reducer.prepare_for_backward(list(outputs) if self.find_unused else [])
        self._prepared = True

    def _finish(self) -> None:
        if self.static and self.reductions == 0:
            self.reducer._delay_all_reduce()  # DDP's first static iteration: every bucket at once
        for p in self._unreached:
            if p.grad is not None and not bool(p.grad.any()):
                p.grad = None
        self._unreached = []
        self._prepared = False
        self.local = False
        self.reductions += 1

    def last_backward(self, call: Callable[[], None], outputs: Sequence[Tensor], upstream: Sequence[Tensor],
                      after: Callable[[], None], run: int = -1) -> None:
        """Run ``call`` (the stage's last backward of the step, from ``outputs``) with the reducer prepared, on
        the reduction thread; return once the ``upstream`` leaves have their gradients (or it is over)."""
        ready: Future[None] = Future()
        left = [len(upstream)]
        lock = threading.Lock()

        def arrived(_: Tensor) -> None:
            with lock:
                left[0] -= 1
                done = left[0] == 0 and not ready.done()
            if done:
                ready.set_result(None)

        handles = [t.register_post_accumulate_grad_hook(arrived) for t in upstream]
        if not upstream:
            ready.set_result(None)
        computed = [0.0]  # when the backward's last parameter gradient arrived (for the timeline)
        recorder = self.stage.recorder
        if recorder is not None:
            stamp = lambda _: computed.__setitem__(0, time.time())  # noqa: E731
            handles += [p.register_post_accumulate_grad_hook(stamp) for p in self.stage.partition.parameters()
                        if p.requires_grad]

        def job() -> None:
            try:
                self._prepare(outputs)
                call()
                self._finish()
            finally:
                for handle in handles:
                    handle.remove()
                after()
            if recorder is not None and computed[0]:
                recorder.record(self.stage.index, "R", [-1], run, computed[0])

        if torch._C._current_graph_task_id() != -1:
            job()  # inside a backward already (a GPU's autograd thread, which the reduction thread would need)
            return
        self.pending = self.worker.submit(job)
        wait([ready, self.pending], return_when=FIRST_COMPLETED)
        if self.pending.done() and self.pending.exception() is not None:
            self.settle()

    def reduce_now(self, extra: Mapping[Tensor, Tensor] | None = None, run: int = -1) -> None:
        """Average the gradients the stage holds now (after adding ``extra[p]`` into each ``p.grad``), on the
        reduction thread: a backward of the parameters alone, prepared as the last one, for a step whose
        reduction could not ride on its last backward (or, with ``OVERLAP`` off, every step)."""
        params = [p for p in self.stage.partition.parameters() if p.requires_grad]
        extra = extra or {}
        grads = {p: extra[p] if p in extra else torch.zeros((), dtype=p.grad.dtype, device=p.grad.device).expand_as(p)
                 for p in params if p in extra or p.grad is not None}
        # This replica's step reached none of the stage's parameters (a stage whose every parameter went unused
        # on its batch): it still joins the other replicas' reduction, contributing zeros, as a DDP rank does for
        # a parameter unused there; one that no replica used keeps no gradient (``_finish``), as under DDP.
        if not grads:
            grads = {p: torch.zeros((), dtype=p.dtype, device=p.device).expand_as(p) for p in params}
        recorder = self.stage.recorder

        def job() -> None:
            start = time.time()
            if not grads:
                return  # the stage trains nothing (frozen on every replica alike)
            with torch.enable_grad():  # queued from a backward (a commit), where grad mode is off
                root = _Into.apply(list(grads.values()), *grads)
                self._prepare([root])
                root.backward(torch.empty(0, device=root.device))
            self._finish()
            if recorder is not None:
                recorder.record(self.stage.index, "R", [-1], run, start)

        self.settle()
        self.pending = self.worker.submit(job)

    def close(self) -> None:
        """Stop averaging this stage: DDP's hooks leave its parameters, the reduction thread ends."""
        try:
            self.settle()
        finally:
            self.reducer._remove_autograd_hooks()
            self.worker.stop()
