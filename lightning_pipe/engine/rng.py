"""Random numbers that do not depend on thread timing: a generator per (stage, micro-batch).

Partitions run concurrently on their own threads, while PyTorch's default generators are shared by the
whole process: two partitions drawing dropout masks at once would interleave their draws in whatever
order the threads happen to run. Inside a partition the engine therefore installs :class:`StageRandom`,
a thread-local ``TorchFunctionMode`` that hands every random operation a generator seeded from
``(run seed, stage, micro-batch)``. The same micro-batch recomputed in backward replays the same seed, so
checkpointed dropout masks match the first forward exactly.

Only the functions in the tables below are routed: functions that take a ``generator=``, the dropout family,
``F.scaled_dot_product_attention`` with ``dropout_p > 0`` (written out, as ATen's math backend computes it) and
``rrelu`` in training. A mode does not see the calls made inside a function it handles, so the Python
functions in ``_COMPOSITES`` (``F.multi_head_attention_forward``, which calls scaled-dot-product attention or
dropout, and ``F.gumbel_softmax``) are run under the mode with their own override check switched off. Other
random draws (inside C++ operations, or inside other Python functions such as ``F.fractional_max_pool2d``) use
the default generator and are not replayed.

The run seed is drawn from the process's default CPU generator the first time a partition needs random
numbers, so ``torch.manual_seed`` makes runs reproducible, and a model with no random operation consumes
nothing from the default generator (its data shuffling stays the same as without the pipeline).

A mode is not free: every torch function call inside it goes through Python, a few microseconds each. For an
8-layer partition the engine's own work per micro-batch about doubles under it (24-44 µs without, 45-78 µs
with, on CPU: ``benchmarks/bench_stage_overhead.py``), which matters where launching small operations is the
work. A partition that :func:`draws_no_random` numbers, made only of built-in layers known to draw none, runs
without it.
"""

from __future__ import annotations

import math
import threading
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as _module
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

_CHECKS = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")


def _no_override(*args: Any) -> bool:
    return False


