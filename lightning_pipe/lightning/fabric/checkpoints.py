"""``fabric.save`` and ``fabric.load`` of a pipelined module: one file of the plain model's state, stage by stage,
or a sharded directory each process writes its part of.

The state a Fabric loop saves is a dict of its own (``{"model": model, "optimizer": optimizer, "step": 3}``). Each
module in it becomes the plain module's ``state_dict`` (the remote stages' tensors as placeholders, fetched from
their processes as the file is written, :mod:`lightning_pipe.lightning.streamed`), each optimizer the plain
model's optimizer's state; the rest as it is. Loading hands each module's entries to their stages and each
optimizer's state to its stages' parts, so the file loads as well into the plain model with no strategy.

Under ``state_dict_type="sharded"`` the state is written as the Trainer's sharded checkpoints are (the module's
entries by the plain model's names, every process writing its own; :mod:`lightning_pipe.lightning.sharded`), the
keys of the loop's state recorded in the directory's Lightning entry (``FABRIC``): another balance or replica
count loads it, and so does a loop given a directory the Trainer wrote (its model and optimizers, in order).
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

from lightning_pipe.lightning import sharded
from lightning_pipe.lightning.body import PipelinedSequential
from lightning_pipe.lightning.checkpoints import (
    StagePlaceholders,
    module_state_dict,
    optimizer_placeholders,
    save_atomically,
)
from lightning_pipe.lightning.optimizers import StageOptimizers
from lightning_pipe.lightning.streamed import save_streamed
from lightning_pipe.transport import placing
from lightning_pipe.transport.parallel import fsdp
from lightning_pipe.transport.stages import optim

__all__ = ["load", "save"]


def _unwrapped(obj: Any) -> Any:
    return obj.module if isinstance(obj, DistributedDataParallel) else obj


def _module_state(table: StagePlaceholders | None, body: PipelinedSequential, root: nn.Module, module: nn.Module
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
    table = StagePlaceholders(body.hosts) if write else None
    values: dict[str, Any] = {}
    for key, obj in state.items():
        obj = _unwrapped(obj)
        if obj is root or obj is body or obj is _unwrapped(model):
            value: Any = _module_state(table, body, root, obj)
        elif isinstance(obj, torch.optim.Optimizer) and hasattr(obj, "_lp_index"):
            own = optim.whole(optim.held_state(obj))  # (shards gathered whole: a collective of their replicas)
            value = optimizer_placeholders(table, obj, own) if table is not None else own
        elif hasattr(obj, "state_dict") and callable(obj.state_dict):
            value = obj.state_dict()
        else:
            value = obj
        values[key] = value
    if table is None:
        return
    streamed = type(checkpoint_io) is TorchCheckpointIO and "://" not in path and storage_options is None
    if not streamed:  # a CheckpointIO of the user's (or a remote path) takes the whole checkpoint in hand: filled
        table.fill()  # before the filter copies the entries it keeps (else it would keep the placeholders)
    converted: dict[str, Any] = {}
    for key, value in values.items():
        _apply_filter(key, dict(filter), value, converted)
    if streamed:  # (the placeholders the filter kept are fetched as they are written)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        save_atomically(lambda p: save_streamed(converted, p, table.lazy, table.fetch), path)
    else:
        save_atomically(lambda p: checkpoint_io.save_checkpoint(converted, p, storage_options), path, checkpoint_io)


def fabric_load(checkpoint: dict[str, Any], state: dict[str, Any], strict: bool, optimizers: StageOptimizers
                ) -> dict[str, Any]:
    """Restore ``state``'s objects from ``checkpoint`` (a file :func:`fabric_save` wrote, or the plain model's):
    modules through their stages, mirrored optimizers through :meth:`StageOptimizers.load`. Returns what was not
    restored, as Fabric's ``load_checkpoint``."""
    _validate_keys_for_strict_loading(state.keys(), checkpoint.keys(), strict=strict)
    return _restore(state, checkpoint, strict, optimizers)


