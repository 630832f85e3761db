"""What crosses processes: the mailbox that receives tensors, how they are packed, and how failures travel.

Tensors go straight from stage to stage: over the data plane (:mod:`~lightning_pipe.transport.wire.dataplane`), or
by RPC, the sender calling ``deliver_to_mailbox`` on the receiver, which puts them into the receiver's :class:`Mailbox`
under their :data:`Slot` (where the data plane also puts what arrives for a slot no one waits for yet); the
action that consumes them takes them out, waiting at most the RPC timeout. An error in a remote call comes
back as a value (:class:`Failure`) with its type, message, notes and the remote traceback, and is located
(which stage, which process) before it is raised.
"""

from __future__ import annotations

import collections
import pickle
import threading
import time
import traceback
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed.rpc as rpc
from torch import Tensor

from lightning_pipe.engine.loss import LossFn, MicroLoss
from lightning_pipe.engine.share import Skipped
from lightning_pipe.engine.stage import settled

__all__: list[str] = []

#: Where a message goes: (pipe key, run id, "F", "B" or "T" (target), micro-batch, receiving stage, sender, skip
#: key or "target").
class Slot(NamedTuple):
    """Where a payload lands in the receiving process (its mailbox key, and what a take waits for): pipeline ``key``'s
    run ``run``, ``kind`` (``"F"`` a forward's input, ``"B"`` a gradient, ``"T"`` the last stage's target, or a
    control kind of the data plane), micro-batch ``microbatch``, for stage ``stage`` (``n``: the driver), from
    ``source`` (the sending stage, ``"target"``, or the key of a skip connection). A plain tuple of the same fields
    is equal to it and hashes alike (what a message decoded before it was named carries)."""

    key: str
    run: int
    kind: str
    microbatch: int
    stage: int
    source: Hashable


@dataclass
class StepSpec:
    """How one step runs on every stage of a pipeline; it travels with each process's actions."""

    microbatches: int
    save: bool
    checkpoint_stop: int
    training: bool
    autocast: list[tuple[str, torch.dtype]]
    anomaly: bool = False
    dtype: torch.dtype | None = None
    eager: bool = False  # backwards run ahead of the caller's: each stage sets its gradients aside
    loss: LossFn | None = None  # computed on the last stage; then weights and loss_scale give its gradient
    weights: list[float] = field(default_factory=list)
    loss_scale: float = 1.0
    reduce: bool = False  # the step's gradients are averaged over replicas (not under DDP's no_sync)


def on_cpu(value: Any) -> Any:
    """``value`` with its tensors on the CPU (what goes back in an RPC answer)."""
    if isinstance(value, Tensor):
        return settled(value).cpu()
    if isinstance(value, MicroLoss):
        return MicroLoss(settled(value.value).cpu(), None if value.extras is None else
                         {k: settled(v).cpu() for k, v in value.extras.items()})
    return value


class Mailbox:
    """Tensors delivered to this process, waiting for the action that consumes them."""

    def __init__(self) -> None:
        self._items: dict[Slot, Any] = {}
        self._cond = threading.Condition()
        self._aborted: collections.deque[tuple[str, int]] = collections.deque(maxlen=4096)

    def put(self, slot: Slot, value: Any) -> None:
        """Deliver ``value`` to ``slot``."""
        with self._cond:
            if slot[:2] not in self._aborted:
                self._items[slot] = value
                self._cond.notify_all()

    def take(self, slot: Slot, timeout: float, describe: Callable[[], str]) -> Any:
        """Wait for ``slot`` (at most ``timeout`` seconds) and remove it."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while slot not in self._items:
                if slot[:2] in self._aborted:
                    raise Skipped()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise no_input(describe, timeout)
                self._cond.wait(remaining)
            return self._items.pop(slot)

    def poll(self, slot: Slot) -> tuple[bool, Any]:
        """``(True, value)`` taken from ``slot`` if it was delivered, else ``(False, None)``; raises
        :class:`Skipped` if the slot's run was aborted."""
        with self._cond:
            if slot in self._items:
                return True, self._items.pop(slot)
            if slot[:2] in self._aborted:
                raise Skipped()
            return False, None

    def pending(self) -> int:
        """How many delivered messages wait for their consumer."""
        with self._cond:
            return len(self._items)

    def abort(self, key: str, run: int) -> None:
        """Wake every wait of run ``run`` (they skip) and drop what was delivered for it."""
        with self._cond:
            self._aborted.append((key, run))
            for slot in [s for s in self._items if s[:2] == (key, run)]:
                del self._items[slot]
            self._cond.notify_all()


