"""Hand-offs through shared memory (``transport/wire/shm.py``): every message in order and intact through rings that
wrap and fill, sends that never wait for their receiver, waits bounded and woken by a writer's exit, and a setup
that every process agrees on or none uses, leaving nothing in ``/dev/shm``."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid

import pytest
import torch

from lightning_pipe.transport.wire import shm
from lightning_pipe.transport.wire.shm import shared_memory_links

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm: the plane goes over gloo there")


def _links(size: int = 2, capacity: int = 1 << 16, timeout: float = 5.0, spin: float | None = None):
    """Every process's links of one plane of ``size`` processes, all made here (one thread each: they meet in the
    store), and the token their files were named by."""
    import torch.distributed as dist

    store, token, made = dist.HashStore(), uuid.uuid4().hex, {}

    def join(rank: int) -> None:
        made[rank] = shared_memory_links(store, token, rank, size, timeout, capacity, spin)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return [made[rank] for rank in range(size)], token


def _left(token: str) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if token in name]


def _message(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_messages_arrive_in_order_and_intact_through_rings_that_wrap_and_fill():
    """300 messages of 0 to 20 000 bytes from process 0 to process 1 and back, through rings of 64 KiB (each wraps
    dozens of times; a burst fills it, so later sends wait for room): each taken in order, byte for byte."""
    (zero, one), token = _links()
    assert _left(token) == []  # unlinked once every process had them open
    sizes = [(k * 7919) % 20_001 for k in range(300)]
    for sender, receiver, peer_of_sender, peer_of_receiver in ((zero, one, 1, 0), (one, zero, 0, 1)):
        works = [sender.send([_message(n, k)], peer_of_sender) for k, n in enumerate(sizes)]
        assert any(isinstance(work, shm._Queued) for work in works)  # the burst filled the ring: some waited
        for k, n in enumerate(sizes):
            buffer = torch.zeros(20_008, dtype=torch.uint8)
            receiver.recv([buffer], peer_of_receiver).wait()
            torch.testing.assert_close(buffer[:n], _message(n, k))
        for work in works:
            assert work.wait() is True  # each one that waited for room went once it was made


def test_a_message_not_yet_written_is_written_into_the_ring_and_arrives_intact(monkeypatch):
    """A hand-off encoded as :class:`~lightning_pipe.transport.wire.codec.Unwritten` (as the data plane sends over
    shared memory) is written straight into the ring: its tensors' bytes copied once, not into a message of their own
    and then again. Where it would wrap round the ring's end, or waits for room, it is written into memory of its own
    first. 200 hand-offs of 0 to 3 000 floats through a 64 KiB ring, sent 5 at a time: each decodes to its payload."""
    from lightning_pipe.transport.wire import codec
    from lightning_pipe.transport.wire.messages import Slot

    written_apart = []
    apart = codec.Unwritten.tensor
    monkeypatch.setattr(codec.Unwritten, "tensor", lambda self: written_apart.append(len(self)) or apart(self))
    (zero, one), _ = _links()
    sizes = [(k * 7919) % 3_001 for k in range(200)]
    payloads = [(torch.randn(n, generator=torch.Generator().manual_seed(k)), k, "x") for k, n in enumerate(sizes)]
    works = []
    for burst in range(0, len(sizes), 5):
        for k in range(burst, burst + 5):
            message, _ = codec.encode_beside(codec.DATA, Slot("p", 0, "F", k, 1, 0), payloads[k], None, unwritten=True)
            assert isinstance(message, codec.Unwritten)
            works.append(zero.send([message], 1))
        for k in range(burst, burst + 5):
            buffer = torch.zeros(16 << 10, dtype=torch.uint8)
            one.recv([buffer], 0).wait()
            slot, (tensor, number, text) = codec.decode(buffer)
            assert slot.microbatch == k and number == k and text == "x"
            torch.testing.assert_close(tensor, payloads[k][0], rtol=0, atol=0)
    assert all(work.wait() is True for work in works)
    # Written apart only where a record wrapped round (64 KiB of ~6 KiB records: about one in ten) or waited for room.
    queued = sum(isinstance(work, shm._Queued) for work in works)
    assert 0 < len(written_apart) < len(sizes) // 5 and len(written_apart) >= queued, (len(written_apart), queued)


def test_a_wait_is_bounded_and_a_writers_exit_ends_it_at_once():
    """Nothing sent: the wait raises after its timeout. A writer watched by its process id (here a process this test
    starts, and ends) that exits wakes the wait at once, as a closed connection does over gloo, so the data plane
    says its process exited or was killed instead of waiting out the timeout."""
    import datetime

    (zero, one), _ = _links()
    buffer = torch.zeros(64, dtype=torch.uint8)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"no message within 0\.3 s"):
        one.recv([buffer], 0).wait(datetime.timedelta(seconds=0.3))
    assert 0.25 < time.monotonic() - start < 3

    if not hasattr(os, "pidfd_open"):
        pytest.skip("no pidfd_open: a lost writer is found by the timeout alone")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        one._in[0].watch(child.pid)
        threading.Timer(0.3, child.kill).start()
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="closed by peer"):
            one.recv([buffer], 0).wait(datetime.timedelta(seconds=20))
        assert time.monotonic() - start < 5
    finally:
        child.kill()
        child.wait(timeout=10)


def test_a_message_larger_than_its_ring_is_refused_and_a_send_with_no_room_fails_after_the_timeout():
    """Larger than the ring: refused as it is sent (the data plane then sends it by RPC). A send that waits for room
    its receiver never makes fails after the timeout, saying so, instead of hanging its flush."""
    import datetime

    with pytest.raises(ValueError, match="multiple of 8 bytes, at least 64 \\(got 1001\\)"):
        shared_memory_links(None, "never-made", 0, 2, 1.0, capacity=1001)  # records are 8-aligned, never split
    (zero, _), _ = _links(capacity=1 << 12, timeout=0.5)
    with pytest.raises(ValueError, match="does not fit in a ring of 4096"):
        zero.send([torch.zeros(5000, dtype=torch.uint8)], 1)
    works = [zero.send([torch.zeros(3000, dtype=torch.uint8)], 1) for _ in range(2)]  # the second finds no room
    with pytest.raises(RuntimeError, match="made no room in its ring within 0.5 s"):
        works[1].wait(datetime.timedelta(seconds=10))


def test_where_one_process_cannot_have_its_rings_none_does_and_nothing_is_left(monkeypatch):
    """Process 2 of 3 finds no room for its rings: every process gets None (the plane goes over gloo in all of them,
    a collective they must agree on), and no file of the plane is left in /dev/shm, made by whichever process."""
    real = os.posix_fallocate

    def full(fd, offset, length):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("-2"):  # the rings process 2 receives on
            raise OSError(28, "No space left on device")
        return real(fd, offset, length)

    monkeypatch.setattr(shm.os, "posix_fallocate", full)
    links, token = _links(size=3)
    assert links == [None, None, None]
    assert _left(token) == []


def test_a_plane_over_shared_memory_carries_hand_offs_and_steps_between_processes():
    """The data plane as a pipeline's processes use it, over the links: hand-offs both ways (one that needs a larger
    receive first: the capacities mirrored as over gloo), then ``CLOSE``, after which the other process waits in
    the mailbox (where what goes by RPC lands) instead of on the ring."""
    from lightning_pipe.transport.wire.dataplane import DataPlane
    from lightning_pipe.transport.wire.messages import Slot

    (zero, one), _ = _links(capacity=1 << 20)
    planes = [DataPlane("shm-plane", [links] * 2, rank, ["p0", "p1"], 5.0, None) for rank, links in
              enumerate((zero, one))]
    assert [plane.links for plane in planes] == ["shared memory", "shared memory"]
    small, large = torch.randn(4, 8), torch.randn(300, 300)  # the second over the first receives' 64 KiB
    for i, payload in enumerate((small, large, small)):
        planes[0].send("p1", Slot("shm-plane", 0, "F", i, 1, 0), (payload,))
        (got,) = planes[1].take("p0", Slot("shm-plane", 0, "F", i, 1, 0), 5.0, lambda: "a test")
        torch.testing.assert_close(got, payload)
        planes[1].send("p0", Slot("shm-plane", 0, "B", i, 0, 1), (2 * payload,))
        (back,) = planes[0].take("p1", Slot("shm-plane", 0, "B", i, 0, 1), 5.0, lambda: "a test")
        torch.testing.assert_close(back, 2 * payload)
    # Over what a ring takes (1 MiB here): refused (the runner then sends it by RPC), not sent to wait forever.
    assert planes[0].max_bytes == (1 << 20) - 8
    assert planes[0].send("p1", Slot("shm-plane", 0, "F", 9, 1, 0), (torch.zeros(300_000),)) is None
    for plane in planes:
        plane.flush()
    planes[0].close()  # CLOSE on the ring: process 1 stops looking there, and waits in the mailbox instead
    assert planes[1].carries("p0")
    with pytest.raises(TimeoutError, match="waited 0.5 s for its input"):
        planes[1].take("p0", Slot("shm-plane", 1, "F", 0, 1, 0), 0.5, lambda: "a test")
    assert not planes[1].carries("p0")


def _wakeups(ring: shm._Ring) -> int:
    """The wake-ups written to ``ring``'s FIFO and not read yet (read now)."""
    try:
        return len(os.read(ring.fifo, 4096))
    except BlockingIOError:
        return 0


