"""The point-to-point data plane (``data_plane``): one message per hand-off, any payload and shape, the plain
model's results through it in every process, what goes by RPC instead, and its failures.

The processes these tests start import this module (``spawn``): what only the tests through Lightning need is
imported inside them, so that each process starts in the time torch takes rather than Lightning's."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.rpc as rpc
from dist_utils import run_processes
from strategy_utils import assert_same_weights, run_script
from test_remote import _mse, build
from torch import nn

from lightning_pipe.engine import pipeline_loss, run_pipeline
from lightning_pipe.transport import pipeline_over_rpc
from lightning_pipe.transport.wire.codec import DATA, Unsuitable, decode, encode, header
from lightning_pipe.transport.wire.dataplane import AUTO_MAX_BYTES


# ---------------------------------------------------------------------- one message
def test_a_message_carries_any_payload_its_tensors_as_views_of_the_buffer():
    slot = ("key", 3, "F", 2, 1, ("ns", "skip"))
    strided = torch.arange(24.0).reshape(4, 6).t()  # not contiguous
    payload = ([torch.randn(3, 5), None, strided, torch.ones(0, 7), torch.tensor([True, False]),
                torch.arange(5, dtype=torch.int64), torch.randn(2, 2).to(torch.bfloat16)],
               [True, False, True, False, False, False, True], False, {"extra": (1, "two", 3.0)})
    message = encode(DATA, slot, payload)
    buffer = torch.zeros(len(message) + 100, dtype=torch.uint8)  # received into a larger receive
    buffer[:len(message)] = message
    assert header(buffer)[0] == DATA
    got_slot, got = decode(buffer)
    assert got_slot == slot
    assert got[1:] == payload[1:]
    for actual, expected in zip(got[0], payload[0]):
        if expected is None:
            assert actual is None
            continue
        assert actual.dtype == expected.dtype and actual.shape == expected.shape
        torch.testing.assert_close(actual, expected)
        assert actual.numel() == 0 or _within(actual, buffer)  # a view of the receive, not a copy


def test_a_small_message_in_a_large_receive_is_copied_out_of_it():
    message = encode(DATA, ("k", 0, "F", 0, 1, 0), (torch.ones(4),))
    buffer = torch.zeros(4 * len(message), dtype=torch.uint8)
    buffer[:len(message)] = message
    _, (tensor,) = decode(buffer)
    assert not _within(tensor, buffer)  # the large receive is not kept alive by it
    torch.testing.assert_close(tensor, torch.ones(4))


def test_flush_waits_for_the_last_send_to_each_process_and_fails_with_the_first_error():
    """Sends to one process complete in order: the last one to each process done, those before it are too; where
    it failed, the ones before it are waited for, and their future fails with the earliest error, located."""
    import threading as _threading
    from concurrent.futures import Future

    from lightning_pipe.transport.wire.dataplane import DataPlane

    waited = []

    class Work:
        def __init__(self, name, error=None):
            self.name, self.error = name, error

        def wait(self, timeout):
            waited.append(self.name)
            if self.error:
                raise RuntimeError(self.error)

    plane = DataPlane.__new__(DataPlane)
    plane._lock, plane._lingering, plane.timeout = _threading.Lock(), [], 5.0
    good, bad = Future(), Future()
    plane._pending = [(Work("a1"), good, lambda: "sending a1", 1, 1),
                      (Work("b1", "lost"), bad, lambda: "sending b1", 2, 2),
                      (Work("a2"), good, lambda: "sending a2", 1, 3),
                      (Work("b2", "gone"), bad, lambda: "sending b2", 2, 4)]
    plane.flush()
    assert waited == ["b2", "a2", "b1"]  # a1 is done once a2 is; b2 failed, so b1 was waited for
    assert good.result() is None
    assert "lost" in str(bad.exception()) and bad.exception().__notes__ == ["sending b1"]

    waited.clear()
    after = Future()
    plane._pending = [(Work("c", "never waited"), after, lambda: "", 1, 5)]
    plane.flush(failed=True)  # after a failure: kept alive, not waited for
    assert waited == [] and after.result() is None and [order for _, order, _ in plane._lingering] == [5]


def _within(tensor, buffer):
    return buffer.data_ptr() <= tensor.data_ptr() < buffer.data_ptr() + buffer.numel()


def _two_planes(key: str):
    """The data planes of two processes of pipeline ``key`` (ranks 0 and 1), both in this process, over real gloo
    groups (one per sender, as ``rendezvous`` makes them) met in an in-memory store."""
    import datetime

    import torch.distributed as dist

    from lightning_pipe.transport.wire.dataplane import DataPlane

    store, groups = dist.HashStore(), {}

    def join(rank: int) -> None:  # each rank's groups, made at once (they meet)
        groups[rank] = [dist.ProcessGroupGloo(dist.PrefixStore(f"{sender}/", store), rank, 2,
                                              datetime.timedelta(seconds=20)) for sender in range(2)]

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return [DataPlane(key, groups[rank], rank, ["p0", "p1"], 5.0, None) for rank in range(2)]


@pytest.mark.timeout(60)
def test_a_send_racing_close_is_delivered_and_every_sends_future_completes(monkeypatch):
    """Process 0 sends 5 hand-offs to process 1 while another of its threads closes its plane, between the
    checks of the 4th send and its start (forced: that send's encoding waits for the close). Each send is either
    on the channel ahead of ``CLOSE`` or refused (None: the runner sends it by RPC, into the mailbox, as here), so
    process 1 takes all 5; and every future a send returned completes, at the latest once the plane is closed.
    Before, the 4th went on the channel after ``CLOSE``, where process 1 never looks (its take waited out the
    timeout), and ``close()`` dropped the first 3 sends' future unfinished (a share waiting on it hung)."""
    from lightning_pipe.transport.wire import dataplane
    from lightning_pipe.transport.wire.messages import MAILBOX, Slot

    sender, receiver = _two_planes("racing-close")
    slots = [Slot("racing-close", 0, "F", i, 1, 0) for i in range(5)]
    reached, released = threading.Event(), threading.Event()
    real = dataplane.encode_beside

    def encode(kind, slot, payload, *args, **kwargs):
        if slot == slots[3]:  # checked that the plane carries it, not started yet: the close comes now
            reached.set()
            assert released.wait(10)
        return real(kind, slot, payload, *args, **kwargs)

    monkeypatch.setattr(dataplane, "encode_beside", encode)
    futures, refused = [], []

    def send_all() -> None:
        for i, slot in enumerate(slots):
            sent = sender.send("p1", slot, (torch.full((3,), float(i)),))
            if sent is None:  # what StageRunner.send_to does then: by RPC, into the receiver's mailbox
                refused.append(i)
                MAILBOX.put(slot, (torch.full((3,), float(i)),))
            else:
                futures.append(sent)

    thread = threading.Thread(target=send_all)
    thread.start()
    assert reached.wait(10)
    closing = threading.Thread(target=sender.close)
    closing.start()
    closing.join(timeout=10)
    released.set()
    thread.join(timeout=10)
    assert not thread.is_alive() and not closing.is_alive()
    assert 4 in refused, refused  # once the plane is closed, a send goes by RPC
    for i, slot in enumerate(slots):
        (value,) = receiver.take("p0", slot, 3.0, lambda i=i: f"taking hand-off {i}")
        assert torch.equal(value, torch.full((3,), float(i))), i
    for sent in futures:
        assert sent.result(timeout=3) is None
    receiver.close()


def test_a_payload_beyond_tuples_lists_and_plain_values_crosses_too():
    """What is not tuples and lists of tensors and plain values (a dict, bytes, a tensor of a dtype numpy lacks)
    is pickled the other way, with persistent ids, and crosses as it is, its tensors views of the receive."""
    payload = ([torch.arange(3.0)], [False], {"a": torch.ones(1)}, b"raw",
               torch.arange(4.0).to(torch.float8_e4m3fn), torch.arange(2.0).to(torch.bfloat16))
    message = encode(DATA, ("k", 0, "F", 0, 1, 0), payload)
    buffer = message.clone()
    assert header(buffer) == (DATA, 0)  # not the holes' form (value 1)
    _, got = decode(buffer)
    torch.testing.assert_close(got[0][0], payload[0][0])
    assert got[1] == [False] and got[3] == b"raw"
    torch.testing.assert_close(got[2]["a"], payload[2]["a"])
    for actual, expected in ((got[4], payload[4]), (got[5], payload[5])):
        assert actual.dtype == expected.dtype and _within(actual, buffer)
        assert torch.equal(actual.view(torch.uint8), expected.view(torch.uint8))


def test_a_hand_off_is_pickled_with_holes_for_its_tensors():
    conjugate = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64).conj()  # a view: its bit resolved on the way
    payload = ([torch.arange(6.0).reshape(2, 3).t(), None, torch.arange(2.0).to(torch.bfloat16), conjugate],
               [True, False, True, False], False)
    buffer = encode(DATA, ("k", 0, "F", 0, 1, 0), payload).clone()
    assert header(buffer) == (DATA, 1)
    _, got = decode(buffer)
    assert got[1:] == payload[1:] and got[0][1] is None
    for actual, expected in zip(got[0][::2] + got[0][3:], payload[0][::2] + payload[0][3:]):
        assert actual.dtype == expected.dtype and _within(actual, buffer)
        torch.testing.assert_close(actual, expected)


