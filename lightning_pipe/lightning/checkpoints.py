"""What both loops' checkpoints share: the plain model's state with remote stages' tensors as placeholders filled
stage by stage, atomic saves, and the whole body gathered back into the module (:func:`gathered`)."""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn

from lightning_pipe.lightning.body import PipelinedSequential
from lightning_pipe.lightning.streamed import Source
from lightning_pipe.transport import placing
from lightning_pipe.transport.parallel import shards

__all__: list[str] = []


def module_state_dict(module: pl.LightningModule, body: nn.Module, writes: bool) -> dict[str, Any]:
    """``module``'s ``state_dict``; with ``writes`` False, the remote layers' entries are left as placeholders
    (meta tensors) instead of being fetched from their stages."""
    if writes or not isinstance(body, PipelinedSequential):
        return module.state_dict()
    body.local_only = True
    try:
        return module.state_dict()
    finally:
        body.local_only = False


def save_atomically(save: Callable[[str], None], path: str, checkpoint_io: Any = None) -> None:
    """Write a file by ``save(temporary)`` beside ``path``, flushed to the disk, then rename it over ``path``
    (remote filesystems, which have no rename to rely on, are written directly). ``checkpoint_io``, the
    ``CheckpointIO`` that ``save`` writes through, if any: Lightning's ``AsyncCheckpointIO`` writes in a thread
    and returns at once, so its write is waited for (``teardown``, which raises its error) before the rename."""
    if "://" in path:
        save(path)
        return
    temporary = shards.staging(path, placing.TMP)
    placing.sweep(os.path.dirname(os.path.abspath(path)))  # what saves of dead processes left there
    try:
        save(temporary)
        if type(checkpoint_io).__name__ == "AsyncCheckpointIO":  # (either package's)
            checkpoint_io.teardown()  # the write finished (its executor made anew at the next save)
        placing.replace(temporary, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)


def sweep_checkpoint_folders(trainer: pl.Trainer | None) -> None:
    """Clear the folders where ``trainer`` saves and looks for checkpoints (each ``ModelCheckpoint``'s, and the
    root directory, where Lightning's SLURM requeue saves) of what saves of processes that no longer run left
    there, a checkpoint a dead save was replacing put back at its name
    (:func:`~lightning_pipe.transport.placing.sweep`). Run as the job is launched: before Lightning looks for
    ``fit(ckpt_path="last")``, which finds only what is at its name."""
    if trainer is None:
        return
    from pytorch_lightning.callbacks import ModelCheckpoint

    folders = {getattr(trainer, "default_root_dir", None)}
    for callback in getattr(trainer, "checkpoint_callbacks", []):
        if isinstance(callback, ModelCheckpoint):
            folder = callback.dirpath
            if folder is None:  # where Lightning will put them (the logger's version folder)
                with contextlib.suppress(Exception):
                    folder = callback._ModelCheckpoint__resolve_ckpt_dir(trainer)  # type: ignore[attr-defined]
            folders.add(folder)
    for folder in folders:
        if isinstance(folder, (str, os.PathLike)) and "://" not in str(folder):
            placing.sweep(os.fspath(folder))


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


class StagePlaceholders:
    """The remote stages' tensors of a checkpoint as placeholders: where each is (its container and key) and
    where its data comes from (its process, and the key ``StageState.checkpoint_tensors`` takes)."""

    def __init__(self, hosts: Any) -> None:
        self.hosts = hosts
        self.lazy: dict[int, Source] = {}
        self.places: dict[int, tuple[dict[Any, Any], Any]] = {}

    def add(self, placeholder: Tensor, process: int, key: tuple[Any, ...], container: dict[Any, Any],
            entry: Any) -> None:
        container[entry] = placeholder
        self.lazy[id(placeholder)] = (process, key)
        self.places[id(placeholder)] = (container, entry)

    def fetch(self, process: Any, keys: Any) -> dict[Any, Tensor]:
        """The tensors ``keys`` of pipeline process ``process`` (one process's, on CPU)."""
        return self.hosts.call_stage(process, "checkpoint_tensors", list(keys))

    def fill(self) -> None:
        """Put every stage's tensors in place of the placeholders (the whole model in this process)."""
        by_process: dict[Any, list[int]] = {}
        for identity, (process, _) in self.lazy.items():
            by_process.setdefault(process, []).append(identity)
        for process, identities in by_process.items():
            fetched = self.fetch(process, [self.lazy[i][1] for i in identities])
            for i in identities:
                container, entry = self.places[i]
                container[entry] = fetched[self.lazy[i][1]]


def placeholders(checkpoint: dict[str, Any], body: PipelinedSequential,
                 optimizers: list[torch.optim.Optimizer]) -> StagePlaceholders:
    """Register the remote stages' entries of ``checkpoint`` (assembled by Lightning with this process's
    tensors, the remote layers' as meta tensors) and put placeholders of their optimizer states in the plain
    model's optimizer's format (per parameter index)."""
    table = StagePlaceholders(body.hosts)
    state = checkpoint["state_dict"]
    for name, t in list(state.items()):
        if isinstance(t, Tensor) and t.is_meta:
            table.add(t, body.stage_of(name), ("state", name), state, name)
    for k, (optimizer, saved) in enumerate(zip(optimizers, checkpoint.get("optimizer_states", []))):
        if hasattr(optimizer, "_lp_index"):
            checkpoint["optimizer_states"][k] = optimizer_placeholders(table, optimizer, saved)
    return table


def optimizer_placeholders(table: StagePlaceholders, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]
                           ) -> dict[str, Any]:
    """``optimizer``'s state in the plain model's optimizer's format (per parameter index): ``saved`` (the driver's
    own ``state_dict``) with placeholders, registered in ``table``, for the remote stages' tensors."""
    remote: dict[str, tuple[int, dict[str, Any]]] = {}
    for j, future in enumerate(table.hosts.start("optimizer_state_shapes", optimizer._lp_index), start=1):
        remote.update({name: (j, shapes) for name, shapes in future.result().items()})
    merged: dict[str, Any] = {"state": {}, "param_groups": saved["param_groups"]}
    for i, name in enumerate(optimizer._lp_names):  # type: ignore[attr-defined]
        if name in remote:
            j, shapes = remote[name]
            entry: dict[str, Any] = {}
            for key, value in shapes.items():
                if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], torch.dtype):
                    table.add(torch.empty(value[0], dtype=value[1], device="meta"), j,
                              ("optimizer", optimizer._lp_index, name, key), entry, key)
                else:
                    entry[key] = value
            merged["state"][i] = entry
        elif i in saved["state"]:
            merged["state"][i] = saved["state"][i]
    return merged


#: Why the whole model cannot be put together in the main process alone when the stages are sharded.
SHARDED_WHOLE = ("{what} cannot gather stages sharded over the replicas (sharding_strategy={setting!r}) into the "
                  "main process alone: every replica holds a shard. Save them with trainer.save_checkpoint (called "
                  "on every replica, as Lightning does): its one file (state_dict_type='full') loads into the plain "
                  "model")
