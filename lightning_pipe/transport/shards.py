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

#: What a sharded checkpoint is, for messages about a path that is not one.
WHAT = ('a sharded checkpoint\'s directory, as PipeStrategy(state_dict_type="sharded") writes one per save (for '
        'example lightning_logs/version_0/checkpoints/epoch=3-step=400.ckpt/, holding meta.pt and a '
        'stage-NNNNN.pt per process)')


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


def sharded_checkpoints(folder: str, depth: int = 4) -> list[str]:
    """The sharded checkpoints (complete: ``meta.pt`` in) in ``folder`` and its folders down to ``depth`` levels
    (``<default_root_dir>/lightning_logs/version_0/checkpoints/<checkpoint>`` is 4), sorted; hidden folders and
    a checkpoint's own are not searched."""
    found: list[str] = []
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return found
    for entry in entries:
        if not entry.is_dir() or entry.name.startswith("."):
            continue
        if os.path.isfile(os.path.join(entry.path, META)):
            found.append(entry.path)
        elif depth > 1:
            found.extend(sharded_checkpoints(entry.path, depth - 1))
    return found


def staging(path: str, kind: str) -> str:
    """Where a checkpoint for ``path`` is written before it is renamed into place: beside it, hidden, tagged
    ``kind`` (``".tmp"`` for a file, ``".partial-"`` for a sharded directory) and this process's id, and never
    holding Lightning's ``hpc_ckpt_`` (Lightning takes the digits of every name holding it for a version, so a
    half-written ``hpc_ckpt_2.ckpt.tmp123`` would make every later resume look for version 2123)."""
    head, tail = os.path.split(os.path.normpath(path))
    return os.path.join(head, f".{tail.replace('hpc_ckpt_', 'hpc-ckpt-')}{kind}{os.getpid()}")


def check_directory(path: str, limit: int = 20) -> None:
    """Refuse ``path`` unless it is a complete sharded checkpoint's directory, saying what it is instead and
    what to pass: ``FileNotFoundError`` (nothing there; a folder without ``meta.pt``, listing the sharded
    checkpoints inside it) or ``NotADirectoryError`` (a file: a one-file checkpoint, or a file of a sharded
    one)."""
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, META)):
        return
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist: expected {WHAT}")
    if not os.path.isdir(path):
        parent = os.path.dirname(os.path.abspath(path))
        if os.path.isfile(os.path.join(parent, META)):
            raise NotADirectoryError(f"{path} is a file of the sharded checkpoint {parent}: pass that directory")
        raise NotADirectoryError(
            f"{path} is a file, not a directory: a one-file checkpoint (PipeStrategy(state_dict_type=\"full\"), "
            "the default) needs no consolidation, Model.load_from_checkpoint and Trainer.fit(ckpt_path=...) take it "
            f"as it is. Expected {WHAT}")
    if ".partial-" in os.path.basename(os.path.normpath(path)) or any(
            name.startswith("stage-") and name.endswith(".pt") for name in os.listdir(path)):
        raise FileNotFoundError(
            f"{path} has no {META}: it is a save that did not finish ({META} is written last, once every "
            f"stage's file is in), not a checkpoint. Expected {WHAT}")
    found = sharded_checkpoints(path)
    if not found:
        raise FileNotFoundError(f"{path} is a folder without {META} and holds no sharded checkpoint: expected {WHAT}")
    shown = "".join(f"\n  {f}" for f in found[:limit]) + (f"\n  ... ({len(found) - limit} more)"
                                                            if len(found) > limit else "")
    raise FileNotFoundError(f"{path} is a folder of checkpoints, not a sharded checkpoint (no {META} in it): pass "
                            f"one of the {len(found)} sharded checkpoints inside it:{shown}")
