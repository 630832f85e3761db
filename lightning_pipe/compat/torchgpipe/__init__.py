"""torchgpipe's public names on this engine: ``from lightning_pipe.compat import torchgpipe``.

A program written for torchgpipe (or for fairscale's ``fairscale.nn.Pipe``, a copy of it) runs after
changing its imports alone::

    from lightning_pipe.compat import torchgpipe               # was: import torchgpipe
    from lightning_pipe.compat.torchgpipe import GPipe         # was: from torchgpipe import GPipe
    from lightning_pipe.compat.torchgpipe.skip import skippable, stash, pop
    from lightning_pipe.compat.torchgpipe.balance import balance_by_time

``GPipe`` is :class:`lightning_pipe.Pipe`: the same arguments, attributes (``balance``, ``devices``, ``chunks``,
``checkpoint``, ``partitions``) and container behaviour (``len``, indexing, iteration). Where it differs from
torchgpipe on purpose (an empty ``nn.Sequential`` and non-integer ``chunks`` are refused, each CPU partition
runs on a thread of its own, dropout draws from per-stage generators, in-place layers are made safe) is
listed in docs/migration.md.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lightning_pipe.compat.torchgpipe import balance, skip
from lightning_pipe.engine.checkpoint import is_checkpointing, is_recomputing
from lightning_pipe.engine.partition import Device
from lightning_pipe.engine.pipe import Pipe

__all__ = ["GPipe", "is_checkpointing", "is_recomputing", "balance", "skip"]


class GPipe(Pipe):
    """torchgpipe's ``GPipe(module, balance, *, devices=None, chunks=1, checkpoint='except_last',
    deferred_batch_norm=False)``: :class:`lightning_pipe.Pipe` under its torchgpipe name.

    ``devices=None`` takes every CUDA device in order, as torchgpipe did; on a machine without CUDA (where
    torchgpipe found no device at all) it places every partition on the CPU, each on a worker thread of its
    own. ``devices[-1]`` is where the output is, to move the target there for the loss.
    """

    def __init__(self, module: nn.Sequential, balance: Sequence[int] | None = None, *,
                 devices: Sequence[Device] | None = None, chunks: int = 1, checkpoint: str = "except_last",
                 deferred_batch_norm: bool = False) -> None:
        super().__init__(module, balance, devices=devices, chunks=chunks, checkpoint=checkpoint,
                         deferred_batch_norm=deferred_batch_norm)
