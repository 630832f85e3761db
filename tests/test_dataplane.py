"""The point-to-point data plane (``data_plane``): one message per hand-off, any payload and shape, the plain
model's results through it in every process, what goes by RPC instead, and its failures."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.rpc as rpc
from dist_utils import run_processes
from jobs import config as case_config
from strategy_utils import assert_same_weights
from test_remote import _mse, build
from test_strategy import load, plain_weights
from torch import nn

from lightning_pipe import PipeStrategy
from lightning_pipe.engine import pipeline_loss, run_pipeline
from lightning_pipe.transport import pipeline_over_rpc
from lightning_pipe.transport.codec import DATA, Unsuitable, decode, encode, header
from lightning_pipe.transport.dataplane import AUTO_MAX_BYTES, connect


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
        assert actual.numel() == 0 or actual.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def test_a_small_message_in_a_large_receive_is_copied_out_of_it():
    message = encode(DATA, ("k", 0, "F", 0, 1, 0), (torch.ones(4),))
    buffer = torch.zeros(4 * len(message), dtype=torch.uint8)
    buffer[:len(message)] = message
    _, (tensor,) = decode(buffer)
    assert tensor.untyped_storage().nbytes() < len(buffer)  # the large receive is not kept alive by it
    torch.testing.assert_close(tensor, torch.ones(4))


@pytest.mark.parametrize("tensor", [torch.ones(2).as_subclass(nn.Parameter), torch.ones(2, requires_grad=True),
                                    torch.ones(2).to_sparse()], ids=["subclass", "requires-grad", "sparse"])
def test_what_a_message_cannot_carry_goes_by_rpc(tensor):
    with pytest.raises(Unsuitable):
        encode(DATA, ("k", 0, "F", 0, 1, 0), ([tensor], [False], True))


def test_an_unknown_data_plane_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"data_plane must be one of 'auto', 'p2p', 'rpc' \(got: 'nccl'\)"):
        PipeStrategy(balance=[1, 1], data_plane="nccl")


def test_point_to_point_for_gpu_stages_is_refused_saying_what_to_use():
    runner = SimpleNamespace(key="k", stage=SimpleNamespace(device=torch.device("cuda", 0)))
    with pytest.raises(ValueError, match="data_plane='p2p' carries CPU tensors.*use data_plane='auto' or 'rpc'"):
        connect(runner, ["worker0", "worker1"], "p2p")
    connect(runner, ["worker0", "worker1"], "auto")  # GPU to GPU by RPC: no plane, nothing refused
    assert not hasattr(runner, "plane")


# ---------------------------------------------------------------------- through processes
def _counts(key: str) -> dict[str, int] | None:
    from lightning_pipe.transport.runner import _RUNNERS

    plane = _RUNNERS[key].plane
    return None if plane is None else {"sent": plane.sent, "received": plane.received}


class Widen(nn.Module):
    """Repeats its input ``factor`` times along the last dimension: a hand-off larger than the step's input."""

    def __init__(self, factor: int) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x.repeat(1, 1, self.factor)


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
        expected = _mse(reference(x), y)
        torch.testing.assert_close(loss, expected)
        loss.backward()
        expected.backward()
        grads = pipeline.call(1, "named_grads")
        torch.testing.assert_close(grads["3.weight"], reference[3].weight.grad)
        pipeline.call(1, "zero_grad")
        reference.zero_grad()
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


def _planes(rank: int, world: int, plane: str):
    pipeline = pipeline_over_rpc(f"plane-{plane}", build(), [2, 3, 2], [f"worker{r}" for r in range(world)],
                                 timeout=20, data_plane=plane)
    if pipeline is None:
        return None
    x = torch.randn(10, 6, requires_grad=True)
    run_pipeline(pipeline, x, chunks=4, checkpoint="except_last", training=True, parameters=iter([])).sum().backward()
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


# ---------------------------------------------------------------------- through Lightning
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["1f1b-2replicas", "rpc-plane-1f1b-2replicas", "p2p-plane-zero-bubble-2replicas"])
def test_every_process_of_every_replica_hands_off_over_its_plane_and_trains_the_plain_models_weights(name, jobs,
                                                                                                   tmp_path):
    """2 replicas x 2 stages: over the default plane ("auto") and "p2p" every process of both replicas sends
    and receives point-to-point; over "rpc" none has a data plane; the plain model's weights every way."""
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
