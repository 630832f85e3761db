"""One process's part of a sharded checkpoint, a ``torch.distributed.checkpoint`` (DCP) directory: written by
key, read back by key.

A sharded checkpoint is one DCP checkpoint: each pipeline process writes its own entries (``__<process>_0.distcp``)
and the main process, last, DCP's ``.metadata`` for all of them. Keys are paths in a nested dict::

    state_dict/<name>                 a tensor of the module's state dict, by the plain model's name
    optimizer/<k>/<name>/<key>        optimizer k's state <key> of parameter <name> (exp_avg, step, ...)
    lightning                         the rest of Lightning's checkpoint (bytes), written by the main process

so any process of any later split reads the entries its layers need by key, whichever process wrote them: a
checkpoint saved at balance ``[2, 2]`` loads at ``[1, 3]``, at another replica count, or into the plain model
(``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``, or :func:`~lightning_pipe.lightning.sharded.
consolidate_checkpoint` for Lightning's one-file format).

Why no process group: DCP's collective save and load take a process group registered with ``torch.distributed``
(``dist.get_rank(group)``, ``gather_object(dst=<global rank>)``). The processes of one pipeline cannot have one:
each process's default group is its *stage* group (stage ``i`` of every replica, :mod:`~lightning_pipe.transport.
session`), whose ranks are replica indices, so every process of replica 0's pipeline has default rank 0 and no
``new_group`` can name them; a gloo group made through the world store (as :mod:`~lightning_pipe.transport.stages.tied`
makes one) is unregistered, and DCP's collectives refuse it. What DCP's collectives would exchange, each
process's plan and its written files, needs no collective here: every process holds distinct keys (no resharding
of a tensor across processes, nothing to deduplicate), so each runs DCP's save on its own (``no_dist``) into the
shared directory under its own file prefix, and hands its part of the metadata back to the main process in the
reply of the RPC that asked for the save (the gather); the main process merges them into the one ``.metadata``.
Loading is DCP's own ``no_dist`` load: a process of any replica reads its own keys, independently of every other
process (no replica waits for another, nothing is exchanged).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pickle
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_pipe.transport.placing import staging  # noqa: F401 - the save paths stage through here

__all__: list[str] = []

#: DCP's metadata file: the last file written, and what makes a directory a sharded checkpoint.
META = ".metadata"

#: The index of lightning_pipe's first sharded format (``meta.pt`` and a ``stage-NNNNN.pt`` per process).
LEGACY_META = "meta.pt"

#: What a sharded checkpoint is, for messages about a path that is not one.
WHAT = ('a sharded checkpoint\'s directory, as PipeStrategy(state_dict_type="sharded") writes one per save (for '
        'example lightning_logs/version_0/checkpoints/epoch=3-step=400.ckpt/, a torch.distributed.checkpoint '
        'directory holding .metadata and a __N_0.distcp file per process)')

#: The top-level keys of a sharded checkpoint's entries.
STATE, OPTIMIZER, LIGHTNING = "state_dict", "optimizer", "lightning"



@contextlib.contextmanager
def _single_process() -> Iterator[None]:
    """Every save and load here is a single process's on purpose (the module's docstring): without DCP's warning
    that it is."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def legacy_message(path: str) -> str:
    """What to say of a sharded checkpoint in the first format."""
    return (f"{path} is a sharded checkpoint in lightning_pipe's earlier format ({LEGACY_META} and a stage-NNNNN.pt "
            "file per process), which this version no longer reads: sharded checkpoints are now "
            "torch.distributed.checkpoint directories (.metadata and __N_0.distcp files). Consolidate it with the "
            "lightning_pipe version that wrote it (python -m lightning_pipe consolidate DIR FILE): the one-file "
            "checkpoint it writes resumes exactly with this version (Trainer.fit(ckpt_path=FILE)), and loads with "
            "Model.load_from_checkpoint")


def is_legacy(path: Any) -> bool:
    """Whether ``path`` is a sharded checkpoint of the first format (``meta.pt``, no DCP ``.metadata``)."""
    return (isinstance(path, (str, os.PathLike)) and os.path.isfile(os.path.join(path, LEGACY_META))
            and not os.path.isfile(os.path.join(path, META)))


