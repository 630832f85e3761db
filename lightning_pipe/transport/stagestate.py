"""A stage host's state for checkpoints: weights and optimizer states by the plain model's names, in or out.

Mixed into :class:`~lightning_pipe.transport.host.StageHost`: what the driver asks of a remote stage to save a
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

from lightning_pipe.transport import optim, shards

__all__: list[str] = []


class StageState:
    """The state methods of a stage host (``partition``: its layers by their names in the body; ``prefix``
    turns those into the LightningModule's; ``optimizers``: its part of each of the driver's optimizers)."""

    partition: nn.Sequential
    prefix: str
    process: int  # the index of its first stage: names its file in a sharded checkpoint
    optimizers: dict[int, tuple[torch.optim.Optimizer, list[str]]]

    def broadcast_state(self) -> None:
        """Take the same stage of replica 0's weights and buffers (its default group: that stage of every
        replica), as DDP starts every replica from rank 0's."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            for t in [*self.partition.parameters(), *self.partition.buffers()]:
                dist.broadcast(t.detach(), src=0)

    def optimizer_state(self, k: int) -> dict[str, dict[str, Any]]:
        """Per-parameter state of optimizer ``k``, by name."""
        if k not in self.optimizers:
            return {}
        optimizer, names = self.optimizers[k]
        return optim.state_by_name(optimizer, names)

    def load_optimizer_state(self, k: int, states: Mapping[str, Mapping[str, Any]]) -> None:
        """Load per-parameter state (by name) into optimizer ``k``."""
        if k in self.optimizers:
            optimizer, names = self.optimizers[k]
            optim.load_state_by_name(optimizer, names, states)

    # ------------------------------------------------------------------ module state
    def state_dict(self) -> dict[str, Tensor]:
        """The partition's state, by the LightningModule's names, on CPU."""
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
        ``nn.Module.load_state_dict``)."""
        own = {n[len(self.prefix):]: t for n, t in state.items() if n.startswith(self.prefix)}
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
        part of DCP's metadata, for the main process to write ``.metadata``."""
        return shards.write_shard(directory, self.process, shards.entries(
            self.state_dict(), {k: self.optimizer_state(k) for k in self.optimizers}))

    def load_shards(self, directory: str, index: Sequence[str], strict: bool = True) -> None:
        """Load this process's entries from a sharded checkpoint (``index``: the names it holds), whatever
        split saved it. ``strict``: every entry of these layers must be there."""
        names = list(self.state_dict_names())
        held = set(index)
        missing = [n for n in names if n not in held]
        if strict and missing:
            raise KeyError(f"the checkpoint has no entry for {', '.join(missing[:5])}"
                           f"{' ...' if len(missing) > 5 else ''} (layers of this stage)")
        self.load_state_dict(shards.read_tensors(directory, [n for n in names if n in held]), strict=False)

    def load_optimizer_shards(self, directory: str, k: int) -> None:
        """Load optimizer ``k``'s states of this process's parameters from a sharded checkpoint."""
        if k in self.optimizers:
            _, names = self.optimizers[k]
            self.load_optimizer_state(k, shards.read_optimizer_states(directory, k, names))

    def state_dict_names(self) -> list[str]:
        """The names of this process's entries, as the LightningModule's ``state_dict`` has them."""
        return [self.prefix + n for n in self.partition.state_dict(keep_vars=True)]
