"""A step as data: the actions each process of a pipeline runs, in order, which process holds each stage, and the
plan run with given action times (its simulation)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["Action", "Plan", "Simulation", "check_plan", "check_shape", "held_span", "parse_action", "peak_level",
           "per_round", "plan_from_actions", "simulate", "v_placement"]


class Action(NamedTuple):
    """Stage ``stage`` runs ``kind`` (``"F"``, ``"B"``, ``"I"`` or ``"W"``) of micro-batch ``microbatch``
    (``-1``: of every micro-batch at once, in one autograd call)."""

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch if self.microbatch >= 0 else '*'}"


@dataclass(frozen=True)
class Plan:
    """What each of ``processes`` processes runs in one step of ``schedule``, in order: ``actions[r]``.

    ``placement[s]`` is the process that holds stage ``s``; empty, stage ``s`` is held by process
    ``s % processes`` (a loop: interleaved schedules). ``stages`` is a multiple of ``processes``.
    """

    schedule: str
    microbatches: int
    stages: int
    processes: int
    actions: tuple[tuple[Action, ...], ...]
    placement: tuple[int, ...] = ()

    def process_of(self, stage: int) -> int:
        """The process that holds ``stage``."""
        return self.placement[stage] if self.placement else stage % self.processes

    def stages_of(self, process: int) -> list[int]:
        """The stages ``process`` holds, in order."""
        return [s for s in range(self.stages) if self.process_of(s) == process]

    def split(self, process: int) -> tuple[tuple[Action, ...], tuple[Action, ...]]:
        """``process``'s actions before its first non-forward one, and from there on."""
        mine = self.actions[process]
        cut = next((k for k, a in enumerate(mine) if a.kind != "F"), len(mine))
        return mine[:cut], mine[cut:]

    @property
    def eager(self) -> bool:
        """Whether some process runs a backward before its last forward: the step's backward cannot wait for
        the caller's (the loss must be on the last stage)."""
        return any(a.kind == "F" for r in range(self.processes) for a in self.split(r)[1])

    def render(self) -> str:
        """One line per process, its actions in order: ``"0F0 0F1 0B1 0B0"``."""
        return "\n".join(" ".join(map(str, actions)) for actions in self.actions)


