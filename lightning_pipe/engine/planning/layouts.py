"""The layouts a body can take on a number of devices, and each one's step time and per-process peak predicted from
the body's measured layers and the schedule's simulation."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_pipe.engine.balance.blockpartition import solve
from lightning_pipe.engine.plan import Action, Plan, check_shape, simulate
from lightning_pipe.engine.planning.measure import BodyProfile
from lightning_pipe.engine.planning.memory import (
    Memory,
    OptimizerModel,
    activation_peak,
    process_memory,
    sharded_per_microbatch,
    trainable_bytes,
)
from lightning_pipe.engine.schedule import MULTISTAGE, placement_of, schedule_plan

__all__ = ["Costs", "Layout", "Prediction", "balances", "candidates", "predict", "tensor_sizes"]

SHARDINGS = ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD")
CHECKPOINTS = ("never", "except_last", "always")


@dataclass(frozen=True)
class Costs:
    """What the measured layers do not show, in seconds and bytes: a hand-off's fixed cost and bandwidth, an
    all-reduce's bandwidth (per process: what it sends of a ring's), the runtime's cost per
    action and per step (and per process beyond the first),
    a collective's fixed cost, FSDP's hooks per action of a sharded stage, what FSDP adds per use of a layer per byte
    of its weights, tensor parallel per split module and action (fixed, and per byte of its layer's input: the
    collective it waits for behind the compute before it), the optimizer's time per byte of trainable
    parameter, and the memory each process holds beyond its tensors (the runtime: RPC, the process groups; the
    driver's, Lightning's loop too; a tensor group's; per other process of its pipeline, the data plane's: shared
    memory's two rings). Defaults measured on a 2-vCPU CPU machine (docs/planning.md):
    the step's is Lightning's loop around a plain model's forward, backward and optimizer step; :meth:`for_device`
    gives a GPU's."""

    handoff: float = 0.6e-3
    bandwidth: float = 1.5e9
    collective_bandwidth: float = 1.3e9
    action: float = 0.3e-3
    step: float = 15e-3
    per_process: float = 0.5e-3
    collective: float = 0.3e-3
    optimizer_per_byte: float = 0.0
    runtime_memory: float = 16 * 2**20
    driver_memory: float = 7 * 2**20
    tensor_memory: float = 8 * 2**20
    peer_memory: float = 2 * (4 * 2**20 + 128)  # the rings to and from each other process (transport/wire/shm.py)
    sharded_action: float = 0.3e-3
    sharded_per_byte: float = 1.75e-9
    tensor_action: float = 1.5e-3
    tensor_per_byte: float = 1e-9

    @classmethod
    def for_device(cls, device_type: str) -> Costs:
        """The defaults for ``device_type``: on a GPU, NCCL's and the CUDA context's."""
        if device_type == "cuda":
            return cls(handoff=0.1e-3, bandwidth=20e9, collective_bandwidth=20e9,
                       action=0.05e-3, step=1e-3, per_process=0.3e-3, collective=0.05e-3, runtime_memory=0.0,
                       driver_memory=0.0, sharded_per_byte=1 / 20e9, tensor_action=0.05e-3,
                       tensor_per_byte=1 / 20e9, peer_memory=0.0)
        return cls()


@dataclass(frozen=True)
class Layout:
    """How a body runs on ``devices``: ``processes`` pipeline processes of ``virtual_stages`` stages each, layers per
    stage ``balance``, each stage split over ``tensor_parallel_size`` processes, ``replicas`` pipelines sharded by
    ``sharding_strategy``, ``microbatches`` per batch in ``schedule``'s order, ``checkpoint``: which micro-batches
    recompute their activations."""

    processes: int
    virtual_stages: int
    balance: tuple[int, ...]
    tensor_parallel_size: int
    replicas: int
    sharding_strategy: str
    microbatches: int
    schedule: str
    checkpoint: str

    @property
    def devices(self) -> int:
        """Processes of the whole job."""
        return self.processes * self.tensor_parallel_size * self.replicas

    def arguments(self) -> dict[str, Any]:
        """This layout as ``PipeStrategy``'s arguments."""
        return {"balance": list(self.balance), "microbatches": self.microbatches, "schedule": self.schedule,
                "checkpoint": self.checkpoint, "virtual_stages": self.virtual_stages,
                "tensor_parallel_size": self.tensor_parallel_size, "sharding_strategy": self.sharding_strategy}

    def __str__(self) -> str:
        return (f"{self.processes}x{self.virtual_stages} stages {list(self.balance)}, "
                f"tensor {self.tensor_parallel_size}"
                f", replicas {self.replicas} {self.sharding_strategy}, {self.microbatches} micro-batches, "
                f"{self.schedule}, checkpoint {self.checkpoint}")


@dataclass(frozen=True)
class Prediction:
    """A layout's predicted step (seconds) and bubble, and each pipeline process's peak (every tensor rank and
    replica of a process holds the same)."""

    layout: Layout
    step: float
    bubble: float
    memory: tuple[Memory, ...] = field(repr=False)
    samples: int = 0  # samples a step trains, over every replica

    @property
    def peak(self) -> float:
        """The largest process's predicted peak, in bytes."""
        return max(m.total for m in self.memory)

    @property
    def per_sample(self) -> float:
        """Seconds of step per sample trained."""
        return self.step / max(1, self.samples)


def _factorizations(devices: int, tensor_sizes: Sequence[int], layers: int) -> Iterator[tuple[int, int, int]]:
    for t in tensor_sizes:
        for p in range(1, devices // t + 1):
            if devices % (p * t) == 0 and p <= layers:
                yield p, t, devices // (p * t)


def balances(profile: BodyProfile, stages: int, rows: float) -> list[tuple[int, ...]]:
    """The split by time (forward and backward) and by size (parameters and activations), each the smallest
    bottleneck (:func:`~lightning_pipe.engine.balance.blockpartition.solve`)."""
    times = [profile.time("forward", k, k + 1, rows) + profile.time("backward", k, k + 1, rows)
             for k in range(len(profile))]
    sizes = [4.0 * profile.total("params", k, k + 1) + rows * profile.activations(k, k + 1)
             for k in range(len(profile))]
    found = []
    for costs in (times, sizes):
        balance = tuple(solve([c + 1e-12 for c in costs], stages))
        if balance not in found:
            found.append(balance)
    return found


def candidates(profile: BodyProfile, devices: int, *, batch: int, fixed_global: bool, tensor_sizes: Sequence[int],
               schedules: Sequence[str], checkpoints: Sequence[str] = CHECKPOINTS,
               shardings: Sequence[str] = SHARDINGS, microbatches: Sequence[int] | None = None,
               balance: Sequence[int] | None = None) -> Iterator[Layout]:
    """Every layout of ``devices`` worth predicting: stages x tensor x replicas, each schedule that fits the stage
    count, micro-batch counts (powers of 2 up to the rows each replica gets, ``batch`` per replica or, with
    ``fixed_global``, ``batch`` over all), both balances (or ``balance`` alone), each recomputation and, with
    replicas, each sharding."""
    for p, t, d in _factorizations(devices, tensor_sizes, len(profile)):
        rows = batch // d if fixed_global else batch
        if rows < 1 or (fixed_global and batch % d):
            continue
        counts = microbatches or [m for m in (1, 2, 4, 8, 16, 32, 64) if m <= rows]
        for name in schedules:
            v = 2 if name in MULTISTAGE else 1  # the interleaved, looped and V-shaped: 2 stages per process
            if p * v > len(profile) or (p == 1 and name != "gpipe") or (balance is not None and len(balance) != p * v):
                continue
            for m in counts:
                try:
                    if name in MULTISTAGE:
                        check_shape(m, p, v)
                    schedule_plan(name, m, p, v)
                except ValueError:
                    continue
                for split in [tuple(balance)] if balance is not None else balances(profile, p * v, rows / m):
                    for checkpoint in checkpoints:
                        for sharding in (shardings if d > 1 else ("NO_SHARD",)):
                            yield Layout(p, v, split, t, d, sharding, m, name, checkpoint)


def predict(layout: Layout, profile: BodyProfile, *, batch: int, fixed_global: bool, optimizer: OptimizerModel,
            costs: Costs, splittable: Callable[[int, int], float], cores: int, bucket_view: bool = False,
            aside: bool = True, split_modules: Sequence[int] | None = None) -> Prediction:
    """``layout``'s step and each pipeline process's peak (see :class:`Prediction`); ``split_modules``: how many
    modules of each layer tensor parallel splits (one per layer ``splittable`` counts where not given)."""
    p, v, t, d, m = (layout.processes, layout.virtual_stages, layout.tensor_parallel_size, layout.replicas,
                     layout.microbatches)
    rows = (batch // d if fixed_global else batch) / m
    n = p * v
    edges = [sum(layout.balance[:s]) for s in range(n + 1)]
    bounds = [(edges[s], edges[s + 1]) for s in range(n)]
    plan = schedule_plan(layout.schedule, m, p, v)
    placement = placement_of(layout.schedule, p, v)
    if placement and not plan.placement:
        plan = Plan(plan.schedule, plan.microbatches, plan.stages, plan.processes, plan.actions, placement)
    stop = {"never": 0, "except_last": m - 1, "always": m}[layout.checkpoint]
    # How many processes compute at once at the measured speed (each on ``profile.threads`` of the ``cores``).
    capacity = max(1.0, cores / max(1, profile.threads))
    share = [splittable(lo, hi) / max(1, profile.total("params", lo, hi)) for lo, hi in bounds]
    # FULL_SHARD: each use of a stage's layers gathers them (what FSDP2 adds per byte, measured); t > 1: each split
    # module's DTensor dispatch and its collective (measured per module and action, fixed and per byte of its
    # layer's input).
    gather = [profile.total("params", lo, hi) / t * costs.sharded_per_byte
              if sharded_per_microbatch(layout.sharding_strategy, d) else 0.0 for lo, hi in bounds]
    modules = list(split_modules) if split_modules is not None else \
        [1 if splittable(k, k + 1) > 0 else 0 for k in range(len(profile))]
    tensor = [sum(modules[k] * (costs.tensor_action + costs.tensor_per_byte * rows * profile.boundary(k))
                  for k in range(lo, hi)) for lo, hi in bounds]

    # Where the engine runs a zero-bubble backward in two: not where FSDP's or tensor parallel's hooks are on the
    # layers (``twice_safe``), whose each I is then a whole backward.
    hooked = t > 1 or (d > 1 and layout.sharding_strategy != "NO_SHARD")
    splits = [not hooked and profile.splits(lo, hi) for lo, hi in bounds]

    def compute(s: int, direction: str) -> float:
        lo, hi = bounds[s]
        if direction in ("inputs", "weights") and not splits[s]:
            return compute(s, "backward") if direction == "inputs" else 0.0
        seconds = profile.time(direction, lo, hi, rows)
        if t > 1 and share[s]:
            seconds = seconds * (1 - share[s] + share[s] / t) + tensor[s]
        return seconds

    forward = [compute(s, "forward") for s in range(n)]
    backward = [compute(s, "backward") for s in range(n)]
    inputs = [compute(s, "inputs") for s in range(n)]  # the backward split in two (zero-bubble): as measured
    weights = [compute(s, "weights") for s in range(n)]

    def cost(action: Action) -> float:
        s, kind, i = action
        again = forward[s] if (kind in "BI" and (i < stop if i >= 0 else stop > 0)) else 0.0
        base = {"F": forward[s], "B": backward[s] + again, "I": inputs[s] + again, "W": weights[s]}[kind]
        fsdp = costs.sharded_action if layout.sharding_strategy != "NO_SHARD" and d > 1 else 0.0
        return base + costs.action + fsdp + (gather[s] if kind in "FBI" else 0.0)

    handoff = costs.handoff + rows * max(profile.boundary(lo) for lo, _ in bounds) / costs.bandwidth if p > 1 else 0.0
    simulation = simulate(plan, cost, handoff=handoff)
    # More processes than the cores run at once: they share them where they compute together, and a pipeline's
    # processes mostly do not (its bubble, its waits for hand-offs); the step is the simulated one, or the whole job's
    # work over the cores where that is longer (scaling every action by the crowding counted it where no one waits).
    work = sum(cost(a) * (m if a.microbatch < 0 else 1) for actions in plan.actions for a in actions) * t * d
    makespan = max(simulation.makespan, work / capacity) if layout.devices > capacity else simulation.makespan
    trainable = [sum(profile.total("trainable", lo, hi) for lo, hi in (bounds[s] for s in plan.stages_of(r)))
                 for r in range(p)]
    sharded = d if layout.sharding_strategy != "NO_SHARD" else 1
    step = makespan + costs.step + costs.per_process * (p * t * (1 if d == 1 else 2) - 1)
    step += max(trainable) / t / sharded * costs.optimizer_per_byte
    if d > 1 and layout.sharding_strategy == "NO_SHARD":  # stage 0's all-reduce, after the step's last backward
        step += 2 * (d - 1) / d * trainable[0] / t / costs.collective_bandwidth + costs.collective
    elif d > 1:  # its gradients reduced and scattered, and (SHARD_GRAD_OP) its parameters gathered once for the step
        step += trainable[0] / t * costs.sharded_per_byte / (2 if layout.sharding_strategy != "SHARD_GRAD_OP" else 1)
    memory = []
    for r in range(p):
        mine = [bounds[s] for s in plan.stages_of(r)]

        # A recomputed micro-batch keeps its input alone (its output is handed on, or is the loss, and not kept: the
        # graph is rebuilt in its backward), and the rest while its backward recomputes it.
        def held(s: int, i: int) -> float:
            lo, hi = bounds[s]
            whole = profile.activations(lo, hi) * ((1 - share[s] + share[s] / t) if t > 1 else 1.0)
            return rows * (profile.boundary(lo) if i < stop else whole)

        def recomputed(s: int, i: int) -> float:
            lo, hi = bounds[s]
            if i >= stop:
                return 0.0
            return rows * (profile.activations(lo, hi) - profile.boundary(lo))

        activations = activation_peak(plan, simulation.times, r, held, recomputed, split=splits.__getitem__)
        new = trainable_bytes(profile, mine, t, splittable)  # the step's gradients, made from its first backward on
        if sharded_per_microbatch(layout.sharding_strategy, d):
            new /= d  # reduced and scattered as each backward ends: their shard
        together = activation_peak(plan, simulation.times, r, held, recomputed, grown=new, split=splits.__getitem__)
        fresh = 1.0 if together - activations >= new * (1 - 1e-9) else max(0.0, (together - activations) / new)
        senders = {plan.process_of(s - 1) for s in plan.stages_of(r) if s > 0} | \
            {plan.process_of(s + 1) for s in plan.stages_of(r) if s + 1 < n}
        incoming = [rows * max(profile.boundary(lo) for lo, _ in bounds) for q in senders if q != r]
        memory.append(process_memory(profile, mine, tensor=t, replicas=d, sharding=layout.sharding_strategy,
                                     optimizer=optimizer, activations=activations, rows=rows, incoming=incoming,
                                     runtime=0.0 if layout.devices == 1 else
                                     (costs.driver_memory if r == 0 else costs.runtime_memory)
                                     + (costs.tensor_memory if t > 1 else 0.0) + costs.peer_memory * (p - 1),
                                     splittable=splittable, bucket_view=bucket_view, aside=aside, fresh=fresh))
    samples = batch if fixed_global else batch * d
    return Prediction(layout, step, simulation.bubble, tuple(memory), samples)


def tensor_sizes(devices: int, plannable: bool) -> list[int]:
    """Tensor-parallel sizes worth trying on ``devices``: 1, and powers of 2 dividing them where a plan exists."""
    return [1] + ([2 ** k for k in range(1, int(math.log2(devices)) + 1) if devices % 2 ** k == 0] if plannable else [])

