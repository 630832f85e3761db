"""A step's answers on the data plane: where they land, how they travel, and the answers a process leaves out.

Each process whose step went on the plane answers it there once its share is done (the last stage's outputs or
losses, or the error). A process that holds nothing for the driver and leaves nothing behind (a middle stage of a
training step; every process but the last one under 1F1B; the backward half of GPipe) does not answer a step that went
well: the driver does not wait for a message that only says "done" (one message and one wake-up per process and step).
What it would have told comes out another way:

- A share that fails aborts the run everywhere and answers with its error, as always. A process whose share had
  ended well by the time it learns of the abort answers then, with :class:`~lightning_pipe.engine.share.Skipped`
  (:meth:`StageRunner.quiet`): the driver, once its step failed, reads every process's answer and raises the
  first real error in process order.
- A share that fails after the driver's step is over (a stage's deferred parameter gradients, its reduction over the
  replicas) answers with its error all the same; the driver finds it once it hears from that process again
  (:class:`Unanswered`): the answer to any later message to its listener (the optimizer's step, every step under
  Lightning) comes behind it on the same channel. Before anything that would overtake the listener (an RPC to that
  process, closing the pipeline) the driver asks the listener for a word (a round trip) where it has heard none,
  and at least every :data:`UNHEARD_MAX` steps.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any

import torch

from lightning_pipe.engine.loss import MicroLoss
from lightning_pipe.engine.share import Skipped
from lightning_pipe.transport.wire.dataplane import ANSWER
from lightning_pipe.transport.wire.messages import MAILBOX, Failure, Slot, where, with_location
from lightning_pipe.transport.wire.riders import defer_commits

__all__: list[str] = []

#: Steps a process may leave unanswered before the driver asks it for a word (bounds how late a late error comes, and
#: what the driver keeps).
UNHEARD_MAX = 64

_SENT: dict[tuple[str, str], int] = {}  # per (pipeline, process): messages sent to its listener, counted
_HEARD: dict[tuple[str, str], int] = {}  # per (pipeline, process): the latest of them whose answer was taken
_TOKENS = itertools.count()  # the tokens of the calls on the plane: where their answers land


def answer_slot(key: str, run: int, process: int, what: int = 0) -> Slot:
    """Where process ``process``'s answer to run ``run`` of pipeline ``key`` lands (``what``: 0 its share, 1 its
    commit, 2 a call of its host, ``run`` then the call's token): apart from the run's data, so that aborting the
    run (which drops its data) keeps the answer that says why."""
    return Slot(f"{key}/answers", run, ANSWER, what, process, process)


def next_token() -> int:
    """A new call's token (where its answer lands)."""
    return next(_TOKENS)


def sent(key: str, peer: str) -> int:
    """Count a message sent to process ``peer``'s listener of pipeline ``key``; its number (see :func:`heard`)."""
    number = _SENT.get((key, peer), 0) + 1
    _SENT[(key, peer)] = number
    return number


def heard(key: str, peer: str, number: int) -> None:
    """The answer to message ``number`` to process ``peer``'s listener was taken: whatever that process answered
    before it is in the mailbox."""
    if number > _HEARD.get((key, peer), 0):
        _HEARD[(key, peer)] = number


def forget(key: str) -> None:
    """Drop what is counted for pipeline ``key`` (closed)."""
    for counts in (_SENT, _HEARD):
        for pair in [pair for pair in counts if pair[0] == key]:
            del counts[pair]


def answered(runner: Any, peer: str, slot: Slot, located: Callable[[], str], number: int, renew: bool = False) -> Any:
    """The answer for ``slot`` from process ``peer`` on the plane (to its listener's message ``number``); the error
    it carries, ``located``, raised."""
    value = runner.plane.take(peer, slot, runner.timeout, located, renew=renew)
    heard(runner.key, peer, number)
    if isinstance(value, Failure):
        raise with_location(value.exc, located)
    return value


def answer(runner: Any, peer: str, process: int, run: int, stages: str, number: int) -> Any:
    """Process ``process``'s answer to run ``run`` (what it held for the driver), once its share is done; its
    error, located in its ``stages`` (``"1"``, or ``"1, 3"``), if the share failed or the process is gone.
    Waits the RPC timeout from the process's last sign of life."""
    located = lambda: f"in stage {stages} of pipeline '{runner.key}' ({where(peer)})"  # noqa: E731
    try:
        return unpacked(answered(runner, peer, answer_slot(runner.key, run, process), located, number, renew=True))
    except TimeoutError:
        raise TimeoutError(f"no answer within {runner.timeout:.1f} s from stage {stages} ({where(peer)}) of pipeline "
                           f"'{runner.key}' although the rest of the step is done: its process is stuck "
                           "(rpc_timeout_sec bounds this wait)") from None


