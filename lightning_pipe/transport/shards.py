"""One process's part of a sharded checkpoint: its tensors and optimizer states written by name, read back by name.

A sharded checkpoint is a directory: one file per pipeline process (``stage-<process>.pt``, written by that
process, in parallel), and ``meta.pt``, written last by the main process, whose index says which file holds
each entry. Entries are named as in the plain model (``sequential_module.3.weight``), so any process of any
later split reads the entries its layers need from whichever files hold them: a checkpoint saved at balance
``[2, 2]`` loads at ``[1, 3]``, or into the plain model once consolidated. Files are opened with
``mmap=True``: a process reads the pages of its own tensors, never a whole file.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__: list[str] = []

#: The name of the main process's file in a sharded checkpoint directory.
META = "meta.pt"


def shard_name(process: int) -> str:
    """The file of pipeline process ``process`` in a sharded checkpoint directory."""
    return f"stage-{process:05d}.pt"


def write_shard(directory: str, process: int, tensors: Mapping[str, Tensor],
                optimizer_states: Mapping[int, Mapping[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """Write one process's entries (by name) and its optimizers' per-parameter states (optimizer index ->
    parameter name -> state) into ``directory``; return what the index needs: the file and the names in it."""
    name = shard_name(process)
    torch.save({"state_dict": dict(tensors), "optimizer_states": {k: dict(s) for k, s in optimizer_states.items()}},
               os.path.join(directory, name))
    return {"file": name, "names": list(tensors),
            "optimizer_names": {k: list(states) for k, states in optimizer_states.items()}}


def _by_file(index: Mapping[str, str], names: Iterable[str]) -> dict[str, list[str]]:
    files: dict[str, list[str]] = {}
    for name in names:
        if name in index:
            files.setdefault(index[name], []).append(name)
    return files


def read_tensors(directory: str, index: Mapping[str, str], names: Iterable[str]) -> dict[str, Tensor]:
    """The entries ``names`` (those the index has) read from the files that hold them, each file mapped, not
    read whole; the tensors are copies (the files may be replaced afterwards)."""
    out: dict[str, Tensor] = {}
    for file, wanted in _by_file(index, names).items():
        shard = torch.load(os.path.join(directory, file), mmap=True, weights_only=True, map_location="cpu")
        out.update({name: shard["state_dict"][name].clone() for name in wanted})
        del shard
    return out


def read_optimizer_states(directory: str, index: Mapping[str, str], k: int,
                          names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Optimizer ``k``'s per-parameter states of ``names`` (those the index has), read from their files."""
    out: dict[str, dict[str, Any]] = {}
    for file, wanted in _by_file(index, names).items():
        shard = torch.load(os.path.join(directory, file), mmap=True, weights_only=True, map_location="cpu")
        states = shard["optimizer_states"].get(k, {})
        for name in wanted:
            out[name] = {key: v.clone() if isinstance(v, Tensor) else v for key, v in states[name].items()}
        del shard
    return out
