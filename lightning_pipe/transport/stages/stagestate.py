"""A stage host's state for checkpoints: weights and optimizer states by the plain model's names, in or out.

Mixed into :class:`~lightning_pipe.transport.stages.host.StageHost`: what the driver asks of a remote stage to save a
checkpoint (entries to consolidate, or this process's entries of a sharded checkpoint), to load one (entries
handed over, or read here by key from a sharded checkpoint), and to start from replica 0's weights.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_pipe.transport.parallel import fsdp, shards
from lightning_pipe.transport.stages import optim

__all__: list[str] = []


def broadcast_from_replica0(tensors: list[Tensor]) -> None:
    """Give ``tensors`` (a stage's weights and buffers) replica 0's values: a broadcast over this process's default
    group, the same stage of every replica (a ``DTensor`` left as it is: sharded over the replicas, each holds its
    own shard)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        for t in tensors:
            if not fsdp.is_dtensor(t):
                dist.broadcast(t.detach(), src=0)


class StageState:
    """The state methods of a stage host (``partition``: its layers by their names in the body; ``prefix``
    turns those into the LightningModule's; ``optimizers``: its part of each of the driver's optimizers)."""

    partition: nn.Sequential
    runner: Any  # the StageRunner of its stages
    prefix: str
    process: int  # the index of its first stage: names its file in a sharded checkpoint
    optimizers: dict[int, tuple[torch.optim.Optimizer, list[str]]]

    _whole: tuple[dict[str, Tensor], dict[int, dict[str, dict[str, Any]]]] | None = None  # see gather_whole

    def broadcast_state(self) -> None:
        """Take the same stage of replica 0's weights and buffers (its default group: that stage of every
        replica), as DDP starts every replica from rank 0's (a stage sharded over the replicas already keeps its
        shards)."""
        broadcast_from_replica0([*self.partition.parameters(), *self.partition.buffers()])

    def is_sharded(self) -> bool:
        """Whether this process's stages are sharded over their replicas (FSDP2 units); if so, every unit is
        resharded now (a forward without backward leaves SHARD_GRAD_OP's parameters whole, and FSDP registers
        the whole ones on the module meanwhile), so that the module's parameters and state are the shards."""
        if not any(fsdp.is_sharded(m) for m in self.partition.modules()):
            return any(fsdp.is_dtensor(p) for p in self.partition.parameters())  # split by tensor parallel
        self.runner.averages.before_update()
        return True

    def gather_whole(self) -> None:
        """With every replica's process of this stage at once (collectives of the stage's group): gather the
        stage's whole weights, buffers and optimizer states onto CPU; replica 0's keeps them, to be saved from
        (:meth:`state_dict`, :meth:`optimizer_state`) until :meth:`release_whole`. Nothing to do unsharded."""
        self._whole = None
        if not self.is_sharded():
            return
        state = {self.prefix + n: fsdp.full(t.detach()).cpu() for n, t in self.partition.state_dict().items()}
        optimizers = {k: {name: {key: fsdp.full(v).cpu() if isinstance(v, Tensor) else v for key, v in per.items()}
                          for name, per in self._optimizer_state(k).items()} for k in sorted(self.optimizers)}
        if dist.get_rank() == 0:
            self._whole = (state, optimizers)

    def release_whole(self) -> None:
        """Forget what :meth:`gather_whole` kept."""
        self._whole = None

    def _refuse_sharded(self, what: str) -> None:
        raise RuntimeError(
            f"{what} of a stage sharded over its replicas (sharding_strategy) needs every replica's shard: save a "
            "checkpoint with trainer.save_checkpoint (called on every replica, as Lightning does), which gathers "
            "each stage's shards together, or use sharding_strategy='NO_SHARD'")

    def _optimizer_state(self, k: int) -> dict[str, dict[str, Any]]:
        """Per-parameter state of optimizer ``k`` as this process holds it (shards, where sharded), by name."""
        if k not in self.optimizers:
            return {}
        optimizer, names = self.optimizers[k]
        return optim.state_by_name(optimizer, names)

    def optimizer_state(self, k: int) -> dict[str, dict[str, Any]]:
        """Per-parameter state of optimizer ``k``, by name, whole."""
        if self._whole is not None:
            return self._whole[1].get(k, {})
        if self.is_sharded() and k in self.optimizers:
            self._refuse_sharded("The optimizer state")
        return self._optimizer_state(k)

    def load_optimizer_state(self, k: int, states: Mapping[str, Mapping[str, Any]]) -> None:
        """Load per-parameter state (by name, whole) into optimizer ``k`` (each process its shards of it, where
        the stage is sharded over its replicas)."""
        if k in self.optimizers:
            optimizer, names = self.optimizers[k]
            params = dict(zip(names, (p for g in optimizer.param_groups for p in g["params"])))
            states = {name: {key: fsdp.like(params[name], v) if isinstance(v, Tensor) and name in params else v
                             for key, v in state.items()} for name, state in states.items()}
            optim.load_state_by_name(optimizer, names, states)

    # ------------------------------------------------------------------ module state
    def state_dict(self) -> dict[str, Tensor]:
        """The partition's state, by the LightningModule's names, on CPU."""
        if self._whole is not None:
            return dict(self._whole[0])
        if self.is_sharded():
            self._refuse_sharded("The weights")
        return {self.prefix + n: t.detach().cpu() for n, t in self.partition.state_dict().items()}

    def layers(self) -> dict[str, nn.Module]:
        """Copies of the partition's layers on CPU, by child name, for the whole model in one place: every
        parameter and buffer (non-persistent ones included) as it is now, gradients left behind."""
        memo: dict[int, Any] = {}
        for p in self.partition.parameters():
            memo[id(p)] = nn.Parameter(p.detach().cpu(), requires_grad=p.requires_grad)
        for b in self.partition.buffers():
            memo[id(b)] = b.detach().cpu()
        return {name: copy.deepcopy(layer, memo) for name, layer in self.partition.named_children()}

    def load_state_dict(self, state: Mapping[str, Tensor], strict: bool = True) -> None:
        """Load the partition's state from entries named as in the LightningModule (``strict``: as in
        ``nn.Module.load_state_dict``); whole entries, each process taking its shards where sharded."""
        own = {n[len(self.prefix):]: t for n, t in state.items() if n.startswith(self.prefix)}
        if self.is_sharded():
            targets = self.partition.state_dict()
            own = {n: fsdp.like(targets[n], t) if n in targets else t for n, t in own.items()}
        self.partition.load_state_dict(own, strict=strict)

    # ------------------------------------------------------------------ a consolidated checkpoint, streamed
    def optimizer_state_shapes(self, k: int) -> dict[str, dict[str, Any]]:
        """Optimizer ``k``'s per-parameter state by name, each tensor as its ``(shape, dtype)`` (what a
        placeholder of it needs), other values as they are."""
        return {name: {key: (tuple(v.shape), v.dtype) if isinstance(v, Tensor) else v for key, v in state.items()}
                for name, state in self.optimizer_state(k).items()}

    def checkpoint_tensors(self, keys: Sequence[tuple[Any, ...]]) -> dict[tuple[Any, ...], Tensor]:
        """The tensors ``keys`` name, on CPU: ``("state", name)`` an entry of the state dict, ``("optimizer",
        k, name, key)`` optimizer ``k``'s state ``key`` of parameter ``name``."""
        state = self.state_dict() if any(key[0] == "state" for key in keys) else {}
        optimizers = {k: self.optimizer_state(k) for k in {key[1] for key in keys if key[0] == "optimizer"}}
        return {key: state[key[1]] if key[0] == "state" else optimizers[key[1]][key[2]][key[3]] for key in keys}

    # ------------------------------------------------------------------ sharded checkpoints
    def save_shard(self, directory: str) -> Any:
        """Write this process's entries of a sharded checkpoint (a DCP directory) into ``directory``; return its
        part of DCP's metadata, for the main process to write ``.metadata``. A stage sharded over its replicas
        is saved by all of them at once, each writing its shards (a collective of the stage's group: every
        replica's process is asked); its replica 0 returns the part of them all, the others None."""
        if self.is_sharded():
            state = {self.prefix + n: t.detach() for n, t in self.partition.state_dict().items()}
            return shards.write_shard(directory, self.process, shards.entries(
                state, {k: self._optimizer_state(k) for k in self.optimizers}), group=True)
        return shards.write_shard(directory, self.process, shards.entries(
            self.state_dict(), {k: self.optimizer_state(k) for k in self.optimizers}))

    def load_shards(self, directory: str, index: Sequence[str], strict: bool = True) -> None:
        """Load this process's entries from a sharded checkpoint (``index``: the names it holds), whatever
        split saved it. ``strict``: every entry of these layers must be there. A stage sharded over its replicas
        reads its own shard of each entry alone."""
        names = list(self.state_dict_names())
        held = set(index)
        missing = [n for n in names if n not in held]
        if strict and missing:
            raise KeyError(f"the checkpoint has no entry for {', '.join(missing[:5])}"
                           f"{' ...' if len(missing) > 5 else ''} (layers of this stage)")
        if self.is_sharded():
            targets = {self.prefix + n: t for n, t in self.partition.state_dict().items()}
            shards.read_into(directory, {n: t for n, t in targets.items() if n in held})
            return
        self.load_state_dict(shards.read_tensors(directory, [n for n in names if n in held]), strict=False)

    def load_optimizer_shards(self, directory: str, k: int) -> None:
        """Load optimizer ``k``'s states of this process's parameters from a sharded checkpoint (where the stage is
        sharded over its replicas, each state of a parameter's shape is read as this process's shard alone: only
        its bytes are read, never the whole tensor)."""
        if k not in self.optimizers:
            return
        optimizer, names = self.optimizers[k]
        params = dict(zip(names, (p for g in optimizer.param_groups for p in g["params"])))
        self.load_optimizer_state(k, shards.read_optimizer_states(directory, k, names, held=params))

    def state_dict_names(self) -> list[str]:
        """The names of this process's entries, as the LightningModule's ``state_dict`` has them."""
        return [self.prefix + n for n in self.partition.state_dict(keep_vars=True)]