def test_a_steps_items_before_plain_are_not_looked_through_and_its_targets_travel_joined():
    """A step's actions and spec go as they are (a bytes value among them is not taken for a hole), and targets
    split from one batch travel as one tensor, each micro-batch's a view of it once split again."""
    from lightning_pipe.transport.stages.steps import _joined, _split

    targets = list(torch.arange(40.0).reshape(10, 4).split([3, 3, 4]))
    deliveries = [(("k", 5, "T", i, 1, "target"), t) for i, t in enumerate(targets)]
    index, payloads = _joined(deliveries)
    assert index is not None and isinstance(payloads, torch.Tensor) and payloads.shape == (10, 4)
    step = (5, [(1, "F", 0), (1, "B", 0)], b"\x00tensor", index, payloads)
    buffer = encode(DATA, ("k", 5, "S", 0, 0, "step"), step, plain=4).clone()
    assert header(buffer) == (DATA, 1)
    _, got = decode(buffer)
    assert got[:4] == step[:4]
    arrived = _split(*got[3:])
    assert [slot for slot, _ in arrived] == [slot for slot, _ in deliveries]
    for (_, actual), expected in zip(arrived, targets):
        assert torch.equal(actual, expected) and _within(actual, buffer)


@pytest.mark.parametrize("targets", [[torch.ones(2, 3), torch.ones(2, 4)], [torch.ones(2), torch.ones(2).long()],
                                     [{"y": torch.ones(2)}, {"y": torch.ones(2)}], [torch.tensor(1.0)] * 2,
                                     [torch.ones(2)], [torch.ones(2, 2).to_sparse()] * 2],
                         ids=["shapes", "dtypes", "mappings", "scalars", "one", "sparse"])
def test_targets_that_do_not_join_travel_one_by_one(targets):
    from lightning_pipe.transport.stages.steps import _joined, _split

    deliveries = [(("k", 5, "T", i, 1, "target"), t) for i, t in enumerate(targets)]
    index, payloads = _joined(deliveries)
    assert index is None and _split(index, payloads) == deliveries


def test_the_last_stages_losses_travel_as_one_tensor_and_arrive_as_they_were_held():
    from lightning_pipe.engine.loss import MicroLoss
    from lightning_pipe.transport.stages.answers import packed as _packed
    from lightning_pipe.transport.stages.answers import unpacked as _unpacked

    held = {i: MicroLoss(torch.tensor(float(i) / 3), None) for i in range(5)}
    packed = _packed(held)
    assert type(packed) is tuple and sum(isinstance(v, torch.Tensor) for v in packed) == 1
    _, got = decode(encode(DATA, ("k/answers", 5, "A", 0, 1, 1), packed).clone())
    arrived = _unpacked(got)
    assert list(arrived) == list(held)
    assert all(type(v) is MicroLoss and v.extras is None and torch.equal(v.value, held[i].value)
               for i, v in arrived.items())
    # Extras, outputs and mixed dtypes travel as they are.
    for other in ({0: MicroLoss(torch.tensor(1.0), {"n": torch.tensor(2)})}, {0: (torch.ones(2), True)},
                  {0: MicroLoss(torch.tensor(1.0), None), 1: MicroLoss(torch.tensor(1.0).double(), None)}, None):
        assert _packed(other) is other and _unpacked(other) is other


