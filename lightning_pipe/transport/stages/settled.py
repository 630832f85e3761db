"""Runs a driver has finished that left nothing behind on its remote stages, and what frees a run's state there.

A run's forward saves activations on every stage until its backward; once a run's backward is over everywhere
(or a forward saved nothing), freeing it needs no message to the other processes: one message less per step.
"""

from __future__ import annotations

import threading

import torch.distributed.rpc as rpc

from lightning_pipe.transport.stages.entries import release_run

__all__: list[str] = []


class Settled:
    """Runs that left nothing behind on any remote stage (their backward, or a forward that saved nothing,
    finished without error), each with the number of remote stages yet to hear that it was freed: freeing
    them needs no message. Runs are freed by whichever thread drops them, hence the lock."""

    def __init__(self) -> None:
        self._left: dict[int, int] = {}
        self._lock = threading.Lock()

    def add(self, run: int, stages: int) -> None:
        """Mark ``run`` settled on ``stages`` remote stages (none: nothing to remember)."""
        if stages > 0:
            with self._lock:
                self._left[run] = stages

    def take(self, run: int) -> bool:
        """Whether ``run`` is settled on the remote stage that asks (each asks once, when it is freed)."""
        with self._lock:
            left = self._left.pop(run, 0)
            if left > 1:
                self._left[run] = left - 1
            return left > 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._left)


class RemoteStageRef:
    """What a :class:`Run` releases when it is freed: the saved state of a remote stage, unless the run is
    among the ``settled`` ones (it left nothing behind on any stage: one message less per step)."""

    def __init__(self, key: str, peer: str, settled: Settled) -> None:
        self.key, self.peer = key, peer
        self.settled = settled

    def release(self, run: int) -> None:
        if self.settled.take(run):
            return
        try:
            rpc.rpc_async(self.peer, release_run, args=(self.key, run))
        except Exception:  # noqa: BLE001 - RPC already shut down: nothing is kept any more
            pass
