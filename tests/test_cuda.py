"""The engine with CUDA partitions (several may share one GPU), and across CPU and GPU; skipped without a GPU.

Run on a machine with a GPU: ``python -m pytest tests/test_cuda.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_pipe import Pipe
from lightning_pipe.skip import pop, skippable, stash

pytestmark = [pytest.mark.gpu,
              pytest.mark.usefixtures("full_precision_matmul")]

# Partitions on one GPU, and hand-offs from host to device and back (the GPU -> CPU copy must be complete
# before the CPU partition reads it).
PLACEMENTS = {
    "one-gpu": ["cuda:0", "cuda:0", "cuda:0"],
    "cpu-gpu-cpu": ["cpu", "cuda:0", "cpu"],
    "gpu-cpu-gpu": ["cuda:0", "cpu", "cuda:0"],
}
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}  # CPU and GPU kernels sum in different orders


def build(dropout: float = 0.0) -> nn.Sequential:
    return nn.Sequential(nn.Linear(5, 64), nn.ReLU(), nn.Dropout(dropout), nn.Linear(64, 64), nn.GELU(),
                         nn.Linear(64, 3))


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("chunks,checkpoint", [(1, "never"), (4, "except_last"), (7, "always")])
def test_outputs_and_gradients_match_the_plain_module(placement, chunks, checkpoint):
    devices = PLACEMENTS[placement]
    plain = build()
    piped = Pipe(copy.deepcopy(plain), [2, 2, 2], devices=devices, chunks=chunks, checkpoint=checkpoint)
    x = torch.randn(4096, 5)
    x1, x2 = x.clone().requires_grad_(), x.clone().to(devices[0]).requires_grad_()
    expected, actual = plain(x1), piped(x2)
    assert actual.device == torch.device(devices[-1])
    torch.testing.assert_close(actual.cpu(), expected, **TOLERANCE)
    target = torch.randn_like(expected)
    ((expected - target) ** 2).mean().backward()
    ((actual - target.to(actual.device)) ** 2).mean().backward()
    torch.testing.assert_close(x2.grad.cpu(), x1.grad, **TOLERANCE)
    for (name, p), q in zip(plain.named_parameters(), piped.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad, msg=name, **TOLERANCE)


def test_dropout_masks_are_the_same_with_and_without_recomputation():
    torch.manual_seed(0)
    model = build(dropout=0.5)
    grads = {}
    for checkpoint in ("always", "never"):
        piped = Pipe(copy.deepcopy(model), [3, 3], devices=["cuda:0", "cuda:0"], chunks=4, checkpoint=checkpoint)
        torch.manual_seed(7)
        piped(torch.randn(64, 5, device="cuda:0")).square().mean().backward()
        grads[checkpoint] = [p.grad.clone() for p in piped.parameters()]
    for always, never in zip(grads["always"], grads["never"]):
        torch.testing.assert_close(always, never)


@skippable(stash=["x"])
class Keep(nn.Module):
    def forward(self, x):
        yield stash("x", x)
        return x


@skippable(pop=["x"])
class AddBack(nn.Module):
    def forward(self, x):
        return x + (yield pop("x"))


def test_skip_connection_from_gpu_to_cpu_partition():
    layers = lambda: nn.Sequential(Keep(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), AddBack())  # noqa: E731
    plain = layers()
    piped = Pipe(copy.deepcopy(plain), [2, 2, 1], devices=["cuda:0", "cuda:0", "cpu"], chunks=3)
    x = torch.randn(12, 8)
    x1, x2 = x.clone().requires_grad_(), x.clone().cuda().requires_grad_()
    plain(x1).sum().backward()
    out = piped(x2)
    assert out.device.type == "cpu"
    out.sum().backward()
    torch.testing.assert_close(x2.grad.cpu(), x1.grad, **TOLERANCE)


def test_bf16_autocast_reaches_every_partition():
    plain = build().cuda()
    piped = Pipe(copy.deepcopy(plain), [3, 3], devices=["cuda:0", "cuda:0"], chunks=4)
    x = torch.randn(64, 5, device="cuda:0")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected, actual = plain(x), piped(x)
    assert actual.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(actual, expected)