MAILBOX = Mailbox()


def no_input(describe: Callable[[], str], timeout: float) -> TimeoutError:
    """The error of a wait for an input that did not come within ``timeout`` (mailbox or data plane alike)."""
    return TimeoutError(f"{describe()} waited {timeout:.1f} s for its input and got none; the process that should "
                        "send it is stuck or gone (rpc_timeout_sec bounds this wait)")

# When a driver last heard that a remote stage is still working on a step: (pipeline key, run) -> the
# time.monotonic() of that sign of life. An entry exists while the driver waits for that step.
PROGRESS: dict[tuple[str, int], float] = {}
PROGRESS_LOCK = threading.Lock()


def note_alive(key: str, run: int) -> None:
    """Note that run ``run`` of pipeline ``key`` made progress in another process (its sign of life), restarting the
    driver's wait for that process."""
    with PROGRESS_LOCK:
        if (key, run) in PROGRESS:
            PROGRESS[(key, run)] = time.monotonic()


def pack_batch(batch_tensors: Sequence[Tensor | None], direct: torch.device | None = None
               ) -> tuple[list[Tensor | None], list[bool]]:
    """A micro-batch's tensors as they cross processes (:func:`to_wire`: detached, on the CPU unless on the GPU
    ``direct``), and a flag per tensor saying whether it needs a gradient back (:func:`unpack_batch`). A skip
    stashed as None crosses as None."""
    return list(to_wire(batch_tensors, direct)), [t is not None and t.requires_grad for t in batch_tensors]


def to_wire(tensors: Sequence[Tensor | None], direct: torch.device | None = None) -> tuple[Tensor | None, ...]:
    """``tensors`` as they go to another process: settled (:func:`settled`), detached; on CPU, except those on
    ``direct``, a GPU from which RPC sends them to the receiver's GPU as they are (a TensorPipe device map)."""
    return tuple(None if t is None else settled(t).detach() if t.device == direct else settled(t).detach().cpu()
                 for t in tensors)


def to_wire_any(value: Any) -> Any:
    """``value`` (a tensor, or tuples, lists and mappings of them, or anything else) as it goes to another
    process: its tensors detached, on the CPU."""
    if isinstance(value, Tensor):
        return settled(value).detach().cpu()
    if isinstance(value, (tuple, list)):
        return type(value)(to_wire_any(v) for v in value)
    if isinstance(value, dict):
        return {k: to_wire_any(v) for k, v in value.items()}
    return value


def maps_device(peer: str, device: torch.device) -> bool:
    """Whether RPC sends CUDA tensors on ``device`` to process ``peer`` as they are (a device map for it)."""
    try:
        mapping = rpc.api._get_current_rpc_agent()._get_device_map(rpc.get_worker_info(peer))
    except Exception:  # noqa: BLE001 - no TensorPipe agent, or an older one: through host memory
        return False
    return any(torch.device(local) == device for local in mapping)


def landed(payload: Any) -> Any:
    """``payload`` as received by RPC, ready for this process's threads: CUDA tensors arrive on a stream of
    RPC's own, so wait for it, and let the memory allocator know that the default stream uses them."""
    tensors = [t for t in tensors_in(payload) if t.is_cuda]
    for device in {t.device for t in tensors}:
        torch.cuda.current_stream(device).synchronize()
    for t in tensors:
        t.record_stream(torch.cuda.default_stream(t.device))
    return payload


