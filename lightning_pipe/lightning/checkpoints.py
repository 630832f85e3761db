"""Checkpoints of a pipelined LightningModule: one file, in Lightning's format, that loads into the plain model.

The main process writes it: the body's ``state_dict`` fetches every remote stage's entries under the plain
model's names, and the optimizers' states are merged into the plain model's optimizer's
(:class:`~lightning_pipe.lightning.optimizers.StageOptimizers`). It is written atomically (a temporary file
beside the target, renamed over it): a crash mid-write leaves the previous checkpoint intact. Loading hands
each stage its own entries. :func:`gathered` puts the whole unpipelined body back in the LightningModule for
code that needs it in one piece (``rpc_save_model``, export).
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import pytorch_lightning as pl
from torch import nn

from lightning_pipe.lightning.body import PipelinedSequential

__all__: list[str] = []


def module_state_dict(module: pl.LightningModule, body: nn.Module, writes: bool) -> dict[str, Any]:
    """``module``'s ``state_dict``; with ``writes`` False (a process that does not write the checkpoint), the
    remote layers' entries are left as placeholders instead of being fetched from their stages."""
    if writes or not isinstance(body, PipelinedSequential):
        return module.state_dict()
    body.local_only = True
    try:
        return module.state_dict()
    finally:
        body.local_only = False


def save_atomically(save: Callable[[str], None], path: str) -> None:
    """Write a file by ``save(temporary)`` beside ``path``, then rename it over ``path`` (remote filesystems,
    which have no rename to rely on, are written directly)."""
    if "://" in path:
        save(path)
        return
    temporary = f"{path}.tmp{os.getpid()}"
    try:
        save(temporary)
        os.replace(temporary, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)


@contextlib.contextmanager
def gathered(module: pl.LightningModule, module_name: str) -> Iterator[pl.LightningModule]:
    """``module`` holding its whole unpipelined body: every remote stage's layers are fetched (rebuilt on CPU
    with their current weights and buffers, non-persistent ones included) and put back in place of the
    pipelined body, which is restored afterwards."""
    body = getattr(module, module_name)
    if not isinstance(body, PipelinedSequential) or body.hosts is None:
        yield module
        return
    remote: dict[str, nn.Module] = {}
    for part in body.hosts.call("layers"):
        remote.update(part)
    layers = [(name, layer if body.owner[name] == 0 else remote[name]) for name, layer in body.named_children()]
    setattr(module, module_name, nn.Sequential(OrderedDict(layers)))
    try:
        yield module
    finally:
        setattr(module, module_name, body)
