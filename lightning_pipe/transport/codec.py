"""One hand-off as one message: a slot and its payload, the payload's tensors packed into one byte buffer.

::

    [ header: kind, length, data bytes, value | tensors' bytes, 64-aligned | skeleton (pickle) ]

The skeleton is the pickled ``(slot, payload)`` with each tensor replaced by its place in the message, so any
payload that pickles today crosses, whatever its shapes (they change from step to step under dynamic
padding); the receiver's tensors are views of the buffer it received into. Control messages (a receive grown,
a run aborted, a channel closed, a payload sent by RPC instead, a sign of life) are a header alone, or a header
and a slot; a step's actions travel as a payload.
"""

from __future__ import annotations

import io
import pickle
import struct
from typing import Any

import numpy
import torch
from torch import Tensor

from lightning_pipe.transport.messages import Slot

__all__: list[str] = []

HEADER = 64  # bytes: 4 int64 (kind, length, data bytes, value), padded so that tensors start aligned
_HEAD = struct.Struct("<4q")
_ALIGN = 64
#: Kinds of message: a payload; the receiver's next receives grow to ``value`` bytes; run ``value`` failed;
#: the sender sends no more; the payload for the slot went by RPC; a process's actions of one step (the
#: driver's); the sender is still working on run ``value`` (a slow stage's sign of life to its driver).
DATA, GROW, ABORT, CLOSE, BY_RPC, STEP, ALIVE = 1, 2, 3, 4, 5, 6, 7


class Unsuitable(Exception):
    """A payload that does not travel as a message (a GPU, sparse or subclassed tensor): it goes by RPC."""


class _Encoder(pickle.Pickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[tuple[Tensor, int]] = []
        self.end = HEADER

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, Tensor):
            return None
        if type(obj) is not Tensor or obj.device.type != "cpu" or obj.layout != torch.strided or obj.is_quantized \
                or obj.requires_grad:
            raise Unsuitable  # a subclass pickles its own way, or refuses to: RPC does what it always did
        offset = self.end
        self.tensors.append((obj, offset))
        self.end = offset + (obj.numel() * obj.element_size() + _ALIGN - 1) // _ALIGN * _ALIGN
        return offset, obj.dtype, tuple(obj.shape)


class _Decoder(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, buffer: Tensor) -> None:
        super().__init__(file)
        self.buffer = buffer

    def persistent_load(self, pid: Any) -> Tensor:
        offset, dtype, shape = pid
        count = 1
        for size in shape:
            count *= size
        return self.buffer[offset:offset + count * dtype.itemsize].view(dtype).view(shape)


def encode(kind: int, slot: Slot, payload: Any = None) -> Tensor:
    """``(slot, payload)`` as one message (a uint8 tensor); raises :class:`Unsuitable` for what goes by RPC."""
    file = io.BytesIO()
    encoder = _Encoder(file)
    encoder.dump((slot, payload))
    skeleton = file.getbuffer()
    data = encoder.end
    message = torch.empty(data + len(skeleton), dtype=torch.uint8)
    raw = message.numpy()  # the header and the skeleton through numpy: a few µs less per message than torch
    _HEAD.pack_into(raw, 0, kind, len(raw), data, 0)
    for tensor, offset in encoder.tensors:
        nbytes = tensor.numel() * tensor.element_size()
        message[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
    raw[data:] = numpy.frombuffer(skeleton, dtype=numpy.uint8)
    return message


def control(kind: int, value: int) -> Tensor:
    """A message of ``kind`` carrying ``value`` alone (a capacity, a run)."""
    message = torch.zeros(HEADER, dtype=torch.uint8)
    _HEAD.pack_into(message.numpy(), 0, kind, HEADER, HEADER, value)
    return message


def header(buffer: Tensor) -> tuple[int, int]:
    """The kind of the message in ``buffer`` and its value (a control message's)."""
    kind, _, _, value = _HEAD.unpack_from(buffer.numpy())
    return kind, value


def decode(buffer: Tensor) -> tuple[Slot, Any]:
    """The ``(slot, payload)`` of the message in ``buffer``; its tensors are views of ``buffer`` (of a copy of
    the used part where that is less than half the buffer, so that a large receive is not held by a small
    message)."""
    raw = buffer.numpy()
    _, length, data, _ = _HEAD.unpack_from(raw)
    if length * 2 < len(buffer):
        buffer = buffer[:length].clone()
    return _Decoder(io.BytesIO(raw[data:length].tobytes()), buffer).load()
