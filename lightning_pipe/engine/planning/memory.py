"""What one process of a layout holds at its peak, term by term: parameters, gradients, optimizer state, the
activations its stages hold as the schedule runs (from the schedule's simulation), what a backward or the optimizer
step holds for a moment, the hand-off receives posted ahead, and the runtime's own."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from lightning_pipe.engine.plan import Action, Plan, held_span, peak_level
from lightning_pipe.engine.planning.measure import BodyProfile

__all__ = ["Memory", "OptimizerModel", "fsdp_backward", "optimizer_model", "process_memory",
           "sharded_per_microbatch"]

#: Receives the data plane keeps posted per peer (CPU stages), each as large as the largest message from it, up
#: to the size above which a hand-off goes by RPC.
POSTED, PLANE_LIMIT = 8, 1.5 * 2**20


@dataclass(frozen=True)
class Memory:
    """Bytes one process holds at its peak, by term (:attr:`total` their sum)."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    transient: float
    buffers: float
    runtime: float

    @property
    def total(self) -> float:
        """Every term together: the predicted peak."""
        return sum(getattr(self, f.name) for f in fields(self))

    def largest(self) -> tuple[str, float]:
        """The largest term and its bytes."""
        return max(((f.name, getattr(self, f.name)) for f in fields(self)), key=lambda item: item[1])


@dataclass(frozen=True)
class OptimizerModel:
    """What an optimizer keeps: ``states`` bytes of state per byte of trainable parameter (AdamW 2, SGD with
    momentum 1), and whether its step works on every parameter at once (``foreach``: temporaries as large as the
    parameters) or one at a time (as large as the largest)."""

    states: float
    foreach: bool


def optimizer_model(optimizer: Any, device: torch.device) -> OptimizerModel:
    """Measure ``optimizer`` (a ``torch.optim.Optimizer`` class, a function of the parameters making one, or None:
    plain SGD) on a probe parameter: the state it keeps per parameter byte after one step, and its foreach choice
    on ``device`` (torch's default: foreach on CUDA, one tensor at a time on the CPU)."""
    if optimizer is None:
        return OptimizerModel(0.0, False)
    probe = torch.nn.Parameter(torch.zeros(4096, device=device))
    probe.grad = torch.ones_like(probe)
    made = optimizer([probe])
    made.step()
    state = made.state.get(probe, {})
    nbytes = sum(t.numel() * t.element_size() for t in state.values()
                 if isinstance(t, torch.Tensor) and t.numel() == probe.numel())
    foreach = made.defaults.get("foreach")
    if foreach is None:
        foreach = device.type == "cuda" and not made.defaults.get("fused")
    return OptimizerModel(nbytes / (probe.numel() * probe.element_size()), bool(foreach))


def activation_peak(plan: Plan, times: Mapping[Action, tuple[float, float]], process: int,
                    held: Callable[[int, int], float], recomputed: Callable[[int, int], float],
                    grown: float = 0.0, split: Callable[[int], bool] = lambda s: True) -> float:
    """The most activation bytes ``process`` holds at once as the simulated ``plan`` runs: each micro-batch's
    ``held(stage, i)`` from its forward's start to its backward's end (the W's, where ``split(stage)``: where the
    stage cannot split its backward, each I is a whole backward and frees the micro-batch), and a recomputed
    micro-batch's ``recomputed(stage, i)`` from its backward's start for as long as it is held (a split backward keeps
    the recomputed graph for its W); with ``grown`` bytes more from the end of the
    process's first backward that makes parameters' gradients on (the step's gradients: they are made as that
    micro-batch's activations are freed, so GPipe, whose activations peak before its first backward, never holds
    both whole)."""
    events: list[tuple[float, float]] = []
    made = [times[a][1] for a in plan.actions[process]
            if (a.kind in "BW" if split(a.stage) else a.kind in "BI") and a in times]
    if grown and made:
        events.append((min(made), grown))
    for s in plan.stages_of(process):
        for i in range(plan.microbatches):
            span = held_span(times, s, i, split(s))
            if span is None:
                continue  # a forward-only plan
            events += [(span[0], held(s, i)), (span[1], -held(s, i))]
            extra = recomputed(s, i)
            if extra:  # from its backward's start until the micro-batch goes (its W's end where the stage splits it)
                back = times.get(Action(s, "B", i)) or times.get(Action(s, "I", i)) or times[Action(s, "B", -1)]
                events += [(back[0], extra), (span[1], -extra)]
    return peak_level(events)


def _kept(profile: BodyProfile, bounds: Sequence[tuple[int, int]], tensor: int,
          splittable: Callable[[int, int], float]) -> float:
    """The share of its stages' parameters a process holds where tensor parallel splits ``splittable``'s over
    ``tensor`` processes."""
    whole = sum(profile.total("params", lo, hi) for lo, hi in bounds)
    parted = min(whole, sum(splittable(lo, hi) for lo, hi in bounds))
    return (whole - parted + parted / tensor) / whole if whole else 1.0


def trainable_bytes(profile: BodyProfile, bounds: Sequence[tuple[int, int]], tensor: int,
                    splittable: Callable[[int, int], float]) -> float:
    """The trainable parameters' bytes a process of stages ``bounds`` holds whole (what tensor parallel leaves it):
    one set of its gradients."""
    return sum(profile.total("trainable", lo, hi) for lo, hi in bounds) * _kept(profile, bounds, tensor, splittable)


