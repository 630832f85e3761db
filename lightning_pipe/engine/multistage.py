"""Schedules of several stages per process beyond interleaved 1F1B: looped BFS, interleaved zero-bubble, and the V
shapes (ZBV zero-bubble, DualPipeV), as plans (data), in the orders torch.distributed.pipelining gives them.

In a V (:func:`~lightning_pipe.engine.plan.v_placement`) process ``r`` holds stage ``r`` and stage ``2p - 1 - r``:
the batch goes down the processes and comes back up, so the first and the last stage share process 0, where the
loss is computed next to the batch. With ``p = 2`` (m micro-batches, I and W the two halves of a backward)::

    zbv        0F0 0F1 0F2 3F0 3I0 3W0 ...      process 0: stages 0 and 3
               .   1F0 2F0 1F1 2F1 2I0 2W0 ...  process 1: stages 1 and 2
    dualpipev  F of one stage beside B of the other in the steady state (DeepSeek-V3's DualPipe folded into
               a V); here they run one after the other, in that order
"""

from __future__ import annotations

import functools

from lightning_pipe.engine.plan import Action, Plan, check_shape, per_round, v_placement

__all__ = ["dualpipev", "interleaved_zero_bubble", "looped_bfs", "zbv"]


def _v(name: str, m: int, p: int, v: int) -> None:
    check_shape(m, p, v)
    if v != 2:
        raise ValueError(f"{name} runs a V of exactly 2 stages per process (virtual_stages=2; got {v})")


@functools.lru_cache(maxsize=64)  # a plan is immutable: built once per shape
def zbv(m: int, p: int, v: int = 2) -> Plan:
    """ZBV zero-bubble (the ZB paper's V schedule): each process holds stages ``r`` and ``2p - 1 - r``; after a warmup
    of forwards down and back up the V, it runs one forward, one input gradient (``I``) and one weight gradient
    (``W``) of each of its stages in turn, the ``W`` filling what would be the bubble. Zero bubble where forward,
    ``I`` and ``W`` take the same time. The order of pipelining's ``ScheduleZBVZeroBubble``."""
    _v("zbv", m, p, v)
    plans = []
    for rank in range(p):
        n = max(2 * p - 1, m)  # (the warmup as for enough micro-batches; the ones past m are dropped below)
        first, second = rank, 2 * p - 1 - rank
        counts = {"f0": 0, "f1": 0, "b0": 0, "b1": 0}
        actions: list[Action] = []

        def add(stage: int, kind: str, counter: str, actions: list[Action] = actions,
                counts: dict[str, int] = counts) -> None:
            actions.append(Action(stage, kind, counts[counter]))
            if kind != "I":  # (an I and its W share the count: advanced by the W)
                counts[counter] += 1

        for _ in range(2 * (p - rank) - 1):
            add(first, "F", "f0")
        for _ in range(rank):
            add(second, "F", "f1")
            add(first, "F", "f0")
        for _ in range(p - rank):
            add(second, "F", "f1")
            add(second, "I", "b1")
            add(second, "W", "b1")
        while counts["f1"] < counts["f0"] or counts["f0"] < n:
            if counts["f0"] < n:
                add(first, "F", "f0")
            add(first, "I", "b0")
            add(first, "W", "b0")
            add(second, "F", "f1")
            add(second, "I", "b1")
            add(second, "W", "b1")
        weights = {first: counts["b0"], second: counts["b1"]}
        for _ in range(rank):
            actions.append(Action(first, "I", counts["b0"]))
            counts["b0"] += 1
            actions.append(Action(second, "I", counts["b1"]))
            counts["b1"] += 1
        for _ in range(p - rank):
            actions.append(Action(first, "I", counts["b0"]))
            counts["b0"] += 1
            actions.append(Action(first, "W", weights[first]))
            weights[first] += 1
        actions += [Action(second, "W", i) for i in range(weights[second], counts["b1"])]
        actions += [Action(first, "W", i) for i in range(weights[first], counts["b0"])]
        plans.append(tuple(a for a in actions if a.microbatch < m))
    return Plan("zbv", m, 2 * p, p, tuple(plans), v_placement(p))


