"""Sharded checkpoints (``PipeStrategy(state_dict_type="sharded")``): a directory, one file per pipeline process.

Every process of replica 0's pipeline writes its own stage's weights and optimizer states at once
(:mod:`lightning_pipe.transport.shards`), the main process its own and, last, ``meta.pt``: the rest of
Lightning's checkpoint (loops, callbacks, schedulers, hyper-parameters, optimizers' parameter groups) and the
index of which file holds each entry. Nothing is gathered anywhere. The files are written into
``.<name>.partial-<pid>`` beside it (``shards.staging``) and the directory renamed to ``<path>`` once complete: a
crash midway leaves the partial directory, never a ``<path>`` that looks whole, and the previous checkpoints
untouched::

    epoch=3-step=400.ckpt/
        meta.pt            Lightning's checkpoint without the tensors, and the index: name -> file
        stage-00000.pt     the main process's entries (stage 0 and what lies outside the body)
        stage-00001.pt     stage 1's, written by its process ...

Entries keep the plain model's names, so a later job of any balance loads it (each process reads its own
entries), and :func:`consolidate_checkpoint` (``python -m lightning_pipe consolidate DIR FILE``) makes the
one-file checkpoint that ``Model.load_from_checkpoint`` and a plain ``Trainer`` take.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_pipe.transport import optim, shards

__all__ = ["consolidate_checkpoint", "is_sharded"]

#: The format marker in ``meta.pt``.
FORMAT = {"format": "lightning_pipe.sharded", "version": 1}


def is_sharded(path: Any) -> bool:
    """Whether ``path`` is a sharded checkpoint's directory."""
    return isinstance(path, (str, os.PathLike)) and os.path.isfile(os.path.join(path, shards.META))


