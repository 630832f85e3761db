"""Compute without the cores: an autograd function that sleeps, for benchmarks whose ideal timeline is known."""

from __future__ import annotations

import time
from typing import Any

import torch

#: The last stretch of a sleep spent watching the clock instead of asleep. A sleep of this VM returns 0.1-0.2 ms
#: past its time and onto a core back from idle, where the next microseconds of code run several times slower
#: (docs/benchmarks.md): a 5 ms layer took 5.3-5.5 ms. A device's kernel that the host waits for ends on time,
#: and CUDA's synchronize spins for it by default; so does this for its last 0.5 ms (10% of a 5 ms layer's core).
WATCHED = 0.0005


def sleep(seconds: float) -> None:
    """Return ``seconds`` after the call: asleep but for the last :data:`WATCHED` seconds, then watching the clock;
    no call at all for 0 (a ``time.sleep(0)`` is a system call of about 0.05 ms here)."""
    if seconds <= 0:
        return
    deadline = time.perf_counter() + seconds
    if seconds > WATCHED:
        time.sleep(seconds - WATCHED)
    while time.perf_counter() < deadline:
        pass


class SleepingIdentity(torch.autograd.Function):
    """The identity on ``x`` (a copy) that takes ``t_fwd`` seconds in forward and ``t_bwd`` in backward
    (:func:`sleep`: as long as asked)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, t_fwd: float, t_bwd: float) -> torch.Tensor:
        ctx.t_bwd = t_bwd
        sleep(t_fwd)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        sleep(ctx.t_bwd)
        return grad, None, None