@pytest.mark.parametrize("tensor", [torch.ones(2).as_subclass(nn.Parameter), torch.ones(2, requires_grad=True),
                                    torch.ones(2).to_sparse()], ids=["subclass", "requires-grad", "sparse"])
def test_what_a_message_cannot_carry_goes_by_rpc(tensor):
    with pytest.raises(Unsuitable):
        encode(DATA, ("k", 0, "F", 0, 1, 0), ([tensor], [False], True))


def test_an_unknown_data_plane_is_refused_naming_the_choices():
    from lightning_pipe import PipeStrategy

    with pytest.raises(ValueError, match=r"data_plane must be one of 'auto', 'p2p', 'rpc' \(got: 'nccl'\)"):
        PipeStrategy(balance=[1, 1], data_plane="nccl")


# ---------------------------------------------------------------------- through processes
def _counts(key: str) -> dict[str, int] | None:
    from lightning_pipe.transport.stages.entries import RUNNERS

    plane = RUNNERS[key].plane
    return None if plane is None else {"sent": plane.sent, "received": plane.received}


class Widen(nn.Module):
    """Repeats its input ``factor`` times along the last dimension: a hand-off larger than the step's input."""

    def __init__(self, factor: int) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x.repeat(1, 1, self.factor)


def check_step(pipeline, reference: nn.Module, loss, expected, process: int, name: str) -> None:
    """A step's ``loss`` through ``pipeline`` is the plain model's ``expected``, and after both backward process
    ``process``'s gradient of parameter ``name`` is ``reference``'s; both zeroed after."""
    torch.testing.assert_close(loss, expected)
    loss.backward()
    expected.backward()
    grads = pipeline.call(process, "named_grads")
    torch.testing.assert_close(grads[name], reference.get_parameter(name).grad)
    pipeline.call(process, "zero_grad")
    reference.zero_grad()


def _shapes(rank: int, world: int, plane: str, lengths: list[int]):
    """A sequence model whose batches change length every step (dynamic padding), through 2 processes over
    ``plane``: each step's loss and gradients are the plain model's; returns what every process's plane
    carried after each step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Widen(32), nn.Tanh(), nn.Linear(256, 4))
    pipeline = pipeline_over_rpc(f"shapes-{plane}", model, [2, 2], [f"worker{r}" for r in range(world)], timeout=20,
                                 data_plane=plane)
    if pipeline is None:
        return None
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 8), Widen(32), nn.Tanh(), nn.Linear(256, 4))
    carried = []
    for length in lengths:
        x, y = torch.randn(4, length, 8, requires_grad=True), torch.randn(4, length, 4)
        loss = pipeline_loss(pipeline, x, y, _mse, chunks=2, checkpoint="never", training=True,
                             parameters=iter([]), schedule="1f1b")
        check_step(pipeline, reference, loss, _mse(reference(x), y), 1, "3.weight")
        pipeline.settle()  # (a process that did not answer may still be finishing its share)
        carried.append([_counts(f"shapes-{plane}"), rpc.rpc_sync("worker1", _counts, args=(f"shapes-{plane}",))])
    pipeline.close()
    return carried


@pytest.mark.timeout(120)
def test_shapes_that_change_every_step_cross_point_to_point_growing_the_receives():
    """Lengths from 3 to 600 tokens and back: an activation of 2 sequences x 600 x 256 floats is 1.2 MiB, past
    the first receives' 64 KiB, so the sender grows every receive posted for it first; each step is the plain
    model's, and every hand-off went point-to-point (2 activations out, 2 gradients back per step)."""
    lengths = [3, 17, 600, 5, 600, 64]
    carried = run_processes(_shapes, 2, "p2p", lengths, timeout=100)[0]
    for step, (driver, stage1) in enumerate(carried, start=1):
        assert driver == {"sent": 2 * step, "received": 2 * step}, (step, driver)
        assert stage1 == {"sent": 2 * step, "received": 2 * step}, (step, stage1)


@pytest.mark.timeout(120)
def test_auto_sends_what_is_larger_than_its_limit_by_rpc_and_the_rest_point_to_point():
    """Under ``"auto"`` the 1.8 MB activations of the 900-token step and their gradients go by RPC (the
    receiver told so on the plane, in their place), the others point-to-point; each step the plain model's."""
    assert 2 * 900 * 256 * 4 > AUTO_MAX_BYTES > 2 * 64 * 256 * 4
    carried = run_processes(_shapes, 2, "auto", [3, 900, 64], timeout=100)[0]
    assert [driver for driver, _ in carried] == [{"sent": n, "received": n} for n in (2, 2, 4)], carried
    assert [stage1 for _, stage1 in carried] == [{"sent": n, "received": n} for n in (2, 2, 4)], carried


def _kept_alive(key: str) -> int:
    from lightning_pipe.transport.stages.entries import RUNNERS

    return len(RUNNERS[key].plane._lingering)


def _many_by_rpc(rank: int, world: int, steps: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Widen(32), nn.Tanh(), nn.Linear(256, 4))
    pipeline = pipeline_over_rpc("kept", model, [2, 2], [f"worker{r}" for r in range(world)], timeout=20)
    if pipeline is None:
        return None
    kept = []
    for _ in range(steps):
        x, y = torch.randn(4, 900, 8, requires_grad=True), torch.randn(4, 900, 4)
        pipeline_loss(pipeline, x, y, _mse, chunks=2, checkpoint="never", training=True, parameters=iter([]),
                      schedule="1f1b").backward()
        pipeline.settle()
        kept.append((_kept_alive("kept"), rpc.rpc_sync("worker1", _kept_alive, args=("kept",))))
    pipeline.close()
    return kept