class Unanswered:
    """The steps process ``peer`` (``process``) of pipeline ``key`` did not answer because they went well (a
    commit in flight, see :func:`~lightning_pipe.transport.wire.riders.defer_commits`): :meth:`result` makes sure
    their shares are over and raises the error of one that failed late, located in the process's ``stages``.
    The next step cannot overtake them (the listener runs its messages in order), nor can a call on the plane."""

    before_steps = True
    shares = True  # left for later by ``settle_commits(..., shares=False)``: the end of every step

    def __init__(self, runner: Any, peer: str, process: int, stages: str, ask: Callable[[Callable[[], str]], Any]
                 ) -> None:
        self.runner, self.peer, self.process, self.stages, self.ask = runner, peer, process, stages, ask
        self.runs: list[int] = []
        self.number = 0  # the last step's message to the listener

    def add(self, run: int, number: int) -> None:
        """Run ``run``'s step (message ``number`` to the listener) went unanswered. The steps before it are
        settled first where the driver has heard from the process since (a look in the mailbox), and where one of
        them was aborted since (by the process that failed: a round trip) or :data:`UNHEARD_MAX` steps are waiting."""
        if self.runs and (self._heard() or len(self.runs) >= UNHEARD_MAX or
                          any(map(self.runner.has_failed, self.runs))):
            self.result()
        self.runs.append(run)
        self.number = number

    def _heard(self) -> bool:
        return _HEARD.get((self.runner.key, self.peer), 0) > self.number

    def result(self) -> None:
        """Wait until the process has answered something sent after these steps (asking it for a word where it
        has not), then raise the first error its unanswered steps left in the mailbox."""
        runs, self.runs = self.runs, []
        if not runs:
            return
        if not self._heard():  # ``ask(located)``: a call on the plane that does nothing (its answer, or None)
            word = self.ask(lambda: f"asking stage {self.stages} of pipeline '{self.runner.key}' ({where(self.peer)}) "
                                    "whether its last steps went well")
            if word is not None:
                word.result()
        for run in runs:
            found, value = MAILBOX.poll(answer_slot(self.runner.key, run, self.process))
            # (a process that failed late aborted the run everywhere: the others' answers say so, Skipped)
            if found and isinstance(value, Failure) and not isinstance(value.exc, Skipped):
                raise with_location(value.exc, partial(self._located, run))

    def _located(self, run: int) -> str:
        return f"in stage {self.stages} of pipeline '{self.runner.key}' ({where(self.peer)}), after step {run} ended " \
               "for the driver"


#: The first item of an answer holding the last stage's losses as one tensor (:func:`packed`).
_LOSSES = "losses, stacked"


def packed(held: dict[int, Any] | None) -> Any:
    """What the last stage holds for the driver (micro-batch: its loss or output), as it travels: losses that are
    scalars alone, as ``(_LOSSES, micro-batches, one tensor of them)`` (one tensor to copy and view instead of one
    per micro-batch, and a plain tuple, which the codec pickles by pickle's C code alone); else as it is."""
    if not held or any(type(v) is not MicroLoss or v.extras is not None or v.value.dim() for v in held.values()):
        return held
    values = [v.value for v in held.values()]
    if any(v.dtype != values[0].dtype or v.device != values[0].device for v in values):
        return held
    return (_LOSSES, tuple(held), torch.stack(values))


def unpacked(value: Any) -> Any:
    """What :func:`packed` made of an answer, as it was held."""
    if type(value) is tuple and value[:1] == (_LOSSES,):
        _, microbatches, losses = value
        return {i: MicroLoss(loss, None) for i, loss in zip(microbatches, losses.unbind())}
    return value


def collect(runner: Any, peers: Sequence[str], run: int, futures: Sequence[Future[Any]], on_plane: Sequence[int],
            numbers: Mapping[int, int], quiet: Iterable[int], stages: Callable[[int], str],
            failed: bool, abort: Callable[[], None], on_done: Callable[[Future[Any]], None],
            unanswered: dict[int, Unanswered], ask: Callable[[int], Callable[[Callable[[], str]], Any]]
            ) -> BaseException | None:
    """The driver's end of run ``run``: the answer of every process in ``on_plane`` (its step went on the plane as
    message ``numbers[r]``) into ``futures[r]``; those in ``quiet`` answer only where the step failed (``failed``,
    or another answer says so): then the run is aborted (``abort()``) and their answers read too, else their steps
    join what :class:`Unanswered` settles later (``unanswered``: one per process, kept by the driver; ``ask(r)``
    asks process ``r`` for a word). Returns the first real error in process order (not a skip), or None."""
    quiet = set(quiet)

    def take(r: int) -> None:
        try:
            futures[r].set_result(answer(runner, peers[r], r, run, stages(r), numbers[r]))
        except BaseException as exc:  # noqa: BLE001 - each process's answer is read; the first real error wins
            futures[r].set_exception(exc)
            on_done(futures[r])

    for r in on_plane:
        if r not in quiet:
            take(r)
    silent = [r for r in on_plane if r in quiet]
    if silent and (failed or any(futures[r].exception() is not None for r in on_plane if r not in quiet)):
        abort()  # every process learns of it: one whose share went well answers now
        for r in silent:
            take(r)
    else:
        for r in silent:
            futures[r].set_result(None)
            waiting = unanswered.get(r)
            if waiting is None:
                waiting = unanswered[r] = Unanswered(runner, peers[r], r, stages(r), ask(r))
            if not waiting.runs:  # (settled since: kept again)
                defer_commits(runner.key, [waiting])
            waiting.add(run, numbers[r])
    errors = (futures[r].exception() for r in on_plane)
    return next((exc for exc in errors if exc is not None and not isinstance(exc, Skipped)), None)
