"""A step's control messages on the data plane: each process's actions go to its step listener, its answer comes back.

RPC's ``run_share`` costs the driver ~0.5 ms to send and the receiver two thread hand-offs before the first action
runs, and its answer ~1 ms back at the end of a step, on the critical path of every step. Where the data plane
carries a process, the driver sends it the step instead (:meth:`DataPlane.send_step`): the process's listener
(:meth:`DataPlane.serve`, one thread waiting on the driver's channel between steps) hands it to the stage's
worker, which answers on the plane once its share is done::

    driver ══STEP (run, actions, spec, targets)══► listener ──► worker: the share
    driver ◄══ANSWER (the last stage's outputs or losses, or the error)══ worker

A step's commit (its gradients made aside added in, at the end of ``loss.backward()`` for the eager schedules)
goes the same way, and the listener runs it before the next step, which cannot overtake it on the channel: the
driver does not wait for it before that step (an RPC commit's round trip, ~1 ms per step), only once the step is
done, or before anything else reaches the process (optimizer steps, gradient reads, a step sent by RPC). Calls of
the process's host that every step makes (the optimizer's step, a clipping norm, a scaler's overflow check) go the
same way too (:func:`call`), each answered on the plane; what rides with a message (commits, ``zero_grad``) is
applied before it, in order (:meth:`StageRunner.ride`).

The last stage's targets and output gradients travel in the step where they are small (as with RPC; split from
one batch, as one tensor); larger, the driver sends each target with stage 0's output of its micro-batch (one
message where the last stage is next), and the output gradients in as few messages as the plane's limit allows
once stage 0 has started. The last stage's losses come back as one tensor. A share that fails aborts
the run in every process itself (the driver, waiting for another process's answer, would not notice), then
answers with the error; the driver reads every answer, so the first real error in process order is raised as
with RPC. A slow stage's sign of life comes on the plane ahead of its answer and restarts the driver's wait.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed.rpc as rpc

from lightning_pipe.engine.schedule import Action
from lightning_pipe.engine.share import Skipped
from lightning_pipe.transport.stages import answers
from lightning_pipe.transport.stages.answers import answer_slot, answered, packed
from lightning_pipe.transport.stages.entries import abort_run, commit_run
from lightning_pipe.transport.stages.runner import StageRunner
from lightning_pipe.transport.wire.messages import (
    MAILBOX,
    Failure,
    Slot,
    StepSpec,
    tensors_in,
    to_concurrent,
    where,
    with_location,
)
from lightning_pipe.transport.wire.riders import Rider, riding, rode, settle_commits

__all__: list[str] = []

#: How many shares of plans (a process's actions of a step) a process keeps, by number, most recent first: the driver
#: sends each share once and then its number alone, and refers to the last ``KEPT // 2`` it sent only.
KEPT = 64
_NUMBERS = itertools.count()

#: Deliveries up to this many bytes travel in the step itself: more would hold up its first action (the step is
#: sent before stage 0 starts; the last stage needs the target of a micro-batch only with its input).
INLINE = 64 << 10


class _Commit:
    """A commit sent to a process's step listener: :meth:`result` waits for its answer, raising its error."""

    before_steps = True  # the listener runs it before the next step (see ``settle_commits``)

    def __init__(self, runner: StageRunner, peer: str, process: int, run: int, number: int) -> None:
        self.runner, self.peer, self.process, self.run, self.number = runner, peer, process, run, number

    def result(self) -> None:
        runner, peer = self.runner, self.peer
        located = lambda: f"committing the gradients of pipeline '{runner.key}' in {where(peer)}"  # noqa: E731
        answered(runner, peer, answer_slot(runner.key, self.run, self.process, 1), located, self.number)