def _restore(state: dict[str, Any], checkpoint: dict[str, Any], strict: bool,
             optimizers: StageOptimizers | None = None) -> dict[str, Any]:
    """Each object of ``state`` whose key ``checkpoint`` holds, restored from it (taken out of ``checkpoint``):
    modules by ``load_state_dict(strict=strict)``, mirrored optimizers through ``optimizers`` (None: they were
    restored already), anything else with a ``load_state_dict`` by it, plain values replaced. Returns the rest."""
    for key, obj in list(state.items()):
        if key not in checkpoint:
            continue
        target = _unwrapped(obj)
        if isinstance(target, nn.Module):
            target.load_state_dict(checkpoint.pop(key), strict=strict)
        elif optimizers is not None and isinstance(target, torch.optim.Optimizer) and hasattr(target, "_lp_index"):
            optimizers.load(target, checkpoint.pop(key))
        elif hasattr(target, "load_state_dict") and callable(target.load_state_dict):
            target.load_state_dict(checkpoint.pop(key))
        else:
            state[key] = checkpoint.pop(key)
    return checkpoint


_RESERVED = ("state_dict", "optimizer_states", "lightning_pipe", sharded.FABRIC)


def _split(state: Mapping[str, Any], body: PipelinedSequential, root: nn.Module, model: nn.Module, count: int
           ) -> tuple[str, str, dict[str, torch.optim.Optimizer], dict[str, Any]]:
    """The key holding the module set up, the prefix of its names that the module saved lacks (the body alone),
    the mirrored optimizers by key (in the order they were set up) and the rest of ``state``; refuses a state a
    sharded directory cannot hold, saying what to do."""
    module_key, prefix, optimizers, rest = None, "", {}, {}
    for key, obj in state.items():
        obj = _unwrapped(obj)
        if key in _RESERVED:
            raise ValueError(f"fabric.save's state has the key {key!r}, which a sharded checkpoint uses for itself: "
                             f"rename it (reserved: {', '.join(_RESERVED)})")
        if obj is root or obj is _unwrapped(model) or obj is body:
            if module_key is not None:
                raise ValueError(f"fabric.save's state holds the pipelined module twice ({module_key!r}, {key!r}): "
                                 "a sharded checkpoint holds it once")
            module_key, prefix = key, "" if obj is root else f"{body.name}."
        elif isinstance(obj, torch.optim.Optimizer) and hasattr(obj, "_lp_index"):
            optimizers[key] = obj
        else:
            rest[key] = obj.state_dict() if hasattr(obj, "state_dict") and callable(obj.state_dict) else obj
    if module_key is None:
        raise ValueError("a sharded fabric.save needs the module fabric.setup returned in its state (as "
                         "{'model': model, ...}): its stages write their entries by its names")
    order = sorted(optimizers, key=lambda k: optimizers[k]._lp_index)  # type: ignore[attr-defined]
    if [optimizers[k]._lp_index for k in order] != list(range(count)):  # type: ignore[attr-defined]
        raise ValueError(f"a sharded fabric.save holds every optimizer fabric.setup returned ({count}); the state "
                         f"holds {len(optimizers)} ({', '.join(map(repr, order)) or 'none'}): put them all in it")
    return module_key, prefix, {k: optimizers[k] for k in order}, rest


def fabric_save_sharded(path: str, state: Mapping[str, Any], body: PipelinedSequential, root: nn.Module,
                        model: nn.Module, count: int, together: bool, main: bool, broadcast: Any) -> None:
    """Write ``state`` as a sharded directory at ``path`` (see the module's docstring): called by the main process
    and, where the stages are sharded over the replicas (``together``), by every driver at once."""
    module_key, prefix, optimizers, rest = _split(state, body, root, model, count)
    checkpoint = {**rest, "state_dict": module_state_dict(root, body, False),  # type: ignore[arg-type]
                  "optimizer_states": [optim.held_state(o) for o in optimizers.values()],
                  sharded.FABRIC: {"module": module_key, "prefix": prefix, "optimizers": list(optimizers)}}
    sharded.save_directory(checkpoint, path, body.hosts, list(optimizers.values()), together, main, broadcast)


