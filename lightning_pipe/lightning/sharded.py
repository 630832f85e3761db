"""Sharded checkpoints (``PipeStrategy(state_dict_type="sharded")``): one ``torch.distributed.checkpoint`` (DCP)
directory, each pipeline process writing its own entries.

Every process of replica 0's pipeline writes its own stage's weights and optimizer states by key
(:mod:`lightning_pipe.transport.parallel.shards`), at once; the main process writes its own, the rest of Lightning's
checkpoint (loops, callbacks, schedulers, hyper-parameters, optimizers' parameter groups) as one entry, and
last DCP's ``.metadata`` for every process's entries. Nothing is gathered anywhere. The files are written into
``.<name>.partial-<owner>`` beside it (``shards.staging``) and the directory put at ``<path>`` once ``.metadata`` is
in (:func:`~lightning_pipe.transport.placing.put_in_place`): a crash at any moment leaves the previous checkpoint
(or this one) findable, never a ``<path>`` that looks whole and is not, and what a dead save left behind is
cleared by the next save, the next resume or the next launch (:func:`~lightning_pipe.transport.placing.sweep`)::

    epoch=3-step=400.ckpt/
        .metadata          DCP's index of every entry (written last, by the main process)
        __0_0.distcp       the main process's entries (stage 0, what lies outside the body, Lightning's rest)
        __1_0.distcp       stage 1's, written by its process ...

Entries keep the plain model's names (``state_dict/<name>``, ``optimizer/<k>/<parameter name>/<key>``), so a later
job of any balance or replica count loads it (each process reads its own keys), ``dcp_to_torch_save`` makes a
file whose ``state_dict`` loads into the plain model, and :func:`consolidate_checkpoint` (``python -m
lightning_pipe consolidate DIR FILE``) makes the one-file checkpoint that ``Model.load_from_checkpoint`` and a
plain ``Trainer`` take. A directory of the first format (``meta.pt``) is refused, saying how to convert it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_pipe.lightning.optimizers import load_held
from lightning_pipe.transport import placing
from lightning_pipe.transport.parallel import shards
from lightning_pipe.transport.stages import optim

__all__ = ["consolidate_checkpoint", "is_sharded"]

#: The format marker in the checkpoint's ``lightning`` entry.
FORMAT = {"format": "lightning_pipe.sharded", "version": 2}

#: The entry where a Fabric loop's save records the keys of its state: the module's (``"module"``), the prefix its
#: names carry beyond the saved module's (``"prefix"``) and the optimizers' in the order they were set up.
FABRIC = "lightning_pipe_fabric"


def is_sharded(path: Any) -> bool:
    """Whether ``path`` is a sharded checkpoint's directory (either format: the first one is refused on loading)."""
    return isinstance(path, (str, os.PathLike)) and (os.path.isfile(os.path.join(path, shards.META))
                                                      or shards.is_legacy(path))


def _own(checkpoint: Mapping[str, Any], optimizers: Sequence[torch.optim.Optimizer]
         ) -> tuple[dict[str, Tensor], dict[int, dict[str, dict[str, Any]]]]:
    """This process's tensors of ``checkpoint`` (not the remote stages' placeholders) and its optimizers' states
    by parameter name."""
    local = {name: t for name, t in checkpoint["state_dict"].items() if not (isinstance(t, Tensor) and t.is_meta)}
    states = checkpoint.get("optimizer_states", [])
    own = {k: optim.state_by_name(opt, getattr(opt, "_lp_names", [])) for k, opt in enumerate(optimizers)
           if k < len(states)}
    return local, own


def prepare(path: str) -> str:
    """An empty directory where this process stages a sharded checkpoint for ``path`` (what an earlier save of
    this process left there removed, and what saves of processes that no longer run left beside it: see
    :mod:`~lightning_pipe.transport.placing`), made before any process writes into it."""
    partial = shards.staging(path, placing.PARTIAL)
    placing.sweep(os.path.dirname(os.path.abspath(path)))
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    return partial


