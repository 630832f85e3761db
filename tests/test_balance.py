"""Tests for lightning_pipe.engine.balance: exact block partitioning and profile-based balancing."""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_pipe.engine.balance import __all__ as balance_all
from lightning_pipe.engine.balance import balance_by_size, balance_by_time
from lightning_pipe.engine.balance.blockpartition import solve
from lightning_pipe.engine.balance.profile import profile_sizes, profile_times

CPU = torch.device("cpu")


# --------------------------------------------------------------------------- helpers


def compositions(n: int, parts: int) -> Iterator[list[int]]:
    """Yield every balance: ``parts`` positive integers summing to ``n``."""
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        yield [b - a for a, b in itertools.pairwise(bounds)]


def block_sums(costs: Sequence[float], balance: Sequence[int]) -> list[float]:
    """Return the sum of every block of ``balance`` over ``costs``."""
    sums: list[float] = []
    start = 0
    for length in balance:
        sums.append(sum(costs[start : start + length]))
        start += length
    return sums


def brute_force(costs: Sequence[int], parts: int) -> list[int]:
    """Return the documented optimum of ``solve`` by trying every balance."""

    def key(balance: list[int]) -> tuple[Any, ...]:
        sums = block_sums(costs, balance)
        return (max(sums), sum(s * s for s in sums), sum(n * n for n in balance), balance)

    return min(compositions(len(costs), parts), key=key)


def greedy_feasible(costs: Sequence[int], parts: int, limit: int) -> bool:
    """Return whether ``costs`` fits in at most ``parts`` blocks of sum <= ``limit``."""
    blocks, current = 1, 0
    for cost in costs:
        if cost > limit:
            return False
        if current + cost > limit:
            blocks, current = blocks + 1, cost
        else:
            current += cost
    return blocks <= parts


class Heavy(nn.Module):
    """Parameter-free layer whose ``sin`` saves ``factor`` copies of its input for backward."""

    def __init__(self, factor: int) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: Tensor) -> Tensor:
        wide = x.repeat(1, self.factor)  # saved by sin (only if x requires grad)
        return torch.sin(wide).view(x.size(0), self.factor, -1).sum(1)


class Square(nn.Module):
    """``x * x``: autograd saves the same tensor twice."""

    def forward(self, x: Tensor) -> Tensor:
        return x * x


class SleepInBackward(torch.autograd.Function):
    """Identity whose backward sleeps."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, seconds: float) -> Tensor:
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


class Counter:
    """Call counter shared by a layer and its profiling copies (deepcopy returns itself)."""

    def __init__(self) -> None:
        self.calls = 0

    def __deepcopy__(self, memo: dict[int, Any]) -> Counter:
        return self


class Sleep(nn.Module):
    """Layer that sleeps ``forward_s`` in forward and ``backward_s`` in backward."""

    def __init__(self, forward_s: float, backward_s: float = 0.0, counter: Counter | None = None) -> None:
        super().__init__()
        self.forward_s = forward_s
        self.backward_s = backward_s
        self.counter = counter
        self.weight = nn.Parameter(torch.ones(()))

    def forward(self, x: Tensor) -> Tensor:
        if self.counter is not None:
            self.counter.calls += 1
        time.sleep(self.forward_s)
        return SleepInBackward.apply(x * self.weight, self.backward_s)


class Split(nn.Module):
    """Tensor -> (scaled, shifted) tuple; both elements require grad."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))
        self.shift = nn.Parameter(torch.zeros(width))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x * self.scale, x + self.shift


class SlowSecond(nn.Module):
    """(a, b) -> (a, b) where only the backward of ``b`` is slow."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, pair: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        a, b = pair
        return a.sin(), SleepInBackward.apply(b.cos(), self.seconds)


class Merge(nn.Module):
    """(a, b) -> a * b + bias."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(width))

    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        a, b = pair
        return a * b + self.bias


class Boom(nn.Module):
    """Fails if it is ever run: proves validation happens before profiling."""

    def forward(self, x: Tensor) -> Tensor:
        raise AssertionError("profiling started before arguments were validated")


