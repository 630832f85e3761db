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

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from lightning_pipe.engine.backward_split import _nothing
from lightning_pipe.engine.schedule import Action
from lightning_pipe.engine.stage import Stage
from lightning_pipe.transport.reduction import Reduction

__all__: list[str] = []

#: Reduce during the last backward (True), or only once it is over (False: what a design without overlap would
#: show; ``benchmarks/bench_ddp.py`` measures both).
OVERLAP = True

_GROUPS: dict[int, dist.ProcessGroup] = {}


def stage_group(stage: int) -> dist.ProcessGroup:
    """This process's group for averaging stage ``stage`` with the same stage of the other replicas: all the
    processes of its default group (which are that stage's replicas), made once per process and stage. Its own
    group, not the default one: the reductions run on a thread of their own, concurrently with what else uses
    the default group (Lightning's collectives on the drivers, barriers)."""
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


class _LastBackward:
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

    def last(self, run: int) -> _LastBackward | None:
        """What runs the stage's last backward of reducing step ``run`` (None: reduce once it is over)."""
        return _LastBackward(self, run) if OVERLAP else None

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


def _is_last(actions: Sequence[Action], k: int, later: Mapping[tuple[int, int], Callable[..., None]]) -> bool:
    """Whether ``actions[k]`` (a backward of stage ``s``) may be the last of ``s`` in the step that computes
    parameters' gradients: the last ``B`` or ``I`` of ``s`` (an ``I`` computes them if its backward is not split)
    unless a later ``W`` of an ``I`` that was split computes them; or the last ``W`` of ``s``."""
    s, kind, _ = actions[k]
    rest = [a for a in actions[k + 1:] if a.stage == s]
    if kind == "W":
        return not any(a.kind == "W" for a in rest)
    if any(a.kind in "BI" for a in rest):
        return False
    return kind == "I" or all(later.get((s, a.microbatch), _nothing) is _nothing for a in rest if a.kind == "W")


def trainable(stage: Stage) -> tuple[bool, ...]:
    """Which of ``stage``'s parameters require a gradient now (its trainable set)."""
    return tuple(p.requires_grad for p in stage.partition.parameters())


class Averages:
    """The averaging over replicas of one process's stages of a pipeline (``stages``: index -> stage): a
    :class:`ReplicatedStage` for each, once :meth:`replicate` built them; nothing to do without."""

    def __init__(self, stages: Mapping[int, Stage]) -> None:
        self.stages = stages
        self.replicas: dict[int, Reduction] = {}
        self._at_commit: set[tuple[int, int]] = set()  # (run, stage): averaged once committed
        self._built: dict[int, tuple[bool, ...]] = {}  # each stage's trainable set when its DDP was built
        self._by_ddp = False  # replicate built DDPs (not FSDP2 shards, not nothing)

    def replicate(self, configure: Callable[..., DistributedDataParallel] | None, sharding: Any = None) -> None:
        """Average each stage holding trainable parameters through the ``DistributedDataParallel`` that
        ``configure(module, device_ids, process_group, stage)`` builds over its partition, or, given ``sharding``
        (a :class:`~lightning_pipe.transport.sharding.Sharding`), shard every stage holding parameters over its
        replicas with FSDP2, frozen ones too: FSDP2 follows each parameter's ``requires_grad`` at every gather
        (None: stop averaging; a sharded stage stays sharded). Every replica's process of a stage calls this at
        once (DDP's constructor and FSDP's sharding are collectives of the stage's replicas)."""
        for replica in self.replicas.values():
            replica.close()
        self.replicas = {}
        self._by_ddp = configure is not None and sharding is None
        self._built = {}
        for s, stage in sorted(self.stages.items()) if configure is not None else ():
            if sharding is not None:
                if next(stage.partition.parameters(), None) is not None:
                    self.replicas[s] = sharding.stage(stage, stage_group(s))
                continue
            self._build(s, configure)

    def _build(self, s: int, configure: Callable[..., DistributedDataParallel]) -> None:
        """Stage ``s``'s DDP over its trainable parameters now (none if it has none)."""
        stage = self.stages[s]
        self._built[s] = trainable(stage)
        if any(self._built[s]):
            device_ids = [stage.device.index or 0] if stage.device.type == "cuda" else None
            self.replicas[s] = ReplicatedStage(stage, configure(stage.partition, device_ids, stage_group(s), s))

    def refresh(self, configure: Callable[..., DistributedDataParallel]) -> list[int]:
        """Rebuild the DDP of every stage here whose trainable set changed since its DDP was built (torch's DDP
        never reduces a parameter that did not require a gradient when it was built, and keeps reducing one
        frozen since), through ``configure`` (built without ``init_sync``: the replicas are in step already).
        A stage that no longer trains loses its DDP, one that starts to gets one. Called between steps, by every
        replica's process of those stages at once (DDP's constructor is a collective); returns the stages
        rebuilt. Stages sharded by FSDP2 follow ``requires_grad`` themselves: nothing to do."""
        if not self._by_ddp:
            return []
        changed = [s for s in sorted(self.stages) if trainable(self.stages[s]) != self._built.get(s)]
        for s in changed:
            old = self.replicas.get(s)
            local = old is not None and old.local
            params = list(self.stages[s].partition.parameters())
            frozen = [p for p, was in zip(params, self._built[s]) if was and not p.requires_grad]
            if local and any(p.grad is not None for p in frozen):
                raise RuntimeError(
                    f"a parameter of stage {s} was frozen (requires_grad=False) while it holds gradients accumulated "
                    "but not yet averaged over the replicas (within accumulate_grad_batches, or no_sync): each "
                    "replica would step it with its own. Freeze parameters between optimizer steps (after "
                    "zero_grad), or set their .grad to None first")
            if old is not None:
                del self.replicas[s]
                old.close()
            self._build(s, configure)
            if s in self.replicas:
                self.replicas[s].local = local
        return changed

    def settle(self) -> None:
        """Wait until every stage's reduction here is over (raising its error)."""
        for replica in self.replicas.values():
            replica.settle()

    def before_update(self) -> None:
        """The optimizer is about to update this process's stages (see :meth:`Reduction.before_update`)."""
        for replica in self.replicas.values():
            replica.before_update()

    def step(self, run: int, actions: Sequence[Action], reduce: bool, eager: bool) -> StepAverages:
        """What averaging does in step ``run`` (this process's ``actions``; ``reduce``: the step averages, not
        under ``no_sync``; ``eager``: its backwards run before the caller's and are committed later). A stage
        holding gradients that are its own (accumulated under ``no_sync``) has the eager step's gradients
        averaged with them at the commit, once their scale is known, in one reduction as under DDP."""
        reducing = {s: r for s, r in self.replicas.items() if reduce or r.always}
        if eager:  # the gradients set aside are the parameters' own (a sharded stage's shards, not whole copies)
            self.before_update()
        for s in list(reducing) if eager else ():
            grads = [p for p in self.stages[s].partition.parameters() if p.grad is not None]
            if reducing[s].local and grads:
                del reducing[s]
                self._at_commit.add((run, s))
            elif reducing[s].grad_views:
                for p in grads:  # set aside for the commit, they must outlive this step's reduction in the buckets
                    p.grad = p.grad.clone() if p.grad._is_view() else p.grad  # type: ignore[union-attr]
        return StepAverages(self, run, actions, reducing, reduce)

    def commit(self, run: int, scale: float) -> None:
        """Add what ``run``'s backwards set aside, times ``scale``, into every stage's gradients here (averaged
        over the replicas where that waited for the commit)."""
        self.settle()
        for s, stage in self.stages.items():
            if (run, s) in self._at_commit:
                self._at_commit.discard((run, s))
                self.replicas[s].reduce_now(stage.aside.take(run, scale), run)
            else:
                stage.aside.commit(run, scale)

    def release(self, run: int) -> None:
        """Forget ``run`` (never committed)."""
        self.settle()
        self._at_commit = {key for key in self._at_commit if key[0] != run}


