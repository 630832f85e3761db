"""One process's stages averaged over their replicas, step by step: which stages reduce in a step, when their last
backward runs the reduction, what waits for the commit, and the averaging rebuilt when what trains changes.

Each stage's averaging is a :class:`~lightning_pipe.transport.parallel.reduction.Reduction`: DDP's
(:class:`~lightning_pipe.transport.parallel.ddp.ReplicatedStage`) or FSDP2's
(:class:`~lightning_pipe.transport.parallel.fsdp.ShardedStage`); :class:`Averages` holds them for the stages of one
process, :class:`StepAverages` drives them through one step's actions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from lightning_pipe.engine.backward_split import finish_nothing
from lightning_pipe.engine.schedule import Action
from lightning_pipe.engine.stage import Stage
from lightning_pipe.transport.parallel import dtensors
from lightning_pipe.transport.parallel.ddp import LastBackward, ReplicatedStage, stage_group
from lightning_pipe.transport.parallel.reduction import Reduction

__all__ = ["is_last_backward"]


def is_last_backward(actions: Sequence[Action], k: int, later: Mapping[tuple[int, int], Callable[..., None]]) -> bool:
    """Whether ``actions[k]`` (a backward of stage ``s``) may be the last of ``s`` in the step that computes
    parameters' gradients: the last ``B`` or ``I`` of ``s`` (an ``I`` computes them if its backward is not split)
    unless a later ``W`` of an ``I`` that was split computes them; or a ``W`` of ``s`` with no backward of ``s``
    after it (DualPipeV runs whole ``B`` after the ``W`` of its first, split, backwards)."""
    s, kind, _ = actions[k]
    rest = [a for a in actions[k + 1:] if a.stage == s]
    if kind == "W":
        return not any(a.kind in "BIW" for a in rest)
    if any(a.kind in "BI" for a in rest):
        return False
    return kind == "I" or all(later.get((s, a.microbatch), finish_nothing) is finish_nothing
                              for a in rest if a.kind == "W")


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
        #: The ``("data", "tensor")`` mesh these stages are split over by tensor parallel (None: not split), set by
        #: whoever splits them: their replicas are its data dimension.
        self.mesh: Any = None

    def replicate(self, configure: Callable[..., DistributedDataParallel] | None, sharding: Any = None) -> None:
        """Average each stage holding trainable parameters through the ``DistributedDataParallel`` that
        ``configure(module, device_ids, process_group, stage)`` builds over its partition, or, given ``sharding``
        (a :class:`~lightning_pipe.transport.parallel.fsdp.Sharding`), shard every stage holding parameters over its
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
                    self.replicas[s] = sharding.stage(stage, stage_group(s, self.mesh), self.mesh)
                continue
            self._build(s, configure)

    def _build(self, s: int, configure: Callable[..., DistributedDataParallel]) -> None:
        """Stage ``s``'s DDP over its trainable parameters now (none if it has none)."""
        stage = self.stages[s]
        self._built[s] = trainable(stage)
        if any(self._built[s]) and any(dtensors.is_split(p) for p in stage.partition.parameters()):
            # Split by tensor parallel: DTensor parameters, which torch's DDP does not take.
            self.replicas[s] = dtensors.SplitReplicas(stage, stage_group(s, self.mesh))
        elif any(self._built[s]):
            device_ids = [stage.device.index or 0] if stage.device.type == "cuda" else None
            group = stage_group(s, self.mesh)
            self.replicas[s] = ReplicatedStage(stage, configure(stage.partition, device_ids, group, s))

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
    def backward(self, k: int, later: Mapping[tuple[int, int], Callable[..., None]]) -> Iterator[LastBackward | None]:
        """Around backward action ``actions[k]``; gives what must run it if it is its stage's last one."""
        s = self.actions[k].stage
        replica = self.reducing.get(s)
        if replica is not None and ("B", s) not in self.started:
            replica.prepare_step()
        self.started.add(("B", s))
        last = replica.last(self.run) if replica is not None and s not in self.reduced and \
            is_last_backward(self.actions, k, later) else None  # (once a step: what comes after is reduced at the end)
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
