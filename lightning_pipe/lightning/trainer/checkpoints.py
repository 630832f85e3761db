"""The Trainer's checkpoints of a pipelined LightningModule, in Lightning's format, under the plain model's names.

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
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning_fabric.utilities.optimizer import _optimizers_to_device
from torch import Tensor
from typing_extensions import override

from lightning_pipe.lightning import checks, sharded
from lightning_pipe.lightning.body import PipelinedSequential
from lightning_pipe.lightning.checkpoints import (
    SHARDED_WHOLE,
    gathered,
    module_state_dict,
    placeholders,
    save_atomically,
)
from lightning_pipe.lightning.optimizers import StageOptimizers, raw
from lightning_pipe.lightning.streamed import save_streamed
from lightning_pipe.lightning.trainer.processes import PipelineProcesses
from lightning_pipe.transport import placing
from lightning_pipe.transport.parallel import fsdp
from lightning_pipe.transport.stages import optim


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
        return {name: fsdp.full(t) if isinstance(t, Tensor) else t for name, t in state.items()}

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        state = optim.held_state(raw(optimizer))  # this process's part: save_checkpoint adds the others'
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
            sharded.save_directory(checkpoint, path, body.hosts if body is not None else None, optimizers, together,
                                   self.is_global_zero, self.broadcast)
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
            save_atomically(lambda p: self.checkpoint_io.save_checkpoint(checkpoint, p, storage_options), path,
                            self.checkpoint_io)
            return
        table = placeholders(checkpoint, body, optimizers)
        if type(self.checkpoint_io) is TorchCheckpointIO and "://" not in path and storage_options is None:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            save_atomically(lambda p: save_streamed(checkpoint, p, table.lazy, table.fetch), path)
        else:  # a CheckpointIO of the user's (or a remote path) takes the whole checkpoint in hand
            table.fill()
            save_atomically(lambda p: self.checkpoint_io.save_checkpoint(checkpoint, p, storage_options), path,
                            self.checkpoint_io)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if isinstance(checkpoint_path, (str, os.PathLike)):  # a save that died replacing it: the one it replaced
            placing.recover(os.fspath(checkpoint_path))
        if sharded.is_sharded(checkpoint_path):
            meta = sharded.read_meta(checkpoint_path, weights_only)
            if sharded.FABRIC in meta:
                raise ValueError(f"{checkpoint_path} was written by a Fabric loop (fabric.save), not by a Trainer: "
                                 "load it with fabric.load, or take its weights with python -m lightning_pipe "
                                 "consolidate")
            return meta
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
        module = self.lightning_module
        held = module_state_dict(module, checks.body_of(module, self.module_name), False)
        sharded.load_module(info, module, held, self._remote(), self.module_name, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self._stage_optimizers is not None
        info = checkpoint.get("lightning_pipe")
        for k, (optimizer, state) in enumerate(zip(self.optimizers, checkpoint["optimizer_states"])):
            optimizer = raw(optimizer)
            if info is None:
                self._stage_optimizers.load(optimizer, state)
            else:
                sharded.load_optimizer(info, k, optimizer, state, self._remote())
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
            raise RuntimeError(SHARDED_WHOLE.format(what="PipeStrategy.gathered()", setting=self.sharding_strategy))
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
            raise RuntimeError(SHARDED_WHOLE.format(what="rpc_save_model", setting=self.sharding_strategy))
        if self.is_global_zero:
            with self.gathered():
                save_model_fn(trainer, filepath)
        self.barrier("rpc_save_model")
