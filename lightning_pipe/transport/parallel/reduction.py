"""What every way of averaging one stage over its replicas has: a reduction thread, waiting for it, and the
hooks a step calls (DDP's :class:`~lightning_pipe.transport.parallel.ddp.ReplicatedStage`, FSDP2's
:class:`~lightning_pipe.transport.parallel.fsdp.ShardedStage`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

from torch import Tensor

from lightning_pipe.engine.stage import Finisher, Stage
from lightning_pipe.engine.worker import Worker

__all__: list[str] = []


class Reduction:
    """What every way of averaging one stage over its replicas has: a thread of its own for the reductions, and
    waiting for them. Its subclasses say what a step does (:class:`ReplicatedStage`, and
    :class:`~lightning_pipe.transport.parallel.fsdp.ShardedStage`)."""

    #: Reduced in every step that has a backward, also while the caller accumulates (its ``no_sync``).
    always = False
    #: Parameters' ``.grad`` may be views into buffers that the next reduction overwrites.
    grad_views = False

    def __init__(self, stage: Stage) -> None:
        self.stage = stage
        self.static = False  # the reducer counts the step's backwards itself (DDP's static_graph)
        self.worker = Worker(f"lightning_pipe.stage{stage.index}.reduce")
        self.pending: Future[Any] | None = None  # the reduction (and what follows it) still running
        self.local = False  # gradients accumulated here since the last reduction (no_sync, or one replica's own)

    # ------------------------------------------------------------------ waiting for it
    def settle(self) -> None:
        """Wait until this stage's reduction (and what was queued after it) is over; raise its error, once."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    def then(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once the pending reduction is over (at once if none is)."""
        if self.pending is None:
            fn()
        else:
            self.pending = self.worker.submit(fn)

    # ------------------------------------------------------------------ a step (see ReplicatedStage)
    def sync_buffers(self, grad: bool, reduce: bool) -> None:
        """The stage's first forward of a step."""

    def prepare_step(self) -> None:
        """The stage's first backward of a step that reduces."""

    def last(self, run: int) -> Finisher | None:
        """What runs the stage's last backward of reducing step ``run`` (None: reduce once it is over)."""
        return None

    def reduce_now(self, extra: Mapping[Tensor, Tensor] | None = None, run: int = -1) -> None:
        """Average the gradients the stage holds now (after adding ``extra[p]`` into each ``p.grad``)."""
        raise NotImplementedError

    def before_update(self) -> None:
        """The optimizer is about to update the stage's parameters (its reduction is over)."""
        self.settle()

    def close(self) -> None:
        """Stop averaging this stage."""
        try:
            self.settle()
        finally:
            self.worker.stop()
