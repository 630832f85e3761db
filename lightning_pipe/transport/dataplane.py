"""Tensors between a pipeline's processes by torch.distributed point-to-point (gloo), beside RPC: each hand-off
one message into a receive posted ahead, taken by the thread that needs it.

RPC stays the control plane (what each stage runs, errors, timeouts, optimizer steps, checkpoints); this plane
carries what stages hand each other (activations, their gradients, skips). The processes of a pipeline form
gloo groups of their own, one per sending process (each TCP connection then carries data one way: on one
connection, two processes sending to each other at once stall each other's sends by milliseconds, measured
in ``benchmarks/bench_handoff.py``); each keeps ``depth`` receives posted from each other process (a gloo send
completes once its receive is posted, so a sender never waits for the receiver's threads). The stage thread that needs a
message waits on that receive itself, with no thread in between; a message for another slot goes into the
:data:`~lightning_pipe.transport.messages.MAILBOX`, where the RPC path delivers too, so schedules, timeouts and
failures do not know which plane carried a message. What the plane does not carry (large messages under
``"auto"``, GPU tensors, tensor subclasses) goes by RPC, and a ``BY_RPC`` message in its place tells the
receiver to look in the mailbox. A failed run sends ``ABORT`` on every channel, which wakes a waiting stage.

A receive must be at least as large as what arrives (gloo aborts the process otherwise), so each sender
mirrors the capacities of the receives posted for it: a message larger than the next one is preceded by
``GROW`` messages, one for each smaller receive still posted, after which the receiver posts at the new size.
"""

from __future__ import annotations

import collections
import datetime
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch import Tensor

from lightning_pipe.engine.pipeline import _Skipped
from lightning_pipe.transport.codec import ABORT, BY_RPC, CLOSE, DATA, GROW, Unsuitable, control, decode, encode, header
from lightning_pipe.transport.messages import MAILBOX, Slot, _located, no_input, where
from lightning_pipe.transport.runner import _RUNNERS, StageRunner
from lightning_pipe.transport.session import SESSION

__all__ = ["AUTO_MAX_BYTES", "DATA_PLANES", "DataPlane"]

#: What ``data_plane`` takes: ``"auto"`` (point-to-point for CPU hand-offs up to :data:`AUTO_MAX_BYTES`, RPC
#: above and for GPU tensors), ``"p2p"`` (every CPU hand-off point-to-point), ``"rpc"`` (every hand-off by RPC).
DATA_PLANES = ("auto", "p2p", "rpc")
#: Above this many bytes a message goes by RPC under ``"auto"`` (``benchmarks/bench_handoff.py``, between two
#: processes of one machine: point-to-point 0.42x RPC's time at 16 KiB, 0.75-0.93x at 1 MiB, 1.08x at 2 MiB,
#: 1.30-1.47x at 4 MiB, where TensorPipe moves large messages faster than gloo's loopback TCP).
AUTO_MAX_BYTES = 3 << 19  # 1.5 MiB
_START = 64 << 10  # every channel's first capacity


class _Channel:
    """The messages from one peer: the receives posted for them, in order, and the capacity of the next."""

    def __init__(self, group: Any, peer: int, depth: int) -> None:
        self.group = group
        self.peer = peer
        self.capacity = _START
        self.posted: collections.deque[tuple[Any, Tensor]] = collections.deque()
        self.lock = threading.Lock()
        self.error: str | None = None  # why it carries no more (the peer closed it, a wait failed)
        for _ in range(depth - 1):
            self._post()

    def _post(self) -> None:
        buffer = torch.empty(self.capacity, dtype=torch.uint8)
        self.posted.append((self.group.recv([buffer], self.peer, 0), buffer))

    def receive(self, timeout: float) -> tuple[int, int, Tensor]:
        """The next message: its kind, value and buffer. A receive is posted first, at the capacity of now
        (``depth`` are then posted), so that posting costs nothing while the message is awaited."""
        self._post()
        work, buffer = self.posted.popleft()
        work.wait(datetime.timedelta(seconds=max(timeout, 0.001)))
        kind, value = header(buffer)
        if kind == GROW:
            self.capacity = value
        return kind, value, buffer