def save(checkpoint: Mapping[str, Any], path: str, hosts: Any, optimizers: Sequence[torch.optim.Optimizer],
         partial: str | None = None) -> None:
    """Write ``checkpoint`` (Lightning's, its state dict holding this process's tensors and placeholders for the
    remote stages') as a sharded checkpoint at ``path``: the remote stages (``hosts``) write their entries while
    this process writes its own, then ``.metadata`` for all. ``partial``: the stages are sharded over the
    replicas, and every replica's processes write their shards at once into this directory, which
    :func:`prepare` made before its path was given to them (the other drivers call :func:`save_shards` with it:
    made after, it could be theirs already, DCP creating it as they write, and removing it would drop their
    shards); None: a directory of its own, written by this pipeline's processes alone."""
    together = partial is not None
    partial = partial if partial is not None else prepare(path)
    futures = []
    try:
        futures = hosts.start("save_shard", partial, timeout=0) if hosts is not None else []
        local, own = _own(checkpoint, optimizers)
        states = checkpoint.get("optimizer_states", [])
        rest = {key: value for key, value in checkpoint.items() if key not in ("state_dict", "optimizer_states")}
        rest["state_dict"] = {}
        rest["optimizer_states"] = [{"param_groups": state["param_groups"], "names": list(optimizers[k]._lp_names)}
                                    for k, state in enumerate(states)]
        rest["lightning_pipe"] = {**FORMAT, "names": list(checkpoint["state_dict"])}  # the plain model's order
        shards.write_shard(partial, 0, shards.entries(local, own, rest), group=together,
                           others=lambda: [part for future in futures for part in [future.result()] if part])
        placing.put_in_place(partial, path)  # at every moment, a complete checkpoint at path (or in .old-)
    except BaseException:
        for future in futures:  # the others stop writing into it before it goes
            with contextlib.suppress(BaseException):
                future.result()
        shutil.rmtree(partial, ignore_errors=True)
        raise