class Called:
    """A call of a process's host sent to its step listener (:func:`call`): :meth:`result` waits for its answer,
    raising its error, located."""

    def __init__(self, runner: StageRunner, peer: str, process: int, token: int, located: Callable[[], str],
                 number: int) -> None:
        self.runner, self.peer, self.process, self.token, self.located = runner, peer, process, token, located
        self.number = number  # the message's to the listener
        self._answer: tuple[bool, Any] | None = None  # (whether it returned, its value or error), once taken

    def result(self) -> Any:
        """The call's result, once its answer is here (within the RPC timeout); the same again when asked again."""
        if self._answer is None:
            slot = answer_slot(self.runner.key, self.token, self.process, 2)
            try:
                self._answer = (True, answered(self.runner, self.peer, slot, self.located, self.number))
            except BaseException as exc:
                self._answer = (False, exc)
        returned, value = self._answer
        if not returned:
            raise value
        return value


def call(runner: StageRunner, peer: str, process: int, method: str | None, args: tuple[Any, ...],
         located: Callable[[], str]) -> Called | None:
    """Call ``method(*args)`` of process ``peer``'s host (``process``) through its step listener on the data plane,
    what rides to that process going first: behind its step, if one is running, and answered on the plane (a
    round trip of 0.1-0.2 ms where RPC's takes ~1 ms). None where the plane does not carry it (the caller calls by
    RPC). ``method`` None: nothing is called (a word from the listener, once what it was sent before is done)."""
    plane = runner.plane
    if plane is None or not plane.carries(peer):
        return None
    settle_commits(runner.key, before_steps=True, peer=peer)  # (none by RPC overtakes it)
    riders = riding(runner.key, peer)
    token = answers.next_token()
    if not plane.send_step(peer, token, ("call", token, process, method, args, [c.rider for c in riders])):
        return None
    rode(runner.key, riders)
    return Called(runner, peer, process, token, located, answers.sent(runner.key, peer))


def commit(runner: StageRunner, peer: str, process: int, run: int, scale: float) -> _Commit | None:
    """Send process ``peer`` (``process``) the commit of run ``run`` (times ``scale``) on the data plane, ahead of
    its next step; None where the plane does not carry it (the caller commits by RPC)."""
    if runner.plane is None or not runner.plane.send_step(peer, run, ("commit", run, scale)):
        return None
    return _Commit(runner, peer, process, run, answers.sent(runner.key, peer))


class Riding(Rider):
    """A step's commit (run ``run``'s gradients made aside, times ``scale``) to process ``peer`` (``process``), whose
    plane carries its steps, not sent yet (a :class:`~lightning_pipe.transport.wire.riders.Rider`): it goes with the
    next message to that process, its next step or a call of its host; no message and no answer of its own. Sent
    alone, on the plane (or by RPC where the plane no longer carries it)."""

    def __init__(self, runner: StageRunner, peer: str, process: int, run: int, scale: float) -> None:
        self.runner, self.peer, self.process, self.run, self.scale = runner, peer, process, run, scale

    @property
    def rider(self) -> tuple[Any, ...]:
        """What goes with the other message: :meth:`StageRunner.ride` applies it."""
        return ("commit", self.run, self.scale)

    @property
    def before_steps(self) -> bool:
        """Whether the next step cannot overtake it: not sent yet (it goes with that step), or sent on the plane."""
        return self._sent is None or isinstance(self._sent, _Commit)

    def send_alone(self) -> Any:
        """The commit sent on its own: to the step listener on the plane, else by RPC."""
        runner = self.runner
        return commit(runner, self.peer, self.process, self.run, self.scale) or commit_by_rpc(
            runner, self.peer, self.run, self.scale,
            lambda: f"committing the gradients of pipeline '{runner.key}' in {where(self.peer)}")


def commit_by_rpc(runner: StageRunner, peer: str, run: int, scale: float, describe: Callable[[], str]
                  ) -> Future[Any]:
    """Send process ``peer`` the commit of run ``run`` (times ``scale``) by RPC; its future, an error noted with
    ``describe()``."""
    return to_concurrent(rpc.rpc_async(peer, commit_run, args=(runner.key, run, scale), timeout=runner.timeout),
                         describe)


