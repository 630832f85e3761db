"""One process's share of a step: its actions, in the plan's order, over a channel to the other shares.

This is the one interpreter of a plan: the local pipeline runs one share per worker thread over an in-process
channel (:class:`LocalChannel`), a stage's process runs its share over the wire's channel
(:mod:`~lightning_pipe.transport.stages.channel`). An action takes what it needs from the channel (the previous
stage's output of its micro-batch, the skips it pops, the next stage's input gradients, the last stage's target)
and sends what it makes (its output, its skips, its input gradients) to the stage that needs it::

    F(s, i):  take ("F", i, s, s - 1), ("F", i, s, skip)...   -> stage.forward ->  send ("F", i, s + 1, s), ...
    B(s, i):  take ("B", i, s, s + 1), ("B", i, s, skip)...   -> stage.backward -> send ("B", i, s - 1, s), ...

Stage ``n`` (one past the last) and stage ``-1`` (one before the first) are the caller: the last stage's outputs
(or losses) and the first stage's input gradients go to them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, Union

from lightning_pipe.engine.loss import LossFn
from lightning_pipe.engine.microbatch import Batch
from lightning_pipe.engine.rng import LazySeed
from lightning_pipe.engine.schedule import Action
from lightning_pipe.engine.skip.layout import SkipLayout
from lightning_pipe.engine.skip.namespace import SkipKey
from lightning_pipe.engine.stage import Finisher, Grads, Stage

__all__ = ["Channel", "Handoff", "LocalChannel", "ShareHooks", "ShareStep", "Skipped", "run_share"]


class Skipped(Exception):
    """An action that did not run because one of its inputs failed."""


class Handoff(NamedTuple):
    """What one action hands to another: ``kind`` ``"F"`` (an output or a skip, for a forward), ``"B"`` (a gradient,
    for a backward) or ``"T"`` (a target, for the last stage's loss), of micro-batch ``microbatch``, for stage
    ``stage`` (``n`` or ``-1``: the caller), from ``source``: a stage, the key of a skip, or ``"target"``."""

    kind: str
    microbatch: int
    stage: int
    source: Union[int, SkipKey, str]  # noqa: UP007 - a runtime annotation on Python 3.10


class Channel(Protocol):
    """Where a share's inputs come from and its outputs go. Payloads: a :class:`Batch` or a ``MicroLoss`` (an
    output), a tensor or None (a skip, or a skip's gradient), :data:`Grads` (input gradients), anything (a target)."""

    def take(self, handoff: Handoff) -> Any:
        """What was sent for ``handoff``, once it is there; raises :class:`Skipped` where the run failed."""

    def send(self, handoff: Handoff, payload: Any) -> None:
        """Hand ``payload`` on for ``handoff``."""


@dataclass
class ShareStep:
    """What a share runs with: run ``run``'s ``microbatches``, keeping what backward needs (``save``) and
    checkpointing micro-batches below ``checkpoint_stop``, random numbers from ``seed``; with ``loss``, the last stage
    computes the loss; ``eager``: its backwards start from the loss's ``weights[i]`` times ``loss_scale`` (a step
    running its backwards ahead of its caller's) instead of gradients taken from the channel."""

    run: Hashable
    microbatches: int
    save: bool
    checkpoint_stop: int
    seed: LazySeed
    loss: LossFn | None = None
    eager: bool = False
    weights: Sequence[float] = field(default_factory=list)
    loss_scale: float = 1.0


class ShareHooks:
    """What a share does around its actions beside the stages' work: nothing here; a stage's process averages its
    stages over their replicas, keeps their modes and autocast as the driver's, and tells the driver it works."""

    def before_forward(self, stage: int) -> None:
        """Called before each forward of ``stage``."""

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        """What each forward runs under."""
        return contextlib.nullcontext()

    def backward_context(self, k: int, later: Mapping[tuple[int, int], Callable[..., None]]
                         ) -> contextlib.AbstractContextManager[Finisher | None]:
        """What backward action ``k`` (a ``B``, ``I`` or ``W``) runs under, and the finisher it gives its autograd
        call (None: a plain call); ``later``: the weight gradients left for later so far."""
        return contextlib.nullcontext()

    def after_action(self) -> None:
        """Called after each action; may raise :class:`Skipped` to stop the share."""


def run_share(stages: Mapping[int, Stage], n: int, layout: SkipLayout, step: ShareStep, actions: Sequence[Action],
              channel: Channel, hooks: ShareHooks | None = None, inputs: Sequence[Batch] | None = None) -> None:
    """Run ``actions`` (this share's of a plan over ``n`` stages, of which ``stages`` are here) in order, over
    ``channel``; ``inputs``: stage 0's micro-batches. What a split backward left for its ``W`` and never ran (a
    failure) is dropped on the way out."""
    hooks = hooks or ShareHooks()
    later: dict[tuple[int, int], Callable[..., None]] = {}
    try:
        for k, (s, kind, i) in enumerate(actions):
            if kind == "F":
                hooks.before_forward(s)
                _forward(stages[s], n, layout, step, i, channel, hooks,
                         inputs[i] if s == 0 and inputs is not None else None)
            elif kind == "W":
                with hooks.backward_context(k, later) as last:
                    later.pop((s, i))(True, last)
            else:
                with hooks.backward_context(k, later) as last:
                    _backward(stages[s], n, layout, step, i, channel, later if kind == "I" else None, last)
            hooks.after_action()
    finally:
        for finish in later.values():
            finish(False)


def _forward(stage: Stage, n: int, layout: SkipLayout, step: ShareStep, i: int, channel: Channel,
             hooks: ShareHooks, given: Batch | None) -> None:
    s = stage.index
    inputs = given if given is not None else channel.take(Handoff("F", i, s, s - 1))
    imports = {skip: channel.take(Handoff("F", i, s, skip)) for skip in layout.imports[s]}
    loss = step.loss if s == n - 1 else None
    target = channel.take(Handoff("T", i, s, "target")) if loss is not None else None
    with hooks.forward_context():
        out, exports = stage.forward(step.run, i, inputs, imports, seed=step.seed, save=step.save,
                                     checkpoint=i < step.checkpoint_stop, last=i == step.microbatches - 1,
                                     loss=loss, target=target)
    channel.send(Handoff("F", i, s + 1, s), out)
    for skip, dst in layout.exports[s].items():
        channel.send(Handoff("F", i, dst, skip), exports[skip])


def _backward(stage: Stage, n: int, layout: SkipLayout, step: ShareStep, i: int, channel: Channel,
              later: dict[tuple[int, int], Callable[..., None]] | None, finisher: Finisher | None) -> None:
    """Stage ``stage``'s backward of micro-batch ``i`` (-1: every micro-batch, in one autograd call); with
    ``later``, only what goes upstream now, the rest into ``later`` under ``(stage, i)``."""
    s = stage.index
    items = []
    for k in range(step.microbatches) if i < 0 else (i,):
        grads = (step.weights[k] * step.loss_scale,) if s == n - 1 and step.eager else \
            channel.take(Handoff("B", k, s, s + 1))
        items.append((k, grads, {skip: channel.take(Handoff("B", k, s, skip)) for skip in layout.exports[s]}))
    if later is None:
        results = stage.backward(step.run, items, finisher)
    else:
        results, later[(s, i)] = stage.backward_inputs_first(step.run, items, finisher)
    for (k, _, _), (grad_inputs, grad_imports) in zip(items, results):
        channel.send(Handoff("B", k, s - 1, s), grad_inputs)
        for skip, src in layout.imports[s].items():
            channel.send(Handoff("B", k, src, skip), grad_imports.get(skip))


class LocalChannel:
    """The channel between shares on threads of one process: each hand-off a future, set by its sender, waited
    for by its taker. Once :meth:`abort` ed, every wait not yet satisfied raises :class:`Skipped`; what the
    caller gets (the last stage's outputs, the first stage's input gradients) is kept apart, by micro-batch."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._futures: dict[Handoff, Future[Any]] = {}
        self._lock = threading.Lock()
        self._aborted = False
        self.outputs: dict[int, Any] = {}  # the last stage's outputs or losses, by micro-batch
        self.input_grads: dict[int, Grads] = {}  # the first stage's input gradients, by micro-batch

    def _future(self, handoff: Handoff) -> Future[Any]:
        with self._lock:
            future = self._futures.get(handoff)
            if future is None:
                future = self._futures[handoff] = Future()
                if self._aborted:
                    future.set_exception(Skipped())
            return future

    def give(self, handoff: Handoff, payload: Any) -> None:
        """What the caller hands in before the shares start: an output gradient of the last stage, a target."""
        self._future(handoff).set_result(payload)

    def send(self, handoff: Handoff, payload: Any) -> None:
        """Hand ``payload`` on: to its taker's future, or to the caller's side (stage ``n``: an output, ``-1``: input
        gradients); dropped once the channel is aborted."""
        if handoff.stage == self.n:
            self.outputs[handoff.microbatch] = payload
        elif handoff.stage < 0:
            self.input_grads[handoff.microbatch] = payload
        else:
            try:
                self._future(handoff).set_result(payload)
            except InvalidStateError:
                if not self._aborted:  # sent twice: a plan that is wrong
                    raise
                # aborted: the taker, if any, skips

    def take(self, handoff: Handoff) -> Any:
        """What was sent for ``handoff``, waiting for it (dropped from the channel once taken); :class:`Skipped`
        where the channel was aborted first."""
        future = self._future(handoff)
        try:
            value = future.result()
        except BaseException:  # noqa: BLE001 - the failing action reports its own error
            raise Skipped() from None
        with self._lock:
            self._futures.pop(handoff, None)  # consumed: dropped at once
        return value

    def abort(self) -> None:
        """Wake every share waiting here: their waits, and later ones not yet satisfied, raise :class:`Skipped`."""
        with self._lock:
            self._aborted = True
            pending = [f for f in self._futures.values() if not f.done()]
        for future in pending:
            with contextlib.suppress(Exception):  # set by its sender meanwhile
                future.set_exception(Skipped())


@contextlib.contextmanager
def aborting(channel: LocalChannel, failed: Callable[[], None]) -> Iterator[None]:
    """Run a share: where it fails, call ``failed`` and abort ``channel`` (the other shares stop waiting)."""
    try:
        yield
    except BaseException:
        failed()
        channel.abort()
        raise
