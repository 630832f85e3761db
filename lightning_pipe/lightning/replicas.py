"""Replicas of the pipeline: every stage's gradients averaged over the same stage of every replica, as DDP does.

Each backward through Lightning ends with the average, before ``on_after_backward`` (hooks, clipping and steps,
manual ones included, see averaged gradients, as under DDP). While Lightning accumulates gradients it blocks the
sync (``no_sync``): those backwards keep their gradients per replica, and the first backward outside averages
everything accumulated. The drivers average in their default group (the drivers of every replica); each
remote stage in its own (that stage of every replica), at the same time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

from lightning_pipe.lightning.optimizers import raw
from lightning_pipe.transport.dataparallel import average_gradients
from lightning_pipe.transport.host import HostGroup

__all__: list[str] = []


class Replicas:
    """Averages the gradients of one pipeline's stages with the other replicas' (``count`` replicas)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.hosts: HostGroup | None = None
        self.blocked = 0  # inside block_backward_sync: gradients stay per replica (accumulation)
        self.unaveraged = False  # a backward ran since the gradients were last averaged
        self.in_backward = 0  # inside Lightning's backward (pre_backward to post_backward)

    def check_backward_path(self) -> None:
        """The pipeline's backward starts: refuse one outside Lightning's backward when there are replicas (a
        bare ``loss.backward()`` in manual optimization), whose gradients nothing would average."""
        if not self.in_backward and self.count > 1:
            raise RuntimeError(
                "the pipeline's backward ran outside Lightning's backward (loss.backward() instead of "
                f"self.manual_backward(loss)?): with {self.count} replicas its gradients would not be averaged "
                "over them, and the replicas would drift apart. Call self.manual_backward(loss)")

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside keep their gradients per replica."""
        self.blocked += 1
        try:
            yield
        finally:
            self.blocked -= 1

    def after_backward(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Average every optimizer's gradients, unless sync is blocked. Averaging again after a further
        backward averages only the new part: the mean of equal values is that value."""
        self.unaveraged = True
        if self.blocked:
            return
        for optimizer in optimizers:
            self.average(raw(optimizer))
        self.unaveraged = False

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Before clipping and the step: average what backwards that ran with sync blocked accumulated (the
        closure's own backward averaged everything, unless it was skipped)."""
        if self.unaveraged:
            self.average(optimizer)
            self.unaveraged = False

    def average(self, optimizer: torch.optim.Optimizer) -> None:
        """Average ``optimizer``'s gradients on every stage of this pipeline with the other replicas'."""
        if self.count == 1 or self.hosts is None:
            return
        # No RPC timeout: each stage waits in a collective for the same stage of the other replicas, which
        # may be a slow callback away; the process group's timeout bounds that wait.
        futures = self.hosts.start("average_gradients", getattr(optimizer, "_lp_index", 0), timeout=0)
        average_gradients([p for g in optimizer.param_groups for p in g["params"] if not p.is_meta])
        for future in futures:
            future.result()
