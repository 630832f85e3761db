"""Checkpoints of a pipelined LightningModule, in Lightning's format, under the plain model's names.

``state_dict_type="full"`` (the default): one file that loads into the plain model
(``Model.load_from_checkpoint``). The main process writes it stage by stage (:mod:`lightning_pipe.lightning.
streamed`): remote stages' tensors are placeholders in the checkpoint Lightning assembles, and each stage's
are fetched when their turn to be written comes, so the main process never holds more than its own stage and
one other. Optimizer states are those of the plain model's optimizer (merged by parameter name). With a
``CheckpointIO`` of your own, or a remote path, the whole checkpoint is gathered first and handed to it.

``state_dict_type="sharded"``: a ``torch.distributed.checkpoint`` directory, each process writing its own
entries (:mod:`lightning_pipe.lightning.sharded`); any later balance or replica count loads it, and
``consolidate_checkpoint`` turns it into the full file.

Both are written atomically (a temporary beside the target, renamed into place): a crash mid-write leaves the
previous checkpoint intact. Loading hands each stage its own entries (from a sharded checkpoint, each stage
reads its own). :func:`gathered` puts the whole unpipelined body back in the LightningModule for code that
needs it in one piece (``rpc_save_model``, export).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning_fabric.utilities.optimizer import _optimizers_to_device
from torch import Tensor, nn
from typing_extensions import override

from lightning_pipe.lightning import checks, sharded
from lightning_pipe.lightning.body import PipelinedSequential
from lightning_pipe.lightning.optimizers import StageOptimizers, raw
from lightning_pipe.lightning.processes import PipelineProcesses
from lightning_pipe.lightning.streamed import Source, save_streamed
from lightning_pipe.transport import optim, placing, sharding, shards

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


def save_atomically(save: Callable[[str], None], path: str) -> None:
    """Write a file by ``save(temporary)`` beside ``path``, then rename it over ``path`` (remote filesystems,
    which have no rename to rely on, are written directly)."""
    if "://" in path:
        save(path)
        return
    temporary = shards.staging(path, placing.TMP)
    placing.sweep(os.path.dirname(os.path.abspath(path)))  # what saves of dead processes left there
    try:
        save(temporary)
        os.replace(temporary, path)
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


class _Placeholders:
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
                 optimizers: list[torch.optim.Optimizer]) -> _Placeholders:
    """Register the remote stages' entries of ``checkpoint`` (assembled by Lightning with this process's
    tensors, the remote layers' as meta tensors) and put placeholders of their optimizer states in the plain
    model's optimizer's format (per parameter index)."""
    table = _Placeholders(body.hosts)
    state = checkpoint["state_dict"]
    for name, t in list(state.items()):
        if isinstance(t, Tensor) and t.is_meta:
            table.add(t, body.stage_of(name), ("state", name), state, name)
    for k, (optimizer, saved) in enumerate(zip(optimizers, checkpoint.get("optimizer_states", []))):
        if hasattr(optimizer, "_lp_index"):
            checkpoint["optimizer_states"][k] = optimizer_placeholders(table, optimizer, saved)
    return table


def optimizer_placeholders(table: _Placeholders, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]
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
_SHARDED_WHOLE = ("{what} cannot gather stages sharded over the replicas (sharding_strategy={setting!r}) into the "
                  "main process alone: every replica holds a shard. Save them with trainer.save_checkpoint (called "
                  "on every replica, as Lightning does): its one file (state_dict_type='full') loads into the plain "
                  "model")


class PipelineCheckpoints(PipelineProcesses):
    """Lightning's checkpoint hooks for a pipelined LightningModule (``PipeStrategy``'s base): what is saved is
    the plain model's, and what is loaded reaches every stage (see the module's docstring)."""

    module_name: str
    state_dict_type: str
    sharding_strategy: str
    _body: PipelinedSequential | None
    _stage_optimizers: StageOptimizers | None

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the weights of remote stages are loaded into their processes, which setup configures

    def _stages_sharded(self) -> bool:
        """Whether the stages are sharded over the replicas now (``sharding_strategy``, while fitting): then every
        replica takes part in each save (each holds shards of every stage)."""
        body = self._body
        if body is None or not body.sharded:  # judged for every stage, not from stage 0's modules alone
            return False
        body.pipeline.runner.averages.before_update()  # its parameters the shards again (after a forward alone)
        return True

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        # The remote layers' entries stay placeholders here: save_checkpoint fetches them as it writes. This
        # process's shards of a stage sharded over the replicas are gathered whole (every replica runs this at
        # once, as Lightning dumps a checkpoint on every rank), except for a sharded checkpoint, which saves them.
        module = self.lightning_module
        self._stages_sharded()
        state = module_state_dict(module, checks.body_of(module, self.module_name), False)
        if self.state_dict_type == "sharded":
            return state
        return {name: sharding.full(t) if isinstance(t, Tensor) else t for name, t in state.items()}

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        state = raw(optimizer).state_dict()  # this process's part: save_checkpoint adds the others'
        return state if self.state_dict_type == "sharded" else optim.whole(state)

    def _remote(self) -> PipelinedSequential | None:
        """The body, if it has remote stages."""
        body = self._body
        return body if body is not None and body.hosts is not None else None

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        body, optimizers = self._remote(), [raw(o) for o in self.optimizers]
        path = str(filepath)
        together = self._stages_sharded()  # every replica holds shards: each takes part
        if not self.is_global_zero and not together:
            return
        if self.state_dict_type == "sharded":
            if self.is_global_zero:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            partial = None
            if together:  # every replica's processes write their shards into the main process's directory
                partial = self.broadcast(sharded.prepare(path) if self.is_global_zero else None)
                if not self.is_global_zero:
                    sharded.save_shards(checkpoint, partial, body.hosts if body is not None else None, optimizers)
                    return
            sharded.save(checkpoint, path, body.hosts if body is not None else None, optimizers, partial)
            return
        if together and body is not None:  # each sharded stage gathered whole by its replica 0's process
            for future in body.hosts.start("gather_whole", timeout=0):
                future.result()
        if not self.is_global_zero:
            return
        try:
            self._save_full(checkpoint, path, storage_options, body, optimizers)
        finally:
            if together and body is not None:
                body.hosts.call("release_whole")

    def _save_full(self, checkpoint: dict[str, Any], path: str, storage_options: Any, body: Any,
                   optimizers: list[torch.optim.Optimizer]) -> None:
        if body is None:
            save_atomically(lambda p: self.checkpoint_io.save_checkpoint(checkpoint, p, storage_options), path)
            return
        table = placeholders(checkpoint, body, optimizers)
        if type(self.checkpoint_io) is TorchCheckpointIO and "://" not in path and storage_options is None:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            save_atomically(lambda p: save_streamed(checkpoint, p, table.lazy, table.fetch), path)
        else:  # a CheckpointIO of the user's (or a remote path) takes the whole checkpoint in hand
            table.fill()
            save_atomically(lambda p: self.checkpoint_io.save_checkpoint(checkpoint, p, storage_options), path)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if isinstance(checkpoint_path, (str, os.PathLike)):  # a save that died replacing it: the one it replaced
            placing.recover(os.fspath(checkpoint_path))
        if sharded.is_sharded(checkpoint_path):
            return sharded.read_meta(checkpoint_path)
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero and sharded.is_sharded(filepath):
            shutil.rmtree(filepath, ignore_errors=True)
            return
        super().remove_checkpoint(filepath)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self._stages_sharded()  # sharded stages: the shards are what loads (each process cuts its own)
        info = checkpoint.get("lightning_pipe")
        if info is None:
            # The body's load_state_dict hands the remote layers' entries to their stages.
            self.lightning_module.load_state_dict(checkpoint["state_dict"], strict=strict)
            return
        # Sharded: each process reads its own entries by key, whatever split saved them (of a tensor it holds as a
        # shard, the shard's bytes alone).
        module, body = self.lightning_module, self._remote()
        held = module_state_dict(module, checks.body_of(module, self.module_name), False)
        names = list(held)
        sharded.check_names(info, names, strict)
        remote = {layer for layer, process in body.owner.items() if process} if body is not None else set()
        prefixes = tuple(f"{self.module_name}.{layer}." for layer in remote)
        futures = body.hosts.start("load_shards", info["path"], info["index"], strict, timeout=0) if body else []
        module.load_state_dict(sharded.local_tensors(info, [n for n in names if not n.startswith(prefixes)], held),
                               strict=False)
        for future in futures:
            future.result()

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self._stage_optimizers is not None
        info = checkpoint.get("lightning_pipe")
        for k, (optimizer, state) in enumerate(zip(self.optimizers, checkpoint["optimizer_states"])):
            optimizer = raw(optimizer)
            if info is None:
                self._stage_optimizers.load(optimizer, state)
            else:
                body = self._remote()
                futures = body.hosts.start("load_optimizer_shards", info["path"], optimizer._lp_index,
                                           timeout=0) if body else []
                optimizer.load_state_dict(optim.as_held(optimizer, sharded.local_optimizer_state(info, k, state,
                                                                                                 optimizer)))
                for future in futures:
                    future.result()
            _optimizers_to_device([optimizer], self.root_device)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[pl.LightningModule]:
        """On the main process, the LightningModule holding the whole unpipelined body, every stage's
        current weights included (remote layers are rebuilt on CPU); the pipeline is back afterwards.

        ::

            with trainer.strategy.gathered() as model:
                torch.save(model, "whole.pt")      # or export, push, inspect ...
        """
        if not self.is_global_zero:
            raise RuntimeError("PipeStrategy.gathered() gathers the model on the main process only (global "
                               f"rank 0); this is replica {self.global_rank}: guard it with trainer.is_global_zero")
        if self._stages_sharded():
            raise RuntimeError(_SHARDED_WHOLE.format(what="PipeStrategy.gathered()", setting=self.sharding_strategy))
        with gathered(self.lightning_module, self.module_name) as module:
            yield module

    def rpc_save_model(self, trainer: pl.Trainer, save_model_fn: Callable[[pl.Trainer, str], Any],
                       filepath: str) -> None:
        """Have the main process gather every stage and call ``save_model_fn(trainer, filepath)`` with the
        whole unpipelined model in ``trainer.lightning_module``; then every process of the job meets
        (:meth:`barrier`), so that the file is complete wherever the script goes on.

        ``trainer.save_checkpoint`` needs no such help: it writes the whole model's checkpoint already.
        """
        if self._stages_sharded():  # refused on every replica alike
            raise RuntimeError(_SHARDED_WHOLE.format(what="rpc_save_model", setting=self.sharding_strategy))
        if self.is_global_zero:
            with self.gathered():
                save_model_fn(trainer, filepath)
        self.barrier("rpc_save_model")
