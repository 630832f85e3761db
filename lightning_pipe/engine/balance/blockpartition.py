"""Exact contiguous partitioning of per-layer costs into balanced blocks."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["solve"]

_INF = math.inf


def solve(costs: Sequence[float], partitions: int) -> list[int]:
    """Split ``costs`` into ``partitions`` contiguous non-empty blocks, optimally.

    This solves the *linear partition* problem exactly: the returned split
    minimises the largest block sum (the pipeline's bottleneck).  Among all
    splits with that optimal bottleneck, the one with the smallest sum of
    squared block sums (the most even one) is returned; remaining ties go to
    the smallest sum of squared block lengths (so zero-cost layers are spread
    evenly), then to the lexicographically smallest balance (earlier blocks
    shorter).  The result is therefore fully deterministic.

    Block sums are computed as differences of prefix sums, so integer costs
    (e.g. byte counts) are handled exactly; with floats, "optimal" and "tie"
    are meant up to that arithmetic.  Runs in ``O(n^2 * partitions)`` time in
    the worst case (usually much less thanks to pruning): well under a second
    for the few hundred layers of a real model.

    Args:
        costs: Non-negative, finite cost of every layer, in order.
        partitions: Number of blocks, between 1 and ``len(costs)``.

    Returns:
        The balance: the number of layers in each block, ``partitions``
        positive integers summing to ``len(costs)``.

    Raises:
        ValueError: ``partitions`` is not positive, exceeds the number of
            costs, or a cost is negative or not finite.

    Example:
        >>> solve([5, 1, 1, 1, 1, 1], 2)
        [1, 5]
    """
    if partitions < 1:
        raise ValueError(f"partitions must be a positive integer (partitions: {partitions})")
    values = list(costs)
    n = len(values)
    if n < partitions:
        raise ValueError(f"too few layers to split into partitions (layers: {n}, partitions: {partitions})")
    for index, cost in enumerate(values):
        if not (cost >= 0 and math.isfinite(cost)):
            raise ValueError(f"costs must be non-negative and finite (index: {index}, cost: {cost})")

    prefix: list[float] = [0]
    for cost in values:
        prefix.append(prefix[-1] + cost)

    bottleneck = _min_bottleneck(prefix, n, partitions)
    return _most_even_under(prefix, n, partitions, bottleneck)


def _min_bottleneck(prefix: list[float], n: int, partitions: int) -> float:
    """Return the smallest achievable largest-block sum (DP over suffixes).

    ``best[i]`` is the optimal bottleneck of splitting ``costs[i:]`` into the
    current number of blocks.  For a fixed start, the first block's sum grows
    with its end while the rest's optimum shrinks, so the scan stops as soon
    as the first block alone is no better than the best found.
    """
    best = [prefix[n] - prefix[i] for i in range(n + 1)]
    for blocks in range(2, partitions + 1):
        current = [_INF] * (n + 1)
        for start in range(n - blocks + 1):
            found = _INF
            for end in range(start + 1, n - blocks + 2):
                first = prefix[end] - prefix[start]
                if first >= found:
                    break
                value = first if first >= best[end] else best[end]
                if value < found:
                    found = value
            current[start] = found
        best = current
    return best[0]


def _most_even_under(prefix: list[float], n: int, partitions: int, limit: float) -> list[int]:
    """Among splits whose blocks all sum to at most ``limit``, return the most even one.

    Minimises the sum of squared block sums, then the sum of squared block
    lengths (spreads zero-cost layers evenly), then takes the shortest first
    block (strict comparisons while scanning block ends in increasing order).
    Both criteria are additive over blocks, so a DP over suffixes is exact.
    """
    # score[i], spread[i]: best (sum of squared sums, sum of squared lengths)
    # for costs[i:] in the current number of blocks.
    score = [_INF] * (n + 1)
    spread = [0] * (n + 1)
    for start in range(n):
        last = prefix[n] - prefix[start]
        if last <= limit:
            score[start] = last * last
            spread[start] = (n - start) ** 2
    choices: list[list[int]] = []  # choices[b][i]: end of the first block, b + 2 blocks
    for blocks in range(2, partitions + 1):
        current = [_INF] * (n + 1)
        current_spread = [0] * (n + 1)
        choice = [-1] * (n + 1)
        for start in range(n - blocks + 1):
            found = _INF
            found_spread = 0
            for end in range(start + 1, n - blocks + 2):
                first = prefix[end] - prefix[start]
                if first > limit:
                    break
                rest = score[end]
                if rest == _INF:
                    continue
                value = first * first + rest
                value_spread = (end - start) ** 2 + spread[end]
                if value < found or (value == found and value_spread < found_spread):
                    found = value
                    found_spread = value_spread
                    choice[start] = end
            current[start] = found
            current_spread[start] = found_spread
        choices.append(choice)
        score = current
        spread = current_spread

    balance: list[int] = []
    start = 0
    for blocks in range(partitions, 1, -1):
        end = choices[blocks - 2][start]
        balance.append(end - start)
        start = end
    balance.append(n - start)
    return balance