def riding_commit(runner: StageRunner, peer: str, process: int, run: int, scale: float) -> Riding | None:
    """Run ``run``'s commit to process ``peer``, to go with what reaches it next (:class:`Riding`); None where the
    plane does not carry that process's steps (the caller commits by RPC)."""
    if runner.plane is None or not runner.plane.carries(peer):
        return None
    return Riding(runner, peer, process, run, scale)


# ---------------------------------------------------------------------- the driver's side
def start(runner: StageRunner, peer: str, run: int, actions: Sequence[Action], spec: StepSpec,
          deliveries: Sequence[tuple[Slot, Any]], quiet: bool = False
          ) -> tuple[list[tuple[Slot, Any]], int] | None:
    """Send process ``peer`` its ``actions`` of run ``run`` on the data plane, with ``deliveries`` (the last
    stage's targets and output gradients) where they are small (:data:`INLINE`), one message as by RPC. Returns
    the deliveries left to send (:func:`deliver`; the driver sends each target with stage 0's output of its
    micro-batch) and the message's number (:func:`~lightning_pipe.transport.stages.answers.sent`), or None where
    the plane does not carry the step (the caller sends it by RPC). ``quiet``: the process answers only if its share
    fails or the run is aborted (:mod:`~lightning_pipe.transport.stages.answers`)."""
    plane = runner.plane
    if plane is None:
        return None
    known, share = runner.shared.setdefault(peer, {}), tuple(actions)
    shared = known.get(share)  # the number the process keeps these actions under, if it has them
    # The actions themselves the first time (plain tuples: pickled by pickle's C code alone), then their number.
    mine = (shared, None) if shared is not None else (next(_NUMBERS), [tuple(action) for action in share])
    commits = riding(runner.key, peer)  # the last steps' commits go first, in the same message
    riders = [c.rider for c in commits]
    left: list[tuple[Slot, Any]] = []
    if not (sum(map(_nbytes, deliveries)) <= INLINE and
            plane.send_step(peer, run, (run, mine, spec, *_joined(deliveries), riders, quiet))):
        if not plane.send_step(peer, run, (run, mine, spec, None, [], riders, quiet)):
            return None
        left = list(deliveries)
    if shared is None:
        known[share] = mine[0]
        while len(known) > KEPT // 2:  # forgotten here well before the process forgets them (it keeps KEPT)
            del known[next(iter(known))]
    rode(runner.key, commits)
    return left, answers.sent(runner.key, peer)


def _joined(deliveries: Sequence[tuple[Slot, Any]]) -> tuple[Any, Any]:
    """``deliveries`` as they travel in a step, ``(index, payloads)``: where every payload is a tensor of one dtype
    and of the same shape but along dim 0 (a batch's targets, split into micro-batches), ``((slots, sizes), one
    tensor of them)``: one tensor to copy and view instead of one per micro-batch, and the rest among the step's
    items that the codec does not look through; else ``(None, deliveries)``."""
    tensors = [payload for _, payload in deliveries]
    if len(tensors) < 2 or any(type(t) is not torch.Tensor or not t.dim() or t.layout != torch.strided
                               or t.is_quantized for t in tensors):
        return None, list(deliveries)
    first = tensors[0]
    if any(t.dtype != first.dtype or t.device != first.device or t.shape[1:] != first.shape[1:] for t in tensors):
        return None, list(deliveries)
    return ([slot for slot, _ in deliveries], [t.size(0) for t in tensors]), torch.cat(tensors)


def _split(index: Any, payloads: Any) -> Any:
    """What :func:`_joined` made of a step's deliveries, as a list of ``(slot, payload)``."""
    if index is None:
        return payloads
    slots, sizes = index
    return list(zip(slots, payloads.split(sizes)))


def _nbytes(item: tuple[Slot, Any]) -> int:
    return 256 + sum(t.numel() * t.element_size() for t in tensors_in(item[1]))


