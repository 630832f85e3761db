"""The precision plugin across stages: clipping and loss-scale unscaling see every stage's gradients.

Mixed into whatever precision plugin the Trainer has (``32-true``, ``16-mixed``, ``bf16-mixed``, ...), so its
own behaviour stays; gradient clipping by norm uses the global norm over every stage (as ``clip_grad_norm_``
over the whole model would), clipping by value clamps every stage, and with a gradient scaler the remote
stages unscale too: an overflow on any stage skips the step everywhere and lowers the scale.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor

from lightning_pipe.lightning.placeholders import is_placeholder
from lightning_pipe.transport.parallel import fsdp

__all__: list[str] = []


class PipePrecision:
    """Mixin for the Trainer's precision plugin (see :func:`~lightning_pipe.lightning.optimizers.mix_in`)."""

    def _after_closure(self, model: Any, optimizer: Any) -> None:
        # Called after backward and the driver's unscaling, before clipping and scaler.step: remote stages
        # unscale too, and an overflow on any stage must skip the step everywhere and lower the scale.
        unscale_remote(getattr(self, "scaler", None), optimizer)
        super()._after_closure(model, optimizer)  # type: ignore[misc]

    def _lp_unscale_shards(self) -> None:
        """Let the gradient scaler unscale gradients that are shards (``DTensor``s: stage 0 sharded over the
        replicas), which torch's unscaling kernel refuses: it unscales each shard in place, and an overflow on any
        shard counts on every replica (all of them skip the step together)."""
        scaler = getattr(self, "scaler", None)
        if scaler is None or getattr(scaler, "_lp_shards", False):
            return
        original = scaler._unscale_grads_

        def unscale(optimizer: Any, inv_scale: Any, found_inf: Any, allow_fp16: bool) -> Any:
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            shards = [g for g in grads if fsdp.is_dtensor(g)]
            if not shards:
                return original(optimizer, inv_scale, found_inf, allow_fp16)
            view = SimpleNamespace(param_groups=[{"params": [_holding(fsdp.local(g)) for g in grads]}])
            per_device = original(view, inv_scale, found_inf, allow_fp16)
            for flag in per_device.values():
                flag.copy_(torch.tensor(float(fsdp.any_true(bool(flag.item()), shards))))
            return per_device

        scaler._unscale_grads_ = unscale
        scaler._lp_shards = True

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        if getattr(optimizer, "_lp_hosts", None) is None:
            return super().clip_grad_by_norm(optimizer, clip_val)  # type: ignore[misc]
        clip_by_global_norm(optimizer, clip_val)
        return None

    def clip_grad_by_value(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        if getattr(optimizer, "_lp_hosts", None) is None:
            return super().clip_grad_by_value(optimizer, clip_val)  # type: ignore[misc]
        clip_by_value(optimizer, clip_val)
        return None


def unscale_remote(scaler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Once the driver's part of ``optimizer`` (a mirrored one) is unscaled by ``scaler`` (a gradient scaler, or
    None), the remote stages unscale theirs, and an overflow on any of them counts as the driver's: the scaler then
    skips the step everywhere and lowers its scale."""
    hosts = getattr(optimizer, "_lp_hosts", None)
    if scaler is None or hosts is None or not scaler.is_enabled():
        return
    found = scaler._per_optimizer_states[id(optimizer)].get("found_inf_per_device")
    if found is not None:  # the driver unscaled (this was not a skipped backward)
        overflow = [future.result() for future in hosts.start(  # on the plane: a round trip of shared memory
            "unscale_grads", optimizer._lp_index, 1.0 / float(scaler.get_scale()), plane=True)]
        if any(overflow):
            device = next(iter(found), torch.device("cpu"))
            found[device] = found.get(device, torch.zeros((), device=device)) + 1.0


def clip_by_global_norm(optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> Tensor:
    """Clip the gradients of every stage's part of ``optimizer`` (a mirrored one) by their ``norm_type`` norm taken
    together, as ``torch.nn.utils.clip_grad_norm_`` over the whole model does; return that norm."""
    hosts = optimizer._lp_hosts  # type: ignore[attr-defined]
    sum_tied(optimizer)  # (manual optimization clips before its step)
    grads = _grads(optimizer)
    norm_type = float(norm_type)
    remote = hosts.start("grad_norm", optimizer._lp_index, norm_type, plane=True)  # type: ignore[attr-defined]
    norms = [fsdp.total_norm(grads, norm_type)] + [future.result() for future in remote]
    if math.isinf(norm_type):
        total = max(norms)
    elif norm_type == 2.0:
        total = math.sqrt(sum(n * n for n in norms))
    else:
        total = sum(n ** norm_type for n in norms) ** (1.0 / norm_type)
    if error_if_nonfinite and not math.isfinite(total):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from every stage is non-finite "
                           f"({total}), so it cannot be clipped; pass error_if_nonfinite=False to clip anyway")
    coefficient = max_norm / (total + 1e-6)  # as torch.nn.utils.clip_grad_norm_
    if coefficient < 1.0:
        for g in grads:
            fsdp.local(g).detach().mul_(coefficient)
        # Nothing reads the stages' gradients before the optimizer's step reaches them: it goes with that.
        hosts.call_later("scale_grads", optimizer._lp_index, coefficient)  # type: ignore[attr-defined]
    # In the parameters' dtype, as clip_grad_norm_ returns it (float64 under "64-true", where the default is float32
    # outside the forward); placeholders of the other stages' parameters have theirs.
    dtypes = [p.dtype for g in optimizer.param_groups for p in g["params"] if p.is_floating_point()]
    return torch.tensor(total, dtype=functools.reduce(torch.promote_types, dtypes) if dtypes else None)


def clip_by_value(optimizer: torch.optim.Optimizer, clip_val: float) -> None:
    """Clamp the gradients of every stage's part of ``optimizer`` (a mirrored one) to ``[-clip_val, clip_val]``, as
    ``torch.nn.utils.clip_grad_value_`` over the whole model does."""
    sum_tied(optimizer)
    for g in _grads(optimizer):
        fsdp.local(g).detach().clamp_(-clip_val, clip_val)
    optimizer._lp_hosts.call_later("clamp_grads", optimizer._lp_index, float(clip_val))  # type: ignore[attr-defined]


def _grads(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The gradients of this process's part of ``optimizer`` (placeholders have none), partial sums summed
    (:func:`~lightning_pipe.transport.parallel.fsdp.settle`)."""
    return fsdp.settle(p for g in optimizer.param_groups for p in g["params"] if not is_placeholder(p))


def _holding(grad: Tensor) -> Tensor:
    """A tensor of ``grad``'s shape holding no memory, whose ``.grad`` is ``grad`` (what a gradient scaler walks)."""
    holder = torch.empty((), dtype=grad.dtype, device=grad.device).expand(grad.shape)
    holder.grad = grad
    return holder


def sum_tied(optimizer: torch.optim.Optimizer) -> None:
    """The gradients of parameters tied across processes summed over their copies, if not yet this step."""
    tied = getattr(optimizer, "_lp_tied", None)
    if tied is not None:
        tied()


def loss_gradient(module: pl.LightningModule, plugin: Any) -> float:
    """The gradient Lightning's backward will bring to a loss computed in ``training_step``: divided by the number
    of accumulated batches in automatic optimization, times the gradient scaler's scale (16-mixed). A schedule
    that runs its backwards ahead of Lightning's runs them with it (:mod:`lightning_pipe.engine.aside`)."""
    scale = 1.0
    if module.automatic_optimization and module._trainer is not None:
        scale /= module.trainer.accumulate_grad_batches
    scaler = getattr(plugin, "scaler", None)
    if scaler is not None and scaler.is_enabled():
        scale *= float(scaler.get_scale())
    return scale


def output_casts(precision: Any) -> dict[torch.dtype, torch.dtype]:
    """What ``precision.convert_output`` (a Fabric precision plugin's) makes of each floating-point dtype, where it
    changes it."""
    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    made = {dtype: precision.convert_output(torch.zeros((), dtype=dtype)).dtype for dtype in dtypes}
    return {dtype: to for dtype, to in made.items() if to != dtype}
