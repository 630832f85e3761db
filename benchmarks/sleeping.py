"""Compute without the cores: an autograd function that sleeps, for benchmarks whose ideal timeline is known."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch


def _overshoot(samples: int = 21, seconds: float = 0.002) -> float:
    """How far past its time a sleep returns on this machine (the median of a few short ones): about 0.1 ms on
    a VM, 2% of a 5 ms layer's time, which a benchmark held to its theory would count against the engine."""
    late = []
    for _ in range(samples):
        start = time.perf_counter()
        time.sleep(seconds)
        late.append(time.perf_counter() - start - seconds)
    return max(0.0, statistics.median(late))


#: Seconds a sleep overshoots here, measured once per process as it imports this module.
OVERSHOOT = _overshoot()


def sleep(seconds: float) -> None:
    """Sleep ``seconds`` on average: the request shortened by :data:`OVERSHOOT`, and no call at all for 0 (a
    ``time.sleep(0)`` is a system call of about 0.05 ms here)."""
    if seconds > 0:
        time.sleep(max(0.0, seconds - OVERSHOOT))


class SleepingIdentity(torch.autograd.Function):
    """The identity on ``x`` (a copy) that sleeps ``t_fwd`` seconds in forward and ``t_bwd`` in backward
    (:func:`sleep`: on average, as long as asked)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, t_fwd: float, t_bwd: float) -> torch.Tensor:
        ctx.t_bwd = t_bwd
        sleep(t_fwd)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        sleep(ctx.t_bwd)
        return grad, None, None
