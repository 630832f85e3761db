"""A lane for tensors beside their messages (``transport/wire/lane.py``: NCCL between GPUs): the same code over gloo
with CPU tensors, in one process and through a pipeline's processes, and where a lane is refused or cannot be had.

The processes these tests start import this module (``spawn``): it imports no Lightning."""

from __future__ import annotations

import datetime
import random
import threading
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from dist_utils import run_processes
from test_dataplane import check_step
from test_remote import _mse, build

from lightning_pipe.engine import pipeline_loss, run_pipeline
from lightning_pipe.transport import pipeline_over_rpc
from lightning_pipe.transport.stages import rendezvous
from lightning_pipe.transport.wire.codec import DATA, Unsuitable, decode, encode_beside
from lightning_pipe.transport.wire.messages import Slot

CPU = torch.device("cpu")


def _payload(seed: int):
    """Tensors of several dtypes and shapes (one not contiguous, one empty) among plain values."""
    g = torch.Generator().manual_seed(seed)
    rows = 1 + seed % 5
    return ([torch.randn(rows, 3, generator=g), torch.arange(2 * rows).reshape(2, rows).t(), torch.empty(0, 4)],
            None, (torch.randn(rows, generator=g).to(torch.bfloat16), torch.tensor([seed % 2 == 0])), seed, "x")


def _same(got, expected) -> None:
    assert type(got) is type(expected), (got, expected)
    if isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and got.shape == expected.shape, (got, expected)
        assert torch.equal(got, expected), (got, expected)
    elif isinstance(expected, (tuple, list)):
        assert len(got) == len(expected)
        for a, b in zip(got, expected):
            _same(a, b)
    else:
        assert got == expected


def test_tensors_on_the_lanes_device_leave_the_message_and_are_taken_in_order_as_it_is_decoded():
    payload = _payload(3)
    slot = Slot("k", 1, "F", 0, 1, 0)
    message, beside = encode_beside(DATA, slot, payload, CPU)
    assert [tuple(t.shape) for t in beside] == [(4, 3), (4, 2), (0, 4), (4,), (1,)]  # in the payload's order
    assert len(message) < 1024  # the skeleton alone: no tensor's bytes
    inside, none = encode_beside(DATA, slot, payload, None)
    assert none == [] and len(inside) > len(message)
    queue = list(beside)
    got_slot, got = decode(message, lambda dtype, shape: queue.pop(0))
    assert got_slot == slot and not queue
    _same(got, payload)
    with pytest.raises(ValueError, match="decoded without the lane"):
        decode(message)
    with pytest.raises(Unsuitable):  # what autograd still holds goes by RPC, lane or not
        encode_beside(DATA, slot, (torch.ones(2, requires_grad=True),), CPU)


def _two_planes_with_lanes(key: str):
    """Two processes' data planes (ranks 0 and 1) in this process, each with its gloo lanes, met in one store."""
    from lightning_pipe.transport.wire.dataplane import DataPlane
    from lightning_pipe.transport.wire.lane import lane_groups

    store, made = dist.HashStore(), {}

    def join(rank: int) -> None:
        groups = [dist.ProcessGroupGloo(dist.PrefixStore(f"{sender}/", store), rank, 2,
                                        datetime.timedelta(seconds=20)) for sender in range(2)]
        made[rank] = (groups, lane_groups(store, key, rank, 2, 20.0, "gloo", CPU))

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return [DataPlane(key, made[rank][0], rank, ["p0", "p1"], 10.0, None, lane=made[rank][1]) for rank in range(2)]


@pytest.mark.timeout(60)
def test_messages_sent_by_two_threads_at_once_each_find_their_own_tensors_on_the_lane():
    """Two threads of process 0 send 20 messages each at once; process 1 takes them in a shuffled order (what
    arrives for another slot waits in the mailbox). The lane's order is the messages' order: every payload arrives
    whole, none with another's tensors."""
    sender, receiver = _two_planes_with_lanes("two-threads")
    slots = {(t, i): Slot("two-threads", 0, "F", i, 1, t) for t in range(2) for i in range(20)}

    def send(t: int) -> None:
        for i in range(20):
            assert sender.send("p1", slots[t, i], _payload(100 * t + i)) is not None

    threads = [threading.Thread(target=send, args=(t,)) for t in range(2)]
    for thread in threads:
        thread.start()
    order = list(slots)
    random.Random(0).shuffle(order)
    for t, i in order:
        _same(receiver.take("p0", slots[t, i], 10.0, lambda: "from p0"), _payload(100 * t + i))
    for thread in threads:
        thread.join(timeout=10)
    sender.flush()
    assert sender.lane.sent == receiver.lane.received == 40 * 4  # the empty tensor is not sent
    for plane in (sender, receiver):
        plane.close()


@pytest.mark.timeout(60)
def test_conjugate_and_negative_views_arrive_as_they_read_and_lanes_meet_under_a_float64_default():
    """A conjugate or negative view keeps its bit through ``contiguous()``: the lane sent the bytes under it, and
    the receiver read the conjugate's conjugate and the negative with its sign flipped. And the lanes' first
    hand-off at setup is a float32 whatever the default dtype (``precision="64-true"`` sets float64, which overran
    the float32 its receiver posts and aborted the process)."""
    torch.set_default_dtype(torch.float64)
    try:
        sender, receiver = _two_planes_with_lanes("views")
    finally:
        torch.set_default_dtype(torch.float32)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, generator=g)
    views = [torch.complex(x[:, :2], x[:, 2:4]).conj(), torch._neg_view(x[:, :3]), torch._neg_view(x.clone()),
             torch.complex(x, x).conj()[:, 1:4], x.t()]
    slot = Slot("views", 0, "F", 0, 1, 0)
    assert sender.send("p1", slot, (views,)) is not None
    (got,) = receiver.take("p0", slot, 10.0, lambda: "from p0")
    for a, b in zip(got, views):
        assert torch.equal(a, b.resolve_conj().resolve_neg())
    sender.flush()
    assert sender.lane.sent == len(views)
    for plane in (sender, receiver):
        plane.close()