@pytest.mark.timeout(120)
def test_control_messages_are_let_go_once_a_later_send_to_their_process_is_done():
    """Each 900-token step sends its activations and gradients by RPC, each announced by a ``BY_RPC`` message on
    the plane, which is only kept alive, not waited for. Sends to one process complete in order, so once a later
    send to it is done, so are they: the sends kept alive stay as few as one step's, over 8 steps (they grew by
    2 a step in each process, for as long as the pipeline lived)."""
    kept = run_processes(_many_by_rpc, 2, 8, timeout=100)[0]
    assert max(max(step) for step in kept) <= 2, kept


def _planes(rank: int, world: int, plane: str):
    pipeline = pipeline_over_rpc(f"plane-{plane}", build(), [2, 3, 2], [f"worker{r}" for r in range(world)],
                                 timeout=20, data_plane=plane)
    if pipeline is None:
        return None
    x = torch.randn(10, 6, requires_grad=True)
    run_pipeline(pipeline, x, chunks=4, checkpoint="except_last", training=True, parameters=iter([])).sum().backward()
    pipeline.settle()
    counts = [_counts(f"plane-{plane}")] + [rpc.rpc_sync(f"worker{r}", _counts, args=(f"plane-{plane}",))
                                            for r in range(1, world)]
    pipeline.close()
    return counts


@pytest.mark.timeout(120)
@pytest.mark.parametrize("plane", ["auto", "p2p", "rpc"])
def test_every_process_hands_off_over_the_plane_asked_for(plane):
    """3 processes with a skip from stage 0 to stage 2: over "auto" and "p2p" every process sends and receives
    point-to-point (4 micro-batches: activations and skips forward, gradients back); over "rpc" no process
    has a data plane at all."""
    counts = run_processes(_planes, 3, plane, timeout=100)[0]
    if plane == "rpc":
        assert counts == [None, None, None]
        return
    # stage 0 sends 4 activations + 4 skips and receives 4 + 4 gradients; stage 1: 4 out, 4 in each way;
    # stage 2 receives 4 activations + 4 skips and sends 4 + 4 gradients back.
    assert counts == [{"sent": 8, "received": 8}, {"sent": 8, "received": 8}, {"sent": 8, "received": 8}], counts


# ---------------------------------------------------------------------- steps on the plane
def _record_threads(key: str) -> None:
    """Record, in this process, the thread that runs each share of a step of pipeline ``key``."""
    import threading

    from lightning_pipe.transport.stages.entries import RUNNERS

    runner = RUNNERS[key]
    run_actions = runner.run_actions
    runner.threads = []

    def recorded(*args, **kwargs):
        runner.threads.append(threading.current_thread().name)
        return run_actions(*args, **kwargs)

    runner.run_actions = recorded


def _threads(key: str) -> list[str]:
    from lightning_pipe.transport.stages.entries import RUNNERS

    return RUNNERS[key].threads


def _steps(rank: int, world: int, plane: str):
    """3 processes, a GPipe step (its forward and its backward, each one plan) and a 1F1B step with the loss on
    the last stage; returns the threads that ran each process's shares, and whether the results were the plain
    model's."""
    key = f"steps-{plane}"
    pipeline = pipeline_over_rpc(key, build(), [2, 3, 2], [f"worker{r}" for r in range(world)], timeout=20,
                                 data_plane=plane)
    if pipeline is None:
        return None
    for r in range(1, world):
        rpc.rpc_sync(f"worker{r}", _record_threads, args=(key,))
    reference = build()
    x = torch.randn(8, 6, requires_grad=True)
    y = torch.randn_like(reference(x))
    out = run_pipeline(pipeline, x, chunks=4, checkpoint="except_last", training=True, parameters=iter([]))
    torch.testing.assert_close(out, reference(x))
    out.sum().backward()
    loss = pipeline_loss(pipeline, x, y, _mse, chunks=4, checkpoint="never", training=True, parameters=iter([]),
                         schedule="1f1b")
    torch.testing.assert_close(loss, _mse(reference(x), y))
    loss.backward()
    pipeline.settle()
    threads = [rpc.rpc_sync(f"worker{r}", _threads, args=(key,)) for r in range(1, world)]
    pipeline.close()
    return threads


@pytest.mark.timeout(120)
@pytest.mark.parametrize("plane", ["auto", "rpc"])
def test_each_process_gets_its_steps_on_the_plane_and_runs_them_on_its_listener(plane):
    """Over the data plane each process's actions of a step come on the driver's channel and run on the
    process's step listener, which answers on the plane (3 plans: GPipe's forward and backward, then 1F1B's);
    over RPC they come by ``run_share`` and run on the stage's worker. The results are the plain model's either way."""
    threads = run_processes(_steps, 3, plane, timeout=100)[0]
    name = "lightning_pipe.steps-auto.steps" if plane == "auto" else None
    for process, ran in enumerate(threads, start=1):
        assert len(ran) == 3, (process, ran)
        if name:
            assert ran == [name] * 3, (process, ran)
        else:
            assert all(thread.startswith("lightning_pipe.steps-rpc.stage") for thread in ran), (process, ran)


class Slow(nn.Module):
    """Sleeps ``seconds`` in each forward: a stage slower than the driver waits for its answer, without being stuck."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        import time

        time.sleep(self.seconds)
        return x


def _slow(rank: int, world: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Slow(0.8), nn.Linear(4, 4))
    pipeline = pipeline_over_rpc("slow", model, [1, 2], [f"worker{r}" for r in range(world)], timeout=2.0)
    if pipeline is None:
        return None
    x = torch.randn(8, 4)
    with torch.no_grad():
        out = run_pipeline(pipeline, x, chunks=4, checkpoint="never", training=False, parameters=iter([]))
        expected = model(x)
    pipeline.close()
    return out.tolist(), expected.tolist()  # plain values: a tensor returned shares memory with a process that ends


@pytest.mark.timeout(120)
def test_a_stage_still_working_after_the_driver_is_done_is_waited_for_past_the_timeout():
    """4 forwards of 0.8 s on stage 1 with a 2 s timeout: the driver's share is over at once and its answer takes
    3.2 s. The stage's signs of life, sent on the plane every third of the timeout, restart the driver's wait:
    the outputs come back, the plain model's."""
    out, expected = run_processes(_slow, 2, timeout=100)[0]
    torch.testing.assert_close(torch.tensor(out), torch.tensor(expected))


