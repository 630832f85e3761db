"""Tensors beside their message: a hand-off's tensors on the stage's device sent point to point over a group per
sending and receiving process (NCCL for CUDA tensors), while the message that says what they are travels the plane.

The data plane copies a CPU tensor into its message; a CUDA tensor it cannot (the message is host memory), so
without a lane it goes by RPC (TensorPipe's device maps). With one, the message goes first on the plane, its places
for those tensors marked (:func:`~lightning_pipe.transport.wire.codec.encode_beside`), and the tensors follow it on
the lane, in order::

    sender:   plane.send(header) ─► lane(s→r).send(t1) ─► lane(s→r).send(t2)      (under the plane's send lock)
    receiver: plane.receive(header) ─► empty(t1's shape) ◄─ lane(s→r).recv ─► ... (under the channel's lock)

Both sides meet each lane's operations in one order, as NCCL requires: the sender starts a message's tensors
right after the message, under the lock that orders its messages; the receiver takes them as it decodes the
message, under the lock that orders its receives from that sender. Each group carries one direction between two
processes (two per pair), so two processes sending each other at once never wait behind each other's receives on
one communicator. A CUDA receive's ``wait`` orders the receiving thread's stream after it; the host does not block.

The same code runs with gloo groups and CPU tensors (``backend="gloo"``), which is how the CPU test suite exercises
it; on one machine the rings of shared memory carry CPU tensors faster, inside the message (docs/benchmarks.md).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["LANES", "TensorLane", "lane_groups"]

#: The backends a lane runs on: NCCL between GPUs, gloo between CPU processes (the test suite's).
LANES = ("nccl", "gloo")


class Sent:
    """A tensor's send on the lane, the tensor kept alive with it. A gloo send completes once its receiver has taken
    it (the message before it decoded: no receive is posted ahead on a lane); a CUDA send is NCCL's to see through
    (it keeps the tensor until its kernel is done), and waiting for it would hold the caller's stream back until
    the receiver takes it, so :meth:`wait` does not."""

    def __init__(self, work: Any, tensor: Tensor, blocking: bool) -> None:
        self.work, self.tensor, self.blocking = work, tensor, blocking

    def wait(self, timeout: datetime.timedelta) -> None:
        """Wait for a gloo send, at most ``timeout``."""
        if self.blocking:
            self.work.wait(timeout)


class TensorLane:
    """This process's lanes to and from every other process of a data plane, over ``backend``: ``outgoing[p]``
    sends to process ``p`` (rank 1 of it), ``incoming[p]`` receives from ``p`` (rank 0 of it); tensors on ``device``
    take it."""

    def __init__(self, outgoing: dict[int, Any], incoming: dict[int, Any], device: torch.device, timeout: float,
                 backend: str) -> None:
        self.outgoing, self.incoming = outgoing, incoming
        self.backend = backend
        self.device = device
        self.timeout = timeout
        self.blocking = backend == "gloo"  # gloo's waits block the host; NCCL's order the caller's stream
        self.sent = 0  # tensors sent (under the plane's send lock), for tests and benchmarks
        self.received_from = dict.fromkeys(incoming, 0)  # tensors received per sender (under its channel's lock)

    @property
    def received(self) -> int:
        """Tensors received from every process, for tests and benchmarks."""
        return sum(self.received_from.values())

    def send(self, peer: int, tensors: Sequence[Tensor]) -> list[Sent]:
        """Start sending ``tensors`` to process ``peer``, in order (right after their message, under the plane's
        send lock). An empty tensor is not sent: its receiver makes it from the shape alone."""
        group = self.outgoing[peer]
        started = []
        for tensor in tensors:
            if tensor.numel() == 0:
                continue
            # Its bytes as it reads: a conjugate or negative view keeps its bit through contiguous(), and the
            # receiver would read the bytes under it (the conjugate's conjugate, the negative's sign flipped).
            tensor = tensor.resolve_conj().resolve_neg().contiguous()
            started.append(Sent(group.send([tensor], 1, 0), tensor, self.blocking))
            self.sent += 1
        return started

    def receiver(self, peer: int) -> Callable[[torch.dtype, tuple[int, ...]], Tensor]:
        """What takes the next tensor from process ``peer`` (``decode``'s ``receive``): a new tensor of the dtype and
        shape its message gave, filled from the lane (waited for: the host blocks on gloo alone)."""
        group = self.incoming[peer]
        timeout = datetime.timedelta(seconds=self.timeout)

        def receive(dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
            if tensor.numel() == 0:
                return tensor
            work = group.recv([tensor], 0, 0)
            if self.blocking:
                work.wait(timeout)
            else:
                work.wait()
            self.received_from[peer] += 1
            return tensor

        return receive


def _group(backend: str, store: Any, rank: int, timeout: float) -> Any:
    """A group of two over ``store``: ``rank`` 0 sends, 1 receives."""
    span = datetime.timedelta(seconds=timeout)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, 2, span)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = span
    return dist.ProcessGroupNCCL(store, rank, 2, options)


def lane_groups(store: Any, token: str, rank: int, size: int, timeout: float, backend: str,
                device: torch.device) -> TensorLane:
    """Process ``rank``'s lanes among ``size`` processes, met under ``token`` in ``store``: a group for each
    ordered pair that includes it. A collective: every process calls it with the same ``token`` and ``backend``.

    Each pair then hands one element over its group, which makes NCCL's communicator now rather than at the first
    hand-off (where the sender would wait for it under the plane's send lock, its other threads' sends behind it).
    The pairs meet in one order everywhere (making a gloo group, or a communicator, waits for its two processes),
    so no two wait for each other."""
    if backend not in LANES:
        raise ValueError(f"a lane runs on one of {', '.join(map(repr, LANES))} (got {backend!r})")
    outgoing, incoming = {}, {}
    pairs = [(s, r) for s in range(size) for r in range(size) if s != r and rank in (s, r)]
    for sender, receiver in pairs:
        prefix = dist.PrefixStore(f"lightning_pipe/lane/{token}/{sender}-{receiver}/", store)
        if rank == sender:
            outgoing[receiver] = _group(backend, prefix, 0, timeout)
        else:
            incoming[sender] = _group(backend, prefix, 1, timeout)
    lane = TensorLane(outgoing, incoming, device, timeout, backend)
    for sender, receiver in pairs:
        if rank == sender:
            for sent in lane.send(receiver, [torch.zeros(1, dtype=torch.float32, device=device)]):  # (not the
                # default dtype: under precision="64-true" a float64 would overrun the float32 its receiver posts)
                sent.wait(datetime.timedelta(seconds=timeout))
        else:
            lane.receiver(sender)(torch.float32, (1,))
    lane.sent, lane.received_from = 0, dict.fromkeys(incoming, 0)
    return lane