def check_shape(m: int, p: int, v: int) -> None:
    """Refuse a number of micro-batches, processes or stages per process that is not a positive integer."""
    for name, value in (("micro-batches", m), ("processes", p), ("stages per process", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"the number of {name} must be a positive integer (got: {value!r})")




def per_round(name: str, m: int, p: int, v: int) -> int:
    """The micro-batches of one round of an interleaved schedule ``name`` (``m / rounds``, ``rounds = max(1, m //
    p)``, each process running a round through one of its ``v`` stages before the next); refused where a process
    holds one stage, or ``m`` is not a multiple of the rounds."""
    check_shape(m, p, v)
    if v < 2:
        raise ValueError(f"{name} needs at least 2 stages per process (stages per process: {v}); with one, use "
                         f"schedule={'1f1b' if name == 'interleaved-1f1b' else 'zero-bubble'!r}")
    rounds = max(1, m // p)
    if m % rounds:
        raise ValueError(f"{name} needs the number of micro-batches ({m}) to be a multiple of the number of rounds "
                         f"({rounds} = max(1, micro-batches // processes)); use {rounds * (m // rounds)} or "
                         f"{rounds * (m // rounds + 1)} micro-batches")
    return m // rounds


def v_placement(processes: int) -> tuple[int, ...]:
    """The V of ``2 * processes`` stages: process ``r`` holds stage ``r`` and stage ``2 p - 1 - r``, so the first and
    the last stage are both in process 0 (the batch and the loss in one place)::

        process 0: stage 0 ............................ stage 2p-1
        process 1:   stage 1 ...................... stage 2p-2
        process p-1:       stage p-1 ── stage p          (one hand-off inside the process)
    """
    return tuple(s if s < processes else 2 * processes - 1 - s for s in range(2 * processes))


#: The kinds of action a plan's computation takes; pipelining's communication and resharding actions
#: (``SEND_F``, ``RECV_B``, ``UNSHARD``, ...) name what the runtime here does by itself, and are passed over.
KINDS = ("F", "B", "I", "W")
_PASSED_OVER = ("SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD", "REDUCE_GRAD")


def parse_action(text: str, where: str) -> Action | None:
    """An action as torch.distributed.pipelining writes it (``"1F0"``: stage 1's forward of micro-batch 0; ``I``,
    ``W``, ``B``), None for one of its communication actions; refused, saying ``where`` it is, otherwise."""
    import re

    match = re.fullmatch(r"\s*(\d+)([A-Z_]+)(\d+)\s*", text)
    if match is None or match[2] not in (*KINDS, *_PASSED_OVER):
        raise ValueError(f"{where}: {text!r} is not an action: write STAGE KIND MICROBATCH, as '1F0' (stage 1's "
                         f"forward of micro-batch 0), with KIND one of F (forward), B (backward), I (input gradients) "
                         f"and W (weight gradients of an earlier I)")
    return None if match[2] in _PASSED_OVER else Action(int(match[1]), match[2], int(match[3]))


def plan_from_actions(rows: object, microbatches: int | None = None) -> Plan:
    """A schedule given as data: one list of actions per process, in the order the process runs them (each an
    ``Action`` or its text, ``"1F0"``; pipelining's communication actions are passed over), or the path of a CSV file
    of such rows (pipelining's ``_dump_csv`` form). The stages each process holds are those its actions name; stage
    0 must be process 0's. Checked before any step (:func:`check_plan`), with an error naming the first action that
    breaks a rule."""
    import csv
    import os

    if isinstance(rows, (str, os.PathLike)):
        with open(rows, newline="") as f:
            rows = [[cell for cell in row if cell.strip()] for row in csv.reader(f)]
    if not isinstance(rows, (list, tuple)) or not rows or not all(isinstance(r, (list, tuple)) for r in rows):
        raise TypeError(f"a schedule as data is a list of lists of actions, one per process (as [['0F0', '0B0'], "
                        f"['1F0', '1B0']]), or the path of a CSV file of them (got: {type(rows).__name__})")
    actions = tuple(tuple(a for k, item in enumerate(row)
                          if (a := item if isinstance(item, Action) else
                              parse_action(str(item), f"process {r}, action {k}")) is not None)
                    for r, row in enumerate(rows))
    owner: dict[int, int] = {}
    for r, row in enumerate(actions):
        for a in row:
            if owner.setdefault(a.stage, r) != r:
                raise ValueError(f"process {r}'s action {a} is of stage {a.stage}, which process {owner[a.stage]} "
                                 "runs too: a stage is held by one process")
    stages = max(owner, default=-1) + 1
    missing = [s for s in range(stages) if s not in owner]
    if missing or owner.get(0, 0) != 0:
        wrong = f"stages {missing} have no action" if missing else f"stage 0 is on process {owner[0]}"
        raise ValueError(f"the schedule's stages must be 0 to {stages - 1}, each held by one process, stage 0 by "
                         f"process 0 (where the batch is): {wrong}")
    p = len(actions)
    if stages % p or any(sum(1 for s in owner if owner[s] == r) != stages // p for r in range(p)):
        raise ValueError(f"the schedule's {stages} stages must be spread evenly over its {p} processes (held: "
                         f"{[sorted(s for s in owner if owner[s] == r) for r in range(p)]})")
    m = max((a.microbatch for row in actions for a in row), default=-1) + 1
    if microbatches is not None and m != microbatches:
        raise ValueError(f"the schedule runs {m} micro-batches and microbatches={microbatches}: make them agree")
    placement = tuple(owner[s] for s in range(stages))
    plan = Plan("custom", m, stages, p, actions, () if placement == tuple(s % p for s in range(stages)) else placement)
    check_plan(plan)
    return plan


def check_plan(plan: Plan) -> None:
    """Refuse a plan that cannot run a step, naming the first action that breaks a rule: every action of a
    stage its process holds; each stage's forwards in micro-batch order, each once; each micro-batch's forward
    before its backward on its stage; one backward per micro-batch (a ``B``, or an ``I`` then its ``W``); and the
    plan finishing (no process waiting forever for a hand-off another never sends: its simulation)."""
    seen: set[Action] = set()
    for r, row in enumerate(plan.actions):
        done: set[tuple[int, str, int]] = set()
        for a in row:
            where = f"process {r}'s action {a}"
            if a.kind not in KINDS or not 0 <= a.stage < plan.stages or not 0 <= a.microbatch < plan.microbatches:
                raise ValueError(f"{where} names no action of this plan (stages 0-{plan.stages - 1}, micro-batches "
                                 f"0-{plan.microbatches - 1}, kinds {', '.join(KINDS)})")
            if plan.process_of(a.stage) != r:
                raise ValueError(f"{where} is of stage {a.stage}, held by process {plan.process_of(a.stage)}")
            if a in seen or (a.kind in "BI" and ((a.stage, "B", a.microbatch) in done or
                                                 (a.stage, "I", a.microbatch) in done)):
                raise ValueError(f"{where} runs a second time (each micro-batch has one forward and one backward "
                                 "per stage)")
            if a.kind == "F" and (a.stage, "F", a.microbatch - 1) not in done and a.microbatch > 0:
                raise ValueError(f"{where} comes before stage {a.stage}'s forward of micro-batch {a.microbatch - 1}: "
                                 "a stage runs its forwards in micro-batch order")
            if a.kind in "BI" and (a.stage, "F", a.microbatch) not in done:
                raise ValueError(f"{where} comes before that micro-batch's forward on stage {a.stage}")
            if a.kind == "W" and (a.stage, "I", a.microbatch) not in done:
                raise ValueError(f"{where} comes before its input gradients ({a.stage}I{a.microbatch}): a W follows "
                                 "its I")
            seen.add(a)
            done.add(tuple(a))  # type: ignore[arg-type]
    for s in range(plan.stages):
        for i in range(plan.microbatches):
            actions = [Action(s, k, i) for k in KINDS if Action(s, k, i) in seen]
            kinds = "".join(a.kind for a in actions)
            if kinds not in ("FB", "FIW"):
                lacking = "its forward" if "F" not in kinds else "its W" if "I" in kinds else "its backward"
                raise ValueError(f"stage {s}'s micro-batch {i} lacks {lacking} (it has: "
                                 f"{', '.join(map(str, actions)) or 'nothing'})")
    simulate(plan)  # raises, naming the actions every process waits at, if the plan cannot finish


@dataclass(frozen=True)
class Simulation:
    """A plan run with fixed action times: when each action ran, the step's length, the idle fraction of
    the processes (the bubble), and how many micro-batches each stage held at most (forward done, its
    backward's parameter gradients not yet)."""

    times: Mapping[Action, tuple[float, float]]
    makespan: float
    bubble: float
    held: tuple[int, ...]


def _needs(action: Action, stages: int, m: int, loss_on_last_stage: bool) -> list[Action]:
    s, kind, i = action
    if kind == "F":
        return [Action(s - 1, "F", i)] if s > 0 else []
    if kind == "W":
        return [Action(s, "I", i)]
    mbs = range(m) if i < 0 else [i]
    if s == stages - 1:  # the loss: after this micro-batch's forward, or after every forward if it is not here
        return [Action(s, "F", k) for k in (mbs if loss_on_last_stage else range(m))]
    return [Action(s, "F", k) for k in mbs] + [Action(s + 1, "grad", k) for k in mbs]


def simulate(plan: Plan, costs: Mapping[str, float] | Callable[[Action], float] | None = None, *,
             loss_on_last_stage: bool = True, handoff: float = 0.0) -> Simulation:
    """Run ``plan`` with action times ``costs`` (by kind, default: forward 1, backward 2, each half of a split
    backward 1; or a function of the action, the time of one micro-batch's); each process runs its actions in
    order, each as soon as its inputs are there, an input from another process ``handoff`` later. Raises
    ``ValueError`` if the plan cannot finish (an action waits for one that comes after it)."""
    kinds = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0, **(costs if isinstance(costs, Mapping) else {})}
    cost: Callable[[Action], float] = costs if callable(costs) else lambda action: kinds[action.kind]
    m, n = plan.microbatches, plan.stages
    done: dict[Action, float] = {}  # also ("grad" of stage s, micro-batch i): its input gradients are out
    times: dict[Action, tuple[float, float]] = {}
    position = [0] * plan.processes
    clock = [0.0] * plan.processes
    remaining = sum(len(a) for a in plan.actions)
    while remaining:
        progressed = False
        for r in range(plan.processes):
            while position[r] < len(plan.actions[r]):
                action = plan.actions[r][position[r]]
                needs = _needs(action, n, m, loss_on_last_stage)
                if any(need not in done for need in needs):
                    break
                start = max([clock[r], *(done[need] + (handoff if plan.process_of(need.stage) != r else 0.0)
                                         for need in needs)])
                count = m if action.microbatch < 0 else 1
                end = start + cost(action) * count
                times[action] = (start, end)
                clock[r] = end
                done[action] = end
                if action.kind in ("B", "I"):
                    for k in (range(m) if action.microbatch < 0 else [action.microbatch]):
                        done[Action(action.stage, "grad", k)] = end
                position[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [str(plan.actions[r][position[r]]) for r in range(plan.processes)
                     if position[r] < len(plan.actions[r])]
            raise ValueError(f"plan {plan.schedule!r} cannot finish: every process waits ({', '.join(stuck)})")
    makespan = max(end for _, end in times.values())
    busy = sum(end - start for start, end in times.values())
    return Simulation(times, makespan, 1.0 - busy / (plan.processes * makespan), _held(plan, times))


def held_span(times: Mapping[Action, tuple[float, float]], stage: int, microbatch: int, split: bool = True
              ) -> tuple[float, float] | None:
    """When ``stage`` holds ``microbatch`` in a simulation's ``times``: from its forward's start to its backward's end
    (its ``W``'s, where the backward is split; ``split`` False: the stage runs each ``I`` as a whole backward and its
    ``W`` does nothing, so the micro-batch goes at the ``I``'s end); None where it has no backward (a forward-only
    plan)."""
    kinds = ("B", "W", "I") if split else ("B", "I")
    ends = [times[a][1] for a in (*(Action(stage, kind, microbatch) for kind in kinds), Action(stage, "B", -1))
            if a in times]
    return (times[Action(stage, "F", microbatch)][0], max(ends)) if ends else None


def peak_level(events: Iterable[tuple[float, float]]) -> float:
    """The highest running sum of ``(time, change)`` events taken in time order, at one time a release before a
    take."""
    level = peak = 0.0
    for _, change in sorted(events):
        level += change
        peak = max(peak, level)
    return peak


def _held(plan: Plan, times: Mapping[Action, tuple[float, float]]) -> tuple[int, ...]:
    """Per stage, the most micro-batches between their forward's start and their backward's end."""
    peaks = []
    for s in range(plan.stages):
        spans = [span for i in range(plan.microbatches) if (span := held_span(times, s, i)) is not None]
        peaks.append(int(peak_level([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])))
    return tuple(peaks)