def deliver(runner: StageRunner, peer: str, run: int, deliveries: Sequence[tuple[Slot, Any]]) -> list[Future[Any]]:
    """Send ``deliveries`` of run ``run`` to process ``peer`` after its step (once stage 0 has started: the last
    stage needs the first of them only after its first input), as few messages as the plane's limit allows,
    one that is larger by RPC; the sends in flight."""
    plane = runner.plane
    limit = plane.max_bytes
    sends: list[Future[Any] | None] = []
    bundle: list[tuple[Slot, Any]] = []
    size = 0

    def flush() -> None:
        sent = plane.send_many(peer, run, bundle) if bundle else None
        if sent is not None:
            sends.append(sent)
        else:
            sends.extend(runner.send_to(slot.stage, slot, payload) for slot, payload in bundle)
        bundle.clear()

    for slot, payload in deliveries:
        nbytes = _nbytes((slot, payload))
        if bundle and limit is not None and size + nbytes > limit:
            flush()
            size = 0
        bundle.append((slot, payload))
        size += nbytes
    flush()
    return [sent for sent in sends if sent is not None]


# ---------------------------------------------------------------------- a stage's process
def serve(runner: StageRunner, step: tuple[Any, ...]) -> None:
    """Run this process's share of a step that came on the plane (or a step's commit) and answer on it; called by
    the listener, which runs it itself (handing it to the stage's worker would wake one more thread before the
    first action, up to milliseconds on an idle virtual CPU) and waits for the next step once this one is
    answered. Steps never overlap here: the listener runs its messages one after another. A quiet step that went well
    is not answered (:mod:`~lightning_pipe.transport.stages.answers`), unless its run is aborted later."""
    if step[0] == "call":
        _, token, process, method, args, riders = step
        try:
            value = runner.call_host(method, args, riders, "on the plane")
        except BaseException as exc:  # noqa: BLE001 - it travels to the driver
            value = Failure(exc)
        runner.send_to(runner.n, answer_slot(runner.key, token, process, 2), value)
        return
    if step[0] == "commit":
        _, run, scale = step
        try:
            runner.commit(run, scale)
            value = None
        except BaseException as exc:  # noqa: BLE001 - it travels to the driver
            value = Failure(exc)
        runner.send_to(runner.n, answer_slot(runner.key, run, runner.index, 1), value)
        return
    run, (number, actions), spec, index, payloads, commits, quiet = step
    if actions is None:
        actions = runner.plans[number]
    else:
        actions = runner.plans[number] = [Action(*action) for action in actions]
        while len(runner.plans) > KEPT:
            del runner.plans[next(iter(runner.plans))]
    for slot, payload in _split(index, payloads):
        MAILBOX.put(slot, payload)

    try:
        for rider in commits:  # the steps' before it (their gradients are in before this one starts), zeroing
            try:
                runner.ride(rider)
            except BaseException as exc:
                raise with_location(exc, lambda rider=rider: f"{runner.describe_rider(rider)} of pipeline "
                                                             f"'{runner.key}' in {where(runner.me)}") from None
        sends, _ = runner.run_actions(run, actions, spec)
        for sent in sends:  # those that went by RPC (the plane's are done once the share is)
            sent.result(timeout=runner.timeout)
        value = packed(runner.take_held(run))
    except BaseException as exc:  # noqa: BLE001 - it travels to the driver
        if not isinstance(exc, Skipped) and not runner.has_failed(run):
            abort_everywhere(runner, run)
        value = Failure(exc)
    slot = answer_slot(runner.key, run, runner.index)
    if quiet and value is None and runner.quiet(run, lambda: runner.send_to(runner.n, slot, Failure(Skipped()))):
        return  # went well: no answer (one if the run is aborted later, the late answer above)
    runner.send_to(runner.n, slot, value)


def abort_everywhere(runner: StageRunner, run: int) -> None:
    """Fail run ``run`` here and in every other process of the pipeline (each then aborts it on its channels,
    which wakes whoever waits there)."""
    runner.fail(run)
    for peer in sorted(set(runner.peers) - {runner.me}):
        try:
            rpc.rpc_async(peer, abort_run, args=(runner.key, run), timeout=runner.timeout)
        except Exception:  # noqa: BLE001 - an unreachable process is what the error will report
            pass