def tensors_in(value: Any) -> list[Tensor]:
    """The tensors of ``value`` (a tensor, or tuples and lists of them), in order."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    return []


def unpack_batch(tensors: Sequence[Tensor | None], flags: Sequence[bool]) -> tuple[Tensor | None, ...]:
    """What :func:`pack_batch` sent, as the receiving stage takes it: each floating tensor needing a gradient where
    its flag says so."""
    return tuple(t.requires_grad_(f) if t is not None and (t.is_floating_point() or t.is_complex()) else t
                 for t, f in zip(tensors, flags))


def where(name: str) -> str:
    """``"rank 3, process 'worker3'"``: how errors name a process."""
    try:
        return f"rank {rpc.get_worker_info(name).id}, process '{name}'"
    except Exception:  # noqa: BLE001 - RPC already down: the name is all there is
        return f"process '{name}'"


def deliver_to_mailbox(slot: Slot, payload: Any) -> None:
    """Put ``payload``, sent by RPC, into this process's mailbox under ``slot`` (an RPC entry point)."""
    MAILBOX.put(slot, landed(payload))


class Failure:
    """An action's error, sent back as a value: RPC would turn an exception set on an async function's
    future into a plain return value, so failures travel explicitly. The exception keeps its type, its
    message and its notes; its remote traceback comes along as a note."""

    def __init__(self, exc: BaseException) -> None:
        if not isinstance(exc, Skipped) and exc.__traceback__ is not None:
            exc.add_note("Traceback in the stage's process (most recent call last):\n" +
                         "".join(traceback.format_tb(exc.__traceback__)).rstrip())
        try:
            pickle.dumps(exc)
        except Exception:  # noqa: BLE001 - an exception that cannot cross processes becomes one that can
            plain = RuntimeError(f"{type(exc).__name__}: {exc}")
            for note in getattr(exc, "__notes__", []):
                plain.add_note(note)
            exc = plain
        self.exc = exc


def chain_into(future: torch.futures.Future, result: Future[Any], describe: Callable[[], str]) -> None:
    """Complete ``result`` with the outcome of an RPC ``future`` (a sent failure becomes its exception)."""

    def done(f: torch.futures.Future) -> None:
        try:
            value = f.value()
            if isinstance(value, Failure):
                raise value.exc
            result.set_result(value)
        except BaseException as exc:  # noqa: BLE001
            result.set_exception(with_location(exc, describe))

    future.add_done_callback(done)


def to_concurrent(future: torch.futures.Future, describe: Callable[[], str]) -> Future[Any]:
    """A ``concurrent.futures.Future`` with the outcome of an RPC ``future``; its error is noted with
    ``describe()`` (where it came from)."""
    result: Future[Any] = Future()
    chain_into(future, result, describe)
    return result


def with_location(exc: BaseException, describe: Callable[[], str]) -> BaseException:
    """``exc`` with a note saying where it happened (``describe()``, once), and that the process is gone where the
    error says its connection broke; a run's abort seen through RPC is :class:`Skipped` again."""
    if isinstance(exc, Skipped) or "Skipped" in str(exc).split("\n", 1)[0]:
        return Skipped()
    if not getattr(exc, "_lightning_pipe_where", False):
        text = str(exc)
        lost = any(sign in text for sign in ("EOF", "end of file", "Connection reset", "pipe closed",
                                             "Connection refused", "closed by peer"))
        exc.add_note(describe() + (": its process exited or was killed" if lost else ""))
        exc._lightning_pipe_where = True  # type: ignore[attr-defined]
    return exc


def chain_work(submit: Callable[[Callable[[], Any]], Future[Any]], work: Callable[[], tuple[list[Future[Any]], Any]]
               ) -> torch.futures.Future:
    """Run ``work`` by ``submit`` (on a stage's worker); once it and the sends it started are done, answer with
    the value it returned beside them."""
    out: torch.futures.Future = torch.futures.Future()

    def finish(f: Future[Any]) -> None:
        exc = f.exception()
        if exc is not None:
            out.set_result(Failure(exc))
            return
        sends, value = f.result()
        pending = [len(sends)]
        if not sends:
            out.set_result(value)
            return
        lock = threading.Lock()

        def sent(s: Future[Any]) -> None:
            with lock:
                pending[0] -= 1
                last = pending[0] == 0
            with lock:
                if out.done():
                    return
                if s.exception() is not None:
                    out.set_result(Failure(s.exception()))  # type: ignore[arg-type]
                elif last:
                    out.set_result(value)

        for s in sends:
            s.add_done_callback(sent)

    submit(work).add_done_callback(finish)
    return out