def snapshot(module: nn.Module) -> dict[str, Any]:
    """Capture everything profiling must leave unchanged."""
    return {
        "modes": [m.training for m in module.modules()],
        "params": [(p, p.detach().clone(), p.requires_grad, p.device) for p in module.parameters()],
        "grads": [(p.grad, None if p.grad is None else p.grad.clone()) for p in module.parameters()],
        "buffers": [(name, b.clone()) for name, b in module.named_buffers()],
    }


def assert_unchanged(module: nn.Module, before: dict[str, Any]) -> None:
    """Assert ``module`` matches its ``snapshot``."""
    assert [m.training for m in module.modules()] == before["modes"]
    for param, (original, value, requires_grad, device) in zip(module.parameters(), before["params"], strict=True):
        assert param is original
        assert torch.equal(param, value)
        assert param.requires_grad == requires_grad
        assert param.device == device
    for param, (grad, value) in zip(module.parameters(), before["grads"], strict=True):
        assert param.grad is grad
        if value is not None:
            assert torch.equal(param.grad, value)
    buffers = dict(module.named_buffers())
    for name, value in before["buffers"]:
        assert torch.equal(buffers[name], value), name


# --------------------------------------------------------------------------- solve


def test_public_names() -> None:
    assert balance_all == ["balance_by_time", "balance_by_size"]


@pytest.mark.parametrize(
    ("costs", "partitions", "expected"),
    [
        ([1, 1, 1, 1], 2, [2, 2]),
        ([5, 1, 1, 1, 1, 1], 2, [1, 5]),
        ([1, 2, 3, 4, 5, 6], 2, [4, 2]),
        ([1, 1, 1000, 1, 1], 3, [2, 1, 2]),  # one huge layer gets its own block
        ([1000, 1, 1, 1], 2, [1, 3]),
        ([1, 1, 1, 1000], 3, [1, 2, 1]),  # tie on every criterion: first block shortest
        ([3, 1, 4, 1, 5], 5, [1, 1, 1, 1, 1]),  # partitions == layers
        ([7], 1, [1]),
        ([1, 2, 3], 1, [3]),
        ([0, 0], 2, [1, 1]),
        ([0, 0, 0, 0, 0, 0], 3, [2, 2, 2]),  # zero costs are spread evenly
        ([1, 1, 1, 1, 1, 1, 10], 3, [3, 3, 1]),  # most even among optimal bottlenecks
        ([0.5, 0.25, 0.25], 2, [1, 2]),
    ],
)
def test_solve_hand_cases(costs: list[float], partitions: int, expected: list[int]) -> None:
    assert solve(costs, partitions) == expected


def test_solve_matches_brute_force_on_integers() -> None:
    rng = random.Random(1234)
    for _ in range(600):
        n = rng.randint(1, 9)
        parts = rng.randint(1, n)
        high = rng.choice([1, 3, 10, 1000])
        costs = [rng.randint(0, high) for _ in range(n)]
        assert solve(costs, parts) == brute_force(costs, parts), (costs, parts)


def test_solve_matches_brute_force_bottleneck_on_floats() -> None:
    rng = random.Random(99)
    for _ in range(300):
        n = rng.randint(1, 10)
        parts = rng.randint(1, n)
        costs = [rng.expovariate(1.0) for _ in range(n)]
        balance = solve(costs, parts)
        assert len(balance) == parts and all(b >= 1 for b in balance) and sum(balance) == n
        best = min(max(block_sums(costs, b)) for b in compositions(n, parts))
        assert max(block_sums(costs, balance)) == pytest.approx(best, rel=1e-12, abs=0.0)


def test_solve_is_optimal_on_long_sequences() -> None:
    """300 layers: no smaller bottleneck is feasible (checked by an independent greedy)."""
    rng = random.Random(7)
    for parts in (2, 8, 16):
        costs = [rng.randint(1, 1000) for _ in range(300)]
        started = time.perf_counter()
        balance = solve(costs, parts)
        assert time.perf_counter() - started < 2.0
        assert len(balance) == parts and min(balance) >= 1 and sum(balance) == len(costs)
        bottleneck = max(block_sums(costs, balance))
        assert greedy_feasible(costs, parts, bottleneck)
        assert not greedy_feasible(costs, parts, bottleneck - 1)


