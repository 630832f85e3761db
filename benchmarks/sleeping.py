"""Compute without the cores: an autograd function that sleeps, for benchmarks whose ideal timeline is known."""

from __future__ import annotations

import time
from typing import Any

import torch


class SleepingIdentity(torch.autograd.Function):
    """The identity on ``x`` (a copy) that sleeps ``t_fwd`` seconds in forward and ``t_bwd`` in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, t_fwd: float, t_bwd: float) -> torch.Tensor:
        ctx.t_bwd = t_bwd
        time.sleep(t_fwd)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        time.sleep(ctx.t_bwd)
        return grad, None, None