def entries(tensors: Mapping[str, Tensor], optimizer_states: Mapping[int, Mapping[str, Mapping[str, Any]]],
            rest: Any = None) -> dict[str, Any]:
    """One process's entries of a sharded checkpoint: its tensors by name, its optimizers' per-parameter states
    (optimizer index -> parameter name -> state) and, for the main process, ``rest`` (kept whole, as bytes:
    DCP's flattening would drop empty dicts, which Lightning's loop states hold, and make int keys strings)."""
    out: dict[str, Any] = {STATE: dict(tensors),
                           OPTIMIZER: {str(k): {name: dict(s) for name, s in states.items()}
                                       for k, states in optimizer_states.items()}}
    if rest is not None:
        buffer = io.BytesIO()
        torch.save(rest, buffer)
        out[LIGHTNING] = buffer.getvalue()
    return out


def _writer(directory: str, process: int, others: Callable[[], list[Any]] | None) -> Any:
    """DCP's file-system writer for process ``process``: its files named ``__<process>_N.distcp`` (with several
    replicas of a sharded stage saving together, ``__<process>-<replica>_N.distcp``); the main process
    (``others`` given: the other processes' ``(metadata, results)``) writes the merged ``.metadata``, any other
    process keeps its part (:attr:`part`) for the main process."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import _StoragePrefix

    class Writer(FileSystemWriter):
        part: Any = None

        def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
            names = [f"__{process}_"] if len(plans) == 1 else [f"__{process}-{r}_" for r in range(len(plans))]
            return [dataclasses.replace(plan, storage_data=_StoragePrefix(name)) for plan, name in zip(plans, names)]

        def finish(self, metadata: Any, results: list[list[Any]]) -> None:
            if others is None:
                self.part = (metadata, results)
                return
            for their_metadata, their_results in others():
                for key, value in their_metadata.state_dict_metadata.items():
                    metadata.state_dict_metadata.setdefault(key, value)
                metadata.planner_data = {**(their_metadata.planner_data or {}), **(metadata.planner_data or {})}
                results = [*results, *their_results]
            super().finish(metadata, results)  # .metadata.tmp, then renamed: last of all

    return Writer(directory, thread_count=1, overwrite=True)


def write_shard(directory: str, process: int, state: Mapping[str, Any],
                others: Callable[[], list[Any]] | None = None, group: bool = False) -> Any:
    """Write process ``process``'s ``state`` (see :func:`entries`) into the DCP checkpoint ``directory``. The main
    process passes ``others`` (waits for the other processes' parts) and writes ``.metadata``; any other process
    returns its part of the metadata, for the main process.

    ``group``: the state holds shards of a stage sharded over its replicas (``DTensor``s), and every replica's
    process of that stage writes at once, DCP's collective save over the process's default group (the stage's
    replicas): each writes its shards, and the group's first process (replica 0's) plans for all and gets the
    part of them all (``others`` is the main process's: replica 0's driver); the others return None."""
    import torch.distributed.checkpoint as dcp

    if not group:
        writer = _writer(directory, process, others)
        with _single_process():
            dcp.save(dict(state), storage_writer=writer, no_dist=True)
        return writer.part
    import torch.distributed as dist

    writer = _writer(directory, process, others)
    dcp.save(dict(state), storage_writer=writer)
    return writer.part if dist.get_rank() == 0 else None


def read_metadata(directory: str) -> Any:
    """DCP's metadata of the checkpoint ``directory``."""
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(directory).read_metadata()


def paths(metadata: Any) -> dict[str, tuple[Any, ...]]:
    """Each key of the checkpoint (DCP's flattened name) and its path in the nested entries."""
    mapping = metadata.planner_data or {}
    return {key: tuple(mapping.get(key, (key,))) for key in metadata.state_dict_metadata}


class _Part:
    """Where one stored tensor's bytes lie in its file (DCP stores each as ``torch.save`` writes it: a small zip
    archive), found from the archive's index and pickle alone, on the meta device: no data read."""

    def __init__(self, view: Any) -> None:
        archive = torch._C.PyTorchFileReader(view)  # what torch.load opens it with
        order = archive.get_record("byteorder") if archive.has_record("byteorder") else b"little"
        if order != sys.byteorder.encode():
            raise ValueError(f"stored {order.decode()}-endian")  # torch.load swaps the bytes: its way, then
        view.seek(0)
        header = torch.load(view, map_location="meta", weights_only=True)
        self.offset = header.untyped_storage()._checkpoint_offset  # of its data, from the archive's start
        self.dtype, self.stride, self.start = header.dtype, header.stride(), header.storage_offset()

    def span(self, offsets: Sequence[int], lengths: Sequence[int]) -> tuple[int, int]:
        """The first element and the element past the last of the block at ``offsets`` of ``lengths``, in the
        stored tensor's storage (the rows of a block of whole rows are contiguous: just their bytes)."""
        first = self.start + sum(o * s for o, s in zip(offsets, self.stride))
        if any(n == 0 for n in lengths):
            return first, first
        return first, first + sum((n - 1) * s for n, s in zip(lengths, self.stride)) + 1


