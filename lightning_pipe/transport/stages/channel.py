"""The wire's channel of a stage's share: hand-offs packed for the wire, sent by the data plane or RPC, taken back.

A share (:func:`~lightning_pipe.engine.share.run_share`) runs the same way in a stage's process as on a thread of
the local pipeline; what differs is here: a hand-off to a stage in this process goes into the mailbox as it is; to
another process, its tensors are packed (:func:`~lightning_pipe.transport.wire.messages.pack_batch`, GPU to GPU
where a device map allows) and sent point-to-point; the last stage's outputs for a driver in another process are
held for the answer to the step (one message, not one per micro-batch); the driver's targets ride with stage 0's
output of their micro-batch. :class:`StageHooks` adds what a share does in a stage's process: the averaging over
replicas, the driver's modes and autocast, and a sign of life to the driver.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

from lightning_pipe.engine.loss import MicroLoss
from lightning_pipe.engine.microbatch import Batch
from lightning_pipe.engine.share import Handoff, ShareHooks
from lightning_pipe.engine.stage import Finisher, Grads
from lightning_pipe.engine.worker import autocast_context
from lightning_pipe.transport.wire.messages import Slot, StepSpec, on_cpu, pack_batch, to_wire, unpack_batch

__all__: list[str] = []


class StageChannel:
    """Run ``run``'s hand-offs between this process's stages (``runner``'s, a
    :class:`~lightning_pipe.transport.stages.runner.StageRunner`) and the others'; ``riders(i)``: what
    to send with stage 0's output of micro-batch ``i`` (the driver's targets for the last stage). The sends in
    flight are collected in :attr:`sends`, the first stage's input gradients in :attr:`input_grads`."""

    def __init__(self, runner: Any, run: int, riders: Callable[[int], list[tuple[Slot, Any]]] | None = None
                 ) -> None:
        self.runner = runner
        self.run = run
        self.riders = riders
        self.sends: list[Future[Any]] = []
        self.input_grads: dict[int, Grads] = {}

    def _slot(self, handoff: Handoff) -> Slot:
        return Slot(self.runner.key, self.run, *handoff)

    def take(self, handoff: Handoff) -> Any:
        """What arrives for ``handoff``, unpacked: a :class:`Batch` (an output), a tensor or None (a skip, or its
        gradient), the gradients or target as sent."""
        value = self.runner.take(self._slot(handoff))
        if handoff.kind == "F":
            if isinstance(handoff.source, tuple):  # a skip popped here
                tensors, flags = value
                return unpack_batch(tensors, flags)[0]
            tensors, flags, atomic = value
            return Batch(unpack_batch(tensors, flags), atomic)
        if handoff.kind == "B" and isinstance(handoff.source, tuple):  # a skip's gradient
            return value[0]
        return value

    def send(self, handoff: Handoff, payload: Any) -> None:
        """Hand ``payload`` on: to the caller (stage 0's input gradients, kept here; the last stage's outputs, held
        for the driver or put in the mailbox where the driver is this process), or to the stage that takes it."""
        runner, (kind, i, dst, src) = self.runner, handoff
        if dst < 0:
            self.input_grads[i] = payload
            return
        riders = self.riders(i) if self.riders is not None and kind == "F" and src == 0 else []
        if kind == "F" and dst == runner.n and runner.peers[dst] != runner.me:
            # Through host memory: it goes back in an RPC answer, which the driver waits for on no stream.
            runner.hold(self.run, i, on_cpu(payload if isinstance(payload, MicroLoss)
                                            else (*pack_batch(payload.tensors), payload.atomic)))
            self.sends += [sent for item in riders if (sent := runner.send_to(item[0].stage, *item)) is not None]
            return
        direct = runner.direct(dst)  # (every stage of a process is on its device)
        if kind == "F" and isinstance(src, tuple):  # a skip, to the stage that pops it
            packed: Any = pack_batch([payload], direct)
        elif kind == "F":
            packed = payload if isinstance(payload, MicroLoss) else \
                (*pack_batch(payload.tensors, direct), payload.atomic)
        elif isinstance(src, tuple):  # a skip's gradient, to the stage that stashed it
            packed = to_wire((payload,), direct)
        else:
            packed = to_wire(payload, direct)
        slot, peer = self._slot(handoff), runner.peers[dst]
        along = [item for item in riders if runner.peers[item[0].stage] == peer]
        bundled = runner.plane.send_many(peer, self.run, [(slot, packed), *along]) \
            if along and runner.plane is not None else None
        sends = [bundled or runner.send_to(dst, slot, packed)]
        if bundled is not None:
            riders = [item for item in riders if runner.peers[item[0].stage] != peer]
        sends += [runner.send_to(item[0].stage, *item) for item in riders]
        self.sends += [sent for sent in sends if sent is not None]


class StageHooks(ShareHooks):
    """A share in a stage's process: each stage's last backward of the step through its averaging over replicas
    (``averages``: the step's :class:`~lightning_pipe.transport.parallel.averages.StepAverages`), the layers in the
    driver's mode (unless their modes are set one by one), its autocast around each forward, and a sign of life
    after each action where the driver waits in another process."""

    def __init__(self, runner: Any, run: int, spec: StepSpec, averages: Any) -> None:
        self.runner, self.run, self.spec, self.averages = runner, run, spec, averages

    def before_forward(self, stage: int) -> None:
        """The step's averaging told of the forward; the stage's layers put in the driver's mode."""
        self.averages.forward(stage, self.spec.save)
        partition = self.runner.stages[stage].partition
        if not self.runner.modes_from_driver and partition.training != self.spec.training:
            partition.train(self.spec.training)

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        """The driver's autocast."""
        return autocast_context(self.spec.autocast)

    def backward_context(self, k: int, later: Mapping[tuple[int, int], Callable[..., None]]
                         ) -> contextlib.AbstractContextManager[Finisher | None]:
        """The averaging's context for backward action ``k``: its finisher where it is the stage's last."""
        return self.averages.backward(k, later)  # type: ignore[no-any-return]

    def after_action(self) -> None:
        """A sign of life to the driver where it waits in another process."""
        self.runner.still_working(self.run)