def test_solve_accepts_any_sequence_and_keeps_input() -> None:
    costs = (4.0, 1.0, 1.0, 1.0, 1.0)
    assert solve(costs, 2) == [1, 4]
    assert costs == (4.0, 1.0, 1.0, 1.0, 1.0)


@pytest.mark.parametrize(
    ("costs", "partitions", "message"),
    [
        ([1, 2], 0, "(partitions: 0)"),
        ([1, 2], -1, "(partitions: -1)"),
        ([1, 2, 3], 4, "(layers: 3, partitions: 4)"),
        ([], 1, "(layers: 0, partitions: 1)"),
        ([1, -2, 3], 2, "(index: 1, cost: -2)"),
        ([1, math.nan], 1, "(index: 1, cost: nan)"),
        ([math.inf, 1], 1, "(index: 0, cost: inf)"),
    ],
)
def test_solve_errors(costs: list[float], partitions: int, message: str) -> None:
    with pytest.raises(ValueError) as info:
        solve(costs, partitions)
    assert message in str(info.value)


# --------------------------------------------------------------------------- balance_by_size


def test_profile_sizes_counts_saved_storages_exactly() -> None:
    model = nn.Sequential(nn.Linear(16, 16), Heavy(8), nn.Linear(16, 16), Square())
    x = torch.randn(6, 16)
    linear_params = (16 * 16 + 16) * 4
    # Linear #1: its input does not require grad, only the input (6x16 fp32) is saved;
    # the weight it may save is a parameter, accounted for by param_scale only.
    # Heavy: saves the repeated input (6x128). Linear #2: saves its input.
    # Square: saves its input twice, counted once.
    assert profile_sizes(model, x, 1, 2.0, CPU) == [
        6 * 16 * 4 + 2 * linear_params,
        6 * 128 * 4,
        6 * 16 * 4 + 2 * linear_params,
        6 * 16 * 4,
    ]
    assert profile_sizes(model, x, 1, 0.0, CPU) == [384, 3072, 384, 384]


def test_profile_sizes_chunks_shrink_activations_only() -> None:
    model = nn.Sequential(nn.Linear(16, 16), Heavy(8))
    x = torch.randn(6, 16)
    params = 2.0 * (16 * 16 + 16) * 4
    full = profile_sizes(model, x, 1, 2.0, CPU)
    thirds = profile_sizes(model, x, 3, 2.0, CPU)  # 2 rows per micro-batch
    assert full == [384 + params, 3072]
    assert thirds == [128 + params, 1024]
    # More chunks than rows: a micro-batch still has one row; 6 // 4 == 1 too.
    assert profile_sizes(model, x, 100, 2.0, CPU) == [64 + params, 512]
    assert profile_sizes(model, x, 4, 2.0, CPU) == [64 + params, 512]


def test_profile_sizes_follows_requires_grad_like_the_real_model() -> None:
    model = nn.Sequential(Heavy(4))
    x = torch.randn(2, 8)
    assert profile_sizes(model, x, 1, 2.0, CPU) == [0]  # data needs no grad: nothing saved
    assert profile_sizes(model, x.requires_grad_(), 1, 2.0, CPU) == [2 * 32 * 4]


def test_balance_by_size_isolates_the_largest_layer() -> None:
    model = nn.Sequential(Heavy(2), Heavy(2), Heavy(2), Heavy(64), Heavy(2), Heavy(2))
    x = torch.randn(8, 32, requires_grad=True)
    for partitions in (2, 3):
        balance = balance_by_size(partitions, model, x)
        assert len(balance) == partitions and sum(balance) == len(model)
    assert balance_by_size(3, model, x) == [3, 1, 2]
    assert balance_by_size(2, model, x) == [3, 3]


def test_balance_by_size_param_scale_shifts_the_split() -> None:
    # Big parameters, tiny activations first; then parameter-free, activation-heavy layers.
    model = nn.Sequential(nn.Linear(512, 512), Heavy(64), Heavy(64), Heavy(64))
    x = torch.randn(2, 512)
    assert balance_by_size(2, model, x, param_scale=0.0) == [2, 2]
    assert balance_by_size(2, model, x, param_scale=10.0) == [1, 3]
    assert balance_by_size(2, model, x) == [1, 3]  # default 2.0: 2 MiB of params win


