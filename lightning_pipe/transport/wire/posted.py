"""The receives a data plane keeps posted ahead for one peer's messages, in order, and the capacity of the next."""

from __future__ import annotations

import collections
import datetime
import threading
from typing import Any

import numpy
import torch
from torch import Tensor

from lightning_pipe.transport.wire.codec import BESIDE, DATA, GROW, STEP, decode, header
from lightning_pipe.transport.wire.lane import TensorLane

__all__ = ["START", "Channel"]

START = 64 << 10  # every channel's first capacity (bytes)


class Channel:
    """The messages from one peer: the receives posted for them, in order, and the capacity of the next."""

    def __init__(self, group: Any, peer: int, depth: int, lane: TensorLane | None) -> None:
        self.group = group
        self.peer = peer
        self.lane = lane.receiver(peer) if lane is not None else None
        self.capacity = START
        self.posted: collections.deque[tuple[Any, Tensor]] = collections.deque()
        self.lock = threading.Lock()
        self.error: str | None = None  # why it carries no more (the peer closed it, a wait failed)
        for _ in range(depth - 1):
            self._post()

    def _post(self) -> None:
        buffer = torch.from_numpy(numpy.empty(self.capacity, dtype=numpy.uint8))  # one call into torch, not two
        self.posted.append((self.group.recv([buffer], self.peer, 0), buffer))

    def receive(self, timeout: float, idle: bool = False) -> tuple[int, int, Any]:
        """The next message (kind, value, buffer); ``idle``: none due soon. A receive is posted first, at the capacity
        of now (``depth`` are then posted), so that posting costs nothing while the message is awaited. A message
        whose tensors follow it on the lane is decoded here, in order (its buffer then its ``(slot, payload)``)."""
        self._post()
        work, buffer = self.posted.popleft()
        if idle and hasattr(work, "awake"):
            work.awake = False  # a ring's reader sleeps at once: no message is due soon (gloo's works: nothing)
        work.wait(datetime.timedelta(seconds=max(timeout, 0.001)))
        kind, value = header(buffer)
        if kind == GROW:
            self.capacity = value
        elif value == BESIDE and (kind == DATA or kind == STEP):
            return kind, value, decode(buffer, self.lane)
        return kind, value, buffer