def _until(condition, seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while not condition() and time.monotonic() < end:
        time.sleep(0.001)
    return condition()


def test_a_writer_wakes_its_reader_only_where_it_sleeps_and_a_reader_looks_again_before_it_sleeps():
    """The writer writes to the FIFO only where its reader raised its flag: a message sent while the reader does not
    wait leaves no wake-up; a reader asleep long past its first short sleep (no spin) is woken by the message, which
    it would otherwise wait for until its timeout. A reader that looks again (a spin longer than the test) takes a
    message sent meanwhile without raising its flag, so its writer made no system call; a receive marked idle (the
    step listener's, between steps) sleeps at once, its flag raised, even where its reader would look again."""
    import datetime

    timeout = datetime.timedelta(seconds=60)
    (zero, one), _ = _links(spin=0.0)
    ring = one._in[0]
    zero.send([_message(100, 0)], 1)
    assert _wakeups(ring) == 0  # nobody waited: no system call to wake anybody
    buffer = torch.zeros(512, dtype=torch.uint8)
    one.recv([buffer], 0).wait(timeout)  # there already: taken without a wait
    torch.testing.assert_close(buffer[:100], _message(100, 0))

    got: list[BaseException | None] = []

    def receive(links: shm.SharedMemoryLinks, awake: bool = True) -> None:
        try:
            work = links.recv([buffer], 0)
            work.awake = awake
            work.wait(timeout)
            got.append(None)
        except BaseException as exc:  # noqa: BLE001 - the test's thread reports it
            got.append(exc)

    reader = threading.Thread(target=receive, args=(one,), daemon=True)
    reader.start()
    assert _until(lambda: ring.counters[shm._WAITING] == 1)  # asleep, its flag up
    time.sleep(0.2)  # past the first short sleep: only the FIFO wakes it before its timeout (60 s)
    zero.send([_message(200, 1)], 1)
    reader.join(timeout=20)
    assert not reader.is_alive() and got == [None]  # woken, long before its timeout
    torch.testing.assert_close(buffer[:200], _message(200, 1))
    assert ring.counters[shm._WAITING] == 0

    (zero, one), _ = _links(spin=60.0)  # looks again for longer than the test
    ring = one._in[0]
    got.clear()
    reader = threading.Thread(target=receive, args=(one,), daemon=True)
    reader.start()
    time.sleep(0.2)
    assert ring.counters[shm._WAITING] == 0  # still looking, awake
    zero.send([_message(300, 2)], 1)
    reader.join(timeout=30)
    assert got == [None] and _wakeups(ring) == 0
    torch.testing.assert_close(buffer[:300], _message(300, 2))

    got.clear()
    reader = threading.Thread(target=receive, args=(one, False), daemon=True)  # idle: asleep at once
    reader.start()
    assert _until(lambda: ring.counters[shm._WAITING] == 1)
    zero.send([_message(50, 3)], 1)
    reader.join(timeout=30)
    assert got == [None]
    torch.testing.assert_close(buffer[:50], _message(50, 3))


def test_readers_look_again_only_where_every_process_of_the_machine_has_a_core(monkeypatch):
    """``spin_for``: the plane's processes, or ``LOCAL_WORLD_SIZE`` where larger (replicas' pipelines on the same
    machine), against this process's cores: one more process than cores and nobody looks again (a process looking
    would take a core from one computing)."""
    monkeypatch.setattr(shm.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert shm.spin_for(4) == shm.SPIN > 0
    assert shm.spin_for(5) == 0.0
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # two pipelines of 4 on this machine
    assert shm.spin_for(4) == 0.0
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # the plane's own count is the larger
    assert shm.spin_for(4) == shm.SPIN


def test_where_stores_may_be_seen_out_of_order_every_record_comes_with_its_byte(monkeypatch):
    """On a processor without x86's store order a reader that saw the tail move could read a record not written yet:
    there every record is preceded by a byte in the FIFO, which the reader takes before it (the pipe's locks order the
    two processes), and nobody looks again. Messages through a ring that wraps and fills arrive in order and intact,
    one byte taken for each, and a wait with nothing sent is still bounded."""
    import datetime

    monkeypatch.setattr(shm, "_ORDERED", False)
    assert shm.spin_for(1) == 0.0
    (zero, one), _ = _links(capacity=1 << 14)
    sizes = [(k * 4099) % 6_001 for k in range(60)]
    works = [zero.send([_message(n, k)], 1) for k, n in enumerate(sizes)]
    for k, n in enumerate(sizes):
        buffer = torch.zeros(6_008, dtype=torch.uint8)
        one.recv([buffer], 0).wait(datetime.timedelta(seconds=10))
        torch.testing.assert_close(buffer[:n], _message(n, k))
    assert all(work.wait() for work in works)
    assert _wakeups(one._in[0]) == 0  # one byte per record, each taken
    with pytest.raises(RuntimeError, match=r"no message within 0\.2 s"):
        one.recv([torch.zeros(64, dtype=torch.uint8)], 0).wait(datetime.timedelta(seconds=0.2))


def test_a_reader_looks_again_only_while_its_waits_are_shorter_than_the_look():
    """A wait that outlasted its look (its messages come further apart: a long compute between them) makes the next
    wait sleep at once, its flag up; a wait shorter than the look makes the next one look again. Looking while the
    sender computes for tens of milliseconds would take a core from it for nothing."""
    import datetime

    timeout = datetime.timedelta(seconds=60)
    (zero, one), _ = _links(spin=0.05)
    ring = one._in[0]
    buffer = torch.zeros(512, dtype=torch.uint8)
    got: list[BaseException | None] = []

    def receive() -> None:
        try:
            one.recv([buffer], 0).wait(timeout)
            got.append(None)
        except BaseException as exc:  # noqa: BLE001 - the test's thread reports it
            got.append(exc)

    def exchange(before_send) -> None:
        got.clear()
        reader = threading.Thread(target=receive, daemon=True)
        reader.start()
        before_send()
        zero.send([_message(64, 0)], 1)
        reader.join(timeout=30)
        assert not reader.is_alive() and got == [None]

    def asleep() -> None:
        assert _until(lambda: ring.counters[shm._WAITING] == 1)  # its flag up long before a minute's look is over

    def looking() -> None:
        time.sleep(0.2)
        assert ring.counters[shm._WAITING] == 0

    assert ring.short
    exchange(lambda: time.sleep(0.5))  # ten times the look
    assert not ring.short
    ring.spin = 60.0  # would look for a minute, were it to look
    exchange(asleep)
    assert ring.short  # that wait was short against the look
    exchange(looking)
    assert ring.short and _wakeups(ring) == 0  # looked, and took it without a wake-up
