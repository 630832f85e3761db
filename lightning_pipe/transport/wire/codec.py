"""One hand-off as one message: a slot and its payload, the payload's tensors packed into one byte buffer.

::

    [ header: kind, length, data bytes, value | tensors' bytes, 64-aligned | skeleton (pickle) ]

The skeleton says where the payload's tensors are in the message, so any payload that pickles today crosses,
whatever its shapes (they change from step to step under dynamic padding); the receiver's tensors are views of
the buffer it received into. A payload of tuples and lists of tensors, None, bools, numbers and strings (every
hand-off between stages, a step's actions) is pickled as ``(slot, payload with holes, the tensors' places, how
many of its first items the encoder was told hold none)`` by pickle's C code alone; any other (a target of the
user's types) is pickled with each tensor replaced by its place as pickle meets it, which calls back into Python
for every object (several times longer).

Control messages (a receive grown, a run aborted, a channel closed, a payload sent by RPC instead, a sign of
life) are a header alone, or a header and a slot; a step's actions travel as a payload.

Where the plane has a lane for the stage's device (:mod:`~lightning_pipe.transport.wire.lane`: CUDA tensors over
NCCL), the payload's tensors on that device are not copied into the message: their places say so (offset -1, their
dtype and shape), and they follow the message on the lane, in order (:func:`encode_beside`, ``decode(receive=)``).
"""

from __future__ import annotations

import io
import pickle
import struct
from collections.abc import Callable
from typing import Any

import numpy
import torch
from torch import Tensor

from lightning_pipe.transport.wire.messages import Slot

__all__: list[str] = []

HEADER = 64  # bytes: 4 int64 (kind, length, data bytes, value), padded so that tensors start aligned
_HEAD = struct.Struct("<4q")
_ALIGN = 64
#: Kinds of message: a payload; the receiver's next receives grow to ``value`` bytes; run ``value`` failed;
#: the sender sends no more; the payload for the slot went by RPC; a process's actions of one step (the
#: driver's); the sender is still working on run ``value`` (a slow stage's sign of life to its driver).
DATA, GROW, ABORT, CLOSE, BY_RPC, STEP, ALIVE = 1, 2, 3, 4, 5, 6, 7


#: The value (fourth field) of a payload's message whose skeleton has holes for its tensors (see the module); of one
#: whose tensors on the lane's device follow it on the lane (:func:`encode_beside`).
_HOLLOW, BESIDE = 1, 2
_HOLE = b"\x00tensor"  # a hole's mark: a payload holding bytes of its own is pickled the other way
_PLAIN = frozenset((bool, int, float, str, type(None)))
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}
# Tensors' bytes as numpy sees them (a dtype numpy lacks as integers of its size): numpy copies and views them with one
# call into torch per tensor, where torch's own slicing and viewing take four. It matters where it runs: on a
# core back from idle (a stage whose layers waited for a GPU or slept), every call into torch costs tens of µs.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NUMPY_HAS = {dtype: torch.empty((), dtype=dtype).numpy().dtype for dtype in _DTYPES if dtype != torch.bfloat16}


class Unsuitable(Exception):
    """A payload that does not travel as a message (a GPU, sparse or subclassed tensor): it goes by RPC."""


class _Other(Exception):
    """A payload that is not tuples and lists of tensors and plain values: pickled with persistent ids."""


def _suitable(tensor: Tensor) -> None:
    if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.is_quantized or tensor.requires_grad:
        raise Unsuitable  # RPC does what it always did with it


def _hollow(value: Any, tensors: list[Tensor], lane: torch.device | None = None) -> Any:
    """``value`` with a hole for each of its tensors, which go into ``tensors`` in order (those on ``lane`` too)."""
    kind = type(value)
    if kind is Tensor:
        if lane is None or value.device != lane:
            _suitable(value)
        elif value.layout != torch.strided or value.is_quantized or value.requires_grad:
            raise Unsuitable
        if value.dtype not in _CODE:
            raise _Other
        tensors.append(value)
        return _HOLE
    if kind is tuple or kind is list:
        return kind([_hollow(item, tensors, lane) for item in value])
    if kind is Slot:  # bundled items' slots: a plain tuple on the wire (equal to it as a mailbox key)
        return tuple(value)
    if kind in _PLAIN:
        return value
    raise _Other


