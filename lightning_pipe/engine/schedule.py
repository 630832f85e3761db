"""Schedules as data: the actions each process of a pipeline runs in one step, in order, and their simulation.

An action is one unit of work of one stage on one micro-batch: ``"F"`` forward, ``"B"`` backward (input and
parameter gradients), ``"I"`` the input gradients alone (the graph kept) and ``"W"`` the parameter gradients
of an earlier ``"I"``. ``"1F0"`` is stage 1's forward of micro-batch 0. A :class:`Plan` lists, per process,
its actions in the order it runs them; each action waits only for its inputs, so a process starts an action
as soon as it is ready. With ``m`` micro-batches and ``p`` processes (``v`` stages each)::

    gpipe          every forward, then every backward: m micro-batches' activations at each stage
        0F0 0F1 0F2 0F3 .   .   .   0B3 0B2 0B1 0B0
        .   1F0 1F1 1F2 1F3 1I3 1B2 1B1 1B0 1W3             (1I3 ... 1W3: stage 1's first backward hands
                                                             on its input gradients first)
    1f1b           after p - j forwards, stage j alternates backward and forward: at most p - j held
        0F0 0F1 .   .   0B0 0F2 0B1 0F3 0B2 0B3
        .   1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3
    zero-bubble    1f1b whose backwards hand on input gradients first (I) and compute parameter gradients
                   (W) where the stage would otherwise wait: a smaller bubble, the same peak at stage 0
    interleaved-1f1b   v stages per process (stage s on process s % p): the bubble shrinks about v times

The loss of a micro-batch is computed on the last stage right after its forward, so a backward can start
before the other micro-batches' forwards; only ``gpipe`` also works with the loss computed after the whole
output is back (its backward then waits for it). :func:`simulate` runs a plan with given action times and
reports the bubble and each stage's peak of micro-batches held, for tests and benchmarks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from lightning_pipe.engine.multistage import dualpipev, interleaved_zero_bubble, looped_bfs, zbv
from lightning_pipe.engine.plan import (
    Action,
    Plan,
    Simulation,
    check_shape,
    per_round,
    plan_from_actions,
    simulate,
    v_placement,
)

__all__ = ["Action", "Plan", "SCHEDULES", "Simulation", "schedule_plan", "simulate"]


@functools.lru_cache(maxsize=64)  # a plan is immutable: built once per shape
def forward_only(m: int, p: int, v: int = 1, placement: tuple[int, ...] = ()) -> Plan:
    """Every forward and no backward (evaluation, or a forward whose backward comes later): each process
    runs its stages in order, each on every micro-batch. ``placement``: as :class:`Plan`'s (a V's)."""
    check_shape(m, p, v)
    shape = Plan("forward", m, p * v, p, (), placement)
    actions = tuple(tuple(Action(s, "F", i) for s in shape.stages_of(r) for i in range(m)) for r in range(p))
    return Plan("forward", m, p * v, p, actions, placement)


@functools.lru_cache(maxsize=64)  # a plan is immutable: built once per shape
def gpipe(m: int, p: int, v: int = 1, *, pipelined: bool = True, inputs_first: bool = True) -> Plan:
    """Every forward, then every backward in reverse micro-batch order. With ``inputs_first``, each stage after
    the first hands on its first backward's input gradients before computing that backward's parameter
    gradients, which it does last (``I`` ... ``W``). ``pipelined=False``: one backward of every micro-batch at
    once per stage."""
    if v != 1:
        raise ValueError(f"gpipe runs one stage per process (stages per process: {v}); for several, use "
                         "schedule='interleaved-1f1b'")
    forward = forward_only(m, p).actions
    plans = []
    for j in range(p):
        if not pipelined:
            backward: list[Action] = [Action(j, "I", -1), Action(j, "W", -1)] if inputs_first and j > 0 else \
                [Action(j, "B", -1)]
        else:
            backward = [Action(j, "B", i) for i in reversed(range(m))]
            if inputs_first and j > 0:
                backward = [Action(j, "I", m - 1), *backward[1:], Action(j, "W", m - 1)]
        plans.append((*forward[j], *backward))
    return Plan("gpipe", m, p, p, tuple(plans))


@functools.lru_cache(maxsize=64)  # a plan is immutable: built once per shape
def one_f_one_b(m: int, p: int, v: int = 1) -> Plan:
    """1F1B: stage ``j`` runs ``min(m, p - j)`` forwards, then alternates one backward and one forward, then
    the remaining backwards: it holds at most ``p - j`` micro-batches' activations."""
    if v != 1:
        raise ValueError(f"1f1b runs one stage per process (stages per process: {v}); for several, use "
                         "schedule='interleaved-1f1b'")
    check_shape(m, p, v)
    plans = []
    for j in range(p):
        warmup = min(m, p - j)
        actions = [Action(j, "F", i) for i in range(warmup)]
        for k in range(m - warmup):
            actions += [Action(j, "B", k), Action(j, "F", warmup + k)]
        actions += [Action(j, "B", k) for k in range(m - warmup, m)]
        plans.append(tuple(actions))
    return Plan("1f1b", m, p, p, tuple(plans))


