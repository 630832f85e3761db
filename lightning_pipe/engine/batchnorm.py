"""Deferred BatchNorm: running statistics updated once per mini-batch, as if it had not been split."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_pipe.engine.checkpoint import is_recomputing
from lightning_pipe.engine.rng import no_random_layer

__all__ = ["DeferredBatchNorm"]


@no_random_layer
class DeferredBatchNorm(_BatchNorm):
    """BatchNorm that normalises each micro-batch by its own statistics but updates the running
    statistics once per mini-batch, with the statistics of all its micro-batches together.

    Without it, a mini-batch split into ``m`` micro-batches would move the running statistics ``m`` times
    with micro-batch statistics. The pipeline calls :meth:`commit` after the last micro-batch of a
    mini-batch; recomputation (checkpointing) does not count twice. State-dict keys are those of
    ``nn.BatchNorm*d``, so weights load back into the plain module.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(num_features, eps, momentum, affine, True, device, dtype)
        # The statistics accumulate in float32 at the least (a float64 layer's in float64, as its own batch_norm's).
        factory = {"device": device, "dtype": torch.promote_types(dtype or torch.get_default_dtype(), torch.float32)}
        self.register_buffer("_count", torch.zeros((), **factory), persistent=False)
        self.register_buffer("_mean", torch.zeros(num_features, **factory), persistent=False)
        self.register_buffer("_m2", torch.zeros(num_features, **factory), persistent=False)

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    @torch.no_grad()
    def _track(self, input: Tensor) -> None:
        # Chan et al.'s pairwise update of mean and sum of squared deviations: accurate in float32 (float64 input
        # kept in float64: under precision="64-true" the running statistics are one device's to float64's rounding).
        dims = [d for d in range(input.dim()) if d != 1]
        x = input.detach().to(torch.promote_types(input.dtype, self._mean.dtype))
        n_b = x.numel() / x.size(1)
        mean_b = x.mean(dims)
        m2_b = ((x - mean_b.view(1, -1, *([1] * (x.dim() - 2)))) ** 2).sum(dims)
        n_a = self._count.clone()
        n = n_a + n_b
        delta = mean_b - self._mean
        self._mean.add_(delta * (n_b / n))
        self._m2.add_(m2_b + delta * delta * (n_a * n_b / n))
        self._count.copy_(n)

    def forward(self, input: Tensor) -> Tensor:
        """Normalise; in training, also accumulate this micro-batch's statistics."""
        self._check_input_dim(input)
        if not self.training:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        if not is_recomputing():
            self._track(input)
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    @torch.no_grad()
    def commit(self) -> None:
        """Fold the accumulated statistics into the running ones (once per mini-batch)."""
        n = float(self._count)
        if n == 0:
            return
        assert self.running_mean is not None and self.running_var is not None
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        var = self._m2 / (n - 1) if n > 1 else self._m2
        self.running_mean.mul_(1 - factor).add_(self._mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(var.to(self.running_var.dtype), alpha=factor)
        self._count.zero_()
        self._mean.zero_()
        self._m2.zero_()

    @classmethod
    def convert(cls, module: nn.Module, memo: dict[int, nn.Module] | None = None) -> nn.Module:
        """Return ``module`` with every BatchNorm that tracks running statistics replaced by a deferred one.

        The new layers hold the very parameters and buffers of the replaced ones (the same tensor objects:
        ``requires_grad`` is kept and an optimizer built before converting still updates them);
        ``SyncBatchNorm`` and BatchNorm without running statistics are left as they are. A BatchNorm held at
        several places (``nn.Sequential(bn, conv, bn)``) becomes one deferred BatchNorm held at all of them
        (``memo``: each module converted so far, by ``id``), which updates its running statistics once per
        mini-batch from all its uses' statistics together.
        """
        memo = {} if memo is None else memo
        if id(module) in memo:
            return memo[id(module)]
        if isinstance(module, _BatchNorm) and not isinstance(module, (cls, nn.SyncBatchNorm)) \
                and module.track_running_stats:
            running_mean = module.running_mean
            assert running_mean is not None  # tracked running statistics
            # Statistics accumulate in the layer's dtype, float32 at the least (the constructor makes them so).
            deferred = cls(module.num_features, module.eps, module.momentum, module.affine,
                           device=running_mean.device, dtype=running_mean.dtype)
            for name in ("weight", "bias"):
                if getattr(module, name) is not None:
                    setattr(deferred, name, getattr(module, name))
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                setattr(deferred, name, getattr(module, name))
            deferred.train(module.training)
            memo[id(module)] = deferred
            return deferred
        memo[id(module)] = module
        # Every place: named_children() lists a module held twice once, and would leave its second place a plain
        # BatchNorm that moves the running statistics per micro-batch (and again in recomputation).
        for name, child in list(module._modules.items()):
            if child is None:
                continue
            converted = cls.convert(child, memo)
            if converted is not child:
                setattr(module, name, converted)
        return module