def _lane_counts(key: str) -> dict[str, int]:
    from lightning_pipe.transport.stages.entries import RUNNERS

    plane = RUNNERS[key].plane
    return {"hand-offs sent": plane.sent, "hand-offs received": plane.received, "lane sent": plane.lane.sent,
            "lane received": plane.lane.received}


def _through_lanes(rank: int, world: int, schedule: str):
    """3 processes with a skip from stage 0 to stage 2 over gloo lanes: steps of several batch sizes (every hand-off's
    shape changes), each the plain model's output, loss and gradients; every process's lane counts after."""
    key = f"lanes-{schedule}"
    pipeline = pipeline_over_rpc(key, build(), [2, 3, 2], [f"worker{r}" for r in range(world)], timeout=20,
                                 data_plane="p2p", lane="gloo")
    if pipeline is None:
        return None
    reference = build()
    for rows in (8, 3, 12):
        x = torch.randn(rows, 6, requires_grad=True)
        y = torch.randn(rows, 2)
        if schedule == "gpipe":
            out = run_pipeline(pipeline, x, chunks=4, checkpoint="except_last", training=True, parameters=iter([]))
            torch.testing.assert_close(out, reference(x))
            loss, expected = _mse(out, y), _mse(reference(x), y)
        else:
            loss = pipeline_loss(pipeline, x, y, _mse, chunks=4, checkpoint="never", training=True,
                                 parameters=iter([]), schedule=schedule)
            expected = _mse(reference(x), y)
        check_step(pipeline, reference, loss, expected, 2, "6.weight")
    pipeline.settle()
    counts = [_lane_counts(key)] + [rpc.rpc_sync(f"worker{r}", _lane_counts, args=(key,)) for r in range(1, world)]
    pipeline.close()
    return counts


@pytest.mark.timeout(150)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_stages_hand_their_tensors_off_on_a_lane_and_give_the_plain_models_results(schedule):
    counts = run_processes(_through_lanes, 3, schedule, timeout=130)[0]
    assert sum(c["lane sent"] for c in counts) == sum(c["lane received"] for c in counts), counts
    for process, c in enumerate(counts):
        # Every hand-off's tensors went on the lane (stage 0 sends activations and skips, the others gradients).
        assert c["hand-offs sent"] > 0 and c["lane sent"] >= c["hand-offs sent"], (process, counts)
        assert c["hand-offs received"] > 0 and c["lane received"] >= c["hand-offs received"], (process, counts)


def test_a_lane_that_cannot_carry_the_stages_tensors_is_refused_saying_what_to_do():
    gpu = SimpleNamespace(key="k", stage=SimpleNamespace(device=torch.device("cuda", 0)))
    cpu = SimpleNamespace(key="k", stage=SimpleNamespace(device=CPU))
    with pytest.raises(ValueError, match=r"lane='gloo' carries CPU tensors and the stages are on cuda:0: leave "):
        rendezvous.connect(gpu, ["worker0", "worker1"], "p2p", "gloo")
    with pytest.raises(ValueError, match=r"lane='nccl' carries GPU tensors and the stages are on cpu"):
        rendezvous.connect(cpu, ["worker0", "worker1"], "p2p", "nccl")
    with pytest.raises(ValueError, match=r"lane must be one of 'nccl', 'gloo' or None \(got 'mpi'\)"):
        rendezvous.connect(cpu, ["worker0", "worker1"], "p2p", "mpi")
    rendezvous.connect(gpu, ["worker0", "worker1"], "auto")  # GPU to GPU by RPC: no plane, nothing refused
    assert not hasattr(gpu, "plane")


def test_gpu_stages_sharing_a_gpu_hand_off_by_rpc_and_say_why_and_each_on_its_own_gpu_take_nccl(monkeypatch):
    runner = SimpleNamespace(key="k", timeout=5.0, stage=SimpleNamespace(device=torch.device("cuda", 0)))
    where = {"worker0": ("node", "GPU-a", "cuda:0"), "worker1": ("node", "GPU-b", "cuda:1"),
             "worker2": ("node", "GPU-b", "cuda:0")}  # another index of the same GPU (CUDA_VISIBLE_DEVICES)
    monkeypatch.setattr(rendezvous, "_whereabouts", lambda key: where["worker0"])
    monkeypatch.setattr(rendezvous.rpc, "rpc_sync", lambda name, fn, args, timeout: where[name])
    with pytest.warns(UserWarning, match=r"several processes on cuda:0 on node, cuda:1 on node: its hand-offs go by "
                                         r"RPC instead"):
        rendezvous.connect(runner, ["worker0", "worker1", "worker2"], "p2p")
    assert not hasattr(runner, "plane")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rendezvous._gpu_lane(runner, ["worker0", "worker1"]) == "nccl"
        where["worker2"] = ("node", "GPU-c", "cuda:1")  # the same index, another GPU
        assert rendezvous._gpu_lane(runner, ["worker0", "worker1", "worker2"]) == "nccl"
        where["worker2"] = ("other node", "GPU-b", "cuda:1")  # (the same on another machine: not one GPU)
        assert rendezvous._gpu_lane(runner, ["worker0", "worker1", "worker2"]) == "nccl"