@functools.lru_cache(maxsize=64)  # a plan is immutable: built once per shape
def zero_bubble(m: int, p: int, v: int = 1) -> Plan:
    """ZB-H1: 1F1B with each backward split into its input gradients (``I``, on the critical path) and its
    parameter gradients (``W``); stage ``j`` runs ``p - 1 - j`` forwards first, then ``F``, ``I`` pairs, and
    holds its ``W`` back by ``j`` micro-batches, so that the stages near the end of the pipeline, which wait
    longest for input gradients, fill that time with parameter gradients. Stage 0 holds at most ``p``
    micro-batches, as in 1F1B; the others hold their inputs of the ``W`` not yet run."""
    if v != 1:
        raise ValueError(f"zero-bubble runs one stage per process (stages per process: {v})")
    check_shape(m, p, v)
    plans = []
    for j in range(p):
        warmup = min(m, p - 1 - j)
        actions = [Action(j, "F", i) for i in range(warmup)]
        weights = 0
        for k in range(m):
            if warmup + k < m:
                actions.append(Action(j, "F", warmup + k))
            actions.append(Action(j, "I", k))
            if k >= j:  # the W of the oldest micro-batch, j behind
                actions.append(Action(j, "W", weights))
                weights += 1
        actions += [Action(j, "W", i) for i in range(weights, m)]
        plans.append(tuple(actions))
    return Plan("zero-bubble", m, p, p, tuple(plans))


