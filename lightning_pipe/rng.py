"""Random numbers that do not depend on thread timing: a generator per (stage, micro-batch).

Partitions run concurrently on their own threads, while PyTorch's default generators are shared by the
whole process: two partitions drawing dropout masks at once would interleave their draws in whatever
order the threads happen to run. Inside a partition the engine therefore installs :class:`StageRandom`,
a thread-local ``TorchFunctionMode`` that hands every random operation a generator seeded from
``(run seed, stage, micro-batch)``. The same micro-batch recomputed in backward replays the same seed, so
checkpointed dropout masks match the first forward exactly.

The run seed is drawn from the process's default CPU generator the first time a partition needs random
numbers, so ``torch.manual_seed`` makes runs reproducible, and a model with no random operation consumes
nothing from the default generator (its data shuffling stays the same as without the pipeline).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__: list[str] = []

_MASK64 = (1 << 64) - 1


def mix_seed(*values: int) -> int:
    """A 63-bit seed from integers, by splitmix64: nearby inputs give unrelated seeds."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h & ((1 << 63) - 1)


class LazySeed:
    """A run's base seed, drawn once from the default CPU generator when first asked for."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seed: int | None = None

    def __call__(self) -> int:
        with self._lock:
            if self._seed is None:
                self._seed = int(torch.empty((), dtype=torch.int64).random_().item())
            return self._seed


_GENERATOR_FUNCTIONS = {
    torch.rand, torch.randn, torch.randint, torch.randperm, torch.rand_like, torch.randn_like,
    torch.randint_like, torch.bernoulli, torch.normal, torch.poisson, torch.multinomial,
    Tensor.bernoulli, Tensor.bernoulli_, Tensor.uniform_, Tensor.normal_, Tensor.random_,
    Tensor.exponential_, Tensor.geometric_, Tensor.cauchy_, Tensor.log_normal_, Tensor.multinomial,
}  # fmt: skip

_ALPHA = 1.7580993408473766  # SELU's -alpha * scale, as in ATen's alpha dropout


def _device_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    for a in args:
        if isinstance(a, Tensor):
            return a.device
    device = kwargs.get("device")
    return torch.device(device) if device is not None else torch.device("cpu")


class StageRandom(TorchFunctionMode):
    """Route the random operations of one partition's forward to generators seeded by ``seed()``.

    Operations that take a ``generator=`` argument get one for their device; dropout, which takes none,
    is computed here from a Bernoulli mask drawn from the same generator (a boolean mask is saved for
    backward, as the built-in dropout does).
    """

    def __init__(self, seed: Callable[[], int]) -> None:
        super().__init__()
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        """The generator for ``device``, created and seeded on first use."""
        g = self._generators.get(device)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(mix_seed(self._seed(), device.index if device.index is not None else -1))
            self._generators[device] = g
        return g

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in _GENERATOR_FUNCTIONS:
            if kwargs.get("generator") is None:
                kwargs["generator"] = self.generator(_device_of(args, kwargs))
            return func(*args, **kwargs)
        dropout = _DROPOUTS.get(func)
        if dropout is not None:
            return dropout(self, *args, **kwargs)
        return func(*args, **kwargs)

    def _mask(self, input: Tensor, p: float, feature: int) -> Tensor:
        if feature:
            # Feature dropout zeroes whole channels: one draw per (sample, channel), or per channel for an
            # input without a batch dimension (``feature`` spatial dims plus the channel dim).
            lead = 1 if input.dim() == feature + 1 else 2
            shape = tuple(input.shape[:lead]) + (1,) * (input.dim() - lead)
        else:
            shape = tuple(input.shape)
        probs = torch.full(shape, 1.0 - p, dtype=torch.float32, device=input.device)
        return torch.bernoulli(probs, generator=self.generator(input.device)).to(torch.bool)

    def dropout(self, input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False, *,
                feature: int = 0) -> Tensor:
        """Dropout with the stage's generator; ``feature`` is the number of spatial dims (0: element-wise)."""
        if p < 0.0 or p > 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        if not training or p == 0.0:
            return input
        mask = self._mask(input, p, feature)
        scale = 0.0 if p == 1.0 else 1.0 / (1.0 - p)
        if inplace:
            return input.mul_(mask).mul_(scale)
        return input * mask * scale

    def alpha_dropout(self, input: Tensor, p: float = 0.5, training: bool = False, inplace: bool = False, *,
                      feature: int = 0) -> Tensor:
        """Alpha dropout (keeps SELU's mean and variance) with the stage's generator."""
        if p < 0.0 or p > 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        if not training or p == 0.0:
            return input
        if p == 1.0:
            return input.mul_(0.0) if inplace else input * 0.0
        keep = self._mask(input, p, feature).to(input.dtype)
        a = 1.0 / math.sqrt((_ALPHA * _ALPHA * p + 1.0) * (1.0 - p))
        b = (keep - 1.0) * (_ALPHA * a) + _ALPHA * a * p
        if inplace:
            return input.mul_(keep * a).add_(b)
        return input * (keep * a) + b


def _feature(method: Callable[..., Tensor], dims: int) -> Callable[..., Tensor]:
    return lambda mode, *args, **kwargs: method(mode, *args, feature=dims, **kwargs)


def _native(method: Callable[..., Tensor], dims: int) -> Callable[..., Tensor]:
    # torch.dropout(input, p, train) and friends take ``train`` positionally.
    return lambda mode, input, p, train: method(mode, input, p, train, feature=dims)


_DROPOUTS: dict[Any, Callable[..., Tensor]] = {
    F.dropout: StageRandom.dropout,
    F.dropout1d: _feature(StageRandom.dropout, 1),
    F.dropout2d: _feature(StageRandom.dropout, 2),
    F.dropout3d: _feature(StageRandom.dropout, 3),
    F.alpha_dropout: StageRandom.alpha_dropout,
    F.feature_alpha_dropout: _feature(StageRandom.alpha_dropout, 2),
    torch.dropout: _native(StageRandom.dropout, 0),
    torch.alpha_dropout: _native(StageRandom.alpha_dropout, 0),
}
