"""The driver's handle on its pipeline's stages in other processes: calls on their hosts, now or riding along.

A call whose answer the driver needs goes at once (:meth:`HostGroup.call`, :meth:`HostGroup.start`): by RPC or, asked
with ``plane=True`` where the data plane carries the process (the optimizer's step, a clipping norm, a scaler's
overflow check: every step, small answers), to its step listener, answered on the plane. One that returns nothing and
whose effect nothing reads before the process's next message (``zero_grad``, clipping's scaling) goes with that
message instead (:meth:`HostGroup.call_later`): a step on the plane, or the next call, which applies it first. Each
carries the step commits not sent yet, so what reaches a host finds its gradients whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch.distributed.rpc as rpc

from lightning_pipe.transport.stages import steps
from lightning_pipe.transport.stages.entries import RUNNERS
from lightning_pipe.transport.stages.host import call, drop
from lightning_pipe.transport.wire.messages import to_concurrent, where
from lightning_pipe.transport.wire.riders import Rider, defer_commits, riding_along

__all__ = ["HostGroup", "RidingCall"]


class RidingCall(Rider):
    """A call of ``method`` on the host of pipeline ``key`` in process ``peer``, not sent yet (see
    :meth:`HostGroup.call_later`; a :class:`~lightning_pipe.transport.wire.riders.Rider`): it goes with the next
    message to that process, applied before it. Sent alone, by RPC."""

    def __init__(self, key: str, peer: str, method: str, args: tuple[Any, ...], timeout: float) -> None:
        self.key, self.peer, self.method, self.args, self.timeout = key, peer, method, args, timeout

    @property
    def rider(self) -> tuple[Any, ...]:
        """What goes with the other message: :meth:`StageRunner.ride` applies it."""
        return ("call", self.method, self.args)

    def send_alone(self) -> Future[Any]:
        """The call by RPC, on its own."""
        return to_concurrent(rpc.rpc_async(self.peer, call, args=(self.key, self.method, *self.args),
                                           timeout=self.timeout),
                             lambda: f"in {self.method} of pipeline '{self.key}' ({where(self.peer)})")


class HostGroup:
    """The driver's handle on the remote stages of its pipeline ``key`` (stages 1..n-1 at ``peers``)."""

    def __init__(self, key: str, peers: Sequence[str], timeout: float) -> None:
        self.key = key
        self.peers = list(peers)
        self.timeout = timeout

    def _start(self, stage: int, method: str, args: tuple[Any, ...], timeout: float | None = None,
               plane: bool = False) -> Any:
        peer = self.peers[stage - 1]
        located = lambda: f"in {method} of stage {stage} of pipeline '{self.key}' ({where(peer)})"  # noqa: E731
        runner = RUNNERS.get(self.key) if plane else None
        if runner is not None and (called := steps.call(runner, peer, stage, method, args, located)) is not None:
            return called
        # The last steps' gradients are in before anything reads or changes them: the commits not sent yet go
        # with this call, which applies them first; those in flight are waited for.
        with riding_along(self.key, peer) as commits:
            future = rpc.rpc_async(peer, call, args=(self.key, method, *args),
                                   kwargs={"commits": commits} if commits else None,
                                   timeout=self.timeout if timeout is None else timeout)
        return to_concurrent(future, located)

    def start(self, method: str, *args: Any, timeout: float | None = None, plane: bool = False) -> list[Any]:
        """Start ``method`` on every remote stage at once; their futures (each with ``result()``) in stage order.
        ``timeout``: the RPC timeout in seconds (default: the pipeline's; 0: none). ``plane``: on the data plane
        where it carries the process, to its step listener (:func:`~lightning_pipe.transport.stages.steps.call`;
        a method whose result is small, run behind any step in progress there), by RPC elsewhere."""
        return [self._start(j, method, args, timeout, plane) for j in range(1, len(self.peers) + 1)]

    def start_each(self, method: str, args: Sequence[Any]) -> list[Future[Any]]:
        """Start ``method`` on every remote stage at once, stage ``j`` with the single argument ``args[j - 1]``."""
        return [self._start(j, method, (arg,)) for j, arg in enumerate(args, start=1)]

    def call(self, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every remote stage at once; return their results in stage order. An error
        names the stage and process it came from."""
        return [f.result() for f in self.start(method, *args)]

    def call_later(self, method: str, *args: Any) -> None:
        """Call ``method`` on every remote stage, where it returns nothing and nothing reads what it changes before
        the next message to that process (``zero_grad``): it goes with that message (the next step on the data
        plane, or an RPC to the host, :class:`RidingCall`) instead of a round trip of its own now. Where the plane
        does not carry a process's steps, called now, as :meth:`call` does."""
        runner = RUNNERS.get(self.key)
        plane = None if runner is None else runner.plane
        later, now = [], []
        for j, peer in enumerate(self.peers, start=1):
            if plane is not None and plane.carries(peer):
                later.append(RidingCall(self.key, peer, method, args, self.timeout))
            else:
                now.append(self._start(j, method, args))
        defer_commits(self.key, later)
        for future in now:
            future.result()

    def start_stage(self, stage: int, method: str, *args: Any, timeout: float | None = None) -> Future[Any]:
        """Start ``method`` on remote stage ``stage`` (1-based); its future (``timeout`` as in :meth:`start`)."""
        return self._start(stage, method, args, timeout)

    def call_stage(self, stage: int, method: str, *args: Any) -> Any:
        """Call ``method`` on remote stage ``stage`` (1-based, as in the pipeline)."""
        return self._start(stage, method, args).result()

    def drop(self) -> None:
        """Have every remote stage stop hosting this pipeline (best effort, without waiting: called when the
        model is freed, possibly at a garbage collection)."""
        for peer in self.peers:
            try:
                rpc.rpc_async(peer, drop, args=(self.key,), timeout=self.timeout)
            except Exception:  # noqa: BLE001 - RPC is down: the processes are ending anyway
                pass