@functools.lru_cache(maxsize=64)  # a plan is immutable: built once per shape
def dualpipev(m: int, p: int, v: int = 2) -> Plan:
    """DualPipeV (DeepSeek-V3's DualPipe folded into a V, as pipelining's ``ScheduleDualPipeV``): each process holds
    stages ``r`` and ``2p - 1 - r``; in the steady state it pairs a forward of one stage with a whole backward
    (``B``) of the other, and the first and last backwards are split into ``I`` and ``W`` to fill the bubbles. Needs
    at least as many micro-batches as stages (``m >= 2p``). The pairs run one after the other here (a stage's
    forward and backward in one process are not overlapped)."""
    _v("dualpipev", m, p, v)
    if m < 2 * p:
        raise ValueError(f"dualpipev needs at least as many micro-batches as stages (micro-batches: {m}, stages: "
                         f"{2 * p}): use microbatches={2 * p} or more")
    plans = []
    for rank in range(p):
        first, second = rank, 2 * p - 1 - rank
        actions: list[Action] = []
        forward = {first: 0, second: 0}
        backward = {first: 0, second: 0}  # the next micro-batch of B or I
        weights: list[tuple[int, int]] = []  # the W owed, oldest first

        def f(stage: int, actions: list[Action] = actions, forward: dict[int, int] = forward) -> None:
            actions.append(Action(stage, "F", forward[stage]))
            forward[stage] += 1

        def b(stage: int, split: bool = False, actions: list[Action] = actions, backward: dict[int, int] = backward,
              weights: list[tuple[int, int]] = weights) -> None:
            actions.append(Action(stage, "I" if split else "B", backward[stage]))
            if split:
                weights.append((stage, backward[stage]))
            backward[stage] += 1

        def w(actions: list[Action] = actions, weights: list[tuple[int, int]] = weights) -> None:
            if weights:
                stage, i = weights.pop(0)
                actions.append(Action(stage, "W", i))

        for _ in range((p - rank - 1) * 2):  # 1: forwards down the V
            f(first)
        for _ in range(rank + 1):  # 2: both stages' forwards
            f(first)
            f(second)
        for _ in range(p - rank - 1):  # 3: zero bubble on the way back up
            b(second, split=True)
            w()
            f(second)
        for _ in range(m - 2 * p + rank + 1):  # 4: the steady state, forwards beside backwards
            f(first)
            b(second)
            f(second)
            b(first)
        for _ in range(p - rank - 1):  # 5
            b(second)
            f(second)
            b(first)
        split = False
        for i in range(rank + 1):  # 6: the last backwards, the second half split
            if i == (rank + 1) // 2 and rank % 2 == 1:
                split = True
            b(second, split)
            if i == (rank + 1) // 2 and rank % 2 == 0:
                split = True
            b(first, split)
        for _ in range(p - rank - 1):  # 7
            w()
            b(first, split)
        for _ in range(rank + 1):  # 8: the weights still owed
            w()
        plans.append(tuple(actions))
    return Plan("dualpipev", m, 2 * p, p, tuple(plans), v_placement(p))


@functools.lru_cache(maxsize=64)  # a plan is immutable: built once per shape
def looped_bfs(m: int, p: int, v: int = 2) -> Plan:
    """Looped BFS (breadth-first): each process holds ``v`` stages (stage ``s`` on process ``s % p``) and runs every
    micro-batch through its first stage, then through its next, ...; then the backwards, its last stage first.
    Every stage holds every micro-batch at once (as GPipe), in exchange for the fewest switches between stages."""
    check_shape(m, p, v)
    plans = []
    for r in range(p):
        mine = range(r, p * v, p)
        actions = [Action(s, "F", i) for s in mine for i in range(m)]
        actions += [Action(s, "B", i) for s in reversed(mine) for i in reversed(range(m))]
        plans.append(tuple(actions))
    return Plan("looped-bfs", m, p * v, p, tuple(plans))


@functools.lru_cache(maxsize=64)  # a plan is immutable: built once per shape
def interleaved_zero_bubble(m: int, p: int, v: int = 2) -> Plan:
    """Interleaved zero-bubble (ZB1P, pipelining's ``ScheduleInterleavedZeroBubble``): each process holds ``v``
    stages (stage ``s`` on process ``s % p``) and runs them as interleaved 1F1B does, in rounds of ``m / rounds``
    micro-batches (``rounds = max(1, m // p)``), but with a warmup one forward per process shorter, each backward
    split into its input gradients (``I``) and its weight gradients (``W``), and process ``r`` holding its ``W``
    back by ``r`` backwards, so that the processes that wait longest for input gradients fill that time."""
    size = per_round("interleaved-zero-bubble", m, p, v)
    plans = []
    for r in range(p):
        warmup = min((v - 1) * size + (p - 1 - r), m * v)
        total = m * v  # forwards, and as many backwards

        def forward_stage(op: int, r: int = r) -> int:
            return ((op // size) % v) * p + r

        def backward_stage(op: int, r: int = r, warmup: int = warmup) -> int:
            return (v - 1 - ((op - warmup) // size) % v) * p + r

        taken: dict[tuple[str, int], int] = {}
        actions: list[Action] = []
        backwards: list[int] = []  # the op of each backward so far: the W follow them in that order
        weights = 0

        def act(stage: int, kind: str, actions: list[Action] = actions, taken: dict[tuple[str, int], int] = taken
                ) -> None:
            i = taken.get((kind, stage), 0)
            taken[(kind, stage)] = i + 1
            actions.append(Action(stage, kind, i))

        for op in range(warmup + total):
            if op < total:
                act(forward_stage(op), "F")
            if op >= warmup:
                act(backward_stage(op), "I")
                backwards.append(op)
                if op - warmup >= r:  # the W of the oldest backward, r behind
                    act(backward_stage(backwards[weights]), "W")
                    weights += 1
        for op in backwards[weights:]:
            act(backward_stage(op), "W")
        plans.append(tuple(actions))
    return Plan("interleaved-zero-bubble", m, p * v, p, tuple(plans))