def fabric_load_sharded(path: str, state: dict[str, Any], strict: bool, body: PipelinedSequential, root: nn.Module,
                        model: nn.Module, module_name: str, weights_only: bool | None = None) -> dict[str, Any]:
    """Restore ``state``'s objects from the sharded directory at ``path`` (one :func:`fabric_save_sharded` wrote, or
    the Trainer): each process reads its own entries. Returns what was not restored, as Fabric's
    ``load_checkpoint``."""
    meta = sharded.read_meta(path, weights_only)
    info = meta.pop("lightning_pipe")
    saved_states = meta.pop("optimizer_states", [])
    keys = meta.pop(sharded.FABRIC, None)
    meta.pop("state_dict", None)
    module_key = next((k for k, o in state.items() if _unwrapped(o) in (root, _unwrapped(model), body)), None)
    mine = {k: _unwrapped(o) for k, o in state.items()
            if isinstance(_unwrapped(o), torch.optim.Optimizer) and hasattr(_unwrapped(o), "_lp_index")}
    if keys is None:  # the Trainer's directory: its model, and its optimizers by the order they were set up in
        by_index = {o._lp_index: k for k, o in mine.items()}  # type: ignore[attr-defined]
        keys = {"module": module_key, "optimizers": [by_index.get(i) for i in range(len(saved_states))]}
    saved = {keys["module"]: None, **{k: None for k in keys["optimizers"] if k is not None}}
    _validate_keys_for_strict_loading(state.keys(), {**meta, **saved}.keys(), strict=strict)
    remote = body if body.hosts is not None else None
    if module_key is not None and module_key == keys["module"]:
        held = module_state_dict(root, body, False)  # type: ignore[arg-type]
        sharded.load_module(info, root, held, remote, module_name, strict)
    for k, key in enumerate(keys["optimizers"]):
        optimizer = mine.get(key) if key is not None else None
        if optimizer is None:
            continue
        if optimizer._lp_index != k:  # type: ignore[attr-defined]
            raise ValueError(f"the sharded checkpoint {path} holds {key!r} as optimizer {k} (in the order set up), "
                             f"and this program set it up as optimizer {optimizer._lp_index}: set up the optimizers "
                             "in the same order")
        sharded.load_optimizer(info, k, optimizer, saved_states[k], remote)
    return _restore(state, meta, strict)


def save(strategy: Any, path: str, state: Mapping[str, Any], storage_options: Any,
         filter: Mapping[str, Callable[[str, Any], bool]] | None) -> None:
    """Fabric's ``save_checkpoint`` for ``strategy`` (Fabric's ``PipeStrategy``, its module set up), called on every
    process: one file by the main process (:func:`fabric_save`), or a sharded directory
    (:func:`fabric_save_sharded`)."""
    body = strategy._body
    together = body.sharded  # every replica holds shards of every stage: each takes part
    if strategy.state_dict_type == "sharded" and filter:
        raise ValueError("fabric.save(filter=...) writes one file (state_dict_type='full'); a sharded directory "
                         "holds every entry: drop the filter, or save with state_dict_type='full'")
    if together:
        body.pipeline.runner.averages.before_update()  # stage 0's parameters the shards again
    main = strategy.is_global_zero
    if strategy.state_dict_type == "sharded":
        _split(state, body, strategy._module, strategy.model, strategy._stage_optimizers.count)  # every process
        if main or together:
            fabric_save_sharded(path, state, body, strategy._module, strategy.model, strategy._stage_optimizers.count,
                                together, main, strategy.broadcast)
        return
    for future in body.hosts.start("gather_whole", timeout=0) if together else ():
        future.result()
    try:
        if main or together:
            fabric_save(path, state, body, strategy._module, strategy.model, filter or {}, strategy.checkpoint_io,
                        storage_options, write=main)
    finally:
        if together:
            body.hosts.call("release_whole")


def load(strategy: Any, path: str, state: dict[str, Any], strict: bool, weights_only: bool | None) -> dict[str, Any]:
    """Fabric's ``load_checkpoint`` for ``strategy`` (its module set up): a file (:func:`fabric_load`) or a sharded
    directory (:func:`fabric_load_sharded`), whichever ``path`` is."""
    body = strategy._body
    if body.sharded:  # whole copies of stage 0's shards (a forward's) dropped: the shards are loaded
        body.pipeline.runner.averages.before_update()
    placing.recover(path)  # a save that died replacing it: the one it replaced
    if sharded.is_sharded(path):
        return fabric_load_sharded(path, state, strict, body, strategy._module, strategy.model, strategy.module_name,
                                   weights_only)
    checkpoint = strategy.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
    return fabric_load(checkpoint, state, strict, strategy._stage_optimizers)