def test_balance_by_size_chunks_shift_the_split() -> None:
    model = nn.Sequential(nn.Linear(64, 64), Heavy(64), Heavy(64), Heavy(64))
    x = torch.randn(64, 64)
    assert balance_by_size(2, model, x, chunks=1) == [2, 2]  # activations dominate
    assert balance_by_size(2, model, x, chunks=64) == [1, 3]  # one row: parameters dominate
    assert balance_by_size(2, model, x, chunks=1000) == [1, 3]


def test_balance_by_size_with_tuples_and_integer_tensors() -> None:
    model = nn.Sequential(Split(8), SlowSecond(0.0), Merge(8), nn.Linear(8, 8))
    x = torch.randn(4, 8)
    sizes = profile_sizes(model, x, 2, 0.0, CPU)
    # Micro-batches of 2 rows.  Split saves x (for the scale's grad); SlowSecond and
    # Merge save both tuple elements; Linear saves its input.
    assert sizes == [2 * 8 * 4, 2 * 2 * 8 * 4, 2 * 2 * 8 * 4, 2 * 8 * 4]
    balance = balance_by_size(2, model, x, chunks=2)
    assert len(balance) == 2 and sum(balance) == 4

    embed = nn.Sequential(nn.Embedding(100, 8), nn.Linear(8, 8))
    tokens = torch.randint(0, 100, (4, 5))
    assert balance_by_size(2, embed, tokens) == [1, 1]


def test_balance_by_size_leaves_module_unchanged() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    model.eval()
    model[1].train()
    model[0].weight.grad = torch.full_like(model[0].weight, 7.0)
    model[3].bias.requires_grad_(False)
    before = snapshot(model)
    balance = balance_by_size(2, model, torch.randn(4, 8), device="cpu")
    assert len(balance) == 2 and sum(balance) == 4
    assert_unchanged(model, before)


# --------------------------------------------------------------------------- balance_by_time


def test_balance_by_time_isolates_the_slow_layer() -> None:
    model = nn.Sequential(Sleep(0.004), Sleep(0.004), Sleep(0.03), Sleep(0.004), Sleep(0.004))
    x = torch.randn(2, 4)
    assert balance_by_time(3, model, x, timeout=0.1) == [2, 1, 2]


def test_balance_by_time_counts_backward() -> None:
    # Layer 1 is fast forward but slow backward; ignoring backward would give [2, 1, 1].
    model = nn.Sequential(Sleep(0.005), Sleep(0.0, 0.03), Sleep(0.005), Sleep(0.005))
    x = torch.randn(2, 4)
    times = profile_times(model, x, 0.001, CPU)
    assert times[1] >= 0.03
    assert balance_by_time(3, model, x, timeout=0.001) == [1, 1, 2]


def test_profile_times_repeats_passes_until_timeout() -> None:
    counter = Counter()
    model = nn.Sequential(Sleep(0.0, counter=counter), Sleep(0.01))
    x = torch.randn(2, 4)

    times = profile_times(model, x, 1e-9, CPU)
    assert counter.calls == 2  # an untimed warm-up pass, then at least one timed pass
    assert len(times) == 2 and 0.01 <= times[1] < 0.02  # the warm-up is not counted

    counter.calls = 0
    started = time.perf_counter()
    times = profile_times(model, x, 0.05, CPU)
    assert time.perf_counter() - started >= 0.05
    timed_passes = counter.calls - 1
    assert timed_passes >= 2
    assert times[1] >= 0.01 * timed_passes  # summed over the timed passes


def test_balance_by_time_with_tuples() -> None:
    model = nn.Sequential(Split(4), SlowSecond(0.03), Merge(4), Sleep(0.0))
    x = torch.randn(3, 4)
    times = profile_times(model, x, 0.001, CPU)
    assert times[1] >= 0.03  # backward ran from the second tuple element as well
    assert balance_by_time(3, model, x, timeout=0.001) == [1, 1, 2]

    # A tuple sample goes to the first layer as one argument, like nn.Sequential.
    pair_model = nn.Sequential(SlowSecond(0.0), Merge(4), Sleep(0.0))
    pair = (torch.randn(3, 4), torch.randn(3, 4))
    balance = balance_by_time(2, pair_model, pair, timeout=0.001)
    assert len(balance) == 2 and sum(balance) == 3
    balance = balance_by_size(2, pair_model, pair)
    assert len(balance) == 2 and sum(balance) == 3