def _reader(directory: str) -> Any:
    """DCP's file-system reader of ``directory``, except that of each stored tensor it reads only the bytes of the
    part asked for: a shard of a ``DTensor`` (a stage sharded over its replicas) from a tensor saved whole costs
    the shard's bytes, read and held, not the tensor's. (DCP's own reader loads every stored tensor whole and
    then narrows it.) Stored items it does not know how to cut (transformed by an extension, or whose
    archive's data cannot be located: another byte order, a torch that does not say) are read DCP's way."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.planner import LoadItemType

    class Reader(FileSystemReader):
        def read_data(self, plan: Any, planner: Any) -> Any:
            theirs, ours = [], []
            for item in plan.items:
                stored = self.storage_data[item.storage_index]
                plain = item.type == LoadItemType.TENSOR and not stored.transform_descriptors
                (ours if plain else theirs).append(item)
            by_file: dict[str, list[Any]] = {}
            for item in ours:
                by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
            for relative, items in by_file.items():
                with self.fs.create_stream(self.fs.concat_path(self.path, relative), "rb") as stream:
                    for item in items:
                        if not self._read_part(stream, item, planner):
                            theirs.append(item)
            return super().read_data(dataclasses.replace(plan, items=theirs), planner)

        def _read_part(self, stream: Any, item: Any, planner: Any) -> bool:
            stored = self.storage_data[item.storage_index]
            try:
                part = _Part(self._slice_file(stream, stored))
            except (AttributeError, RuntimeError, ValueError, pickle.UnpicklingError):
                return False
            first, end = part.span(item.storage_offsets, item.lengths)
            size = torch.empty((), dtype=part.dtype).element_size()
            data = bytearray((end - first) * size)
            stream.seek(stored.offset + part.offset + first * size)
            if stream.readinto(data) != len(data):
                raise OSError(f"{self.path}/{stored.relative_path} ends before the tensor stored at offset "
                              f"{stored.offset} does: a truncated checkpoint file")
            target = planner.resolve_tensor(item).detach()
            if data:  # (an empty block: nothing to copy)
                target.copy_(torch.frombuffer(data, dtype=part.dtype).as_strided(tuple(item.lengths), part.stride))
            planner.commit_tensor(item, target)
            return True

    return Reader(directory)


def read(directory: str, wanted: Callable[[tuple[Any, ...]], bool], metadata: Any = None,
         into: Callable[[tuple[Any, ...], Any], Tensor | None] | None = None) -> dict[tuple[Any, ...], Any]:
    """The entries whose path ``wanted`` accepts, by path, read on CPU; ``into(path, metadata)`` may give a tensor
    to read an entry into instead (a ``DTensor``: its own shard alone is read, see :func:`_reader`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_metadata(directory) if metadata is None else metadata
    keys = {key: path for key, path in paths(metadata).items() if wanted(path)}
    if not keys:
        return {}
    flat: dict[str, Any] = {}
    for key, path in keys.items():
        md = metadata.state_dict_metadata[key]
        target = into(path, md) if into is not None and isinstance(md, TensorStorageMetadata) else None
        flat[key] = (target if target is not None else torch.empty(md.size, dtype=md.properties.dtype)
                     if isinstance(md, TensorStorageMetadata) else None)  # bytes: DCP puts the object there
    with _single_process():
        dcp.load(flat, storage_reader=_reader(directory), no_dist=True)
    return {path: flat[key] for key, path in keys.items()}


def read_into(directory: str, targets: Mapping[str, Tensor]) -> None:
    """Read the state-dict entries ``targets`` names into those tensors, in place: into a ``DTensor`` its own
    shard alone (only the bytes of that shard are read, :func:`_reader`), whichever layout saved them."""
    import torch.distributed.checkpoint as dcp

    if not targets:
        return
    with _single_process():
        dcp.load({STATE: dict(targets)}, storage_reader=_reader(directory), no_dist=True)


def read_tensors(directory: str, names: Iterable[str], metadata: Any = None) -> dict[str, Tensor]:
    """The state-dict entries ``names`` (those the checkpoint has)."""
    names = set(names)
    found = read(directory, lambda p: len(p) == 2 and p[0] == STATE and p[1] in names, metadata)
    return {path[1]: t for path, t in found.items()}


def read_optimizer_states(directory: str, k: int, names: Sequence[str], metadata: Any = None,
                          held: Mapping[str, Tensor] | None = None) -> dict[str, dict[str, Any]]:
    """Optimizer ``k``'s per-parameter states of ``names`` (those the checkpoint has), by name. ``held``: the
    parameters by name; a state of a parameter held as a shard (a ``DTensor``: a stage sharded over its replicas),
    of the parameter's shape, is read as that shard alone (a ``DTensor`` like the parameter)."""
    from lightning_pipe.transport.parallel import fsdp

    names, optimizer = set(names), str(k)

    def into(path: tuple[Any, ...], md: Any) -> Tensor | None:
        param = (held or {}).get(path[2])
        if param is None or not fsdp.is_dtensor(param) or tuple(md.size) != tuple(param.shape):
            return None
        return fsdp.empty_like(param, md.properties.dtype)

    found = read(directory, lambda p: len(p) == 4 and p[0] == OPTIMIZER and p[1] == optimizer and p[2] in names,
                 metadata, into)
    out: dict[str, dict[str, Any]] = {}
    for path, value in found.items():
        out.setdefault(path[2], {})[path[3]] = value
    return out


def state_names(metadata: Any) -> list[str]:
    """The names of the state-dict entries a checkpoint holds."""
    return [path[1] for path in paths(metadata).values() if len(path) == 2 and path[0] == STATE]


def read_rest(directory: str, metadata: Any = None, weights_only: bool | None = None) -> Any:
    """The rest of Lightning's checkpoint, as the main process saved it, unpickled as ``torch.load(...,
    weights_only=weights_only)`` does (None: torch's default, as Lightning's loading of a local file)."""
    found = read(directory, lambda p: p == (LIGHTNING,), metadata)
    if (LIGHTNING,) not in found:
        raise ValueError(f"{directory} is a torch.distributed.checkpoint directory without the '{LIGHTNING}' entry "
                         "that PipeStrategy(state_dict_type=\"sharded\") writes: not a checkpoint of a Lightning run")
    return torch.load(io.BytesIO(found[(LIGHTNING,)]), weights_only=weights_only, map_location="cpu")


def sharded_checkpoints(folder: str, depth: int = 4) -> list[str]:
    """The sharded checkpoints (complete: ``.metadata`` in) in ``folder`` and its folders down to ``depth``
    levels (``<default_root_dir>/lightning_logs/version_0/checkpoints/<checkpoint>`` is 4), sorted; hidden folders
    and a checkpoint's own are not searched."""
    found: list[str] = []
    try:
        scanned = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return found
    for entry in scanned:
        if not entry.is_dir() or entry.name.startswith("."):
            continue
        if os.path.isfile(os.path.join(entry.path, META)):
            found.append(entry.path)
        elif depth > 1:
            found.extend(sharded_checkpoints(entry.path, depth - 1))
    return found


def check_directory(path: str, limit: int = 20) -> None:
    """Refuse ``path`` unless it is a complete sharded checkpoint's directory, saying what it is instead and
    what to pass: ``FileNotFoundError`` (nothing there; a folder without ``.metadata``, listing the sharded
    checkpoints inside it), ``NotADirectoryError`` (a file: a one-file checkpoint, or a file of a sharded
    one), ``OSError`` (a sharded checkpoint of the earlier format)."""
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, META)):
        return
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist: expected {WHAT}")
    if not os.path.isdir(path):
        parent = os.path.dirname(os.path.abspath(path))
        if os.path.isfile(os.path.join(parent, META)) or is_legacy(parent):
            raise NotADirectoryError(f"{path} is a file of the sharded checkpoint {parent}: pass that directory")
        raise NotADirectoryError(
            f"{path} is a file, not a directory: a one-file checkpoint (PipeStrategy(state_dict_type=\"full\"), "
            "the default) needs no consolidation, Model.load_from_checkpoint and Trainer.fit(ckpt_path=...) take it "
            f"as it is. Expected {WHAT}")
    if is_legacy(path):
        raise OSError(legacy_message(path))
    if ".partial-" in os.path.basename(os.path.normpath(path)) or any(
            name.endswith(".distcp") for name in os.listdir(path)):
        raise FileNotFoundError(
            f"{path} has no {META}: it is a save that did not finish ({META} is written last, once every "
            f"process's file is in), not a checkpoint. Expected {WHAT}")
    found = sharded_checkpoints(path)
    if not found:
        raise FileNotFoundError(f"{path} is a folder without {META} and holds no sharded checkpoint: expected {WHAT}")
    shown = "".join(f"\n  {f}" for f in found[:limit]) + (f"\n  ... ({len(found) - limit} more)"
                                                            if len(found) > limit else "")
    raise FileNotFoundError(f"{path} is a folder of checkpoints, not a sharded checkpoint (no {META} in it): pass "
                            f"one of the {len(found)} sharded checkpoints inside it:{shown}")