def _slow_commit(key: str) -> None:
    """Make this process's commits of a step's gradients take a second."""
    import time

    from lightning_pipe.transport.stages.entries import RUNNERS

    runner = RUNNERS[key]
    commit = runner.commit

    def slow(run, scale):
        time.sleep(1.0)
        commit(run, scale)

    runner.commit = slow


def _commits(rank: int, world: int):
    pipeline = pipeline_over_rpc("commits", build(), [2, 3, 2], [f"worker{r}" for r in range(world)], timeout=20)
    if pipeline is None:
        return None
    for r in range(1, world):
        rpc.rpc_sync(f"worker{r}", _slow_commit, args=("commits",))
    reference = build()
    x = torch.randn(8, 6, requires_grad=True)
    y = torch.randn_like(reference(x))
    seen = []
    for _ in range(2):
        loss = pipeline_loss(pipeline, x, y, _mse, chunks=4, checkpoint="never", training=True, parameters=iter([]),
                             schedule="1f1b")
        loss.backward()  # the commits in the other processes are still sleeping
        seen.append([{name: grad.tolist() for name, grad in pipeline.call(r, "named_grads").items()} for r in (1, 2)])
    _mse(reference(x), y).backward()
    reference_once = {name: p.grad.tolist() for name, p in reference.named_parameters()}
    pipeline.close()
    return seen, reference_once  # plain values: a tensor returned shares memory with a process that ends


@pytest.mark.timeout(120)
def test_gradients_read_right_after_backward_include_the_commits_still_in_flight():
    """``loss.backward()`` of an eager schedule does not wait for the other processes to commit the step's
    gradients (a round trip per step); what reaches them next waits for those commits first. With commits
    made to take a second, gradients read at once are the whole step's, twice accumulated after two steps."""
    (first, second), once = run_processes(_commits, 3, timeout=100)[0]
    for step, seen in enumerate((first, second), start=1):
        for grads in seen:
            for name, grad in grads.items():
                layer = int(name.split(".")[0])
                assert grad is not None, (step, name)
                expected = step * torch.tensor(once[f"{layer}.{name.split('.', 1)[1]}"])
                torch.testing.assert_close(torch.tensor(grad), expected, msg=name)


def _slow_or_failing_commits(key: str, fail: bool) -> None:
    """Make this process's commits take half a second, noting the thread and the time each ends; or fail."""
    import time

    from lightning_pipe.transport.stages.entries import RUNNERS

    runner = RUNNERS[key]
    commit = runner.commit
    runner.seen = []

    def slow(run, scale):
        if fail:
            raise RuntimeError("the commit broke")
        time.sleep(0.5)
        commit(run, scale)
        runner.seen.append((threading.current_thread().name, run, time.time()))

    runner.commit = slow


def _seen(key: str):
    from lightning_pipe.transport.stages.entries import RUNNERS

    return RUNNERS[key].seen


def _commits_on_the_plane(rank: int, world: int, fail: bool):
    import time

    from lightning_pipe.transport.stages import steps

    pipeline = pipeline_over_rpc("planned", build(), [2, 3, 2], [f"worker{r}" for r in range(world)], timeout=20)
    if pipeline is None:
        return None
    for r in range(1, world):
        rpc.rpc_sync(f"worker{r}", _slow_or_failing_commits, args=("planned", fail and r == 2))
    sent = {}  # run -> when the driver had sent its last process its step
    start = steps.start

    def noted(runner, peer, run, *args):
        left = start(runner, peer, run, *args)
        sent[run] = time.time()
        return left

    steps.start = noted
    x = torch.randn(8, 6, requires_grad=True)
    y = torch.randn_like(build()(x))
    try:
        for _ in range(3):
            pipeline_loss(pipeline, x, y, _mse, chunks=4, checkpoint="never", training=True, parameters=iter([]),
                          schedule="1f1b").backward()
        pipeline.call(1, "named_grads")  # waits for the last commits
        return sent, [rpc.rpc_sync(f"worker{r}", _seen, args=("planned",)) for r in (1, 2)]
    except RuntimeError as exc:
        return "\n".join([str(exc), *getattr(exc, "__notes__", [])])
    finally:
        steps.start = start
        pipeline.close()


@pytest.mark.timeout(120)
def test_a_commit_goes_to_the_step_listener_and_the_next_step_does_not_wait_for_it():
    """Over the plane, each step's commit goes to the process's step listener, which runs it before the next
    step: the driver sends that step without waiting for the commit (a round trip per step). With commits made
    to take half a second, each of the next steps was sent before the commit before it was done."""
    sent, seen = run_processes(_commits_on_the_plane, 3, False, timeout=100)[0]
    runs = sorted(sent)
    for process in seen:
        assert [(thread, run) for thread, run, _ in process] == [("lightning_pipe.planned.steps", run) for run in runs]
        for (_, _, done), later in zip(process, runs[1:]):
            assert sent[later] < done


@pytest.mark.timeout(120)
def test_a_commit_that_fails_on_the_plane_fails_the_next_step_naming_its_process():
    """A commit that fails in the step listener answers with its error: the step after it raises it, located."""
    error = run_processes(_commits_on_the_plane, 3, True, timeout=100)[0]
    assert "the commit broke" in error and "committing the gradients of pipeline 'planned' in rank 2" in error


