"""Tensors between a pipeline's processes point to point (gloo, or shared memory on one machine), beside RPC: each
hand-off one message into a receive posted ahead, taken by the thread that needs it.

RPC stays the control plane (what each stage runs, errors, timeouts, optimizer steps, checkpoints); this plane carries
what stages hand each other (activations, their gradients, skips). The processes of a pipeline form gloo groups of their
own, one per sending process (each TCP connection then carries data one way: on one connection, two processes sending to
each other at once stall each other's sends by milliseconds, measured in ``benchmarks/bench_handoff.py``); each keeps
``depth`` receives posted from each other process (a gloo send completes once its receive is posted, so a sender never
waits for the receiver's threads). The stage thread that needs a message waits on that receive itself, with no thread in
between; a message for another slot goes into the :data:`~lightning_pipe.transport.wire.messages.MAILBOX`, where the RPC
path delivers too, so schedules, timeouts and failures do not know which plane carried a message. What the plane does
not carry (large messages under ``"auto"``, GPU tensors, tensor subclasses) goes by RPC, and a ``BY_RPC`` message in its
place tells the receiver to look in the mailbox. A failed run sends ``ABORT`` on every channel: a waiting stage wakes.

A receive must be at least as large as what arrives (gloo aborts the process otherwise), so each sender mirrors the
capacities of the receives posted for it: a message larger than the next one is preceded by ``GROW`` messages, one for
each smaller receive still posted, after which the receiver posts at the new size. On one machine, rings in shared
memory (:mod:`~lightning_pipe.transport.wire.shm`) take gloo's place, all else unchanged. Tensors on a GPU follow their
message on a lane of their own (:mod:`~lightning_pipe.transport.wire.lane`, NCCL) where the plane has one."""

from __future__ import annotations

import collections
import datetime
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
from torch import Tensor

from lightning_pipe.engine.share import Skipped
from lightning_pipe.transport.wire.codec import (
    ABORT,
    ALIVE,
    BY_RPC,
    CLOSE,
    DATA,
    GROW,
    STEP,
    Unsuitable,
    control,
    decode,
    encode,
    encode_beside,
)
from lightning_pipe.transport.wire.lane import TensorLane
from lightning_pipe.transport.wire.listeners import start_listener
from lightning_pipe.transport.wire.messages import MAILBOX, Slot, no_input, note_alive, where, with_location
from lightning_pipe.transport.wire.posted import START, Channel
from lightning_pipe.transport.wire.shm import SharedMemoryLinks

__all__ = ["AUTO_MAX_BYTES", "DATA_PLANES", "DataPlane"]

#: What ``data_plane`` takes: ``"auto"`` (CPU hand-offs up to :data:`AUTO_MAX_BYTES` point to point, through shared
#: memory on one machine, else gloo; RPC above and for GPU tensors), ``"p2p"`` (every CPU hand-off over gloo), ``"rpc"``
DATA_PLANES = ("auto", "p2p", "rpc")
#: Above this many bytes a message goes by RPC under ``"auto"`` (``benchmarks/bench_handoff.py``, over gloo: 0.42x RPC's
#: time at 16 KiB, 1.08x at 2 MiB, 1.30-1.47x at 4 MiB, where TensorPipe moves large messages faster than loopback TCP).
AUTO_MAX_BYTES = 3 << 19  # 1.5 MiB
#: The kind (third field) of the slot of a message holding several ``(slot, payload)`` items (``send_many``).
BUNDLE = "bundle"
#: The kind of the slot of a process's answer to a step (:mod:`~lightning_pipe.transport.stages.steps`): not a hand-off.
ANSWER = "A"
_SHARED = 0.005  # s: how often a wait for a channel another thread receives on looks in the mailbox again
_IDLE = 365 * 86400.0  # s: how long the step listener waits for a step (a gloo wait that times out closes its pair)