class StepAverages:
    """What averaging over replicas does during one step of one process's stages (see :meth:`Averages.step`):
    ``reducing`` holds the stages whose last backward of the step averages their gradients."""

    def __init__(self, averages: Averages, run: int, actions: Sequence[Action],
                 reducing: dict[int, Reduction], reduce: bool) -> None:
        self.averages, self.run, self.actions = averages, run, actions
        self.reducing, self.reduce = reducing, reduce
        self.produced = {s: stage.produced for s, stage in averages.stages.items()}
        self.unreduced: set[int] = set()  # produced gradients after (or without) their stage's reduction
        self.reduced: set[int] = set()  # averaged by their last backward
        self.started: set[tuple[str, int]] = set()

    def forward(self, s: int, grad: bool) -> None:
        """Stage ``s`` runs a forward of the step: on its first, its buffers follow replica 0's (as DDP's)."""
        if ("F", s) not in self.started:
            self.started.add(("F", s))
            replica = self.averages.replicas.get(s)
            if replica is not None:
                replica.sync_buffers(grad, self.reduce)

    @contextlib.contextmanager
    def backward(self, k: int, later: Mapping[tuple[int, int], Callable[..., None]]) -> Iterator[_LastBackward | None]:
        """Around backward action ``actions[k]``; gives what must run it if it is its stage's last one."""
        s = self.actions[k].stage
        replica = self.reducing.get(s)
        if replica is not None and ("B", s) not in self.started:
            replica.prepare_step()
        self.started.add(("B", s))
        last = replica.last(self.run) if replica is not None and _is_last(self.actions, k, later) else None
        stage = self.averages.stages[s]
        done = stage.produced
        yield last
        if last is not None and last.used:
            self.reduced.add(s)
        if stage.produced != done:
            if last is not None and last.used:
                self.unreduced.discard(s)
            else:
                self.unreduced.add(s)

    def finish(self) -> None:
        """Every action ran: a stage whose gradients its last backward did not average has them averaged now; so
        does a stage whose backwards here produced none (its parameters unused on this replica's batch): every
        replica of a stage joins each reduction, as every rank of a DDP does. (Under ``static_graph`` the reducer
        counts every backward's hooks itself, and a stage cannot sit a step out.)"""
        idle = {s for s, replica in self.reducing.items() if ("B", s) in self.started and not replica.static
                and s not in self.reduced and self.averages.stages[s].produced == self.produced[s]}
        for s in sorted((self.unreduced & self.reducing.keys()) | idle):
            self.reducing[s].reduce_now(run=self.run)

    def close(self, keep: Callable[[Stage], None] | None) -> None:
        """The step is over here (or failed): stages that kept their gradients to themselves are marked so, and
        ``keep(stage)`` (an eager step's gradients set aside) runs on each once its reduction is over."""
        for s, stage in self.averages.stages.items():
            replica = self.averages.replicas.get(s)
            if replica is not None and stage.produced != self.produced[s] and s not in self.reducing:
                replica.local = True
            if keep is not None and replica is not None:
                replica.then(lambda stage=stage: keep(stage))  # type: ignore[misc]
            elif keep is not None:
                keep(stage)