def _riding_commits(rank: int, world: int):
    from lightning_pipe.transport.wire.dataplane import DataPlane

    pipeline = pipeline_over_rpc("riding", build(), [2, 3, 2], [f"worker{r}" for r in range(world)], timeout=20)
    if pipeline is None:
        return None
    sent = []  # (process, what): every message to a step listener, as the driver sent it
    send_step = DataPlane.send_step

    def noted(plane, name, run, step):
        sent.append((name, ("commit", step[1]) if step[0] == "commit" else ("call", step[3], step[-1])
                     if step[0] == "call" else ("step", run, step[-2])))
        return send_step(plane, name, run, step)

    DataPlane.send_step = noted
    reference = build()
    x = torch.randn(8, 6, requires_grad=True)
    y = torch.randn_like(reference(x))
    try:
        runs = []
        for _ in range(3):
            loss = pipeline_loss(pipeline, x, y, _mse, chunks=4, checkpoint="never", training=True,
                                 parameters=iter([]), schedule="1f1b")
            runs.append(max(run for _, (kind, run, *_) in sent if kind == "step"))
            loss.backward()
        before_call = list(sent)
        grads = {name: grad.tolist() for name, grad in pipeline.call(1, "named_grads").items()}
    finally:
        DataPlane.send_step = send_step
    _mse(reference(x), y).backward()
    once = {name: p.grad.tolist() for name, p in reference.named_parameters()}
    pipeline.close()
    return runs, before_call, sent, grads, once


@pytest.mark.timeout(120)
def test_a_commit_rides_with_the_next_step_and_sends_no_message_of_its_own():
    """Over the plane, a step's commit is not sent at ``loss.backward()``: it goes with the next step to each process
    (applied there before that step's share); where something else reaches the process first (here a read of its
    gradients), it is sent alone then. The gradients read are three steps' worth."""
    runs, before_call, sent, grads, once = run_processes(_riding_commits, 3, timeout=100)[0]
    for peer in ("worker1", "worker2"):
        mine = [what for name, what in before_call if name == peer]
        # Step k carries step k-1's commit (scale 1: the loss's own gradient), and nothing went alone.
        assert mine == [("step", runs[0], []), ("step", runs[1], [("commit", runs[0], 1.0)]),
                        ("step", runs[2], [("commit", runs[1], 1.0)])], mine
    # The read of worker1's gradients settles every process's last commit first: alone, on the plane. worker1, in the
    # middle, answered none of its steps (they went well): the driver asks it for a word first (what else it sends it
    # could overtake the listener's share of the last step); worker2 answered each step with its losses.
    after = [(name, what) for name, what in sent[len(before_call):]]
    assert after == [("worker1", ("call", None, [])), ("worker1", ("commit", runs[2])),
                     ("worker2", ("commit", runs[2]))], after
    for name, grad in grads.items():
        layer = int(name.split(".")[0])  # worker1 holds layers 2-4, named as in the whole body
        expected = 3 * torch.tensor(once[f"{layer}.{name.split('.', 1)[1]}"])
        torch.testing.assert_close(torch.tensor(grad), expected, msg=name)


class _RecordingHost:
    """Stands for a stage's host: records each call, with the thread it ran on; ``step`` fails on demand."""

    def __init__(self) -> None:
        self.done: list[tuple[str, tuple, str]] = []

    def zero_grad(self, k, set_to_none=True) -> None:
        self.done.append(("zero_grad", (k, set_to_none), threading.current_thread().name))

    def step(self, k, hyperparameters) -> None:
        self.done.append(("step", (k, hyperparameters), threading.current_thread().name))
        if hyperparameters == "fail":
            raise ValueError("stage 1 ran out of memory in its step")

    def stats(self):
        return self.done


def _install_host(key: str) -> None:
    from lightning_pipe.transport.stages import host
    from lightning_pipe.transport.stages.entries import RUNNERS

    RUNNERS[key].host = _RecordingHost()
    host._HOSTS[key] = SimpleNamespace(runner=RUNNERS[key])  # what its RPC entry point finds


def _host_calls(rank: int, world: int):
    from lightning_pipe.transport.stages.remote import HostGroup
    from lightning_pipe.transport.wire.dataplane import DataPlane

    pipeline = pipeline_over_rpc("calls", build(), [2, 5], [f"worker{r}" for r in range(world)], timeout=20)
    if pipeline is None:
        return None
    rpc.rpc_sync("worker1", _install_host, args=("calls",))
    hosts = HostGroup("calls", ["worker1"], 20.0)
    sent = []  # every message to the step listener, as the driver sent it
    send_step = DataPlane.send_step
    DataPlane.send_step = lambda plane, name, run, step: sent.append(step[0]) or send_step(plane, name, run, step)
    try:
        hosts.call_later("zero_grad", 0, True)
        after_zeroing = list(sent)
        futures = hosts.start("step", 0, [{"lr": 0.1}], plane=True)
        stepped = [f.result() for f in futures] + [f.result() for f in futures]  # asked again: the same answer
        hosts.call_later("zero_grad", 0, False)
        failing = hosts.start("step", 0, "fail", plane=True)
        errors = []
        for _ in range(2):  # raised again when asked again, not waited for
            try:
                [f.result() for f in failing]
            except ValueError as exc:
                errors.append("\n".join([str(exc), *getattr(exc, "__notes__", [])]))
        error = errors[0] if len(errors) == 2 and errors[0] == errors[1] else errors
        done = hosts.call("stats")[0]
    finally:
        DataPlane.send_step = send_step
    pipeline.close()
    return after_zeroing, sent, stepped, error, done


@pytest.mark.timeout(120)
def test_zeroing_rides_with_the_next_call_and_an_optimizer_step_goes_to_the_step_listener():
    """``call_later`` sends nothing: the zeroing goes with the next message to the process, applied first; a call
    ``start``ed with ``plane=True`` goes to the step listener on the data plane and is answered there, its error
    raised on the driver with the stage and process it came from."""
    after_zeroing, sent, stepped, error, done = run_processes(_host_calls, 2, timeout=100)[0]
    assert after_zeroing == [] and sent == ["call", "call"], sent  # two steps; no message for either zeroing
    assert stepped == [None, None]
    assert "stage 1 ran out of memory in its step" in error and "in step of stage 1 of pipeline 'calls'" in error
    listener = "lightning_pipe.calls.steps"
    assert done == [("zero_grad", (0, True), listener), ("step", (0, [{"lr": 0.1}]), listener),
                    ("zero_grad", (0, False), listener), ("step", (0, "fail"), listener)], done


