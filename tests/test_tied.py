"""Parameters shared by partitions of one ``Pipe`` (engine/tied.py): the plain module's gradients and weights, the
shared parameter listed once, each partition holding its own copy."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_pipe import Pipe, loss_on_last_stage


class Unembed(nn.Module):
    """Projects back with the embedding module's own weight (the module itself is shared, not only the tensor)."""

    def __init__(self, embedding: nn.Linear) -> None:
        super().__init__()
        self.embedding = embedding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.embedding.weight


def body() -> nn.Sequential:
    torch.manual_seed(0)
    embed = nn.Linear(4, 8, bias=False)
    scale = nn.Linear(8, 8)
    scale.weight = nn.Parameter(torch.randn(8, 8) * 0.3)
    return nn.Sequential(embed, nn.Tanh(), scale, nn.Tanh(), Unembed(embed))


def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, schedule: str) -> torch.Tensor:
    if schedule == "gpipe":
        return nn.functional.mse_loss(model(x), y)
    return loss_on_last_stage(model, x, y, nn.functional.mse_loss)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble", "interleaved-1f1b"])
def test_a_parameter_shared_across_partitions_trains_as_in_the_plain_module(schedule):
    plain = body()
    virtual = 2 if schedule == "interleaved-1f1b" else 1
    pipe = Pipe(body(), balance=[1, 1, 2, 1] if virtual == 2 else [2, 3], devices=["cpu", "cpu"], chunks=4,
                schedule=schedule, virtual_stages=virtual)
    assert len(list(pipe.parameters())) == len(list(plain.parameters())) == 3  # the shared one once
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    pipe_opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(16, 4), torch.randn(16, 4)
    for step in range(3):
        for model, opt in ((plain, plain_opt), (pipe, pipe_opt)):
            opt.zero_grad()
            loss(model, x, y, schedule).backward()
            if step == 2:  # two backwards without zeroing: the shared gradient accumulates as plainly
                loss(model, x[:8], y[:8], schedule).backward()
        torch.testing.assert_close(pipe[0].weight.grad, plain[0].weight.grad, rtol=1e-5, atol=1e-6)
        plain_opt.step()
        pipe_opt.step()
    for (name, p), q in zip(pipe.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    # The later partition's copy holds the owner's values in the state dict, and is its own tensor.
    state = pipe.state_dict()
    copies = [k for k in state if k.endswith("embedding.weight")]
    assert copies and all(torch.equal(state[k], pipe[0].weight) for k in copies)
    assert pipe[-1].embedding.weight is not pipe[0].weight and pipe[-1].embedding is not pipe[0]


def test_the_first_partitions_module_is_left_as_it_was():
    """The head calls the embedding module itself: the later partition gets its own module object, and the first
    partition's embedding keeps its parameter (an in-place untie would have handed it the copy)."""
    model = body()
    embed, weight = model[0], model[0].weight
    pipe = Pipe(model, balance=[2, 3], devices=["cpu", "cpu"], chunks=2)
    assert pipe[0] is embed and pipe[0].weight is weight
    assert pipe[-1].embedding is not embed


def test_a_frozen_shared_parameter_gets_no_gradient_anywhere():
    pipe = Pipe(body(), balance=[2, 3], devices=["cpu", "cpu"], chunks=2)
    pipe[0].weight.requires_grad_(False)
    nn.functional.mse_loss(pipe(torch.randn(4, 4)), torch.randn(4, 4)).backward()
    assert pipe[0].weight.grad is None and pipe[-1].embedding.weight.grad is None
    assert pipe[2].weight.grad is not None


def test_a_copy_of_the_pipe_keeps_its_own_copies_in_step():
    pipe = Pipe(body(), balance=[2, 3], devices=["cpu", "cpu"], chunks=2)
    twin = copy.deepcopy(pipe)
    with torch.no_grad():
        twin[0].weight.add_(1.0)
    state = twin.state_dict()
    assert torch.equal(state["partitions.1.4.embedding.weight"], twin[0].weight)
    assert not torch.equal(pipe.state_dict()["partitions.1.4.embedding.weight"], twin[0].weight)
