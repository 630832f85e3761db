"""``fabric.save`` and ``fabric.load`` of a pipelined module: one file of the plain model's state, stage by stage.

The state a Fabric loop saves is a dict of its own (``{"model": model, "optimizer": optimizer, "step": 3}``). Each
module in it becomes the plain module's ``state_dict`` (the remote stages' tensors as placeholders, fetched from
their processes as the file is written, :mod:`lightning_pipe.lightning.streamed`), each optimizer the plain
model's optimizer's state; the rest as it is. Loading hands each module's entries to their stages and each
optimizer's state to its stages' parts, so the file loads as well into the plain model with no strategy.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning_fabric.strategies.strategy import _apply_filter, _validate_keys_for_strict_loading
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from lightning_pipe.lightning.body import PipelinedSequential
from lightning_pipe.lightning.checkpoints import (
    _Placeholders,
    module_state_dict,
    optimizer_placeholders,
    save_atomically,
)
from lightning_pipe.lightning.optimizers import StageOptimizers
from lightning_pipe.lightning.streamed import save_streamed
from lightning_pipe.transport.parallel import fsdp
from lightning_pipe.transport.stages import optim

__all__: list[str] = []


def _unwrapped(obj: Any) -> Any:
    return obj.module if isinstance(obj, DistributedDataParallel) else obj


def _module_state(table: _Placeholders | None, body: PipelinedSequential, root: nn.Module, module: nn.Module
                  ) -> dict[str, Any]:
    """``module``'s ``state_dict`` (the root module, or the body alone), this process's shards gathered whole (a
    collective of their replicas), remote stages' tensors as placeholders registered in ``table`` under the root's
    names (None: not registered, a replica that does not write)."""
    state = module_state_dict(root, body, False)  # type: ignore[arg-type]
    prefix = "" if module is root else f"{body.name}."
    own: dict[str, Any] = {}
    for name, t in state.items():
        if not name.startswith(prefix):
            continue
        key = name[len(prefix):]
        own[key] = fsdp.full(t) if isinstance(t, Tensor) else t
        if table is not None and isinstance(t, Tensor) and t.is_meta:
            table.add(t, body.stage_of(name), ("state", name), own, key)
    return own


def fabric_save(path: str, state: Mapping[str, Any], body: PipelinedSequential, root: nn.Module, model: nn.Module,
                filter: Mapping[str, Callable[[str, Any], bool]], checkpoint_io: Any, storage_options: Any,
                write: bool = True) -> None:
    """Write ``state`` (Fabric's, its objects unwrapped) to ``path``: see the module's docstring. Where the stages
    are sharded over the replicas, every replica's driver calls this at once (the shards it holds gathered whole:
    collectives), each remote stage's shards gathered whole by its replica 0's process first; the main process
    alone ``write``s."""
    table = _Placeholders(body.hosts) if write else None
    converted: dict[str, Any] = {}
    for key, obj in state.items():
        obj = _unwrapped(obj)
        if obj is root or obj is body or obj is _unwrapped(model):
            value: Any = _module_state(table, body, root, obj)
        elif isinstance(obj, torch.optim.Optimizer) and hasattr(obj, "_lp_index"):
            own = optim.whole(obj.state_dict())  # (shards gathered whole: a collective of their replicas)
            value = optimizer_placeholders(table, obj, own) if table is not None else own
        elif hasattr(obj, "state_dict") and callable(obj.state_dict):
            value = obj.state_dict()
        else:
            value = obj
        _apply_filter(key, dict(filter), value, converted)
    if table is None:
        return
    if type(checkpoint_io) is TorchCheckpointIO and "://" not in path and storage_options is None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        save_atomically(lambda p: save_streamed(converted, p, table.lazy, table.fetch), path)
    else:  # a CheckpointIO of the user's (or a remote path) takes the whole checkpoint in hand
        table.fill()
        save_atomically(lambda p: checkpoint_io.save_checkpoint(converted, p, storage_options), path)


def fabric_load(checkpoint: dict[str, Any], state: dict[str, Any], strict: bool, optimizers: StageOptimizers,
                root: nn.Module, model: nn.Module) -> dict[str, Any]:
    """Restore ``state``'s objects from ``checkpoint`` (a file :func:`fabric_save` wrote, or the plain model's):
    modules through their stages, mirrored optimizers through :meth:`StageOptimizers.load`. Returns what was not
    restored, as Fabric's ``load_checkpoint``."""
    _validate_keys_for_strict_loading(state.keys(), checkpoint.keys(), strict=strict)
    for key, obj in list(state.items()):
        if key not in checkpoint:
            continue
        target = _unwrapped(obj)
        if isinstance(target, nn.Module):
            target.load_state_dict(checkpoint.pop(key), strict=strict)
        elif isinstance(target, torch.optim.Optimizer) and hasattr(target, "_lp_index"):
            optimizers.load(target, checkpoint.pop(key))
        elif hasattr(target, "load_state_dict") and callable(target.load_state_dict):
            target.load_state_dict(checkpoint.pop(key))
        else:
            state[key] = checkpoint.pop(key)
    return checkpoint