def _open(func: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of a Python torch function whose ``has_torch_function*`` checks say no, so that under the mode its
    body runs (and the mode sees the calls it makes) instead of handing the call back to the mode."""
    opened = types.FunctionType(func.__code__, {**func.__globals__, **dict.fromkeys(_CHECKS, _no_override)},
                                func.__name__, func.__defaults__, func.__closure__)
    opened.__kwdefaults__ = func.__kwdefaults__
    return opened


# Only functions that check for overrides by one of those names (else the copy would hand itself back forever).
_COMPOSITES = {f: _open(f) for f in (F.multi_head_attention_forward, F.gumbel_softmax)
               if set(_CHECKS) & set(f.__code__.co_names)}

_ALPHA = 1.7580993408473766  # SELU's -alpha * scale, as in ATen's alpha dropout


def _device_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    for a in args:
        if isinstance(a, Tensor):
            return a.device
    device = kwargs.get("device")
    return torch.device(device) if device is not None else torch.device("cpu")


def attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None, dropout_p: float = 0.0,
              is_causal: bool = False, *, scale: float | None = None, enable_gqa: bool = False,
              generator: torch.Generator | None = None) -> Tensor:
    """``F.scaled_dot_product_attention`` written out as ATen's math backend computes it, with the dropout mask
    drawn from ``generator``: ``softmax(q @ k.T * scale + mask)``, dropped and scaled by ``1 / (1 - p)``, ``@ v``."""
    if dropout_p < 0.0 or dropout_p > 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {dropout_p}")
    if is_causal and attn_mask is not None:
        raise ValueError(f"attn_mask should not be set when is_causal=True (attn_mask: {tuple(attn_mask.shape)})")
    dtype = query.dtype
    if dtype in (torch.float16, torch.bfloat16):  # the math backend keeps intermediates in float32
        query, key, value = query.float(), key.float(), value.float()
    if enable_gqa:
        heads, kv_heads = query.size(-3), key.size(-3)
        if heads % kv_heads or value.size(-3) != kv_heads:
            raise ValueError("the heads of key and value must be equal and divide those of query "
                             f"(query: {heads}, key: {kv_heads}, value: {value.size(-3)})")
        key = key.repeat_interleave(heads // kv_heads, -3)
        value = value.repeat_interleave(heads // kv_heads, -3)
    if is_causal:  # upper-left aligned: query i sees keys 0..i
        attn_mask = torch.ones(query.size(-2), key.size(-2), dtype=torch.bool, device=query.device).tril()
    scores = query @ key.transpose(-2, -1) * (1.0 / math.sqrt(query.size(-1)) if scale is None else scale)
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # True: takes part in attention
        scores = scores.masked_fill(attn_mask.logical_not(), float("-inf"))
    elif attn_mask is not None:
        scores = scores + attn_mask
    attn = torch.ops.aten._safe_softmax(scores, -1)  # a row with every key masked out gives zeros, not NaN
    if dropout_p > 0.0:
        keep = torch.bernoulli(torch.full_like(attn, 1.0 - dropout_p), generator=generator).to(torch.bool)
        attn = attn * keep * (0.0 if dropout_p == 1.0 else 1.0 / (1.0 - dropout_p))
    return (attn @ value).to(dtype)


# Built-in layers whose forward draws no random number, in training or not (looked up by name: some are
# recent). Not here: the dropout family, RReLU, FractionalMaxPool, attention and transformer layers.
_NO_RANDOM_NAMES = (
    "Sequential", "Identity", "Linear", "Bilinear", "Flatten", "Unflatten", "Embedding", "EmbeddingBag",
    "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
    "MaxPool1d", "MaxPool2d", "MaxPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d", "LPPool1d", "LPPool2d",
    "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d",
    "AdaptiveMaxPool1d", "AdaptiveMaxPool2d", "AdaptiveMaxPool3d",
    "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "LayerNorm", "GroupNorm", "RMSNorm", "LocalResponseNorm",
    "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d",
    "ReLU", "ReLU6", "LeakyReLU", "PReLU", "ELU", "SELU", "CELU", "GELU", "SiLU", "Mish", "Sigmoid", "Tanh",
    "Hardtanh", "Hardsigmoid", "Hardswish", "Softplus", "Softsign", "Softshrink", "Hardshrink", "Tanhshrink",
    "Threshold", "LogSigmoid", "Softmax", "Softmin", "LogSoftmax", "GLU",
    "ZeroPad1d", "ZeroPad2d", "ZeroPad3d", "ConstantPad1d", "ConstantPad2d", "ConstantPad3d",
    "ReflectionPad1d", "ReflectionPad2d", "ReflectionPad3d", "ReplicationPad1d", "ReplicationPad2d",
    "ReplicationPad3d", "PixelShuffle", "PixelUnshuffle", "Upsample",
)
_NO_RANDOM: set[type] = {getattr(nn, name) for name in _NO_RANDOM_NAMES if hasattr(nn, name)}


def no_random_layer(cls: type[nn.Module]) -> type[nn.Module]:
    """Declare that the forward of layer class ``cls`` (exactly that class) draws no random number, so that
    partitions made of such layers run without :class:`StageRandom`. Returns ``cls`` (usable as a decorator)."""
    _NO_RANDOM.add(cls)
    return cls


def draws_no_random(module: nn.Module) -> bool:
    """Whether running ``module`` certainly draws no random number: every module in it is of a class known to
    draw none (the class itself: a subclass may override ``forward``), and no forward hook, which could draw
    some, is registered on any of them or for every module."""
    if any(getattr(_module, name, None) for name in ("_global_forward_pre_hooks", "_global_forward_hooks")):
        return False
    return all(type(m) in _NO_RANDOM and not m._forward_pre_hooks and not m._forward_hooks for m in module.modules())


class StageRandom(TorchFunctionMode):
    """Route the random operations of one partition's forward to generators seeded by ``seed()``.

    Operations that take a ``generator=`` argument get one for their device; dropout, which takes none,
    is computed here from a Bernoulli mask drawn from the same generator (a boolean mask is saved for
    backward, as the built-in dropout does), and so is attention with dropout; ``rrelu`` in training gets the
    generator its ATen kernel takes.
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
        if func not in _ROUTED:  # most calls: straight through, nothing copied (a block makes ~60 a forward)
            return func(*args, **kwargs) if kwargs else func(*args)
        kwargs = dict(kwargs or {})
        if func in _GENERATOR_FUNCTIONS:
            if kwargs.get("generator") is None:
                kwargs["generator"] = self.generator(_device_of(args, kwargs))
            return func(*args, **kwargs)
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(self, *args, **kwargs)
        opened = _COMPOSITES.get(func)
        if opened is not None:
            with self:  # the mode is popped while it handles a call: push it back for the calls inside
                return opened(*args, **kwargs)
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

    def attention(self, query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                  dropout_p: float = 0.0, is_causal: bool = False, *, scale: float | None = None,
                  enable_gqa: bool = False) -> Tensor:
        """Scaled-dot-product attention: the native kernel without dropout, else :func:`attention`."""
        if dropout_p == 0.0:
            return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                                  enable_gqa=enable_gqa)
        return attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa,
                         generator=self.generator(query.device))

    def rrelu(self, input: Tensor, lower: float = 1.0 / 8, upper: float = 1.0 / 3, training: bool = False,
              inplace: bool = False, generator: torch.Generator | None = None) -> Tensor:
        """Randomized leaky ReLU: in training each negative slope is drawn from ``U(lower, upper)`` by the stage's
        generator (ATen's kernel takes one); in eval the fixed slope ``(lower + upper) / 2``, natively."""
        native = torch.rrelu_ if inplace else torch.rrelu
        if training and generator is None:
            generator = self.generator(input.device)
        return native(input, lower, upper, training, generator=generator)