def test_a_riding_call_waits_for_the_stages_reduction_before_it_changes_gradients():
    """A call that rode with another message (an optimizer's ``zero_grad``) runs once this process's reduction over
    the replicas is over, as a call by RPC does: zeroed while the last step's all-reduce is in flight, a gradient
    would get that all-reduce's result after it (seen: replicas under 1F1B training other weights than one device's,
    where the machine was loaded)."""
    from collections import Counter

    from lightning_pipe.transport.stages.runner import StageRunner

    order = []
    runner = SimpleNamespace(averages=SimpleNamespace(settle=lambda: order.append("settled")), calls=Counter(),
                             host=SimpleNamespace(zero_grad=lambda k, none: order.append(("zero_grad", k, none))))
    StageRunner.ride(runner, ("call", "zero_grad", (0, True)))
    assert order == ["settled", ("zero_grad", 0, True)] and runner.calls == {"zero_grad riding": 1}


def _large_targets(rank: int, world: int, stages: list[int]):
    torch.manual_seed(0)
    width = 256
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(sum(stages))])
    key = f"targets-{len(stages)}"
    pipeline = pipeline_over_rpc(key, model, stages, [f"worker{r}" for r in range(world)], timeout=20)
    if pipeline is None:
        return None
    x, y = torch.randn(512, width), torch.randn(512, width)  # a target of 128 KiB per micro-batch
    loss = pipeline_loss(pipeline, x, y, _mse, chunks=4, checkpoint="never", training=True,
                         parameters=model[0].parameters(), schedule="1f1b")
    torch.testing.assert_close(loss, _mse(model(x), y))
    pipeline.settle()
    counts = [_counts(key)] + [rpc.rpc_sync(f"worker{r}", _counts, args=(key,)) for r in range(1, world)]
    pipeline.close()
    return counts


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stages", [[1, 1], [1, 1, 1]], ids=["next", "two-away"])
def test_targets_too_large_for_a_step_travel_with_stage_0s_outputs(stages):
    """Targets of 128 KiB per micro-batch would make the step's message 512 KiB, held up before stage 0 starts:
    each goes right after stage 0's forward of its micro-batch instead, in the very message of its output where
    the last stage is next (4 messages out, 4 gradients back), on its own otherwise (the last stage receives 4
    activations and 4 targets)."""
    counts = run_processes(_large_targets, len(stages), stages, timeout=100)[0]
    if len(stages) == 2:
        assert counts == [{"sent": 4, "received": 4}, {"sent": 4, "received": 4}], counts
    else:
        assert counts == [{"sent": 8, "received": 4}, {"sent": 8, "received": 8}, {"sent": 4, "received": 8}], counts


# ---------------------------------------------------------------------- through Lightning
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["1f1b-2replicas", "rpc-plane-1f1b-2replicas", "p2p-plane-zero-bubble-2replicas",
                                  "lane-1f1b-2replicas-clip"])
def test_every_process_of_every_replica_hands_off_over_its_plane_and_trains_the_plain_models_weights(name, jobs,
                                                                                                   tmp_path):
    """2 replicas x 2 stages: over the default plane ("auto") and "p2p" every process of both replicas sends
    and receives point-to-point; over "rpc" none has a data plane; with a lane (gloo here, NCCL between GPUs) every
    hand-off's tensors go after its message, clipped by the global norm; the plain model's weights every way."""
    from jobs import config as case_config
    from test_strategy import load, plain_weights

    config = case_config(name)
    out = jobs.directory(name)
    assert_same_weights(load(out / "final.ckpt"), plain_weights(config, tmp_path / "plain"))
    planes = [json.loads(Path(out / f"plane_replica{r}.json").read_text()) for r in range(2)]
    for replica in planes:
        for process in replica:
            if config.get("data_plane") == "rpc":
                assert process is None
            else:
                assert process["sent"] > 0 and process["received"] > 0, planes
                # One machine: "auto" hands off through shared memory, "p2p" over gloo.
                links = "gloo" if config.get("data_plane") == "p2p" else "shared memory"
                assert process["links"] == links + (", tensors over gloo" if config.get("lane") else ""), planes


@pytest.mark.parametrize("data_plane", ["p2p", "auto"])
def test_a_process_serving_a_pipeline_its_driver_never_closed_exits_cleanly(data_plane):
    """The driver leaves without ``pipeline.close()`` before ``rpc.shutdown``: the other process's step listener
    still waits on the driver's channel as it exits. Over gloo, a process leaving under it was ended by gloo's threads
    (``terminate called without an active exception``, exit code -6) though its work was done; its exit now waits for
    the listener, which ends as the driver's process does."""
    result = run_script("unclosed.py", data_plane, timeout=150)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [0, 0], result.stdout + result.stderr
    assert "terminate called" not in result.stderr


def _answers_taken(rank: int, world: int):
    """Three processes over the plane: which processes the driver read an answer from, per step, under 1F1B with the
    loss on the last stage and under GPipe with the loss on the driver (its forward and its backward), then 1F1B
    again; what the last process's step messages carried of its actions; and whether the gradients are the plain
    model's."""
    from lightning_pipe.transport.stages import answers
    from lightning_pipe.transport.wire.dataplane import DataPlane

    pipeline = pipeline_over_rpc("quiet", build(), [2, 3, 2], [f"worker{r}" for r in range(world)], timeout=20)
    if pipeline is None:
        return None
    taken, carried = [], []
    answer, send_step = answers.answer, DataPlane.send_step

    def noted(runner, peer, process, run, *args):
        taken.append(process)
        return answer(runner, peer, process, run, *args)

    def sent(plane, name, run, step):
        if name == "worker2" and step[0] not in ("call", "commit"):
            number, actions = step[1]
            carried.append((number, None if actions is None else len(actions)))
        return send_step(plane, name, run, step)

    answers.answer, DataPlane.send_step = noted, sent
    reference = build()
    x = torch.randn(8, 6, requires_grad=True)
    y = torch.randn_like(reference(x))
    seen = []
    try:
        for schedule in ("1f1b", "gpipe", "1f1b"):
            taken.clear()
            if schedule == "1f1b":
                pipeline_loss(pipeline, x, y, _mse, chunks=4, checkpoint="never", training=True, parameters=iter([]),
                              schedule="1f1b").backward()
            else:
                _mse(run_pipeline(pipeline, x, chunks=4, checkpoint="never", training=True, parameters=iter([])),
                     y).backward()
            seen.append(list(taken))
        grads = {name: grad.tolist() for name, grad in pipeline.call(2, "named_grads").items()}
    finally:
        answers.answer, DataPlane.send_step = answer, send_step
    _mse(reference(x), y).backward()
    once = {name: p.grad.tolist() for name, p in reference.named_parameters()}
    pipeline.close()
    return seen, carried, grads, once


