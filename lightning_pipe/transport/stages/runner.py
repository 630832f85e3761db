"""Stages in their process: runs the process's share of each step in the plan's order, and the RPC entry points
through which its driver reaches it.

Each stage executes its actions in schedule order on one worker thread, exactly like the local pipeline,
with the same :class:`~lightning_pipe.engine.stage.Stage` doing the work; outputs go straight to the stage
that needs them, over the data plane (:mod:`~lightning_pipe.transport.wire.dataplane`, point-to-point) where it
carries them, else by RPC into the receiver's mailbox; inputs are taken from the channel or the mailbox::

    driver ──act F(i)──► stage 1 ──act F(i)──► ...        (one RPC per stage and step, its actions in order)
    stage 0 ══ x_i ══► stage 1 ══ x_i ══► stage 2 ══ y_i ══► driver   (the data plane; y_i in the answer)

A failure anywhere aborts the run on every stage (waiting actions wake up and skip). Every wait is bounded
by the RPC timeout, so a lost process becomes an error, not a hang.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import Tensor

from lightning_pipe.engine.microbatch import Batch
from lightning_pipe.engine.rng import LazySeed
from lightning_pipe.engine.schedule import Action
from lightning_pipe.engine.share import ShareStep, Skipped, run_share
from lightning_pipe.engine.skip.layout import SkipLayout
from lightning_pipe.engine.stage import Grads, Stage
from lightning_pipe.engine.worker import Inline, Worker
from lightning_pipe.transport.parallel.averages import Averages
from lightning_pipe.transport.stages.channel import StageChannel, StageHooks
from lightning_pipe.transport.wire.messages import (
    MAILBOX,
    Slot,
    StepSpec,
    chain_into,
    deliver_to_mailbox,
    maps_device,
    note_alive,
    where,
    with_location,
)

__all__: list[str] = []



class StageRunner:
    """Runs the actions of this process's stages of pipeline ``key`` (one stage, or several: interleaved).

    ``peers[s]`` is the RPC name of the process holding stage ``s``; ``peers[n]`` receives the last stage's
    outputs (the driver). Actions run in order on one worker thread.
    """

    def __init__(self, key: str, stages: Stage | Sequence[Stage], peers: Sequence[str], layout: SkipLayout,
                 timeout: float) -> None:
        stages = [stages] if isinstance(stages, Stage) else sorted(stages, key=lambda st: st.index)
        self.key = key
        self.stages = {st.index: st for st in stages}
        self.stage = stages[0]  # the first of them (stage 0 on the driver)
        self.index = self.stage.index
        self.peers = list(peers)
        self.n = len(peers) - 1
        self.layout = layout
        self.timeout = timeout
        self.me = rpc.get_worker_info().name
        self.worker = Worker(f"lightning_pipe.{key}.stage{self.index}")
        self.sender: Worker | Inline = Inline() if self.stage.device.type == "cpu" else \
            Worker(f"lightning_pipe.{key}.stage{self.index}.send")
        self._seeds: dict[int, LazySeed] = {}
        self._failed: collections.deque[int] = collections.deque(maxlen=4096)
        # Runs whose share here went well and was not answered (a quiet step), each with what answers it if the run
        # is aborted after all; the lock orders that answer with the share's end.
        self._unanswered: collections.OrderedDict[int, Callable[[], Any]] = collections.OrderedDict()
        self._answering = threading.Lock()
        self.plans: dict[int, list[Action]] = {}  # the shares of plans the driver sent on the plane, by number
        self.shared: dict[str, dict[tuple[Action, ...], int]] = {}  # the driver's: which each process keeps
        # The last stage's outputs (or losses) for a driver in another process, per run and micro-batch: they
        # go back in the answer to the step's actions (the driver needs none before the last one), one message
        # instead of one delivery and its acknowledgement per micro-batch.
        self._held: dict[int, dict[int, Any]] = {}
        self._beat = 0.0  # when this process last told the driver it is still working
        # False: the run's training flag sets every layer's mode. True: each layer's mode is set as the
        # driver's copy of it is (by PipeStrategy: ``layer.eval()`` on one layer, frozen BatchNorm).
        self.modes_from_driver = False
        self._direct: dict[tuple[int, int], torch.device | None] = {}
        self.averages = Averages(self.stages)  # with replicas: each stage averaged with the others' by DDP
        self.plane: Any = None  # tensors to other processes: by RPC, or this DataPlane where it carries them
        self.host: Any = None  # the StageHost of these stages in a stage's process: riders call its methods
        self.calls: collections.Counter[str] = collections.Counter()  # its host's calls, by how each came
        self.plane_store: Any = None  # the store the driver hosts for its plane, without PipeStrategy's session

    def direct(self, dst: int, src: int | None = None) -> torch.device | None:
        """Stage ``src``'s GPU (default: this process's first stage) if its tensors go to stage ``dst`` (``n``:
        the driver) as they are, GPU to GPU (in this process, or by RPC with a device map); None if they go
        through host memory."""
        device = (self.stage if src is None else self.stages[src]).device
        if (dst, device.index or 0) not in self._direct:
            peer = self.peers[dst]
            mapped = device.type == "cuda" and (peer == self.me or maps_device(peer, device))
            self._direct[(dst, device.index or 0)] = device if mapped else None
        return self._direct[(dst, device.index or 0)]

    def describe(self, stage: int | None = None) -> str:
        """The stage and the process, for error messages."""
        return f"stage {self.index if stage is None else stage} of pipeline '{self.key}' ({where(self.me)})"

    def send_to(self, dst: int, slot: Slot, payload: Any) -> Future[Any] | None:
        """Deliver ``payload`` to stage ``dst``; returns the send in flight (None when ``dst`` is here).

        A CPU stage starts the message itself, before its next micro-batch: its cores are busy computing,
        so a thread of its own would have to wait for one while the next stage waits for the message (2.5-
        3.6% slower per step on 2 cores, measured). A GPU stage hands it to its sender thread and goes back
        to launching kernels. Either way an error in starting the send (a payload that cannot be pickled)
        fails this send, and so the action, instead of leaving the receiver to wait out the timeout.
        """
        peer = self.peers[dst]
        if peer == self.me:
            MAILBOX.put(slot, payload)
            return None
        sender = slot.source if isinstance(slot.source, int) else None
        describe = lambda: f"{self.describe(sender)} could not send to stage {dst} ({where(peer)})"  # noqa: E731
        if self.plane is not None and (sent := self.plane.send(peer, slot, payload, describe)) is not None:
            return sent  # point-to-point (:mod:`~lightning_pipe.transport.wire.dataplane`)
        sent = Future()
        plane = self.plane

        def send() -> None:
            chain_into(rpc.rpc_async(peer, deliver_to_mailbox, args=(slot, payload), timeout=self.timeout), sent,
                       describe)
            if plane is not None:
                plane.sent_by_rpc(peer, slot)  # the receiver waits for it in the mailbox

        def started(f: Future[Any]) -> None:
            exc = f.exception()
            if exc is not None and not sent.done():
                sent.set_exception(with_location(exc, describe))

        self.sender.submit(send).add_done_callback(started)
        return sent

    def take(self, slot: Slot, timeout: float | None = None) -> Any:
        """What arrives for ``slot`` (from the channel of the process that sends it, or the mailbox), waiting at most
        ``timeout`` (default: the RPC timeout); a failed run's take raises :class:`Skipped`."""
        if slot.run in self._failed:
            raise Skipped()
        src = slot.source
        def describe() -> str:  # only where a wait fails: ``where`` asks RPC
            if isinstance(src, int):
                source = f"stage {src} ({where(self.peers[src])})" if src < self.n else "the driver"
            else:
                source = "the driver (the target)" if src == "target" else f"the stage stashing '{src[1]}'"
            return f"{self.describe(slot.stage)}, micro-batch {slot.microbatch} ({slot.kind}) from {source}"

        if self.plane is not None:
            if isinstance(src, tuple):  # a skip: from the stage that stashed it
                layout = self.layout.imports if slot.kind == "F" else self.layout.exports
                peer = self.peers[layout[slot.stage][src]]
            else:  # a stage, or the driver (the last stage's targets and output gradients)
                peer = self.peers[src if isinstance(src, int) else self.n]
            if self.plane.carries(peer):  # waits on the channel from the sender itself
                return self.plane.take(peer, slot, timeout or self.timeout, describe)
        return MAILBOX.take(slot, timeout or self.timeout, describe)

    def hold(self, run: int, microbatch: int, value: Any) -> None:
        """Keep the last stage's output (or loss) of ``microbatch`` for the driver's answer to run ``run``."""
        self._held.setdefault(run, {})[microbatch] = value

    def run_actions(self, run: int, actions: Sequence[Action], spec: StepSpec, inputs: Sequence[Batch] | None = None,
                    riders: Callable[[int], list[tuple[Slot, Any]]] | None = None
                    ) -> tuple[list[Future[Any]], dict[int, Grads]]:
        """This process's share of one step (:func:`~lightning_pipe.engine.share.run_share`, over the wire's channel,
        :class:`~lightning_pipe.transport.stages.channel.StageChannel`; ``inputs``: stage 0's micro-batches, on the
        driver), with the driver's anomaly detection and default dtype (``precision="64-true"`` sets it there:
        tensors a layer creates must have it here too; this process's own is back once the share is done). Returns
        the sends still in flight and stage 0's input gradients by micro-batch. With replicas, each stage's last
        backward runs through DDP's reducer. ``riders(i)`` (the driver's): what to send with stage 0's output of
        micro-batch ``i``."""
        self.averages.settle()  # the previous step's reductions here are over
        self._beat = time.monotonic()
        default = torch.get_default_dtype()  # put back after the share: what this process makes between steps
        # (an optimizer's state, Adam's step count) takes the default dtype, as the driver's outside its forward does
        taken = spec.dtype is not None and default != spec.dtype and 0 not in self.stages
        if taken:
            torch.set_default_dtype(spec.dtype)  # a worker's own; never the driver's program's (bf16-true's leaked)
        averages = self.averages.step(run, actions, spec.reduce, spec.eager)
        if spec.eager:
            for stage in self.stages.values():
                stage.aside.defer(run)
        channel = StageChannel(self, run, riders)
        seed = self._seeds.setdefault(run, LazySeed())
        step = ShareStep(run, spec.microbatches, spec.save, spec.checkpoint_stop, seed, spec.loss,
                         spec.eager and spec.loss is not None, spec.weights, spec.loss_scale)
        with torch.autograd.set_detect_anomaly(spec.anomaly):
            try:
                run_share(self.stages, self.n, self.layout, step, actions, channel,
                          StageHooks(self, run, spec, averages), inputs)
                averages.finish()
            finally:
                if self.plane is not None:
                    self.plane.flush(run in self._failed)  # the step's sends are taken: their futures complete
                averages.close((lambda stage: stage.aside.keep(run)) if spec.eager else None)
                if not any(stage.has_saved(run) for stage in self.stages.values()):
                    self._seeds.pop(run, None)  # nothing will be recomputed: the seed is not needed any more
                if taken:
                    torch.set_default_dtype(default)
        return channel.sends, channel.input_grads

    def still_working(self, run: int) -> None:
        """Tell a driver in another process that this process is making progress, at most every third of the
        timeout: a slow stage that keeps finishing micro-batches is not taken for a stuck one (a stuck one
        finishes none). Fast stages never send it."""
        driver = self.peers[self.n]
        now = time.monotonic()
        if driver != self.me and now - self._beat >= self.timeout / 3:
            self._beat = now
            if self.plane is None or not self.plane.alive(driver, run):  # on the plane: ahead of the answer
                rpc.rpc_async(driver, note_alive, args=(self.key, run), timeout=self.timeout)

    def take_held(self, run: int) -> dict[int, Any] | None:
        """The outputs held for the driver from run ``run`` (see :meth:`hold`), forgotten here."""
        return self._held.pop(run, None)

    def commit(self, run: int, scale: float) -> None:
        """Add what ``run``'s backwards made aside, times ``scale``, into every stage's gradients here (and
        average them over the replicas, where that waited for the commit)."""
        self.averages.commit(run, scale)

    def ride(self, rider: tuple[Any, ...]) -> None:
        """Apply what came with a message, ahead of it: a step's commit ``("commit", run, scale)``, or a call of this
        process's host ``("call", method, args)`` (an optimizer's ``zero_grad``)."""
        if rider[0] == "commit":
            self.commit(rider[1], rider[2])  # (which waits for this stage's reduction first)
        else:
            # What changes or reads gradients waits for this stage's reduction over its replicas, as a call by RPC
            # does: zeroed while the last step's all-reduce is in flight, a gradient would get its result after.
            self.averages.settle()
            self.calls[f"{rider[1]} riding"] += 1
            getattr(self.host, rider[1])(*rider[2])

    def call_host(self, method: str | None, args: Sequence[Any], riders: Sequence[tuple[Any, ...]], how: str) -> Any:
        """Call ``method(*args)`` of this process's host once ``riders`` (what came with the call) are applied and this
        stage's reduction is over (what reads or changes gradients waits for it), counting it as come ``how``;
        ``method`` None: nothing more (the driver asks for a word once this process is done with what came before)."""
        for rider in riders:
            try:
                self.ride(rider)
            except BaseException as exc:
                exc.add_note(f"{self.describe_rider(rider)} of pipeline '{self.key}' before {method}")
                raise
        self.averages.settle()
        if method is None:  # a word asked for: what came before is done
            return None
        self.calls[f"{method} {how}"] += 1
        return getattr(self.host, method)(*args)

    @staticmethod
    def describe_rider(rider: tuple[Any, ...]) -> str:
        """What ``rider`` was doing, for its error."""
        return "committing the gradients" if rider[0] == "commit" else f"{rider[1]} (sent with the next message)"

    def named_grads(self) -> dict[str, Tensor | None]:
        """The gradients of this process's stages' parameters, by name within their partitions."""
        return {name: None if p.grad is None else p.grad.detach().cpu()
                for stage in self.stages.values() for name, p in stage.partition.named_parameters()}

    def zero_grad(self) -> None:
        """Drop this process's stages' parameter gradients."""
        for stage in self.stages.values():
            stage.partition.zero_grad(set_to_none=True)

    def has_failed(self, run: int) -> bool:
        """Whether run ``run`` failed here (its actions skip)."""
        return run in self._failed

    def bookkeeping(self) -> dict[str, int]:
        """What it keeps for backwards and the driver (0 between steps): activations, held outputs' runs, seeds."""
        return {"saved": sum(st.saved_count() for st in self.stages.values()), "held": len(self._held),
                "seeds": len(self._seeds)}

    def quiet(self, run: int, answer: Callable[[], Any]) -> bool:
        """Leave run ``run``'s share, which went well, unanswered, unless the run failed meanwhile (False: the caller
        answers); ``answer()`` answers it if the run is aborted later (the driver then reads every process's
        answer). The last few runs only: the driver aborts none older."""
        with self._answering:
            if run in self._failed:
                return False
            self._unanswered[run] = answer
            while len(self._unanswered) > 8:
                self._unanswered.popitem(last=False)
            return True

    def fail(self, run: int) -> None:
        """Mark ``run`` failed: its queued actions skip and its waits wake up (once: a run is aborted on the
        plane's channels once per process, whoever asks); a share of it that went well unanswered answers now."""
        with self._answering:
            if run in self._failed:
                return
            self._failed.append(run)
            answer = self._unanswered.pop(run, None)
        if answer is not None:
            answer()
        self._held.pop(run, None)
        MAILBOX.abort(self.key, run)
        if self.plane is not None:
            self.plane.abort(run)

    def stop(self) -> None:
        """Let this process's threads of the pipeline finish their queued work and exit."""
        self.worker.stop()
        if self.plane is not None:
            self.plane.close()
        if isinstance(self.sender, Worker):
            self.sender.stop()

    def release(self, run: int) -> None:
        """Forget what is kept for ``run``."""
        self.averages.release(run)
        self._seeds.pop(run, None)
        self._held.pop(run, None)
        for stage in self.stages.values():
            stage.release(run)