def save_shards(checkpoint: Mapping[str, Any], partial: str, hosts: Any,
                optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """A replica other than the first, its stages sharded over the replicas: its processes write their shards
    into the main process's directory ``partial`` while the main process saves (:func:`save` with ``together``),
    every stage's replicas at once."""
    futures = hosts.start("save_shard", partial, timeout=0) if hosts is not None else []
    try:
        local, own = _own(checkpoint, optimizers)
        shards.write_shard(partial, 0, shards.entries(local, own), group=True)
    finally:
        for future in futures:
            future.result()


def save_directory(checkpoint: Mapping[str, Any], path: str, hosts: Any, optimizers: Sequence[torch.optim.Optimizer],
                   together: bool, main: bool, broadcast: Any) -> None:
    """A sharded save as either loop makes it, called by the main process and, where the stages are sharded
    over the replicas (``together``), by every driver at once (``broadcast``: the loop's, from the main process):
    each replica's processes then write their shards into the directory the main process prepared."""
    if main:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    partial = None
    if together:
        partial = broadcast(prepare(path) if main else None)
        if not main:
            save_shards(checkpoint, partial, hosts, optimizers)
            return
    save(checkpoint, path, hosts, optimizers, partial)


def load_module(info: Mapping[str, Any], module: Any, held: Mapping[str, Any], body: Any, module_name: str,
                strict: bool) -> None:
    """Load ``module`` (whose ``state_dict`` is ``held``: this process's tensors, the remote stages' as
    placeholders) from a sharded checkpoint: each process reads its own entries by key, whatever split saved
    them (of a tensor it holds as a shard, the shard's bytes alone); ``body``: the pipelined body whose remote
    stages read theirs at once (None: none)."""
    names = list(held)
    check_names(info, names, strict)
    remote = {layer for layer, process in body.owner.items() if process} if body is not None else set()
    prefixes = tuple(f"{module_name}.{layer}." for layer in remote)
    futures = body.hosts.start("load_shards", info["path"], info["index"], strict, timeout=0) if body else []
    try:
        module.load_state_dict(local_tensors(info, [n for n in names if not n.startswith(prefixes)], held),
                               strict=False)
    finally:
        for future in futures:
            future.result()


def load_optimizer(info: Mapping[str, Any], k: int, optimizer: torch.optim.Optimizer, group_state: Mapping[str, Any],
                   body: Any) -> None:
    """Load ``optimizer`` (mirrored across the stages) from optimizer ``k``'s states in a sharded checkpoint,
    every stage's part reading its own (``body``: the pipelined body, or None where no stage is remote)."""
    futures = body.hosts.start("load_optimizer_shards", info["path"], optimizer._lp_index,  # type: ignore[attr-defined]
                               timeout=0) if body else []
    try:
        load_held(optimizer, optim.as_held(optimizer, local_optimizer_state(info, k, group_state, optimizer)))
    finally:
        for future in futures:
            future.result()


def read_meta(path: str, weights_only: bool | None = None) -> dict[str, Any]:
    """A sharded checkpoint's Lightning entries: Lightning's checkpoint without the tensors of the model and
    optimizers, unpickled as ``torch.load(..., weights_only=weights_only)`` would (None: torch's default); its
    ``lightning_pipe`` entry also records ``path`` and ``index``, the names of the state-dict entries the
    checkpoint holds. A directory of the first format is refused, saying what to do."""
    path = os.fspath(path)
    if shards.is_legacy(path):
        raise OSError(shards.legacy_message(path))
    metadata = shards.read_metadata(path)
    meta = shards.read_rest(path, metadata, weights_only)
    info = meta.get("lightning_pipe", {}) if isinstance(meta, dict) else {}
    if info.get("format") != FORMAT["format"] or info.get("version") != FORMAT["version"]:
        raise ValueError(f"{path} is not a sharded checkpoint this version reads (format: {info.get('format')!r}, "
                         f"version: {info.get('version')!r}; expected: {FORMAT})")
    info["path"] = path
    info["index"] = shards.state_names(metadata)
    return meta


def check_names(info: Mapping[str, Any], expected: Sequence[str], strict: bool) -> None:
    """Refuse, as ``load_state_dict(strict=True)`` does, a checkpoint whose entries are not the model's."""
    if not strict:
        return
    index = set(info["index"])
    missing = [n for n in expected if n not in index]
    unexpected = [n for n in info["index"] if n not in set(expected)]
    if missing or unexpected:
        raise RuntimeError(f"the sharded checkpoint {info['path']} does not hold this model's entries (missing: "
                           f"{missing[:5]}{' ...' if len(missing) > 5 else ''}, unexpected: {unexpected[:5]}"
                           f"{' ...' if len(unexpected) > 5 else ''}); pass strict=False to load what matches")


def local_tensors(info: Mapping[str, Any], names: Sequence[str], held: Mapping[str, Tensor] | None = None
                  ) -> dict[str, Tensor]:
    """The entries ``names`` (this process's) read from the checkpoint. ``held``: this process's tensors by name;
    an entry held as a shard (a ``DTensor``: a stage sharded over its replicas) is read as that shard alone."""
    from lightning_pipe.transport.parallel import fsdp

    held, present = held or {}, set(info["index"])
    shards_of = {n: fsdp.empty_like(held[n], held[n].dtype) for n in names
                 if n in present and n in held and fsdp.is_dtensor(held[n])}
    shards.read_into(info["path"], shards_of)
    return {**shards.read_tensors(info["path"], [n for n in names if n not in shards_of]), **shards_of}


def local_optimizer_state(info: Mapping[str, Any], k: int, group_state: Mapping[str, Any],
                          optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Optimizer ``k``'s ``state_dict`` for this process's parameters: their states from the checkpoint (a
    parameter held as a shard, its states' shards alone), the parameter groups (hyper-parameters) as saved;
    ``optimizer`` spans the whole model in the plain model's order (its remote parameters as placeholders), as the
    one that saved did."""
    names = list(optimizer._lp_names)  # type: ignore[attr-defined]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    own = {n: p for n, p in zip(names, params) if not p.is_meta}
    states = shards.read_optimizer_states(info["path"], k, list(own), held=own)
    index = {n: i for i, n in enumerate(names)}
    return {"state": {index[n]: s for n, s in states.items()}, "param_groups": group_state["param_groups"]}


def consolidate_checkpoint(path: str, output: str) -> None:
    """Write the sharded checkpoint at ``path`` as one file at ``output``, in Lightning's format, with the
    plain model's ``state_dict`` and optimizer states: what ``Model.load_from_checkpoint`` and a plain
    ``Trainer(...).fit(ckpt_path=...)`` take; a Fabric loop's directory becomes the file its ``fabric.save`` writes
    under ``state_dict_type="full"`` (its state's keys, the module's state by the plain module's names). (It holds
    the whole model in memory, as the plain model does.)
    A ``path`` that is no sharded checkpoint (a one-file checkpoint, a folder of checkpoints, a sharded
    checkpoint of the first format) is refused with what it is and what to pass (``NotADirectoryError``,
    ``FileNotFoundError``, ``OSError``)."""
    shards.check_directory(path)
    meta = read_meta(path, weights_only=False)  # (a directory of one's own, consolidated by one's own command)
    info = meta.pop("lightning_pipe")
    entries = shards.read(path, lambda p: p[0] in (shards.STATE, shards.OPTIMIZER))
    state_dict = {p[1]: t for p, t in entries.items() if p[0] == shards.STATE and len(p) == 2}
    states: dict[str, dict[str, dict[str, Any]]] = {}
    for p, value in entries.items():
        if p[0] == shards.OPTIMIZER and len(p) == 4:
            states.setdefault(p[1], {}).setdefault(p[2], {})[p[3]] = value
    del entries
    order = [name for name in info.get("names", []) if name in state_dict]
    meta["state_dict"] = {name: state_dict[name] for name in order + sorted(set(state_dict) - set(order))}
    meta["optimizer_states"] = [
        {"state": {i: states.get(str(k), {})[name] for i, name in enumerate(group["names"])
                   if name in states.get(str(k), {})},
         "param_groups": group["param_groups"]} for k, group in enumerate(meta.get("optimizer_states", []))]
    fabric = meta.pop(FABRIC, None)
    if fabric is not None:  # a Fabric loop's state: its keys again, the module's names as the saved module's
        prefix = fabric.get("prefix", "")  # the body alone saved: the entries outside it are not its
        meta[fabric["module"]] = {name[len(prefix):]: t for name, t in meta.pop("state_dict").items()
                                  if name.startswith(prefix)}
        meta.update(zip(fabric["optimizers"], meta.pop("optimizer_states")))
    temporary = shards.staging(output, ".tmp")
    try:
        torch.save(meta, temporary)
        placing.replace(temporary, output)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)