@pytest.mark.timeout(120)
def test_a_process_holding_nothing_for_the_driver_does_not_answer_a_step_that_went_well():
    """Under 1F1B with the loss on the last stage, the middle process holds nothing for the driver: the driver reads
    the last process's answer (its losses) alone. GPipe with the loss on the driver: both processes answer the
    forward (the last one with the outputs, the middle one because its activations wait for the backward), neither
    answers the backward. Each process is sent its actions of a plan once, then their number alone. The gradients
    are the plain model's, three steps' worth."""
    seen, carried, grads, once = run_processes(_answers_taken, 3, timeout=100)[0]
    assert seen == [[2], [1, 2], [2]], seen
    # The last process: 1F1B's 8 actions, GPipe's 4 forwards and 5 backwards (its last micro-batch's split in two), then
    # 1F1B's again by their number.
    assert [actions for _, actions in carried] == [8, 4, 5, None], carried
    assert len({number for number, _ in carried[:3]}) == 3 and carried[3][0] == carried[0][0], carried
    for name, grad in grads.items():
        layer = int(name.split(".")[0])  # worker2 holds layers 5-6, named as in the whole body
        expected = 3 * torch.tensor(once[f"{layer}.{name.split('.', 1)[1]}"])
        torch.testing.assert_close(torch.tensor(grad), expected, msg=name)


def _fail_after_share(key: str, on_run: int) -> None:
    """Make this process's share of its ``on_run``-th step fail once the share itself is done (as a stage's deferred
    parameter gradients or its reduction over the replicas could, after the driver's step is over)."""
    from lightning_pipe.transport.stages.entries import RUNNERS

    runner = RUNNERS[key]
    run_actions = runner.run_actions
    count = [0]

    def failing(*args, **kwargs):
        done = run_actions(*args, **kwargs)
        count[0] += 1
        if count[0] == on_run:
            raise RuntimeError("failed after its hand-offs")
        return done

    runner.run_actions = failing


def _late_failure(rank: int, world: int, failing: int):
    balance = [2, 3, 2] if world == 3 else [2, 2, 1, 2]
    pipeline = pipeline_over_rpc("late", build(), balance, [f"worker{r}" for r in range(world)], timeout=20)
    if pipeline is None:
        return None
    rpc.rpc_sync(f"worker{failing}", _fail_after_share, args=("late", 2))
    x = torch.randn(8, 6, requires_grad=True)
    y = torch.randn_like(build()(x))
    done = 0  # steps that returned
    try:
        while done < 5:
            pipeline_loss(pipeline, x, y, _mse, chunks=4, checkpoint="never", training=True, parameters=iter([]),
                          schedule="1f1b").backward()
            done += 1
        return "no error"
    except RuntimeError as exc:
        return done + 1, "\n".join([str(exc), *getattr(exc, "__notes__", [])])
    finally:
        pipeline.close()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world, failing", [(3, 1), (4, 2)])
def test_a_quiet_process_whose_share_fails_after_its_hand_offs_fails_the_driver_by_the_next_step(world, failing):
    """The middle processes leave the steps that went well unanswered; one whose share fails once its hand-offs are done
    (the driver may be past that step already) reaches the driver at the end of a later step, once its abort has
    reached it (an RPC: the step after, or under load the one after that), naming its stage; the other middle
    process, told of the abort after its share went well, answers that it was skipped, which is not the error
    raised."""
    result = run_processes(_late_failure, world, failing, timeout=130)[0]
    assert result != "no error"
    step, error = result
    assert 2 <= step <= 5, result
    assert "failed after its hand-offs" in error and f"stage {failing} of pipeline 'late'" in error, error


def _drop_held(key: str, on_run: int) -> None:
    """Have this process (the last stage's) find its ``on_run``-th step's losses gone when it answers, as an abort of
    that run arriving between its share's end and its answer leaves it (``StageRunner.fail`` drops them)."""
    from lightning_pipe.transport.stages.entries import RUNNERS

    runner = RUNNERS[key]
    take_held = runner.take_held
    count = [0]

    def dropping(run: int):
        count[0] += 1
        held = take_held(run)
        return None if count[0] == on_run else held

    runner.take_held = dropping


def _dropped(rank: int, world: int):
    pipeline = pipeline_over_rpc("dropped", build(), [2, 3, 2], [f"worker{r}" for r in range(world)], timeout=20)
    if pipeline is None:
        return None
    rpc.rpc_sync("worker2", _drop_held, args=("dropped", 2))
    x = torch.randn(8, 6, requires_grad=True)
    y = torch.randn_like(build()(x))
    step = 0
    try:
        while step < 3:
            step += 1
            pipeline_loss(pipeline, x, y, _mse, chunks=4, checkpoint="never", training=True, parameters=iter([]),
                          schedule="1f1b").backward()
        return "no error"
    except Exception as exc:  # noqa: BLE001 - what the driver raised, for the test to read
        return step, f"{type(exc).__name__}: {exc}"
    finally:
        pipeline.close()


@pytest.mark.timeout(120)
def test_a_last_stage_answering_without_its_outputs_fails_the_step_saying_so():
    """A run aborted between the last stage's share and its answer (a quiet process failing late aborts it) leaves the
    answer without the losses: the driver indexed it and raised a TypeError ('NoneType' object is not subscriptable),
    seen once under a loaded CI. It now raises the late failure where one is pending, else says the outputs were
    dropped as the run was aborted."""
    result = run_processes(_dropped, 3, timeout=100)[0]
    assert result[0] == 2 and result[1].startswith("RuntimeError: the last stage's outputs of run"), result