def test_balance_by_time_handles_inplace_layers_and_int_inputs() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4))
    x = torch.randn(2, 4, requires_grad=True)
    before = x.detach().clone()
    assert len(balance_by_time(3, model, x, timeout=0.001)) == 3
    assert torch.equal(x.detach(), before)  # the caller's sample is never modified
    embed = nn.Sequential(nn.Embedding(10, 4), nn.ReLU(inplace=True), nn.Linear(4, 4))
    assert len(balance_by_time(2, embed, torch.randint(0, 10, (2, 3)), timeout=0.001)) == 2


def test_balance_by_time_leaves_module_unchanged() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.ReLU(inplace=True), nn.Linear(8, 2))
    model.eval()
    model[1].train()
    model[0].weight.grad = torch.full_like(model[0].weight, 7.0)
    model[4].bias.requires_grad_(False)
    before = snapshot(model)
    balance = balance_by_time(2, model, torch.randn(4, 8), timeout=0.01, device=CPU)
    assert len(balance) == 2 and sum(balance) == 5
    assert_unchanged(model, before)
    assert model[4].weight.grad is None and model[0].bias.grad is None


# --------------------------------------------------------------------------- errors


def _by_time(partitions: int, module: Any, sample: Any, **kwargs: Any) -> list[int]:
    return balance_by_time(partitions, module, sample, **kwargs)


def _by_size(partitions: int, module: Any, sample: Any, **kwargs: Any) -> list[int]:
    return balance_by_size(partitions, module, sample, **kwargs)


BOOM = nn.Sequential(Boom(), Boom(), Boom())
X = torch.randn(2, 4)


@pytest.mark.parametrize("balance", [_by_time, _by_size])
@pytest.mark.parametrize(
    ("partitions", "module", "sample", "error", "message"),
    [
        (0, BOOM, X, ValueError, "(partitions: 0)"),
        (-2, BOOM, X, ValueError, "(partitions: -2)"),
        (4, BOOM, X, ValueError, "too few layers to split into partitions (layers: 3, partitions: 4)"),
        (1, nn.Sequential(), X, ValueError, "(layers: 0, partitions: 1)"),
        (1, nn.ModuleList([Boom()]), X, TypeError, "(module: ModuleList)"),
        (1, Boom(), X, TypeError, "(module: Boom)"),
        (1, BOOM, torch.empty(0, 4), ValueError, "(batch size: 0)"),
        (1, BOOM, (), ValueError, "(tensors: 0)"),
        (1, BOOM, (X, 3), TypeError, "(types: Tensor, int)"),
        (1, BOOM, [[1.0]], TypeError, "(types: list)"),
        (1, BOOM, 1.5, TypeError, "(type: float)"),
    ],
)
def test_common_errors(balance: Any, partitions: int, module: Any, sample: Any, error: type, message: str) -> None:
    with pytest.raises(error) as info:
        balance(partitions, module, sample)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("timeout", "message"),
    [(0, "(timeout: 0)"), (-1.0, "(timeout: -1.0)"), (math.nan, "(timeout: nan)")],
)
def test_timeout_errors(timeout: float, message: str) -> None:
    with pytest.raises(ValueError) as info:
        balance_by_time(1, BOOM, X, timeout=timeout)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"chunks": 0}, "(chunks: 0)"),
        ({"chunks": -3}, "(chunks: -3)"),
        ({"param_scale": -0.5}, "(param_scale: -0.5)"),
        ({"param_scale": math.nan}, "(param_scale: nan)"),
    ],
)
def test_size_option_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        balance_by_size(1, BOOM, X, **kwargs)
    assert message in str(info.value)


def test_size_needs_a_batch_dimension() -> None:
    with pytest.raises(ValueError) as info:
        balance_by_size(1, BOOM, torch.tensor(1.0))
    assert "(dim: 0)" in str(info.value)
    # Timing has no batch to split, so a 0-dim sample is fine there.
    assert balance_by_time(1, nn.Sequential(Sleep(0.0)), torch.tensor(1.0), timeout=1e-3) == [1]