class DataPlane:
    """Point-to-point channels between this process and the other processes ``names`` of pipeline ``key``,
    over ``groups`` (gloo, one per sending process; this process is ``names[rank]``). Messages over
    ``max_bytes`` (None: no limit) and payloads it cannot carry go by RPC: :meth:`send` returns None for them.
    Sends complete when :meth:`flush` waits for them (the end of a process's share of a step)."""

    def __init__(self, key: str, groups: Sequence[Any], rank: int, names: Sequence[str], timeout: float,
                 max_bytes: int | None, depth: int = 8) -> None:
        self.key = key
        self.group = groups[rank]  # what this process sends goes through its own group
        self.rank = rank
        self.names = list(names)
        self._rank_of = {name: r for r, name in enumerate(self.names)}  # looked up on every message
        self.timeout = timeout
        self.max_bytes = max_bytes
        self.closed = False
        self.sent = self.received = 0  # data messages, for tests and benchmarks
        self._channels = {peer: _Channel(groups[peer], peer, depth) for peer in range(len(self.names)) if peer != rank}
        # Per peer, the capacities of the receives it has posted for this process's messages, in order; it posts
        # one more, at its capacity then, as it starts waiting for each message (see ``_Channel.receive``).
        self._posted = {peer: collections.deque([_START] * (depth - 1)) for peer in self._channels}
        self._capacity = dict.fromkeys(self._channels, _START)
        self._lock = threading.Lock()
        self._pending: list[tuple[Any, Future[Any], Callable[[], str]]] = []
        self._lingering: list[Any] = []  # sends of failed runs: kept alive (gloo drops a send whose work is freed)

    # ------------------------------------------------------------------ sending
    def carries(self, name: str) -> bool:
        """Whether messages to and from process ``name`` go this way."""
        peer = self._rank_of.get(name)
        return not self.closed and peer in self._channels and self._channels[peer].error is None

    def send(self, name: str, slot: Slot, payload: Any, describe: Callable[[], str] | None = None
             ) -> Future[Any] | None:
        """Start sending ``payload`` for ``slot`` to process ``name``; the send in flight (done once
        :meth:`flush` saw it through; its error noted with ``describe()``), or None where this plane does not
        carry it: the caller sends it by RPC, then calls :meth:`sent_by_rpc`."""
        if not self.carries(name):
            return None
        try:
            message = encode(DATA, slot, payload)
        except Unsuitable:
            return None
        if self.max_bytes is not None and len(message) > self.max_bytes:
            return None
        sent: Future[Any] = Future()
        self._send(self._rank_of[name], message, sent, describe or (lambda: f"sending to {where(name)}"))
        self.sent += 1
        return sent

    def sent_by_rpc(self, name: str, slot: Slot) -> None:
        """Tell process ``name`` that the payload for ``slot`` went by RPC (it waits for it in the mailbox)."""
        if self.carries(name):
            self._send(self._rank_of[name], encode(BY_RPC, slot), Future(), lambda: "")

    def abort(self, run: int) -> None:
        """Tell every peer that run ``run`` failed: a stage waiting for one of its messages wakes and skips."""
        for peer in self._channels:
            if self.carries(self.names[peer]):
                self._send(peer, control(ABORT, run), Future(), lambda: "")

    def _send(self, peer: int, message: Tensor, sent: Future[Any], describe: Callable[[], str]) -> None:
        with self._lock:
            posted = self._posted[peer]
            if len(message) > (posted[0] if posted else self._capacity[peer]):
                grown = max(len(message), 2 * self._capacity[peer])
                while len(message) > (posted[0] if posted else self._capacity[peer]):
                    self._start(peer, control(GROW, grown), Future(), describe)  # one per smaller receive
                    self._capacity[peer] = grown
            self._start(peer, message, sent, describe)

    def _start(self, peer: int, message: Tensor, sent: Future[Any], describe: Callable[[], str]) -> None:
        posted = self._posted[peer]
        posted.append(self._capacity[peer])  # posted by the receiver as it starts waiting for this message
        if len(message) > posted.popleft():
            raise AssertionError("a message larger than the receive posted for it")  # gloo would abort
        try:
            work = self.group.send([message], peer, 0)
        except Exception as exc:  # noqa: BLE001 - the channel is gone: the action that sent it fails, located
            self._channels[peer].error = f"sending failed: {exc}"
            sent.set_exception(_located(exc, describe))
            return
        self._pending.append((work, sent, describe))

    def flush(self, failed: bool = False) -> None:
        """Wait until every send started so far is done with (its receive posted and filled) and complete
        its future; after a failure (``failed``), only keep them alive: their receivers may never take them."""
        with self._lock:
            pending, self._pending = self._pending, []
            self._lingering = [work for work in self._lingering if not work.is_completed()]
            if failed:
                self._lingering += [work for work, _, _ in pending]
                for _, sent, _ in pending:
                    sent.set_result(None)
                return
        deadline = time.monotonic() + self.timeout
        for work, sent, describe in pending:
            try:
                work.wait(datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
                sent.set_result(None)
            except BaseException as exc:  # noqa: BLE001 - the action that sent it fails, located
                sent.set_exception(_located(exc, describe))

    # ------------------------------------------------------------------ receiving
    def take(self, name: str, slot: Slot, timeout: float, describe: Callable[[], str]) -> Any:
        """The payload for ``slot`` from process ``name``, waiting at most ``timeout`` seconds: from the
        mailbox if it is there, else from the channel (messages for other slots go to the mailbox)."""
        channel = self._channels[self._rank_of[name]]
        deadline = time.monotonic() + timeout
        while True:
            found, value = MAILBOX.poll(slot)
            if found:
                return value
            remaining = deadline - time.monotonic()
            if channel.error is not None or self.closed or not channel.lock.acquire(timeout=max(0.0, remaining)):
                return MAILBOX.take(slot, max(0.0, remaining), describe)
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
                    raise _located(exc, lambda: f"{describe()}: receiving from {where(name)}") from None
            finally:
                channel.lock.release()
            if kind == DATA:
                got, payload = decode(buffer)
                self.received += 1
                if got == slot:
                    return payload
                MAILBOX.put(got, payload)
            elif kind == BY_RPC:
                got, _ = decode(buffer)
                if got == slot:
                    return MAILBOX.take(slot, max(0.0, deadline - time.monotonic()), describe)
            elif kind == ABORT:
                MAILBOX.abort(self.key, value)
                if value == slot[1]:
                    raise _Skipped()
            elif kind == CLOSE:
                channel.error = f"{where(name)} closed it"

    def close(self) -> None:
        """Tell every peer this process sends no more: a stage waiting for it looks in the mailbox instead."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        for peer in self._channels:
            try:
                self._send(peer, control(CLOSE, 0), Future(), lambda: "")
            except Exception:  # noqa: BLE001 - a peer already gone has nothing to end
                pass
        with self._lock:
            self._lingering += [work for work, _, _ in self._pending]
            self._pending = []


# ---------------------------------------------------------------------- joining a pipeline's plane
def _groups(store: Any, token: str, rank: int, size: int, timeout: float) -> list[Any]:
    """``size`` gloo groups of the ``size`` processes (this one ``rank``), one per sending process, met under
    ``token`` in ``store``."""
    return [dist.ProcessGroupGloo(dist.PrefixStore(f"lightning_pipe/plane/{token}/{sender}/", store), rank, size,
                                  datetime.timedelta(seconds=timeout)) for sender in range(size)]


def _store(address: tuple[str, int] | None, timeout: float) -> Any:
    if address is None:
        return SESSION.store
    host, port = address
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))


def _attach(key: str, token: str, names: Sequence[str], address: tuple[str, int] | None, max_bytes: int | None
            ) -> None:
    """Join pipeline ``key``'s data plane here (an RPC entry point, called by the driver)."""
    runner = _RUNNERS[key]
    rank = list(names).index(rpc.get_worker_info().name)
    groups = _groups(_store(address, runner.timeout), token, rank, len(names), runner.timeout)
    runner.plane = DataPlane(key, groups, rank, names, runner.timeout, max_bytes)


def connect(runner: StageRunner, names: Sequence[str], mode: str) -> None:
    """Give pipeline ``runner.key`` (driven here; ``names``: its processes, this one first) a data plane in
    every process, as ``mode`` asks (see :data:`DATA_PLANES`; none for ``"rpc"``, one process, or GPU stages
    under ``"auto"``). The other processes' runners must be registered."""
    if mode not in DATA_PLANES:
        raise ValueError(f"data_plane must be one of {', '.join(map(repr, DATA_PLANES))} (got {mode!r})")
    if mode == "rpc" or len(names) < 2:
        return
    if runner.stage.device.type != "cpu":
        if mode == "p2p":
            raise ValueError(f"data_plane='p2p' carries CPU tensors (over gloo) and the stages are on "
                             f"{runner.stage.device}: use data_plane='auto' or 'rpc' (RPC sends GPU tensors from "
                             "GPU to GPU)")
        return
    max_bytes = AUTO_MAX_BYTES if mode == "auto" else None
    token = f"{runner.key}-{uuid.uuid4().hex}"
    address: tuple[str, int] | None = None
    store = SESSION.store
    if store is None:  # without PipeStrategy's session: a store of the plane's own, hosted here
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=runner.timeout))
        address = (host, store.port)
    futures = [rpc.rpc_async(name, _attach, args=(runner.key, token, list(names), address, max_bytes),
                             timeout=runner.timeout) for name in names[1:]]
    groups = _groups(store, token, 0, len(names), runner.timeout)
    for future in futures:
        future.wait()
    runner.plane = DataPlane(runner.key, groups, 0, names, runner.timeout, max_bytes)
    runner.plane_store = store  # a store hosted here lives as long as the pipeline


def detach(key: str) -> None:
    """Close this process's data plane of pipeline ``key`` (an RPC entry point, called by the driver)."""
    runner = _RUNNERS.get(key)
    if runner is not None and runner.plane is not None:
        runner.plane.close()