def save(checkpoint: Mapping[str, Any], path: str, hosts: Any, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Write ``checkpoint`` (Lightning's, its state dict holding this process's tensors and placeholders for the
    remote stages') as a sharded checkpoint at ``path``: the remote stages (``hosts``) write their files while
    this process writes its own."""
    partial = shards.staging(path, ".partial-")
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    try:
        futures = hosts.start("save_shard", partial, timeout=0) if hosts is not None else []
        local = {name: t for name, t in checkpoint["state_dict"].items() if not (isinstance(t, Tensor) and t.is_meta)}
        states = checkpoint.get("optimizer_states", [])
        own = {k: optim.state_by_name(opt, getattr(opt, "_lp_names", [])) for k, opt in enumerate(optimizers)
               if k < len(states)}
        entries = [shards.write_shard(partial, 0, local, own)] + [future.result() for future in futures]
        meta = {key: value for key, value in checkpoint.items() if key not in ("state_dict", "optimizer_states")}
        meta["state_dict"] = {}
        meta["optimizer_states"] = [{"param_groups": state["param_groups"], "names": list(optimizers[k]._lp_names)}
                                    for k, state in enumerate(states)]
        meta["lightning_pipe"] = {**FORMAT,
                                  "index": {name: e["file"] for e in entries for name in e["names"]},
                                  "optimizer_index": [{name: e["file"] for e in entries
                                                       for name in e["optimizer_names"].get(k, [])}
                                                      for k in range(len(states))]}
        torch.save(meta, os.path.join(partial, shards.META))  # last: a directory without it is no checkpoint
        _swap(partial, path)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _swap(partial: str, path: str) -> None:
    """Put the complete directory ``partial`` at ``path``, replacing what is there."""
    if os.path.lexists(path):
        old = shards.staging(path, ".old-")
        os.rename(path, old)
        os.rename(partial, path)
        if os.path.isdir(old) and not os.path.islink(old):
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.remove(old)
    else:
        os.rename(partial, path)


def read_meta(path: str) -> dict[str, Any]:
    """A sharded checkpoint's ``meta.pt``: Lightning's checkpoint without the tensors, and the index; its
    ``lightning_pipe`` entry also records ``path``."""
    meta = torch.load(os.path.join(path, shards.META), weights_only=False, map_location="cpu")
    info = meta.get("lightning_pipe", {})
    if info.get("format") != FORMAT["format"] or info.get("version") != FORMAT["version"]:
        raise ValueError(f"{path} is not a sharded checkpoint this version reads (format: {info.get('format')!r}, "
                         f"version: {info.get('version')!r}; expected: {FORMAT})")
    info["path"] = os.fspath(path)
    return meta


def check_names(info: Mapping[str, Any], expected: Sequence[str], strict: bool) -> None:
    """Refuse, as ``load_state_dict(strict=True)`` does, a checkpoint whose entries are not the model's."""
    if not strict:
        return
    index = info["index"]
    missing = [n for n in expected if n not in index]
    unexpected = [n for n in index if n not in set(expected)]
    if missing or unexpected:
        raise RuntimeError(f"the sharded checkpoint {info['path']} does not hold this model's entries (missing: "
                           f"{missing[:5]}{' ...' if len(missing) > 5 else ''}, unexpected: {unexpected[:5]}"
                           f"{' ...' if len(unexpected) > 5 else ''}); pass strict=False to load what matches")


def local_tensors(info: Mapping[str, Any], names: Sequence[str]) -> dict[str, Tensor]:
    """The entries ``names`` (this process's) read from the checkpoint's files."""
    return shards.read_tensors(info["path"], info["index"], names)


def local_optimizer_state(info: Mapping[str, Any], k: int, group_state: Mapping[str, Any],
                          optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Optimizer ``k``'s ``state_dict`` for this process's parameters: their states from the files, the
    parameter groups (hyper-parameters) as saved; ``optimizer`` spans the whole model in the plain model's
    order (its remote parameters as placeholders), as the one that saved did."""
    names = list(optimizer._lp_names)  # type: ignore[attr-defined]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    own = [n for n, p in zip(names, params) if not p.is_meta]
    states = shards.read_optimizer_states(info["path"], info["optimizer_index"][k], k, own)
    index = {n: i for i, n in enumerate(names)}
    return {"state": {index[n]: s for n, s in states.items()}, "param_groups": group_state["param_groups"]}


def consolidate_checkpoint(path: str, output: str) -> None:
    """Write the sharded checkpoint at ``path`` as one file at ``output``, in Lightning's format, with the
    plain model's ``state_dict`` and optimizer states: what ``Model.load_from_checkpoint`` and a plain
    ``Trainer(...).fit(ckpt_path=...)`` take. (It holds the whole model in memory, as the plain model does.)
    A ``path`` that is no sharded checkpoint (a one-file checkpoint, a folder of checkpoints) is refused with what
    it is and what to pass (``NotADirectoryError``, ``FileNotFoundError``)."""
    shards.check_directory(path)
    meta = read_meta(path)
    info = meta.pop("lightning_pipe")
    files = sorted(set(info["index"].values()) | {f for index in info["optimizer_index"] for f in index.values()})
    state_dict: dict[str, Tensor] = {}
    states: list[dict[str, Any]] = [{} for _ in info["optimizer_index"]]
    for file in files:
        shard = torch.load(os.path.join(path, file), weights_only=True, map_location="cpu")
        state_dict.update({n: t for n, t in shard["state_dict"].items() if info["index"].get(n) == file})
        for k, part in shard["optimizer_states"].items():
            states[k].update(part)
        del shard
    meta["state_dict"] = {name: state_dict[name] for name in info["index"]}
    meta["optimizer_states"] = [
        {"state": {i: states[k][name] for i, name in enumerate(group["names"]) if name in states[k]},
         "param_groups": group["param_groups"]} for k, group in enumerate(meta.get("optimizer_states", []))]
    temporary = shards.staging(output, ".tmp")
    try:
        torch.save(meta, temporary)
        os.replace(temporary, output)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)