def _feature(method: Callable[..., Tensor], dims: int) -> Callable[..., Tensor]:
    return lambda mode, *args, **kwargs: method(mode, *args, feature=dims, **kwargs)


def _native(method: Callable[..., Tensor], dims: int) -> Callable[..., Tensor]:
    # torch.dropout(input, p, train) and friends take ``train`` positionally.
    return lambda mode, input, p, train: method(mode, input, p, train, feature=dims)


def _aten_rrelu(inplace: bool) -> Callable[..., Tensor]:
    # torch.rrelu(input, lower, upper, training, generator) and torch.rrelu_ take no ``inplace``.
    return lambda mode, input, lower=1.0 / 8, upper=1.0 / 3, training=False, generator=None: mode.rrelu(
        input, lower, upper, training, inplace, generator)


_HANDLERS: dict[Any, Callable[..., Tensor]] = {
    F.dropout: StageRandom.dropout,
    F.dropout1d: _feature(StageRandom.dropout, 1),
    F.dropout2d: _feature(StageRandom.dropout, 2),
    F.dropout3d: _feature(StageRandom.dropout, 3),
    F.alpha_dropout: StageRandom.alpha_dropout,
    F.feature_alpha_dropout: _feature(StageRandom.alpha_dropout, 2),
    torch.dropout: _native(StageRandom.dropout, 0),
    torch.alpha_dropout: _native(StageRandom.alpha_dropout, 0),
    F.scaled_dot_product_attention: StageRandom.attention,
    F.rrelu: StageRandom.rrelu,
    torch.rrelu: _aten_rrelu(False),
    torch.rrelu_: _aten_rrelu(True),
}

#: Every function that :class:`StageRandom` does something about: anything else goes straight through.
_ROUTED = frozenset((*_GENERATOR_FUNCTIONS, *_HANDLERS, *_COMPOSITES))