def _fill(value: Any, views: Any) -> Any:
    """``value`` with its holes filled by ``views`` in order."""
    kind = type(value)
    if kind is bytes:
        return next(views)
    if kind is tuple or kind is list:
        return kind([_fill(item, views) for item in value])
    return value


class _Encoder(pickle.Pickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[tuple[Tensor, int]] = []
        self.end = HEADER

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, Tensor):
            return None
        if type(obj) is not Tensor:
            raise Unsuitable  # a subclass pickles its own way, or refuses to: RPC does what it always did
        _suitable(obj)
        offset = self.end
        self.tensors.append((obj, offset))
        self.end = offset + (obj.numel() * obj.element_size() + _ALIGN - 1) // _ALIGN * _ALIGN
        return offset, obj.dtype, tuple(obj.shape)


class _Decoder(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, raw: numpy.ndarray) -> None:
        super().__init__(file)
        self.raw = raw

    def persistent_load(self, pid: Any) -> Tensor:
        return _view(self.raw, *pid)


def _view(raw: numpy.ndarray, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
    """The tensor of ``dtype`` and ``shape`` at ``offset`` in the message ``raw``, a view of it: numpy views its
    bytes (a dtype numpy lacks as integers of its size), one call into torch makes it a tensor."""
    bits = dtype if dtype in _NUMPY_HAS else _BITS[dtype.itemsize]
    count = 1
    for size in shape:
        count *= size
    view = torch.from_numpy(raw[offset:offset + count * dtype.itemsize].view(_NUMPY_HAS[bits]).reshape(shape))
    return view if bits is dtype else view.view(dtype)


def encode(kind: int, slot: Slot, payload: Any = None, plain: int = 0) -> Tensor:
    """``(slot, payload)`` as one message (a uint8 tensor); raises :class:`Unsuitable` for what goes by RPC.
    ``plain``: the first so many items of the tuple ``payload`` hold no tensor (not looked through)."""
    return encode_beside(kind, slot, payload, None, plain)[0]


def encode_beside(kind: int, slot: Slot, payload: Any, lane: torch.device | None, plain: int = 0,
                  unwritten: bool = False) -> tuple[Tensor | Unwritten, list[Tensor]]:
    """As :func:`encode`, the payload's tensors on device ``lane`` left out of the message: they are returned to
    be sent after it on the lane, in order (the receiver's :func:`decode` takes them as it meets their places).
    ``unwritten``: the message as an :class:`Unwritten`, for a transport that writes it where it goes."""
    tensors: list[Tensor] = []
    try:
        hollow = (*payload[:plain], *_hollow(payload[plain:], tensors, lane)) if plain \
            else _hollow(payload, tensors, lane)
    except _Other:
        return _encode_pickled(kind, slot, payload), []
    places = []
    data = HEADER
    beside, inside = [], []
    for tensor in tensors:
        if lane is not None and tensor.device == lane:
            places.append((-1, _CODE[tensor.dtype], tuple(tensor.shape)))
            beside.append(tensor)
            continue
        places.append((data, _CODE[tensor.dtype], tuple(tensor.shape)))
        inside.append((tensor, data))
        data += (tensor.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    skeleton = pickle.dumps((tuple(slot), hollow, places, plain), protocol=pickle.HIGHEST_PROTOCOL)
    message = Unwritten(kind, BESIDE if beside else _HOLLOW, data, skeleton, inside)
    return (message if unwritten else message.tensor()), beside


def _encode_pickled(kind: int, slot: Slot, payload: Any) -> Tensor:
    file = io.BytesIO()
    encoder = _Encoder(file)
    encoder.dump((tuple(slot), payload))
    return _message(kind, 0, encoder.end, file.getbuffer(), encoder.tensors)


def _numpy(tensor: Tensor) -> numpy.ndarray:
    """``tensor`` as numpy sees it, sharing its memory: dtypes numpy lacks as integers of their size."""
    if tensor.dtype not in _NUMPY_HAS:
        tensor = tensor.view(_BITS[tensor.element_size()])
    try:
        return tensor.numpy()
    except RuntimeError:  # a conjugate or negated view: numpy has no such bit, so resolve it (a copy)
        return tensor.resolve_conj().resolve_neg().numpy()


class Unwritten:
    """A message not written yet: its length (``len``), and :meth:`write` to write it into memory of that length. A
    ring in shared memory has it written where the receiver reads it: one copy of its tensors' bytes, not two."""

    __slots__ = ("kind", "value", "data", "skeleton", "tensors")

    def __init__(self, kind: int, value: int, data: int, skeleton: Any, tensors: Any) -> None:
        self.kind, self.value, self.data, self.skeleton, self.tensors = kind, value, data, skeleton, tensors

    def __len__(self) -> int:
        return self.data + len(self.skeleton)

    def write(self, raw: numpy.ndarray) -> None:
        """Write the message into ``raw`` (uint8, as long as the message)."""
        _HEAD.pack_into(raw, 0, self.kind, len(raw), self.data, self.value)
        for tensor, offset in self.tensors:
            source = _numpy(tensor)
            numpy.copyto(raw[offset:offset + source.nbytes].view(source.dtype).reshape(source.shape), source)
        raw[self.data:] = numpy.frombuffer(self.skeleton, dtype=numpy.uint8)

    def tensor(self) -> Tensor:
        """The message written into memory of its own, as a uint8 tensor."""
        raw = numpy.empty(len(self), dtype=numpy.uint8)
        self.write(raw)
        return torch.from_numpy(raw)


def _message(kind: int, value: int, data: int, skeleton: Any, tensors: Any) -> Tensor:
    return Unwritten(kind, value, data, skeleton, tensors).tensor()


def control(kind: int, value: int) -> Tensor:
    """A message of ``kind`` carrying ``value`` alone (a capacity, a run)."""
    raw = numpy.zeros(HEADER, dtype=numpy.uint8)
    _HEAD.pack_into(raw, 0, kind, HEADER, HEADER, value)
    return torch.from_numpy(raw)


def header(buffer: Tensor) -> tuple[int, int]:
    """The kind of the message in ``buffer`` and its value (a control message's)."""
    kind, _, _, value = _HEAD.unpack_from(buffer.numpy())
    return kind, value


def decode(buffer: Tensor, receive: Callable[[torch.dtype, tuple[int, ...]], Tensor] | None = None
           ) -> tuple[Slot, Any]:
    """The ``(slot, payload)`` of the message in ``buffer``; its tensors are views of ``buffer`` (of a copy of
    the used part where that is less than half the buffer, so that a large receive is not held by a small
    message), those that follow it on the lane ``receive(dtype, shape)``'s, taken in order."""
    raw = buffer.numpy()
    _, length, data, value = _HEAD.unpack_from(raw)
    if length * 2 < len(buffer):
        raw = raw[:length].copy()
    if value != _HOLLOW and value != BESIDE:
        slot, payload = _Decoder(io.BytesIO(raw[data:length].tobytes()), raw).load()
        return Slot._make(slot), payload
    slot, hollow, places, plain = pickle.loads(raw[data:length])
    slot = Slot._make(slot)
    if not places:
        return slot, hollow
    if value == BESIDE and receive is None:
        raise ValueError("a message whose tensors follow it on a lane, decoded without the lane")
    views = iter([_view(raw, offset, _DTYPES[code], shape) if offset >= 0 else receive(_DTYPES[code], shape)
                  for offset, code, shape in places])
    if plain:  # the items before ``plain`` have no holes: not looked through (a step's actions)
        return slot, (*hollow[:plain], *_fill(hollow[plain:], views))
    return slot, _fill(hollow, views)
