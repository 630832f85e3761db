"""The GPipe schedule as data: which micro-batch each partition works on at each clock tick.

With ``m`` micro-batches and ``n`` partitions, partition ``j`` runs the forward of micro-batch ``i`` at
tick ``i + j``; backward runs the same ticks in reverse. A step therefore takes ``m + n - 1`` ticks in
each direction, which bounds the speed-up over one device at ``n·m / (m + n - 1)``::

    tick        0    1    2    3    4          forward, m=4, n=2
    part 0     0F0  0F1  0F2  0F3  .
    part 1      .   1F0  1F1  1F2  1F3

The runtime does not wait for a whole tick before starting the next: each partition processes its own
actions in this order as soon as their inputs are ready, which is the same schedule without barriers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

__all__: list[str] = []


class Action(NamedTuple):
    """One unit of work: partition ``stage`` runs ``kind`` ("F" or "B") of micro-batch ``microbatch``."""

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


def clock_cycles(m: int, n: int) -> Iterator[list[tuple[int, int]]]:
    """Yield, tick by tick, the ``(micro-batch, partition)`` pairs that run forward at that tick."""
    if m < 1 or n < 1:
        raise ValueError(f"a schedule needs at least one micro-batch and one partition (m: {m}, n: {n})")
    for k in range(m + n - 1):
        yield [(k - j, j) for j in range(max(1 + k - m, 0), min(1 + k, n))]


def forward_plan(m: int, n: int) -> list[list[Action]]:
    """The forward actions, one list per tick."""
    return [[Action(j, "F", i) for i, j in tick] for tick in clock_cycles(m, n)]


def backward_plan(m: int, n: int) -> list[list[Action]]:
    """The backward actions, one list per tick: the forward ticks reversed, last partition first."""
    return [[Action(j, "B", i) for i, j in reversed(tick)] for tick in reversed(list(clock_cycles(m, n)))]


def stage_order(plan: list[list[Action]], stage: int) -> list[Action]:
    """The actions of one partition in the order it executes them."""
    return [a for tick in plan for a in tick if a.stage == stage]


def render(plan: list[list[Action]]) -> str:
    """The plan as text, one tick per line (``"0F1 1F0"``), for tests and debugging."""
    return "\n".join(" ".join(str(a) for a in tick) for tick in plan)
