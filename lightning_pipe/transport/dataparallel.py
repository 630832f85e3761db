"""Averaging gradients across pipeline replicas: one collective per dtype, as one device would see them."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

__all__: list[str] = []


def average_gradients(parameters: Iterable[Tensor], group: dist.ProcessGroup | None = None) -> None:
    """Average the ``.grad`` of ``parameters`` over the processes of ``group`` (default: the default group).

    Every process must pass the same parameters in the same order. A parameter that got no gradient on
    some replicas counts as zero there; one that got none anywhere keeps ``grad = None``, exactly like
    the parameter of a single model that no sample used (optimizers then skip it).
    """
    params = [p for p in parameters if p.requires_grad]
    world = dist.get_world_size(group)
    if world == 1 or not params:
        return
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.float32,
                       device=params[0].device)
    dist.all_reduce(has, group=group)
    used = [p for p, h in zip(params, has.tolist()) if h > 0]
    for p in used:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_dtype: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for p in used:
        by_dtype.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)  # type: ignore[union-attr]
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        flat.div_(world)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