def sharded_per_microbatch(sharding: str, replicas: int) -> bool:
    """Whether ``sharding`` (Lightning's names) over ``replicas`` keeps the shards alone between uses: parameters
    gathered for each use and resharded, gradients reduced and scattered as each backward ends (``FULL_SHARD``,
    ``HYBRID_SHARD``), as the stages' ``Sharding.per_microbatch`` does."""
    return sharding in ("FULL_SHARD", "HYBRID_SHARD") and replicas > 1


def fsdp_backward(profile: BodyProfile, bounds: Sequence[tuple[int, int]], tensor: int,
                  splittable: Callable[[int, int], float]) -> float:
    """The most bytes FSDP2 holds whole, beyond the shards, in the backward of one layer of stages ``bounds`` sharded
    per micro-batch (``FULL_SHARD``, every layer a unit): the layer's parameters gathered and the gradient of them it
    makes, the layer before prefetched, and the last reduce-scatter's input (the layer after, or the stage's first
    layer: the previous micro-batch's last), which FSDP keeps until the next reduce-scatter. (The forward's last
    all-gather is freed as the forward ends.) Four whole layers where they are even, as measured."""
    def unit(k: int, what: str = "params") -> float:
        return profile.total(what, k, k + 1) / (tensor if splittable(k, k + 1) else 1)

    return max(unit(k) + unit(k, "trainable") + (unit(k - 1) if k > lo else 0.0)
               + unit(k + 1 if k + 1 < hi else lo, "trainable")
               for lo, hi in bounds for k in range(lo, hi))


def process_memory(profile: BodyProfile, bounds: Sequence[tuple[int, int]], *, tensor: int, replicas: int,
                   sharding: str, optimizer: OptimizerModel, activations: float, rows: float,
                   incoming: Sequence[float], runtime: float, splittable: Callable[[int, int], float],
                   bucket_view: bool = False, aside: bool = True, fresh: float = 1.0) -> Memory:
    """One process's peak: its stages' layers ``bounds`` (``(lo, hi)`` each), ``splittable(lo, hi)`` the bytes of
    their parameters that tensor parallel splits over ``tensor`` processes, sharded over ``replicas`` by
    ``sharding`` (Lightning's names), ``activations`` from :func:`activation_peak`, micro-batches of ``rows``
    samples, ``incoming`` the largest message from each process that sends to it. ``aside``: the step's backward runs
    inside ``training_step`` (the loss on the last stage), making its gradients aside while the previous step's are
    still held (Lightning zeroes them after ``training_step``): two sets of gradients at the peak. ``fresh``: the
    share of the step's own gradients there at the process's peak (:func:`activation_peak`'s ``grown``)."""
    params = sum(profile.total("params", lo, hi) for lo, hi in bounds) * _kept(profile, bounds, tensor, splittable)
    trainable = trainable_bytes(profile, bounds, tensor, splittable)
    d = replicas if sharding != "NO_SHARD" else 1
    # FULL_SHARD keeps its shard alone between uses; SHARD_GRAD_OP its shard and the whole parameters it gathered for
    # the step (freed after the optimizer step); without sharding, the whole parameters.
    per_microbatch = sharded_per_microbatch(sharding, d)
    stored = params / d if per_microbatch else params / d + params if sharding == "SHARD_GRAD_OP" and d > 1 else params
    # The step's own gradients, beside the previous step's where the backward runs inside training_step (sharded: its
    # shard). Whole under SHARD_GRAD_OP (a stage accumulates them until its last backward reduces and scatters them);
    # under FULL_SHARD each micro-batch's backward reduces and scatters a layer's as it ends: their shard alone.
    gradients = (trainable / d if per_microbatch else trainable) * fresh + (trainable / d if aside else 0.0)
    states = optimizer.states * trainable / d
    # A moment's extra: the backward's gradients flowing through the largest saved tensor and a stage's input
    # gradient, or the optimizer's temporaries; under FULL_SHARD, what FSDP2 holds whole in a layer's backward (each
    # layer a unit of its own): :func:`fsdp_backward`.
    flowing = max(profile.largest_saved(lo, hi) + profile.boundary(lo) for lo, hi in bounds) * rows
    gathered = fsdp_backward(profile, bounds, tensor, splittable) if per_microbatch else 0.0
    # With the loss on the last stage, its backward starts from the loss's: one more tensor as large as the body's
    # output in flight (a cross-entropy's gradient of its log-softmax, beside that of the logits), gone before the
    # first layer makes its parameters' gradient, where FSDP's buffers are: the larger of the two counts.
    loss = profile.boundary(len(profile)) * rows if aside and any(hi == len(profile) for _, hi in bounds) else 0.0
    # The optimizer's temporaries (sharded: on its shards), at the step: after the backward, whose activations are
    # freed by then (the gradients are not: the MLP's processes measured both sets there). They count as far as they
    # exceed the activations: the peak is the higher of the two moments.
    step = (trainable / d if optimizer.foreach else
            max(layer.largest_param for lo, hi in bounds for layer in profile.layers[lo:hi]) / tensor / d) \
        if optimizer.states else 0.0
    transient = max(flowing + max(gathered, loss), 2 * step - activations)
    # Posted receives (CPU stages), and DDP's buckets: a copy of the gradients unless they are views of them.
    buffers = sum(POSTED * min(b, PLANE_LIMIT) for b in incoming)
    if replicas > 1 and sharding == "NO_SHARD" and not bucket_view:
        buffers += trainable
    return Memory(stored + sum(profile.total("buffers", lo, hi) for lo, hi in bounds), gradients, states,
                  activations, transient, buffers, runtime)
