"""The core promise: outputs and gradients through a Pipe equal those of the unwrapped module."""

import copy
import itertools

import pytest
import torch
from torch import nn

from lightning_pipe import Pipe

BALANCES = [[6], [1, 5], [3, 3], [2, 2, 2], [1, 1, 1, 1, 1, 1]]
CHUNKS = [1, 2, 4, 7, 16]
MODES = ["always", "except_last", "never"]


def build() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(5, 16), nn.ReLU(inplace=True), nn.Linear(16, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3)
    )


@pytest.mark.parametrize("balance,chunks,checkpoint", list(itertools.product(BALANCES, CHUNKS, MODES)))
def test_outputs_and_gradients(balance, chunks, checkpoint):
    plain = build()
    piped = Pipe(copy.deepcopy(plain), balance, chunks=chunks, checkpoint=checkpoint)
    x = torch.randn(11, 5)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()

    expected = plain(x1)
    actual = piped(x2)
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)

    target = torch.randn_like(expected)
    ((expected - target) ** 2).mean().backward()
    ((actual - target) ** 2).mean().backward()
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-5, atol=1e-7)
    for (name, p), q in zip(plain.named_parameters(), piped.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_input_without_grad_gets_none_and_params_still_train():
    plain = build()
    piped = Pipe(copy.deepcopy(plain), [3, 3], chunks=3)
    x = torch.randn(6, 5)
    plain(x).sum().backward()
    piped(x).sum().backward()
    for p, q in zip(plain.parameters(), piped.parameters()):
        torch.testing.assert_close(q.grad, p.grad)


def test_no_grad_and_eval_store_nothing():
    piped = Pipe(build(), [3, 3], chunks=3)
    x = torch.randn(6, 5)
    with torch.no_grad():
        y = piped(x)
    assert not y.requires_grad
    assert all(not s._saved for s in piped.pipeline.stages)
    piped.eval()
    with torch.no_grad():
        assert torch.allclose(piped(x), y)


def test_frozen_model_output_needs_no_grad():
    piped = Pipe(build().requires_grad_(False), [3, 3], chunks=2)
    assert not piped(torch.randn(4, 5)).requires_grad


def test_unused_forward_is_released():
    piped = Pipe(build(), [3, 3], chunks=3, checkpoint="never")
    y = piped(torch.randn(6, 5))
    assert all(s._saved for s in piped.pipeline.stages)
    del y
    assert all(not s._saved for s in piped.pipeline.stages)


def test_backward_twice_is_a_clear_error():
    piped = Pipe(build(), [3, 3], chunks=2)
    y = piped(torch.randn(4, 5)).sum()
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph is not supported through a pipe"):
        y.backward()


def test_two_forwards_then_one_backward():
    plain = build()
    piped = Pipe(copy.deepcopy(plain), [2, 4], chunks=2)
    a, b = torch.randn(4, 5), torch.randn(6, 5)
    (plain(a).sum() + plain(b).pow(2).sum()).backward()
    (piped(a).sum() + piped(b).pow(2).sum()).backward()
    for p, q in zip(plain.parameters(), piped.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6)


def test_pipelined_and_single_backward_agree():
    piped = Pipe(build(), [2, 2, 2], chunks=4)
    x = torch.randn(8, 5)
    piped(x).pow(2).sum().backward()
    pipelined = [p.grad.clone() for p in piped.parameters()]
    piped.zero_grad()
    # One autograd call per stage over all micro-batches.
    original = piped.pipeline.backward
    piped.pipeline.backward = lambda run, grads, **kw: original(run, grads, **{**kw, "pipelined": False})
    piped(x).pow(2).sum().backward()
    for a, p in zip(pipelined, piped.parameters()):
        torch.testing.assert_close(p.grad, a)


def test_bfloat16_autocast_reaches_the_workers():
    piped = Pipe(build(), [3, 3], chunks=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = piped(torch.randn(4, 5))
    assert y.dtype == torch.bfloat16  # the Linear layers ran under autocast on the worker threads
    y.float().sum().backward()
    assert all(p.grad is not None for p in piped.parameters())
