"""Hand-offs between the processes of one machine through shared memory: a ring each way, a FIFO to wake its reader.

The sender copies a message into the ring (a file in ``/dev/shm`` both map: records of a length and the message,
8-aligned, wrapping round; ``tail`` moved by the writer alone, ``head`` by the reader alone) and writes a byte to the
FIFO only where the reader sleeps (its flag up); a reader that finds its ring empty looks again for up to :data:`SPIN`
where every process of the machine has a core, then sleeps in ``poll``. A send never waits for its receiver; a ring is
set up by every process of the plane or by none. :class:`SharedMemoryLinks` has the two calls of a gloo group the data
plane makes, so it runs over them unchanged. Why each of these, and what was measured: docs/design.md, "The data plane".
"""

from __future__ import annotations

import datetime
import logging
import mmap
import os
import platform
import select
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy
from torch import Tensor

__all__ = ["RING_BYTES", "RING_MEMORY", "SPIN", "SharedMemoryLinks", "shared_memory_links", "spin_for"]

log = logging.getLogger(__name__)

#: Bytes of each ring (one per sender and receiver). The data plane's largest message under ``"auto"`` is 1.5 MiB.
RING_BYTES = 4 << 20
_HEADER = 128  # head (bytes 0-7) and the reader's flag (32-39); tail (64-71): the reader's line, the writer's line
#: What one ring holds in memory, in each of the two processes that map it (the planner counts two per peer).
RING_MEMORY = _HEADER + RING_BYTES
_HEAD, _WAITING, _TAIL = 0, 4, 8  # their indexes as int64
SPIN = 2e-3  #: s: a reader looks again this long before sleeping (:func:`spin_for`; not after a longer wait)
_FIRST_SLEEP = 2e-3  # s: a wait's first sleep at most (a flag seen late by the writer costs this, not the timeout)
_ROOT = "/dev/shm"
_CHUNK = 3600.0  # s: the longest single poll (a year's wait is a loop of them)
_EXITED = "the writing process exited (closed by peer; shared memory)"
_FENCE = threading.Lock()  # taken and given back between a store and a load of the other side's counter: a barrier
#: Whether the processor shows stores in the order made (x86): a reader seeing the tail moved sees the record. Elsewhere
#: each record comes with a FIFO byte the reader takes first (the pipe's locks order the two), and nobody looks again.
_ORDERED = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def spin_for(processes: int) -> float:
    """How long a reader of a plane of ``processes`` processes here looks at its empty ring, asleep after: :data:`SPIN`
    where every process of the machine (``processes``, or ``LOCAL_WORLD_SIZE`` where larger: torchrun and the strategy
    set it) has one of this process's cores, else 0 (looking would take a core from one that computes)."""
    here = max(processes, int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return SPIN if here <= cores and _ORDERED else 0.0


def _host() -> str:
    """This machine, as the processes of a plane compare it: its name and, where Linux says, its boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            boot = file.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class _Ring:
    """A ring of ``capacity`` bytes at ``path`` (created, or opened); its FIFO ``path + '.fifo'`` wakes the reader."""

    def __init__(self, path: str, capacity: int, create: bool) -> None:
        self.path = path
        try:
            fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
            try:
                if create:  # its memory taken now: a full /dev/shm refuses here, not with SIGBUS at a later write
                    os.posix_fallocate(fd, 0, _HEADER + capacity)
                # Its pages mapped now (where Linux can): a process's resident memory then holds the whole ring from
                # the start, and does not grow as the ring wraps round.
                self._map = mmap.mmap(fd, _HEADER + capacity, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            finally:
                os.close(fd)
            if create:
                os.mkfifo(path + ".fifo", 0o600)
            # Both ends on one descriptor (one end alone blocks until the other opens); non-blocking: never waits.
            self.fifo = os.open(path + ".fifo", os.O_RDWR | os.O_NONBLOCK)
        except OSError:
            if create:
                self.unlink()
            raise
        self._poller = select.poll()
        self._poller.register(self.fifo, select.POLLIN)
        self.writer: int | None = None  # a descriptor of the writing process (a pidfd): readable once it exits
        raw = numpy.frombuffer(self._map, dtype=numpy.uint8)
        self.counters = raw[:_HEADER].view(numpy.int64)
        self.data = raw[_HEADER:]
        self.capacity = capacity
        self.spin = 0.0  # s: how long the reader looks again before it sleeps (see :data:`SPIN`)
        self.short = True  # whether the last wait was shorter than the look

    def watch(self, pid: int) -> None:
        """Wake a wait here when process ``pid`` (the writer) exits, as a closed connection would (Linux 5.3+)."""
        try:
            self.writer = os.pidfd_open(pid)
        except (AttributeError, OSError):  # elsewhere, a lost writer is found by the wait's timeout
            return
        self._poller.register(self.writer, select.POLLIN)

    def put(self, message: numpy.ndarray) -> bool:
        """Write ``message`` as the next record and wake the reader; False (nothing written) where it does not fit."""
        n = len(message)
        need = 8 + (n + 7) // 8 * 8
        tail = int(self.counters[_TAIL])
        if self.capacity - (tail - int(self.counters[_HEAD])) < need:
            return False
        start = tail % self.capacity
        self.data[start:start + 8].view(numpy.int64)[0] = n  # (records are 8-aligned: never split)
        _copy_in(self.data, (start + 8) % self.capacity, message)
        self.counters[_TAIL] = tail + need
        with _FENCE:  # the tail stored before the flag is read (a lock is a full barrier on x86)
            pass
        while not _ORDERED or self.counters[_WAITING]:
            try:
                os.write(self.fifo, b"\0")
                break
            except BlockingIOError:  # full of wake-ups not read yet: the reader wakes anyway (each counts: retried)
                if _ORDERED:
                    break
                time.sleep(1e-4)
        return True

    def get(self, into: numpy.ndarray, timeout: float, awake: bool = True) -> int:
        """Wait at most ``timeout`` seconds for the next record, copy it into ``into``; its length. ``awake``: look
        again for :attr:`spin` seconds before sleeping (False: asleep at once, no message being due soon)."""
        counters = self.counters
        head = int(counters[_HEAD])
        if not _ORDERED:
            self._woken(timeout)
        elif int(counters[_TAIL]) == head:
            self._wait(head, timeout, self.spin if awake else 0.0)
        start = head % self.capacity
        n = int(self.data[start:start + 8].view(numpy.int64)[0])
        if n > len(into):
            raise RuntimeError(f"a message of {n} bytes for a receive of {len(into)}")  # the plane mirrors them
        _copy_out(self.data, (start + 8) % self.capacity, into[:n])
        counters[_HEAD] = head + 8 + (n + 7) // 8 * 8
        return n

    def _wait(self, head: int, timeout: float, spin: float) -> None:
        """Until the ring holds more than ``head``: looked at again for ``spin`` seconds, then asleep, woken by the
        writer (its FIFO) or its exit; at most ``timeout`` seconds."""
        counters, began = self.counters, time.perf_counter()
        if spin and self.short:  # not after a wait longer than the look: its messages come further apart
            while int(counters[_TAIL]) == head and time.perf_counter() < began + spin:
                time.sleep(0)  # the interpreter to this process's other threads; not sched_yield (docs/design.md)
            if int(counters[_TAIL]) != head:
                return
        deadline = time.monotonic() + timeout
        counters[_WAITING] = 1
        with _FENCE:  # the flag stored before the tail is read again
            pass
        longest = _FIRST_SLEEP
        try:
            while int(counters[_TAIL]) == head:
                woken, gone = self._sleep(deadline, longest, timeout)
                longest = _CHUNK
                if woken:
                    try:
                        os.read(self.fifo, 4096)  # the wake-ups so far; the ring says what arrived
                    except BlockingIOError:
                        pass
                elif gone and int(counters[_TAIL]) == head:  # nothing is left from the writer
                    raise RuntimeError(_EXITED)
        finally:
            counters[_WAITING] = 0
            if spin:  # (idle waits: not counted)
                self.short = time.perf_counter() - began < spin

    def _woken(self, timeout: float) -> None:
        """Take the next record's byte from the FIFO (off x86), at most ``timeout`` s; raise if the writer exits."""
        deadline = time.monotonic() + timeout
        while True:
            woken, gone = self._sleep(deadline, _CHUNK, timeout)
            if woken:
                try:
                    os.read(self.fifo, 1)
                    return
                except BlockingIOError:
                    continue
            if gone:
                raise RuntimeError(_EXITED)

    def _sleep(self, deadline: float, longest: float, timeout: float) -> tuple[bool, bool]:
        """Sleep in ``poll`` up to ``longest`` s (past ``deadline``: raise): whether the FIFO woke; the writer left."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"no message within {timeout:.1f} s (shared memory)")
        ready = [fd for fd, _ in self._poller.poll(max(1, int(min(left, longest) * 1000)))]
        return self.fifo in ready, any(fd != self.fifo for fd in ready)

    def unlink(self) -> None:
        for path in (self.path, self.path + ".fifo"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def _copy_in(data: numpy.ndarray, start: int, message: Any) -> None:
    if not isinstance(message, numpy.ndarray):  # unwritten: written where it goes, unless it wraps round
        if start + len(message) <= len(data):
            return message.write(data[start:start + len(message)])
        message = message.tensor().numpy()
    first = min(len(message), len(data) - start)
    data[start:start + first] = message[:first]
    if first < len(message):
        data[:len(message) - first] = message[first:]


def _copy_out(data: numpy.ndarray, start: int, into: numpy.ndarray) -> None:
    first = min(len(into), len(data) - start)
    into[:first] = data[start:start + first]
    if first < len(into):
        into[first:] = data[:len(into) - first]


class _Done:
    """A send already in its ring."""

    def wait(self, timeout: Any = None) -> bool:
        return True


_DONE = _Done()  # every such send's work: nothing to keep per send


class _Queued:
    """A send waiting for room in its ring: :meth:`wait` until it is in, or raise why it never went."""

    def __init__(self, message: numpy.ndarray) -> None:
        self.message = message
        self.done = threading.Event()
        self.error: str | None = None

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if not self.done.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError("a send still waits for room in its ring (shared memory): its receiver takes nothing")
        if self.error is not None:
            raise RuntimeError(self.error)
        return True


class _Receive:
    """A receive into ``buffer``: :meth:`wait` takes ``ring``'s next message; ``awake`` False: none due soon, sleep."""

    def __init__(self, ring: _Ring, buffer: Tensor) -> None:
        self.ring, self.buffer = ring, buffer
        self.awake = True

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        seconds = 365 * 86400.0 if timeout is None else timeout.total_seconds()
        self.ring.get(self.buffer.numpy(), seconds, self.awake)
        return True


class SharedMemoryLinks:
    """This process's (``rank``) rings to and from every other process of a plane, as the data plane uses a gloo
    group: :meth:`send` and :meth:`recv` of one uint8 tensor to or from process ``peer``."""

    def __init__(self, rank: int, outgoing: dict[int, _Ring], incoming: dict[int, _Ring], timeout: float) -> None:
        self.rank = rank
        self._out, self._in = outgoing, incoming
        #: The largest message a ring takes (the data plane sends a larger one by RPC).
        self.largest = min((ring.capacity for ring in outgoing.values()), default=0) - 8
        self.timeout = timeout
        self._lock = threading.Lock()
        self._queued: dict[int, deque[_Queued]] = {peer: deque() for peer in outgoing}
        self._drainer: threading.Thread | None = None
        fds = [ring.fifo for ring in (*outgoing.values(), *incoming.values())]
        fds += [ring.writer for ring in incoming.values() if ring.writer is not None]
        weakref.finalize(self, _close_all, fds)

    def send(self, tensors: Sequence[Tensor], peer: int, tag: int = 0) -> Any:
        """Put the message ``tensors[0]`` (a tensor, or the codec's ``Unwritten``, written in the ring) in the ring to
        ``peer`` (``tag`` is 0); one that does not fit now goes as soon as it does, after any before it."""
        message = tensors[0].numpy() if isinstance(tensors[0], Tensor) else tensors[0]
        ring = self._out[peer]
        if 8 + len(message) > ring.capacity:
            raise ValueError(f"a message of {len(message)} bytes does not fit in a ring of {ring.capacity}")
        with self._lock:
            queue = self._queued[peer]
            if not queue and ring.put(message):
                return _DONE
            queued = _Queued(message.copy() if isinstance(message, numpy.ndarray) else message.tensor().numpy())
            queue.append(queued)
            if self._drainer is None:
                self._drainer = threading.Thread(target=self._drain, name="lightning_pipe.shm.send", daemon=True)
                self._drainer.start()
        return queued

    def recv(self, tensors: Sequence[Tensor], peer: int, tag: int = 0) -> _Receive:
        """A receive of the next message from ``peer`` into ``tensors[0]``, taken when it is waited for."""
        return _Receive(self._in[peer], tensors[0])

    def _drain(self) -> None:
        """Put the messages waiting for room in their rings as it comes, in order; give up where none comes in time."""
        since, pause = time.monotonic(), 1e-4
        while True:
            with self._lock:
                moved = False
                for peer, queue in self._queued.items():
                    while queue and self._out[peer].put(queue[0].message):
                        queue.popleft().done.set()
                        moved = True
                if not any(self._queued.values()):
                    self._drainer = None
                    return
                if moved:
                    since, pause = time.monotonic(), 1e-4
                elif time.monotonic() - since > self.timeout:
                    for peer, queue in self._queued.items():
                        for queued in queue:
                            queued.error = (f"process {peer} made no room in its ring within {self.timeout:.1f} s "
                                            "(shared memory): it takes nothing")
                            queued.done.set()
                        queue.clear()
                    self._drainer = None
                    return
            time.sleep(pause)  # the receiver makes room as it takes: looked at again, less often while it does not
            pause = min(2 * pause, 2e-3)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def shared_memory_links(store: Any, token: str, rank: int, size: int, timeout: float,
                        capacity: int = RING_BYTES, spin: float | None = None) -> SharedMemoryLinks | None:
    """Process ``rank``'s rings to and from the other ``size - 1`` processes of a plane met under ``token`` in
    ``store`` (each calls it; a collective); None in every process where any of them cannot have them (another
    machine, no ``/dev/shm``, no room): the plane then goes over gloo. Waits at most ``timeout`` for the others.
    ``spin``: seconds a reader looks at its empty ring before it sleeps (default :func:`spin_for` ``(size)``)."""
    if capacity % 8 or capacity < 64:
        raise ValueError(f"a ring's capacity must be a multiple of 8 bytes, at least 64 (got {capacity})")
    prefix = f"lightning_pipe/shm/{token}"
    wait = datetime.timedelta(seconds=timeout)
    path = lambda sender, receiver: f"{_ROOT}/lightning_pipe-{token}-{sender}-{receiver}"  # noqa: E731
    incoming: dict[int, _Ring] = {}
    outgoing: dict[int, _Ring] = {}
    ok = False
    try:
        why = ""
        try:
            if not os.path.isdir(_ROOT):
                raise OSError(f"no {_ROOT}")
            for peer in range(size):
                if peer != rank:
                    incoming[peer] = _Ring(path(peer, rank), capacity, create=True)
        except OSError as exc:
            why = f"process {rank}: {exc}"
        store.set(f"{prefix}/pid/{rank}", str(os.getpid()))
        store.set(f"{prefix}/made/{rank}", f"{_host()}\n{why}")
        hosts = _agreed(store, f"{prefix}/made", size, wait)
        ok = hosts is not None and len(set(hosts)) == 1
        if ok:
            try:
                for peer in range(size):
                    if peer != rank:
                        outgoing[peer] = _Ring(path(rank, peer), capacity, create=False)
            except OSError as exc:
                why = f"process {rank}: {exc}"
            store.set(f"{prefix}/opened/{rank}", f"\n{why}")
            ok = _agreed(store, f"{prefix}/opened", size, wait) is not None
    finally:  # every process has them open, or none will use them: gone from the file system either way
        for ring in incoming.values():
            ring.unlink()
    if not ok:
        _close_all([ring.fifo for ring in (*incoming.values(), *outgoing.values())])
        log.info("the data plane goes over gloo, not shared memory: %s", why or "another process cannot have its "
                 "rings (another machine, or no room in /dev/shm)")
        return None
    spin = spin_for(size) if spin is None else spin
    for peer, ring in incoming.items():
        ring.watch(int(store.get(f"{prefix}/pid/{peer}")))
        ring.spin = spin
    return SharedMemoryLinks(rank, outgoing, incoming, timeout)


def _agreed(store: Any, prefix: str, size: int, wait: datetime.timedelta) -> list[str] | None:
    """What every process set as ``prefix/<rank>``'s first line, once all have; None where any set an error after it."""
    keys = [f"{prefix}/{r}" for r in range(size)]
    store.wait(keys, wait)
    found = [store.get(key).decode().split("\n", 1) for key in keys]
    return None if any(why for _, why in found) else [first for first, _ in found]
