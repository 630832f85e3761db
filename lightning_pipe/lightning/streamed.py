"""``torch.save``'s file format written one group of tensors at a time: a consolidated checkpoint, stage by stage.

The main process holds its own stage's tensors and, for every other stage's, a placeholder on the meta device
(its name, shape and dtype). :func:`save_streamed` pickles the checkpoint with each placeholder as the tensor
it stands for (a storage record of the right size, on CPU), writes the main process's records, then asks each
stage in turn for its tensors and writes them, dropping each stage's before the next arrives. The file is the
one ``torch.save`` would write with every tensor in hand (``torch.load``, ``weights_only`` and ``mmap``
included), and the main process never holds more than its own stage and one other::

    data.pkl            the checkpoint, placeholders as CPU tensors of storage "k"
    data/0, data/1 ...  the main process's tensors
    data/k ...          stage 1's, fetched, written, dropped; then stage 2's ...
"""

from __future__ import annotations

import io
import pickle
import sys
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__: list[str] = []

#: A placeholder's source: (group, key), fetched as ``fetch(group, [keys])[key]``.
Source = tuple[Hashable, Hashable]


class _Lazy:
    """The storage of a placeholder in the pickle: its record's key, type and element count."""

    def __init__(self, key: str, storage_type: Any, numel: int) -> None:
        self.key, self.storage_type, self.numel = key, storage_type, numel


def _storage_type(dtype: torch.dtype) -> Any:
    return getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])


class _Pickler(pickle.Pickler):
    """Pickles as ``torch.save`` does, real storages by reference to their records; a placeholder listed in
    ``lazy`` becomes a contiguous CPU tensor over a record still to come."""

    def __init__(self, file: io.BytesIO, lazy: Mapping[int, Source]) -> None:
        super().__init__(file, protocol=2)
        self.lazy = lazy
        self.keys: dict[int, str] = {}  # storage (or placeholder) id -> record key
        self.real: dict[str, Any] = {}  # record key -> untyped storage
        self.later: dict[str, tuple[Source, Tensor]] = {}  # record key -> (source, placeholder)

    def _key(self, identity: int) -> str:
        return self.keys.setdefault(identity, str(len(self.keys)))

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, Tensor) and id(obj) in self.lazy:
            key = self._key(id(obj))
            self.later[key] = (self.lazy[id(obj)], obj)
            size = tuple(obj.size())
            stride = tuple(torch.empty(size, device="meta").stride())
            storage = _Lazy(key, _storage_type(obj.dtype), obj.numel())
            return torch._utils._rebuild_tensor_v2, (storage, 0, size, stride, obj.requires_grad, OrderedDict())
        if isinstance(obj, Tensor) and obj.is_meta:  # pickle would keep it as a meta tensor: data lost
            raise ValueError(f"a tensor on the meta device that stands for no stage's tensor cannot be saved "
                             f"(shape {tuple(obj.shape)}, {obj.dtype}): materialise it, or leave it out of the "
                             f"checkpoint")
        return NotImplemented

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Lazy):
            return ("storage", obj.storage_type, obj.key, "cpu", obj.numel)
        if isinstance(obj, torch.storage.TypedStorage):
            storage, storage_type, numel = obj._untyped_storage, getattr(torch, obj._pickle_storage_type()), obj._size()
        elif torch.is_storage(obj):
            storage, storage_type, numel = obj, torch.UntypedStorage, obj.nbytes()
        else:
            return None
        key = self._key(storage._cdata)
        self.real[key] = storage
        return ("storage", storage_type, key, torch.serialization.location_tag(storage), numel)


def _record(tensor: Tensor) -> Any:
    """``tensor``'s data as a storage of exactly its elements, contiguous, on CPU."""
    t = tensor.detach().cpu()
    exact = t.untyped_storage().nbytes() == t.numel() * t.element_size()
    if not (t.is_contiguous() and t.storage_offset() == 0 and exact):
        t = t.clone(memory_format=torch.contiguous_format)
    return t.untyped_storage()


def save_streamed(obj: Any, path: str, lazy: Mapping[int, Source],
                  fetch: Callable[[Hashable, Sequence[Hashable]], Mapping[Hashable, Tensor]]) -> None:
    """``torch.save(obj, path)``, where every placeholder ``t`` with ``id(t)`` in ``lazy`` (meta tensors) is
    saved as the tensor ``fetch(group, keys)[key]`` with ``(group, key) = lazy[id(t)]``; ``fetch`` is called
    once per group, in the order groups first appear, and what it returns is dropped once written."""
    buffer = io.BytesIO()
    pickler = _Pickler(buffer, lazy)
    pickler.dump(obj)
    groups: dict[Hashable, list[tuple[str, Hashable, Tensor]]] = {}
    for key, ((group, source), placeholder) in pickler.later.items():
        groups.setdefault(group, []).append((key, source, placeholder))
    writer = torch._C.PyTorchFileWriter(path, torch.serialization.get_crc32_options(),
                                        torch.serialization._get_storage_alignment())
    data = buffer.getvalue()
    writer.write_record("data.pkl", data, len(data))
    writer.write_record(".format_version", "1", len("1"))
    alignment = str(torch.serialization._get_storage_alignment())
    writer.write_record(".storage_alignment", alignment, len(alignment))
    writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
    for key, storage in pickler.real.items():
        storage = storage.cpu()
        writer.write_record(f"data/{key}", storage, storage.nbytes())
    for group, entries in groups.items():
        fetched = fetch(group, [source for _, source, _ in entries])
        for key, source, placeholder in entries:
            tensor = fetched[source]
            if tensor.shape != placeholder.shape or tensor.dtype != placeholder.dtype:
                raise RuntimeError(f"{source} of {group} changed while saving (expected {tuple(placeholder.shape)} "
                                   f"{placeholder.dtype}, got {tuple(tensor.shape)} {tensor.dtype})")
            storage = _record(tensor)
            writer.write_record(f"data/{key}", storage, storage.nbytes())
        del fetched
    writer.write_end_of_file()