@functools.lru_cache(maxsize=64)  # a plan is immutable: built once per shape
def interleaved_1f1b(m: int, p: int, v: int = 2) -> Plan:
    """Interleaved 1F1B: each process holds ``v`` stages (stage ``s`` on process ``s % p``) and runs their
    micro-batches in rounds of ``m / rounds`` (``rounds = max(1, m // p)``), depth first: a process's warmup
    runs ``(v - 1)`` rounds plus two forwards per process after it, then it alternates one forward and one
    backward. The bubble is about ``1 / v`` of 1F1B's."""
    size = per_round("interleaved-1f1b", m, p, v)
    total = v * m
    plans = []
    for r in range(p):
        warmup = min((v - 1) * size + 2 * (p - 1 - r), total)
        taken: dict[tuple[str, int], int] = {}  # the next micro-batch of each (kind, stage)
        actions: list[Action] = []
        for step in range(total + warmup):
            due = []
            if step < total:  # forwards: v stages in turn, a round of micro-batches each
                due.append(("F", ((step // size) % v) * p + r))
            if step >= warmup:  # backwards: the stages in reverse, a round each
                due.append(("B", (v - 1 - ((step - warmup) // size) % v) * p + r))
            for kind, stage in due:
                i = taken.get((kind, stage), 0)
                taken[(kind, stage)] = i + 1
                actions.append(Action(stage, kind, i))
        plans.append(tuple(actions))
    return Plan("interleaved-1f1b", m, p * v, p, tuple(plans))


#: Schedule names (``PipeStrategy(schedule=...)``, ``Pipe(schedule=...)``) and their plans, as
#: ``plan(micro-batches, processes, stages per process)``.
SCHEDULES: dict[str, Callable[[int, int, int], Plan]] = {
    "gpipe": gpipe, "1f1b": one_f_one_b, "interleaved-1f1b": interleaved_1f1b, "zero-bubble": zero_bubble,
    "interleaved-zero-bubble": interleaved_zero_bubble, "looped-bfs": looped_bfs, "zbv": zbv, "dualpipev": dualpipev,
}
#: The schedules that place their stages in a V (process ``r`` holds stages ``r`` and ``2p - 1 - r``).
V_SHAPED = ("zbv", "dualpipev")
#: The schedules that hold several stages per process (``virtual_stages`` > 1); the others hold one.
MULTISTAGE = ("interleaved-1f1b", "interleaved-zero-bubble", "looped-bfs", *V_SHAPED)


def check_schedule(name: object) -> str | Plan:
    """Reject an unknown schedule name, naming the valid ones; a :class:`Plan` (a schedule given as data, made by
    :func:`~lightning_pipe.engine.plan.plan_from_actions`) is taken as it is."""
    if isinstance(name, Plan):
        return name
    if not isinstance(name, str) or name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(map(repr, SCHEDULES))}, or a list of each process's "
                         f"actions (got: {name!r})")
    return name


def schedule_plan(name: str | Plan, m: int, p: int, v: int = 1) -> Plan:
    """The plan of schedule ``name`` for ``m`` micro-batches on ``p`` processes of ``v`` stages each; a schedule given
    as data (a :class:`Plan`) is checked against them."""
    name = check_schedule(name)
    if isinstance(name, Plan):
        if (name.microbatches, name.processes, name.stages) != (m, p, p * v):
            raise ValueError(f"the schedule given as data runs {name.microbatches} micro-batches on {name.processes} "
                             f"processes of {name.stages // name.processes} stages each, and the pipeline has {m} "
                             f"micro-batches on {p} processes of {v} stages each: make them agree (a last batch "
                             "smaller than the micro-batches is one: drop_last=True)")
        return name
    return SCHEDULES[name](m, p, v)


def schedule_from(value: object, microbatches: int | None = None) -> str | Plan:
    """A ``schedule=`` argument as a schedule: a name as it is, a list of each process's actions or the path of a CSV
    file of them as their checked :class:`Plan` (:func:`~lightning_pipe.engine.plan.plan_from_actions`)."""
    if isinstance(value, Plan) or (isinstance(value, str) and not value.endswith(".csv")):
        return value
    return plan_from_actions(value, microbatches)


def stages_per_process(schedule: str | Plan) -> int:
    """The ``virtual_stages`` a schedule takes when none is given: 2 in a V, a schedule given as data's own, else 1."""
    if isinstance(schedule, Plan):
        return schedule.stages // schedule.processes
    return 2 if schedule in V_SHAPED else 1


def placement_of(name: str | Plan, p: int, v: int = 1) -> tuple[int, ...]:
    """Where schedule ``name`` puts the stages of ``p`` processes of ``v`` stages each (see :class:`Plan`): a V for the
    V-shaped schedules, a schedule given as data's own, else empty (stage ``s`` on process ``s % p``)."""
    if isinstance(name, Plan):
        return name.placement
    return v_placement(p) if name in V_SHAPED and v == 2 else ()


def theory(name: str | Plan, m: int, p: int, v: int = 1) -> tuple[float, Sequence[int]]:
    """The textbook bubble fraction (forward 1, backward 2) and per-stage peak of micro-batches held by
    schedule ``name``: gpipe and 1f1b ``(p - 1) / (m + p - 1)``, with ``m`` and ``p - j`` held; interleaved
    ``(p - 1) / (v m + p - 1)``, and looped BFS, which holds every micro-batch; zero-bubble (I = W = 1)
    ``(p - 1) / (3 m + p - 1)``; ZBV, DualPipeV (its pairs run in turn) and interleaved zero-bubble
    ``(p - 1) / (3 v m + p - 1)``."""
    if isinstance(name, Plan):  # a schedule given as data: its own simulation is its theory
        simulation = simulate(name, {"F": 1, "B": 2, "I": 1, "W": 1})
        return simulation.bubble, list(simulation.held)
    if name == "gpipe":
        return (p - 1) / (m + p - 1), [m] * p
    if name == "1f1b":
        return (p - 1) / (m + p - 1), [min(m, p - j) for j in range(p)]
    if name == "interleaved-1f1b":
        return (p - 1) / (v * m + p - 1), []
    if name == "zero-bubble":
        return (p - 1) / (3 * m + p - 1), []
    if name == "looped-bfs":
        return (p - 1) / (v * m + p - 1), [m] * (p * v)
    if name in ("zbv", "dualpipev", "interleaved-zero-bubble"):
        # A process's 2m F, I and W of each of its stages, after the first micro-batch's way down (p - 1 slots).
        return (p - 1) / (3 * v * m + p - 1), []
    raise ValueError(f"no theory for schedule {name!r}")