def _complete(sent: Future[Any], error: BaseException | None) -> None:
    """Complete the future of some sends (unless a send that failed to start already failed it)."""
    if not sent.done():
        if error is None:
            sent.set_result(None)
        else:
            sent.set_exception(error)


class DataPlane:
    """Point-to-point channels between this process (``names[rank]``) and the other processes ``names`` of pipeline
    ``key``, over ``groups`` (gloo, one per sending process, or shared memory's links). Messages over ``max_bytes``
    (None: no limit but a ring's) and payloads it cannot carry go by RPC: :meth:`send` returns None for them.
    Sends complete when :meth:`flush` waits for them (the end of a process's share of a step)."""

    def __init__(self, key: str, groups: Sequence[Any], rank: int, names: Sequence[str], timeout: float,
                 max_bytes: int | None, depth: int = 8, lane: TensorLane | None = None) -> None:
        self.key = key
        self.group = groups[rank]  # what this process sends goes through its own group
        self.rank = rank
        self.names = list(names)
        self._rank_of = {name: r for r, name in enumerate(self.names)}  # looked up on every message
        self.timeout = timeout
        limits = (max_bytes, getattr(self.group, "largest", None))  # the largest message a shared memory ring takes
        self.max_bytes = min((b for b in limits if b is not None), default=None)
        self.closed = False
        self.sent = self.received = 0  # hand-offs (data messages but the answers to steps), for tests and benchmarks
        self.links = "shared memory" if isinstance(self.group, SharedMemoryLinks) else "gloo"  # what carries them
        self._in_place = isinstance(self.group, SharedMemoryLinks)  # messages written into the ring (codec.Unwritten)
        # Where tensors on the stage's device go (beside their message), if anywhere; that device.
        self.lane, self._beside = lane, (lane.device if lane is not None else None)
        self.links += f", tensors over {lane.backend}" if lane is not None else ""
        self._channels = {p: Channel(groups[p], p, depth, lane) for p in range(len(self.names)) if p != rank}
        # Per peer, the capacities of the receives it has posted for this process's messages, in order; it posts
        # one more, at its capacity then, as it starts waiting for each message (see ``Channel.receive``).
        self._posted = {peer: collections.deque([START] * (depth - 1)) for peer in self._channels}
        self._capacity = dict.fromkeys(self._channels, START)
        self._lock = threading.Lock()
        # Sends in flight as (work, future, describe, peer, order), and those only kept alive (control messages,
        # those of failed runs: gloo drops a send whose work is freed) as (peer, order, work). ``order`` counts
        # sends: to one peer they complete in the order sent (one pair, one tag), so once one is waited for, those
        # before it are done too; a send's ``is_completed()`` says so only once it is waited for.
        self._pending: list[tuple[Any, Future[Any], Callable[[], str], int, int]] = []
        self._batch: Future[Any] | None = None  # what :meth:`send` returns until the next flush
        self._lingering: list[tuple[int, int, Any]] = []
        self._order = 0
        self._steps: collections.deque[Any] = collections.deque()  # steps' actions received, for the listener

    # ------------------------------------------------------------------ sending
    def carries(self, name: str) -> bool:
        """Whether messages to and from process ``name`` go this way."""
        peer = self._rank_of.get(name)
        return not self.closed and peer in self._channels and self._channels[peer].error is None

    def send(self, name: str, slot: Slot, payload: Any, describe: Callable[[], str] | None = None
             ) -> Future[Any] | None:
        """Start sending ``payload`` for ``slot`` to process ``name``; the sends in flight (one future for every
        send until :meth:`flush` sees them through, failed by one of their errors, noted with that send's
        ``describe()``), or None where this plane does not carry it: the caller sends it by RPC, then calls
        :meth:`sent_by_rpc`."""
        if not self.carries(name):
            return None
        try:
            message, beside = encode_beside(DATA, slot, payload, self._beside, unwritten=self._in_place)
        except Unsuitable:
            return None
        if self.max_bytes is not None and len(message) > self.max_bytes:
            return None
        describe = describe or (lambda: f"sending to {where(name)}")
        started, sent = self._send(self._rank_of[name], message, None, describe, True, beside)
        self.sent += started and slot.kind != ANSWER
        return sent

    def send_step(self, name: str, run: int, step: tuple[Any, ...]) -> bool:
        """Start sending ``step`` (process ``name``'s actions of run ``run``, or its commit) to its listener
        (:meth:`serve`); its first four items hold no tensors (the codec does not look through them). False where
        this plane does not carry it (the caller sends it by RPC, where an error in pickling it is raised as it
        always was)."""
        if not self.carries(name):
            return False
        try:
            message, beside = encode_beside(STEP, Slot(self.key, run, "S", 0, 0, "step"), step, self._beside, 4,
                                            self._in_place)
        except Exception:  # noqa: BLE001 - what RPC carries, or refuses with its own error
            return False
        if self.max_bytes is not None and len(message) > self.max_bytes:
            return False
        sent: Future[Any] = Future()
        started, _ = self._send(self._rank_of[name], message, sent, lambda: f"sending a step to {where(name)}",
                                beside=beside)
        return started and not (sent.done() and sent.exception() is not None)

    def alive(self, name: str, run: int) -> bool:
        """Tell process ``name`` (the driver) that this one still works on run ``run``; False where this plane
        does not carry it."""
        return self.carries(name) and self._send(self._rank_of[name], control(ALIVE, run), None, lambda: "")[0]

    def send_many(self, name: str, run: int, items: Sequence[tuple[Slot, Any]]) -> Future[Any] | None:
        """Start sending several ``(slot, payload)`` items of run ``run`` to process ``name`` in one message
        (its receiver puts each into its mailbox); None where this plane does not carry them (as :meth:`send`)."""
        return self.send(name, Slot(self.key, run, BUNDLE, 0, 0, 0), list(items))

    def sent_by_rpc(self, name: str, slot: Slot) -> None:
        """Tell process ``name`` that the payload for ``slot`` went by RPC (it waits for it in the mailbox)."""
        if self.carries(name):
            self._send(self._rank_of[name], encode(BY_RPC, slot), None, lambda: "")

    def abort(self, run: int) -> None:
        """Tell every peer that run ``run`` failed: a stage waiting for one of its messages wakes and skips."""
        for peer in self._channels:
            if self.carries(self.names[peer]):
                self._send(peer, control(ABORT, run), None, lambda: "")

    def _send(self, peer: int, message: Tensor, sent: Future[Any] | None, describe: Callable[[], str],
              batch: bool = False, beside: Sequence[Tensor] = ()) -> tuple[bool, Future[Any] | None]:
        """Start ``message`` (``GROW`` first where a receive is too small), then its tensors ``beside`` on the lane;
        whether it started (not once closed: nothing follows ``CLOSE``, a send racing it goes by RPC), its future."""
        with self._lock:
            if self.closed:
                return False, None
            if batch:  # the sends until the next flush share one future (one of its own costs ~4 µs a send)
                sent = self._batch = self._batch if self._batch is not None and not self._batch.done() else Future()
            posted = self._posted[peer]
            if len(message) > (posted[0] if posted else self._capacity[peer]):
                grown = max(len(message), 2 * self._capacity[peer])
                while len(message) > (posted[0] if posted else self._capacity[peer]):
                    self._start(peer, control(GROW, grown), None, describe)  # one per smaller receive
                    self._capacity[peer] = grown
            if self._start(peer, message, sent, describe) and beside and sent is not None and self.lane is not None:
                for work in self.lane.send(peer, beside):  # in the lane's order of messages: under this lock
                    self._order += 1  # (``~peer``: the lane to ``peer``, whose sends complete in order too)
                    self._pending.append((work, sent, describe, ~peer, self._order))
        return True, sent

    def _start(self, peer: int, message: Tensor, sent: Future[Any] | None, describe: Callable[[], str]) -> bool:
        """Send ``message`` to ``peer``; a data message's send completes ``sent`` at :meth:`flush`, a control
        message's (``sent`` None) is only kept alive: its receiver may not read that channel for a long time (a
        stage's channel from the next stage during forwards), and no share waits for it."""
        posted = self._posted[peer]
        posted.append(self._capacity[peer])  # posted by the receiver as it starts waiting for this message
        if len(message) > posted.popleft():
            raise AssertionError("a message larger than the receive posted for it")  # gloo would abort
        self._order += 1
        try:
            work = self.group.send([message], peer, 0)
        except Exception as exc:  # noqa: BLE001 - the channel is gone: the action that sent it fails, located
            self._channels[peer].error = f"sending failed: {exc}"
            if sent is not None:
                _complete(sent, with_location(exc, describe))
            return False
        if sent is None:
            self._lingering.append((peer, self._order, work))
        else:
            self._pending.append((work, sent, describe, peer, self._order))
        return True

    def flush(self, failed: bool = False) -> None:
        """Wait until every send started so far is done with (its receive posted and filled) and complete
        their futures; after a failure (``failed``), only keep them alive: their receivers may never take them."""
        with self._lock:
            pending, self._pending, self._batch = self._pending, [], None
            if failed:
                self._lingering += [(peer, order, work) for work, _, _, peer, order in pending]
        deadline = time.monotonic() + self.timeout
        done: dict[int, int] = {}  # per peer, the last send known done
        errors: dict[int, BaseException] = {}  # per future, the first error of its sends
        # Sends to one peer complete in order: once the last one is waited for (a wait costs ~8 µs, 16 of them at the
        # end of every share), those before it are done too; where it failed, each before it is waited for.
        for work, sent, describe, peer, order in () if failed else reversed(pending):
            if order <= done.get(peer, 0):
                continue
            try:
                work.wait(datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
                done[peer] = order
            except BaseException as exc:  # noqa: BLE001 - the action that sent it fails, located
                errors[id(sent)] = with_location(exc, describe)  # the earliest error, once the loop is over
        for key, sent in {id(sent): sent for _, sent, _, _, _ in pending}.items():
            _complete(sent, errors.get(key))
        if done:
            with self._lock:  # what was sent to a peer before a send now done is done too: its work may go
                self._lingering = [(peer, order, work) for peer, order, work in self._lingering
                                   if order > done.get(peer, 0)]

    # ------------------------------------------------------------------ receiving
    def take(self, name: str, slot: Slot, timeout: float, describe: Callable[[], str], renew: bool = False) -> Any:
        """The payload for ``slot`` from process ``name``, waiting at most ``timeout`` seconds: from the
        mailbox if it is there, else from the channel (messages for other slots go to the mailbox). ``renew``:
        each sign of life from ``name`` for the slot's run starts the ``timeout`` again (a driver waiting for a
        process's answer to a step; an abort of the run does not end that wait, the answer says how it ended)."""
        channel = self._channels[self._rank_of[name]]
        deadline = time.monotonic() + timeout
        while True:
            found, value = MAILBOX.poll(slot)
            if found:
                return value
            remaining = deadline - time.monotonic()
            if channel.error is not None or self.closed:
                return MAILBOX.take(slot, max(0.0, remaining), describe)
            if not channel.lock.acquire(timeout=max(0.0, min(remaining, _SHARED))):
                # Another thread receives on this channel (the step listener, a driver's collecting thread):
                # what it receives for this slot goes into the mailbox, looked at again first.
                if remaining <= 0:
                    raise no_input(describe, timeout)
                continue
            try:
                found, value = MAILBOX.poll(slot)  # another thread may have received it meanwhile
                if found:
                    return value
                try:
                    kind, value, buffer = channel.receive(remaining)
                except Exception as exc:  # noqa: BLE001 - gloo closes a channel whose wait fails
                    late = time.monotonic() >= deadline - 0.01
                    channel.error = "a wait timed out" if late else f"the channel failed: {exc}"
                    if late:
                        raise no_input(describe, timeout) from None
                    raise with_location(exc, describe) from None  # ``describe`` names the sender
            finally:
                channel.lock.release()
            if kind == ALIVE:
                note_alive(self.key, value)
                if renew and value == slot.run:
                    deadline = time.monotonic() + timeout
                continue
            got, payload = self._route(name, kind, value, buffer, slot)
            if kind == ABORT and got == (slot.key, slot.run):
                raise Skipped()
            if got != slot:
                continue
            if kind == BY_RPC:
                return MAILBOX.take(slot, max(0.0, deadline - time.monotonic()), describe)
            return payload

    def _route(self, name: str, kind: int, value: int, buffer: Tensor, slot: Slot | None = None) -> tuple[Any, Any]:
        """Deal with a message received from ``name`` that is not a sign of life: return its slot and payload where
        it is for ``slot`` (a payload, or word that it went by RPC), or for an ``ABORT`` the aborted run's
        ``(key, run)``; anything else is put where it belongs (a payload into the mailbox, a step's actions aside
        for the listener) and ``(None, None)`` returned."""
        if kind == DATA:
            got, payload = buffer if type(buffer) is tuple else decode(buffer)
            self.received += got[2] != ANSWER
            if got == slot:
                return got, payload
            if got[2] == BUNDLE:  # several payloads in one message (a step's targets)
                for item in payload:
                    MAILBOX.put(*item)
            else:
                MAILBOX.put(got, payload)
        elif kind == STEP:
            self._steps.append((buffer if type(buffer) is tuple else decode(buffer))[1])
        elif kind == BY_RPC:
            got, _ = decode(buffer)
            if got == slot:
                return got, None
        elif kind == ABORT:
            MAILBOX.abort(self.key, value)
            return (self.key, value), None
        elif kind == CLOSE:
            self._channels[self._rank_of[name]].error = f"{where(name)} closed it"
        return None, None

    def next_step(self, name: str) -> Any:
        """The next step's actions sent by process ``name`` (the driver), waiting as long as the pipeline is
        idle; None once the channel is closed or gone (the listener then stops: steps come by RPC)."""
        channel = self._channels[self._rank_of[name]]
        while True:
            if self._steps:
                return self._steps.popleft()
            if channel.error is not None or self.closed:
                return None
            if not channel.lock.acquire(timeout=_SHARED):
                continue
            try:
                if self._steps:
                    continue
                try:
                    kind, value, buffer = channel.receive(_IDLE, idle=True)
                except Exception as exc:  # noqa: BLE001 - the driver exited, or closed the channel
                    channel.error = f"the channel failed: {exc}"
                    return None
            finally:
                channel.lock.release()
            if kind != ALIVE:
                self._route(name, kind, value, buffer)

    def serve(self, name: str, handler: Callable[[Any], None]) -> threading.Thread:
        """Run ``handler`` on each step's actions that process ``name`` (the driver) sends, one after another,
        on a thread of their own, until the channel closes; then close this plane (its peers, the driver
        included, then reach this process by RPC alone)."""
        threads = torch.get_num_threads()

        def listen() -> None:
            torch.set_num_threads(threads)  # OpenMP's count is per thread: as a stage's worker does
            while (step := self.next_step(name)) is not None:
                handler(step)
            self.close()  # no one serves steps here any more: the driver sends them by RPC from now on

        return start_listener(f"lightning_pipe.{self.key}.steps", listen)

    def close(self) -> None:
        """Tell every peer this process sends no more (a stage waiting for it looks in the mailbox instead), then
        see the sends started before through, completing their futures (a share racing this may never flush them).
        ``CLOSE`` goes under the lock that starts sends: no send follows it, later ones go by RPC."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            for peer in self._channels:  # (a failed send marks its channel; a peer gone has nothing to end)
                self._start(peer, control(CLOSE, 0), None, lambda: "")
        self.flush()
